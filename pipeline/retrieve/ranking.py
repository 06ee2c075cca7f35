"""The neighbours stored in shards brought up to date after the database changed, from the hits among
the new vectors alone (`refreshed`).

Why a refresh can be exact: after a change a query's top k can differ from its stored top k
only where (a) a stored neighbour was deleted, or (b) a new vector scores above its k-th
stored neighbour. So the stored neighbours less the deleted, merged in the one order with the
query's best hits among the new vectors, are the top k of the changed database, but for ties,
unless (a): then the candidate that followed the k stored ones was never kept, and the query
must be searched in the whole index again (`RefreshedNeighbours.search_again`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeline.index.ties import ranked


@dataclass(frozen=True)
class RefreshedNeighbours:
    """Each query's k neighbours after a change: `scores` float32 [q, k], `ids` int64 [q, k]
    (-1 where absent), and `search_again` bool [q]: a stored neighbour was deleted, so its row
    is only what is known, and the query is searched in the whole changed index again."""

    scores: np.ndarray
    ids: np.ndarray
    search_again: np.ndarray


def refreshed(
    stored_scores: np.ndarray, stored_ids: np.ndarray, deleted: np.ndarray, new_scores: np.ndarray, new_ids: np.ndarray
) -> RefreshedNeighbours:
    """Stored neighbours [q, k] (ids -1 where the build found fewer), `deleted` [q, k] (which of
    them the change deleted) and the queries' best hits among the new vectors [q, w] (searched
    with the same exclusions as the build) -> the first k of their union in the one order.
    A stored row with empty slots stays exact: the whole database was searched for it then."""
    k = stored_ids.shape[1]
    gone = deleted & (stored_ids >= 0)
    kept_ids = np.where(gone, -1, stored_ids)
    scores, ids = ranked(np.concatenate([stored_scores, new_scores], 1), np.concatenate([kept_ids, new_ids], 1))
    return RefreshedNeighbours(scores[:, :k], ids[:, :k], np.any(gone, axis=1))
