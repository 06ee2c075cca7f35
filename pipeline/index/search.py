"""Searching an index: the search depth (nprobe or efSearch), excluding chunk-id ranges inside
faiss, and deepening a query until its k slots are filled.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import faiss
import numpy as np

from pipeline.index.factory import is_ivf
from pipeline.index.recall import RECALL_K
from pipeline.index.ties import TIE_SLACK, exact_search, is_exact, ranked, scored_again


def set_search_depth(index, depth: int) -> None:
    """nprobe for IVF (and an HNSW coarse quantizer's efSearch at least that: it returns at
    most about efSearch lists), efSearch for HNSW."""
    if is_ivf(index):
        faiss.extract_index_ivf(index).nprobe = depth
        graph = quantizer_graph(index)
        if graph is not None:
            graph.efSearch = max(graph.efSearch, depth)
    elif _hnsw(index) is not None:
        _hnsw(index).efSearch = depth


def quantizer_graph(ivf_index):
    """The HNSW graph of an IVF index's coarse quantizer, or None for a flat quantizer."""
    return _hnsw(faiss.downcast_index(faiss.extract_index_ivf(ivf_index).quantizer))


def _hnsw(index):
    inner = faiss.downcast_index(index.index) if isinstance(index, faiss.IndexIDMap) else index
    return inner.hnsw if hasattr(inner, "hnsw") else None


def search_depth(index) -> int | None:
    """The depth searches run at: nprobe (IVF), efSearch (HNSW), None (exhaustive types)."""
    if is_ivf(index):
        return faiss.extract_index_ivf(index).nprobe
    hnsw = _hnsw(index)
    return None if hnsw is None else hnsw.efSearch


def deepest_search(index) -> int | None:
    """The depth at which a search reaches every vector: all lists (IVF), a candidate list as
    long as the index (HNSW); None for exhaustive types."""
    if is_ivf(index):
        return faiss.extract_index_ivf(index).nlist
    return None if _hnsw(index) is None else max(int(index.ntotal), 1)


def _search_params(index, selector, depth: int | None):
    """faiss SearchParameters with `selector` at `depth` (faiss params replace the index's own
    nprobe / efSearch, so the depth is always given)."""
    # faiss's stubs list neither the SWIG constructors' keyword arguments nor SearchParametersHNSW
    if is_ivf(index):
        params = faiss.SearchParametersIVF(sel=selector, nprobe=depth)  # type: ignore[call-arg]
        graph = quantizer_graph(index)
        if graph is not None and depth is not None and depth > graph.efSearch:
            # an HNSW coarse quantizer returns at most about efSearch lists: it walks at least
            # as deep as the lists asked for, or deepening would stop short of them
            walk = faiss.SearchParametersHNSW(efSearch=depth)  # type: ignore[attr-defined]
            params.quantizer_params = walk
            params.referenced_objects = [walk]  # type: ignore[attr-defined]  # faiss holds a raw pointer
        return params
    if _hnsw(index) is not None:
        return faiss.SearchParametersHNSW(sel=selector, efSearch=depth)  # type: ignore[attr-defined]
    return faiss.SearchParameters(sel=selector)  # type: ignore[call-arg]


def exclusion_selector(excluded: list[tuple[int, int]]) -> tuple[faiss.IDSelector | None, list[faiss.IDSelector]]:
    """(a faiss selector of every id outside the [start, end) ranges, or None for no ranges;
    the selectors it is built of, which the caller keeps alive while searching: they hold raw
    pointers to each other)."""
    parts = [faiss.IDSelectorRange(int(start), int(end)) for start, end in excluded]
    if not parts:
        return None, []
    keep: list[faiss.IDSelector] = list(parts)
    union: faiss.IDSelector = parts[0]
    for part in parts[1:]:
        union = faiss.IDSelectorOr(union, part)
        keep.append(union)
    return faiss.IDSelectorNot(union), keep


def search_deepening(search_at, depth: int | None, deepest: int | None):
    """`search_at(depth)` -> (scores, ids); the rows that come back with an empty slot are
    searched again at twice the depth, up to `deepest` (None: never).
    -> (scores [q, k], ids [q, k] (-1 = none), deeper searches made)."""
    if deepest is not None and depth is None:
        raise ValueError(f"searching deeper, up to depth {deepest}, needs a starting depth, got None")
    scores, ids = search_at(depth)
    deeper = 0
    while deepest is not None and depth is not None and depth < deepest and (ids < 0).any():
        depth = min(2 * depth, deepest)
        deeper += 1
        # the same query block again (fixed shape), keeping the rows that were already full
        more_scores, more_ids = search_at(depth)
        short = (ids < 0).any(axis=1)
        scores[short], ids[short] = more_scores[short], more_ids[short]
    return scores, ids, deeper


def search_excluding(index, queries: np.ndarray, k: int, excluded: list[tuple[int, int]], width: int | None = None):
    """The k best ids outside the id ranges `excluded` ([start, end) each) per query, skipped
    by faiss during the search itself, so they never take a place in the top k. A query that
    comes back with fewer than k (an IVF whose probed lists, or an HNSW walk, hold mostly
    excluded vectors) is searched again at twice the depth, up to the deepest: a slot stays
    empty only when the index holds fewer than k vectors outside the ranges.
    An exact index has nothing to deepen: its ties are scored again (`ties.exact_search`, from
    `width` hits). -> (scores [q, k], ids [q, k] (-1 = none), deeper searches made)."""
    selector, _keep = exclusion_selector(excluded)
    queries = np.ascontiguousarray(queries, dtype=np.float32)
    if is_exact(index):
        return (*exact_search(index, queries, k, _search_params(index, selector, None), width), 0)
    return search_deepening(
        lambda depth: index.search(queries, k, params=_search_params(index, selector, depth)),
        search_depth(index),
        deepest_search(index),
    )


