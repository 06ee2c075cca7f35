"""Stage 4, index: the faiss index over chunk embeddings.

Without Beam, a module per concern: `factory` (the factory from a memory budget, the plan),
`sampling`, `kmeans` (two-level), `train` (train, fill, merge), `search` (depth, exclusion),
`exact` (exact search), `recall` (the two measures), `tuning` (depth against a target),
`files` (index and embedding I/O), `slices` (an index in slices: their size, merging their
hits), `routing` (slices by groups of nearby inverted lists, searched with one coarse
assignment per query).
The Beam wiring apart: `train_beam` (`TrainIndex`), `build` (`BuildIndex`), and
`build_info` (what it hands the job that commits it).
"""
