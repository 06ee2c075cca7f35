"""The jobs: each resolves its inputs, builds its Beam graph, builds its manifest from the data
written and commits through `commit`.

`job` (what every job shares), `index_job` (build-index), `vector_index_job` (index),
`shards_job` (build-shards), `run` (both, skipping what matches), `reuse` (the one reuse
policy), `index_files` (an index directory's entries), `commit`, `options` (Beam options),
`memory_model`, `flex_template`.
"""
