"""Stage 4, index: the faiss index over chunk embeddings.

Its modules, one line each: docs/design.md §2.
"""
