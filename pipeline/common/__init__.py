"""Shared by every stage: file access (`fileio`), counts as data (`tally`), progress logs,
encoder and tokenizer locations (`models`), deterministic file writers (`writers`), numbered
file names and their order (`names`).
"""
