"""The chunk index as S faiss files (slices), without Beam: how many vectors a slice holds, and
merging the slices' hits of the same queries as one index ranks them.

Every slice is the same trained IVF index (coarse quantizer and PQ) holding some of the
vectors (`routing`: the lists it owns), so each file loads and searches alone, and a vector
has the same code and the same score in its slice as in one index holding everything; the
best k of the slices' best k are the one index's best k (faiss's IndexShards model, with the
single index's tie order kept, see `one_index_order`). Importing this module imports no Beam.
"""

from __future__ import annotations

import numpy as np

from pipeline.index.factory import IndexBuildError, estimated_bytes

EMPTY_SCORE = np.finfo(np.float32).min  # faiss's -FLT_MAX in an inner-product slot it could not fill


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


def merge_slice_results(results, k: int):
    """The per-slice (scores [q, k], ids [q, k]) of the same queries -> the best k per query as
    one index returns them (`merge_hits`). faiss's own IndexShards breaks ties by shard instead."""
    queries = results[0][1].shape[0]
    return merge_hits([np.arange(queries)] * len(results), results, queries, k)


def merge_hits(rows: list[np.ndarray], found: list[tuple[np.ndarray, np.ndarray]], queries: int, k: int):
    """Slices' (scores, ids) [r, k] of the query rows `rows` (each a subset of `queries` rows)
    -> the best k per query [queries, k] as one index lists them, empty slots id -1 and score
    EMPTY_SCORE as faiss leaves them. Only the rows a slice searched are merged."""
    query = np.concatenate([np.repeat(r, k) for r in rows] + [np.zeros(0, np.int64)])
    scores = np.concatenate([f[0].ravel() for f in found] + [np.zeros(0, np.float32)])
    ids = np.concatenate([f[1].ravel() for f in found] + [np.zeros(0, np.int64)])
    hit = np.flatnonzero(ids >= 0)
    listed, rank = one_index_order((query[hit],), ids[hit], scores[hit], k)
    kept = hit[listed]
    merged_scores = np.full((queries, k), EMPTY_SCORE, np.float32)
    merged_ids = np.full((queries, k), -1, np.int64)
    merged_scores[query[kept], rank], merged_ids[query[kept], rank] = scores[kept], ids[kept]
    return merged_scores, merged_ids


def one_index_order(query: tuple[np.ndarray, ...], ids: np.ndarray, scores: np.ndarray, width: int):
    """Hits of the same queries from several slices (`query`: the key columns naming each hit's
    query; chunk `ids`; `scores`) -> (positions of the best `width` hits per query, in the order
    one index lists them; each one's rank in its query). The one rule for merging slices: of
    exact ties the lowest ids are kept (the first an index scans: its lists fill in chunk-id
    order), and listed highest id first (faiss's top-k heap pops them so)."""
    order = np.lexsort((ids, -scores, *reversed(query)))
    keys = np.stack([column[order] for column in query], axis=1)
    first = np.ones(len(order), bool)
    first[1:] = (keys[1:] != keys[:-1]).any(axis=1)
    starts = np.flatnonzero(first)
    place = np.arange(len(order)) - np.repeat(starts, np.diff(np.append(starts, len(order))))
    kept = order[place < width]
    listed = kept[np.lexsort((-ids[kept], -scores[kept], *(column[kept] for column in reversed(query))))]
    return listed, place[place < width]
