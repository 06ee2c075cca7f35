"""The two recall measures, with ties within TIE_TOLERANCE counting as found:
1-recall@10 (the query itself excluded) and recall@k of the search build-shards makes (the
query's own document excluded).
"""

from __future__ import annotations

import numpy as np

from pipeline.index.exact import exact_scores_of
from schemas.measures import TIE_TOLERANCE

RECALL_K = 10
# Share of queries for which one of the index's top 10 (the query excluded) is as similar as
# the exact nearest other vector, within TIE_TOLERANCE: near-duplicates are interchangeable.
RECALL_MEASURE = f"1-recall@{RECALL_K} with ties within {TIE_TOLERANCE:g}"
PLATEAU_GAIN = 0.005  # stop deepening the search when two doublings of the depth gain less recall


def one_recall_at_k(index, query_ids, queries, truth, k: int = RECALL_K) -> float:
    """RECALL_MEASURE: share of queries one of whose top k from the index (self excluded) is
    within TIE_TOLERANCE of the exact nearest other vector's similarity. A returned vector's
    exact similarity comes from the truth list; one beyond it is a miss unless the list
    ends above the tie line (then it cannot be told, and counts as a miss)."""
    _, found = index.search(np.ascontiguousarray(queries, dtype=np.float32), k + 1)
    return one_recall_of_found(query_ids, found, truth, k)


def one_recall_of_found(query_ids, found: np.ndarray, truth, k: int = RECALL_K) -> float:
    """RECALL_MEASURE of what a search found for the queries (ids [q, >= k + 1]): for a search
    made elsewhere, such as an index's slices searched one per worker and merged."""
    truth_scores, truth_ids = truth
    hits = 0
    for q, row, t_scores, t_ids in zip(query_ids, found, truth_scores, truth_ids):
        returned = [f for f in row if f != q and f >= 0][:k]
        similarity = dict(zip(t_ids.tolist(), t_scores.tolist()))
        hits += any(similarity.get(f, -np.inf) >= t_scores[0] - TIE_TOLERANCE for f in returned)
    return hits / len(query_ids) if len(query_ids) else 1.0


# The neighbour measure: what build-shards checks, and what the index stage tunes on when it
# knows each query's document.
NEIGHBOUR_MEASURE = f"recall@k with ties within {TIE_TOLERANCE:g} (empty slot = miss)"


def recall_with_ties(exact_scores: np.ndarray, ours_exact: np.ndarray) -> tuple[int, int]:
    """(right neighbours, slots that exact search fills) over the sampled queries.

    exact_scores [n, >= k]: exact search's best scores (-inf where fewer exist), of which the
    first k count; ours_exact [n, k]: the exact score of each of our neighbours (nan for an
    empty slot). A neighbour is right when it is within TIE_TOLERANCE of the exact k-th best
    (near-duplicates are interchangeable); an empty slot is a miss unless exact search has
    nothing to offer either."""
    k = ours_exact.shape[1]
    slots = np.isfinite(exact_scores[:, :k]).sum(axis=1)  # [n]
    kth = np.where(slots > 0, exact_scores[np.arange(len(slots)), np.maximum(slots - 1, 0)], np.inf)
    with np.errstate(invalid="ignore"):
        right = (ours_exact >= kth[:, None] - TIE_TOLERANCE).sum(axis=1)  # nan compares False
    return int(np.minimum(right, slots).sum()), int(slots.sum())


def recall_of(truth, found: np.ndarray) -> float:
    """NEIGHBOUR_MEASURE of found ids [n, k] against the truth (scores, ids) of the same queries."""
    right, slots = recall_with_ties(truth[0], exact_scores_of(truth, found))
    return right / slots if slots else 1.0
