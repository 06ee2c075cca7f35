"""Exact search, in blocks so memory stays bounded: each query's nearest vectors other than
itself, or outside its own chunk-id ranges; the ground truth of both recall measures.
"""

from __future__ import annotations

import numpy as np

TRUTH_DEPTH = 100  # exact best per query kept as ground truth (ties beyond it count as misses)
# vectors per block of the exact search: bounds its [q, block] scores and their sort. Small
# blocks reuse the same memory; 32,768 made [500, 32768] blocks whose fresh pages cost more
# than the arithmetic (0.5 s against 1.8-2.9 s for 500 queries over 49,680 vectors, Intel Xeon
# with AMX, on a VM that hands freed memory back to its host)
EXACT_BLOCK = 8192


def exact_top(scores: np.ndarray, ids: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row of scores [n, r] over `ids` [r] (excluded entries -inf), the k best (higher
    score, then lower id): (scores [n, k] float32, ids [n, k]); -inf / -1 past the reachable."""
    n = len(scores)
    top_scores, top_ids = np.full((n, k), -np.inf, np.float32), np.full((n, k), -1, np.int64)
    if scores.shape[1] > k:  # the k best in linear time, then only those sorted
        best = np.argpartition(-scores, k - 1, axis=1)[:, :k]
        scores, candidates = np.take_along_axis(scores, best, axis=1), ids[best]
    else:
        candidates = np.broadcast_to(ids, scores.shape)
    order = np.lexsort((candidates, -scores), axis=1)
    found = np.take_along_axis(scores, order, axis=1)
    top_scores[:, : found.shape[1]] = found
    top_ids[:, : found.shape[1]] = np.where(np.isfinite(found), np.take_along_axis(candidates, order, axis=1), -1)
    return top_scores, top_ids


def merge_top(a, b, k: int):
    """Associative merge of two (scores, ids) top-k lists of the same queries."""
    scores = np.concatenate([a[0], b[0]], axis=1)
    ids = np.concatenate([a[1], b[1]], axis=1)
    order = np.lexsort((ids, -scores), axis=1)[:, :k]
    return np.take_along_axis(scores, order, axis=1), np.take_along_axis(ids, order, axis=1)


def _blocked_top(queries, ids, vectors, depth: int, mask_block):
    """Per query, the `depth` best of `ids`, scored a block of EXACT_BLOCK vectors at a time;
    `mask_block(scores, begin)` sets to -inf what a query may not return among the block's
    vectors `begin` … `begin + len(scores[0])`. No vectors: every slot empty (-inf, -1)."""
    result = exact_top(np.zeros((len(queries), 0), np.float32), ids[:0], depth)
    for begin in range(0, len(ids), EXACT_BLOCK):
        scores = queries @ vectors[begin : begin + EXACT_BLOCK].T  # [q, block]
        mask_block(scores, begin)
        result = merge_top(result, exact_top(scores, ids[begin : begin + EXACT_BLOCK], depth), depth)
    return result


def exact_nearest_other(query_ids, queries, ids, vectors, depth: int = TRUTH_DEPTH):
    """Per query, the `depth` nearest vectors among `ids` other than itself: (scores, ids)
    [q, depth], merged over blocks with `merge_top`."""

    def not_itself(scores, begin):
        scores[query_ids[:, None] == ids[None, begin : begin + scores.shape[1]]] = -np.inf

    return _blocked_top(queries, ids, vectors, depth, not_itself)


def truth_depth(k: int) -> int:
    """Exact best kept per query for a recall@k: enough to read the similarity of any
    neighbour that can count (one beyond the list is below its k-th best)."""
    return max(TRUTH_DEPTH, 4 * k)


def exact_nearest_outside(queries, excluded, ids, vectors, depth: int):
    """Per query, the `depth` nearest vectors among `ids` outside that query's [start, end) id
    ranges (`excluded`, one tuple of ranges per query): (scores, ids) [q, depth]. Rows in any
    order; merge over blocks with `merge_top`."""
    queries, vectors = np.asarray(queries, np.float32), np.asarray(vectors, np.float32)
    if np.any(ids[1:] < ids[:-1]):  # the ranges are cut from ids in order (files are in order already)
        order = np.argsort(ids, kind="stable")
        ids, vectors = ids[order], vectors[order]

    # every range's rows among the sorted ids, found once: [lo, hi) per (query row, range)
    rows = np.array([row for row, ranges in enumerate(excluded) for _ in ranges], np.int64)
    bounds = np.array([bound for ranges in excluded for bound in ranges], np.int64).reshape(-1, 2)
    lo, hi = np.searchsorted(ids, bounds[:, 0]), np.searchsorted(ids, bounds[:, 1])

    def outside(scores, begin):
        end = begin + scores.shape[1]
        for row, first, last in zip(*(a[(lo < end) & (hi > begin)].tolist() for a in (rows, lo, hi))):
            scores[row, max(first, begin) - begin : min(last, end) - begin] = -np.inf

    return _blocked_top(queries, ids, vectors, depth, outside)


def merge_nearest(a, b):
    """Associative merge of two ground truths (`exact_nearest_other` results)."""
    return merge_top(a, b, a[0].shape[1])


def exact_scores_of(truth, found: np.ndarray) -> np.ndarray:
    """The exact similarity of each found id [n, k] to its query, from the truth lists (scores,
    ids [n, depth]): nan for an empty slot (-1), -inf for an id beyond the list (below its
    depth-th best, so below the k-th)."""
    truth_scores, truth_ids = truth
    hit = (found[:, :, None] == truth_ids[:, None, :]) & (found[:, :, None] >= 0)  # [n, k, depth]
    ours = np.where(hit, truth_scores[:, None, :].astype(np.float64), -np.inf).max(axis=2, initial=-np.inf)
    ours[found < 0] = np.nan
    return ours
