"""Ties among a query's hits: the one order (`ranked`: score descending, then chunk id
ascending), and an exact index's hits near a query's k-th scored again pair by pair, so that a
pair's score does not depend on the search call it came from.

faiss rounds a pair's inner product differently depending on how many queries its call holds
(a vector against its own copy: 0.8999999 with 1 or 41 queries in the call, 0.9 with 2,048;
faiss 1.15.1, IndexFlatIP). A chunk repeated verbatim in a corpus has bit-identical embeddings,
so its copies came out a float32 step apart, and which copy a build kept depended on the batch
it was searched in: a refresh, which merges stored and new hits, and a full build disagreed.
Scored again in float64, rounded once, copies tie exactly and the chunk id decides.
"""

from __future__ import annotations

import faiss
import numpy as np

# hits within this of a query's k-th by faiss's scores are scored again: far above its rounding
TIE_BAND = 1e-5
# hits beyond k an exact search asks for at least, so that the k-th's ties usually fit in it (a
# row whose ties reach its last hit is searched again alone, wider)
TIE_SLACK = 8


def ranked(scores: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's hits [rows, width] in the one candidate order: score descending, then chunk
    id ascending (a tie is broken the same way by every search and every refresh), empty slots
    (id -1) last."""
    order = np.lexsort((ids, -scores.astype(np.float64), ids < 0), axis=-1)
    return np.take_along_axis(scores, order, -1), np.take_along_axis(ids, order, -1)


def is_exact(index) -> bool:
    """Whether `index` scores every vector exactly by inner product (a Flat index, with or
    without an id map)."""
    inner = faiss.downcast_index(index.index if isinstance(index, faiss.IndexIDMap) else index)
    return isinstance(inner, faiss.IndexFlat) and index.metric_type == faiss.METRIC_INNER_PRODUCT


def pair_scores(queries: np.ndarray, vectors: np.ndarray) -> np.ndarray:
    """Row i's inner product of queries[i] and vectors[i], float32 [n]: in float64 (products of
    float32s are exact there), rounded once, so the same pair scores the same in any call."""
    return np.einsum("ij,ij->i", queries.astype(np.float64), vectors.astype(np.float64)).astype(np.float32)


def scored_again(index, queries: np.ndarray, scores: np.ndarray, ids: np.ndarray, k: int):
    """An exact index's hits [q, w] (ids -1 where none or left out), those within `TIE_BAND` of
    each row's k-th scored again (`pair_scores`) -> (the scores, and per row whether its band
    reaches the last of its w slots: a tie may lie beyond what was searched)."""
    valid = ids >= 0
    best = -np.sort(-np.where(valid, scores, -np.inf), axis=1)
    kth = best[:, min(k, scores.shape[1]) - 1]
    band = valid & (scores >= (kth - TIE_BAND)[:, None])
    rows, columns = np.nonzero(band)
    again = scores.copy()
    if len(rows):
        again[rows, columns] = pair_scores(queries[rows], _vectors_of(index, ids[rows, columns]))
    return again, scores[:, -1] >= kth - TIE_BAND


def _vectors_of(index, ids: np.ndarray) -> np.ndarray:
    """The stored vectors of these ids (an id map without a reverse map: through its positions)."""
    ids = np.ascontiguousarray(ids, np.int64)
    if isinstance(index, faiss.IndexIDMap) and not isinstance(index, faiss.IndexIDMap2):
        id_map = faiss.vector_to_array(index.id_map)
        order = np.argsort(id_map, kind="stable")
        ids = np.ascontiguousarray(order[np.searchsorted(id_map, ids, sorter=order)], np.int64)
        index = faiss.downcast_index(index.index)
    return index.reconstruct_batch(ids)


def exact_search(
    index, queries: np.ndarray, k: int, params=None, width: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """An exact index's k best hits per query in the one order, ties scored again, from a
    search `width` hits wide (at least k): a row whose tied hits may reach past what was
    searched is searched again four times as wide, up to the whole index. -> (scores [q, k],
    ids [q, k], -1 = none)."""
    queries = np.ascontiguousarray(queries, np.float32)
    scores = np.full((len(queries), k), -np.inf, np.float32)
    ids = np.full((len(queries), k), -1, np.int64)
    need, width = np.arange(len(queries)), min(max(k, width or k), max(int(index.ntotal), k))
    while len(need):
        found_scores, found = index.search(queries[need], width, params=params)
        again, beyond = scored_again(index, queries[need], found_scores, found, k)
        again, found = ranked(again, found)
        scores[need], ids[need] = again[:, :k], found[:, :k]
        if width >= index.ntotal:
            break
        need, width = need[beyond & (found[:, -1] >= 0)], min(4 * width, int(index.ntotal))
    return scores, ids