def search_depth_range(index) -> list[int] | None:
    """Depths to try, smallest first; None when the index is exact or has no depth knob."""
    if is_ivf(index):
        nlist = faiss.extract_index_ivf(index).nlist
        return sorted({min(2**i, nlist) for i in range(int(math.log2(nlist)) + 2)})
    return [16, 32, 64, 128, 256, 512, 1024] if _hnsw(index) is not None else None


# Hits beyond k that `search_each_excluding`'s one batched search asks for: a query's own
# documents' chunks are mostly its nearest, so it asks for k + as many as its ranges hold, up
# to this; a query left short is searched again alone with its ranges skipped inside faiss.
EXCLUSION_MARGIN_CAP = 64


@dataclass(frozen=True)
class ExcludedSearch:
    """What `search_each_excluding` found: per query row, the k best ids outside its ranges."""

    scores: np.ndarray  # [q, k]
    ids: np.ndarray  # [q, k], -1 = none
    searched_alone: np.ndarray  # bool [q]: left short by the batched search, searched again alone
    deeper: np.ndarray  # bool [q]: searched deeper than the index's depth


def search_each_excluding(index, queries: np.ndarray, k: int, excluded) -> ExcludedSearch:
    """Each query's k best ids outside its own [start, end) id ranges (`excluded[row]`), the
    answer `search_excluding` gives it alone, deepening included, in one batched search: every
    query at width k + margin (the chunks its ranges hold, at most EXCLUSION_MARGIN_CAP), its
    hits inside its ranges dropped exactly; a query left with fewer than k is searched again
    alone by `search_excluding` (rows with equal ranges together). Among vectors of the probed
    lists, the k best outside the ranges are the first k outside them of a longer list, so
    the answers agree but for ties."""
    queries = np.ascontiguousarray(queries, dtype=np.float32)
    rows = len(queries)
    excluded = [tuple(map(tuple, ranges)) for ranges in excluded]
    starts, ends = _range_table(excluded, rows)
    margin = int(min((ends - starts).sum(axis=1).max(initial=0), EXCLUSION_MARGIN_CAP))
    if is_exact(index):  # else a query with nothing to exclude has no room for its k-th's ties
        margin = max(margin, TIE_SLACK)
    scores, ids, alone, deeper = (
        np.empty((rows, k), np.float32),
        np.full((rows, k), -1, np.int64),
        np.zeros(rows, bool),
        np.zeros(rows, bool),
    )
    if rows == 0:
        return ExcludedSearch(scores, ids, alone, deeper)
    wide_scores, wide_ids = index.search(queries, k + margin)
    inside = ((wide_ids[..., None] >= starts[:, None, :]) & (wide_ids[..., None] < ends[:, None, :])).any(-1)
    if is_exact(index):  # ties scored again (`ties`); a band reaching the last hit searched goes alone, wider
        outside = np.where(inside, -1, wide_ids)
        again, beyond = scored_again(index, queries, wide_scores, outside, k)
        again, outside = ranked(again, outside)
        scores[:], ids[:] = again[:, :k], outside[:, :k]
        alone[:] = (ids < 0).any(axis=1) | (beyond & (wide_ids[:, -1] >= 0))
    else:
        first = np.argsort(inside | (wide_ids < 0), axis=1, kind="stable")[:, :k]  # the first k outside, by rank
        scores[:], ids[:] = np.take_along_axis(wide_scores, first, 1), np.take_along_axis(wide_ids, first, 1)
        alone[:] = (np.take_along_axis(inside, first, 1) | (ids < 0)).any(axis=1)
    rows_by_ranges: dict[tuple, list[int]] = {}
    for row in np.flatnonzero(alone).tolist():
        rows_by_ranges.setdefault(excluded[row], []).append(row)
    for ranges, same in rows_by_ranges.items():
        # an exact index's ties that reached the last of k + margin hits: four times as many
        scores[same], ids[same], deepened = search_excluding(index, queries[same], k, list(ranges), 4 * (k + margin))
        deeper[same] = deepened > 0
    return ExcludedSearch(scores, ids, alone, deeper)


def _range_table(excluded: list[tuple], rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's [start, end) ranges as two int64 arrays [rows, most ranges], padded with
    empty ranges."""
    width = max((len(ranges) for ranges in excluded), default=0)
    starts, ends = np.zeros((rows, width), np.int64), np.zeros((rows, width), np.int64)
    for row, ranges in enumerate(excluded):
        for column, (start, end) in enumerate(ranges):
            starts[row, column], ends[row, column] = start, end
    return starts, ends


def search_each_at(index, queries: np.ndarray, k: int, excluded, depth: int) -> tuple[np.ndarray, np.ndarray]:
    """Each query alone with its own id ranges skipped, at `depth` and no deeper (a slice of an
    index: whether to deepen is decided on the slices' merged result): (scores, ids) [q, k]."""
    scores, ids = np.empty((len(queries), k), np.float32), np.empty((len(queries), k), np.int64)
    for row, (query, ranges) in enumerate(zip(queries, excluded)):
        selector, _keep = exclusion_selector(list(ranges))
        found = index.search(
            np.ascontiguousarray(query[None], np.float32), k, params=_search_params(index, selector, depth)
        )
        scores[row], ids[row] = found[0][0], found[1][0]
    return scores, ids


def query_rate(index, queries: np.ndarray, k: int = RECALL_K) -> float:
    start = time.perf_counter()
    index.search(np.ascontiguousarray(queries, dtype=np.float32), k)
    return len(queries) / max(time.perf_counter() - start, 1e-9)
