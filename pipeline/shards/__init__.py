"""Stage 6, write: training shards (Arrow IPC) of sequences joined with their neighbours.

`rows` (`Sequence`, `ShardRow`, the r(C) overlap audit; no Beam, faiss or torch), `write`
(`WriteShards`).
"""
