"""Shared by every stage: file access, rejected records, counts as data, progress, encoder and
tokenizer locations, deterministic file writers, numbered file names, samples, array idioms.

Its modules, one line each: docs/design.md §2.
"""
