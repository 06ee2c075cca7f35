"""The index's jobs: build-index (read, chunk, embed and index a corpus; append to and delete from
a committed index as its next generation; rebuild only its faiss files) and `index` (a faiss
index over embedding files), each with the manifest it commits.

Its modules, one line each: docs/design.md §2.
"""
