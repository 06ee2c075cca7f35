"""The chunk index as S faiss files (slices), without Beam: how many vectors a slice holds, and
merging the slices' hits of the same queries as one index ranks them.

Every slice is the same trained IVF index (coarse quantizer and PQ) holding some of the
vectors (`routing`: the lists it owns), so each file loads and searches alone, and a vector
has the same code and the same score in its slice as in one index holding everything; the
best k of the slices' best k are the one index's best k (faiss's IndexShards model, with the
single index's tie order kept, see `merge_hits`). Importing this module imports no Beam.
"""

from __future__ import annotations

import numpy as np

from pipeline.index.factory import IndexBuildError, estimated_bytes

EMPTY_SCORE = np.finfo(np.float32).min  # faiss's -FLT_MAX in an inner-product slot it could not fill

# The build assembles a slice from pieces, each its blocks from a run of consecutive files: a group
# through a shuffle is one element, received and decoded whole and read ahead while the one before
# it is worked on (benchmarks/group_read_ahead.py), so a slice's blocks in one group would cost
# several times the slice where it is assembled. A piece holds about PIECE_BYTES of codes at
# most (files hold about as many vectors of a slice as each other), and a slice has at least
# PIECES_PER_SLICE of them where there are the files.
PIECE_BYTES = 64 << 20
PIECES_PER_SLICE = 8


def vectors_per_slice(factory: str, dim: int, slice_bytes: int) -> int:
    """Vectors a slice of `slice_bytes` holds: every slice carries the trained tables (coarse
    quantizer, its graph, PQ codebooks), the rest is codes and ids."""
    empty = estimated_bytes(factory, 0, dim)
    if empty > slice_bytes:
        raise IndexBuildError(
            f"the trained {factory} index alone (quantizer and codebooks, no vectors) needs about "
            f"{empty:,} B, more than the slice size of {slice_bytes:,} B: use a larger slice size"
        )
    return (slice_bytes - empty) // (estimated_bytes(factory, 1, dim) - empty)


def files_per_piece(vectors: int, files: int, slices: int, vector_bytes: int) -> int:
    """Consecutive files whose blocks of one slice make a piece: a file's block of a slice holds
    about vectors / files / slices vectors of `vector_bytes` (a code and its id)."""
    block = vectors / max(files, 1) / slices * vector_bytes
    by_bytes = int(PIECE_BYTES // max(block, 1))
    return max(1, min(by_bytes, files // PIECES_PER_SLICE))


def merge_slice_results(results, k: int):
    """The per-slice (scores [q, k], ids [q, k]) of the same queries -> the best k per query as
    one index returns them (`merge_hits`). faiss's own IndexShards breaks ties by shard instead."""
    queries = results[0][1].shape[0]
    return merge_hits([np.arange(queries)] * len(results), results, queries, k)


def merge_hits(rows: list[np.ndarray], found: list[tuple[np.ndarray, np.ndarray]], queries: int, k: int):
    """Slices' (scores, ids) [r, w] of the query rows `rows` (each a subset of `queries` rows)
    -> the best k per query [queries, k] as one index lists them, empty slots id -1 and score
    EMPTY_SCORE as faiss leaves them. Only the rows a slice searched are merged.

    The one rule for merging slices: of exact ties the lowest ids are kept (the first an index
    scans: its lists fill in chunk-id order), and listed highest id first (faiss's top-k heap
    pops them so). Each query's hits are laid out in one row of a table and sorted along it,
    so the sorts stay as short as a query's hits."""
    query = np.concatenate([np.repeat(r, f[1].shape[1]) for r, f in zip(rows, found)] + [np.zeros(0, np.int64)])
    scores = np.concatenate([f[0].ravel() for f in found] + [np.zeros(0, np.float32)])
    ids = np.concatenate([f[1].ravel() for f in found] + [np.zeros(0, np.int64)])
    hit = np.flatnonzero(ids >= 0)
    query, scores, ids = query[hit], scores[hit], ids[hit]
    merged_scores = np.full((queries, k), EMPTY_SCORE, np.float32)
    merged_ids = np.full((queries, k), -1, np.int64)
    if not len(hit):
        return merged_scores, merged_ids
    counts = np.bincount(query, minlength=queries)
    by_query = np.argsort(query, kind="stable")
    slot = np.arange(len(by_query)) - (np.cumsum(counts) - counts)[query[by_query]]
    # A row per query: negated scores (lowest first), +inf and the largest id where it has no hit.
    negated = np.full((queries, int(counts.max())), np.inf, np.float32)
    table_ids = np.full(negated.shape, np.iinfo(np.int64).max, np.int64)
    negated[query[by_query], slot] = -scores[by_query]
    table_ids[query[by_query], slot] = ids[by_query]
    best = np.lexsort((table_ids, negated), axis=1)[:, :k]  # the k kept: best score, then lowest id
    negated, table_ids = np.take_along_axis(negated, best, 1), np.take_along_axis(table_ids, best, 1)
    listed = np.lexsort((-table_ids, negated), axis=1)  # listed: best score, then highest id
    negated, table_ids = np.take_along_axis(negated, listed, 1), np.take_along_axis(table_ids, listed, 1)
    filled = np.isfinite(negated)
    width = negated.shape[1]
    merged_scores[:, :width] = np.where(filled, -negated, EMPTY_SCORE)
    merged_ids[:, :width] = np.where(filled, table_ids, -1)
    return merged_scores, merged_ids
