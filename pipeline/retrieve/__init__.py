"""Stage 5, retrieve: each training chunk's nearest chunks outside its sequence's documents.

Its modules, one line each: docs/design.md §2.
"""
