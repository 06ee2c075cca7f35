"""Stage 2, chunk: tokenise documents into chunks with dense, stable chunk ids; the chunk files.

Its modules, one line each: docs/design.md §2.
"""
