"""Stage 3, embed: chunks into L2-normalised vectors with a sentence-transformers encoder.

Its modules, one line each: docs/design.md §2.
"""
