"""Shared by every stage: file access (`fileio`), counts as data (`tally`), progress logs,
encoder and tokenizer locations (`models`), deterministic file writers (`writers`).
"""
