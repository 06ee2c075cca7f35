"""Stage 1, read: list, split and parse the corpus into `Document`s and rejected records.

Its modules, one line each: docs/design.md §2.
"""
