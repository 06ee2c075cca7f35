"""Stage 2, chunk: tokenise documents into chunks with dense, stable chunk ids.

`chunking` (tokeniser, cutting, chunk-id buckets, without Beam), `beam` (`ChunkDocuments`),
`chunk_files` (which chunk file holds a chunk id, and reading its rows).
"""
