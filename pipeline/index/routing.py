"""Index slices by groups of nearby inverted lists, and a search routed to them, without Beam.

Slices by chunk-id range (`slices.py`) each hold a share of every list, so every query goes to
every slice, and each repeats the coarse assignment and the per-list tables of every probed
list: the search's cost multiplies with the slices. Here a slice owns whole lists instead, and
the lists a slice owns are neighbours in the embedding space (a k-means of the centroids), so a
query's probed lists fall in few slices. The coarse assignment runs once per query; each query
goes only to the slices owning at least one of its probed lists, with those lists; each slice
scans only them (faiss `search_preassigned`, the other lists masked as -1); the slices' hits
merge as one index lists them (`slices.merge_slice_results`). A query whose merged top k is
short after the exclusion is searched again at twice the depth, on the merged result, as one
index decides it. Exact score ties between vectors of different lists, which live in different
slices, keep the lowest ids, where one index keeps the one in the list it probes first.
"""

from __future__ import annotations

import faiss
import numpy as np

from pipeline.index.search import exclusion_selector, quantizer_graph, search_deepening
from pipeline.index.slices import merge_slice_results


def list_owners(centroids: np.ndarray, list_sizes: np.ndarray, slices: int, seed: int = 0) -> np.ndarray:
    """The slice of each inverted list [nlist]: the lists ordered by a spherical k-means of their
    centroids into `slices` groups (nearby lists together), then cut into `slices` consecutive
    runs of about equal vectors (`list_sizes`), so slices are balanced and mostly one group each."""
    nlist = len(centroids)
    slices = max(1, min(slices, nlist))
    if slices == 1:
        return np.zeros(nlist, np.int32)
    kmeans = faiss.Kmeans(centroids.shape[1], slices, niter=20, seed=seed, spherical=True, min_points_per_centroid=1)
    kmeans.train(np.ascontiguousarray(centroids, dtype=np.float32))
    _, group = kmeans.index.search(np.ascontiguousarray(centroids, dtype=np.float32), 1)
    order = np.lexsort((np.arange(nlist), group.ravel()))
    before = np.cumsum(list_sizes[order]) - list_sizes[order]  # vectors ahead of each list in that order
    run = np.minimum(before * slices // max(int(list_sizes.sum()), 1), slices - 1)
    owner = np.empty(nlist, np.int32)
    owner[order] = run
    return owner


def slice_by_lists(index, owner: np.ndarray) -> list:
    """An IVF index split into slices that each hold only the lists `owner` gives them (the
    trained quantizer and codebooks in every slice)."""
    slices = []
    for number in range(int(owner.max()) + 1):
        index_slice = faiss.clone_index(index)
        invlists = faiss.extract_index_ivf(index_slice).invlists
        assert invlists is not None  # a trained IVF index has its lists
        for listed in np.flatnonzero(owner != number):
            invlists.resize(int(listed), 0)
        slices.append(index_slice)
    return slices


def assign_lists(index, queries: np.ndarray, depth: int) -> tuple[np.ndarray, np.ndarray]:
    """The coarse assignment, once per query: (centroid scores, list ids) [q, depth] of the
    `depth` lists each query probes (an HNSW quantizer walking at least that deep, as
    `search._search_params` sets it for a whole search)."""
    quantizer = faiss.extract_index_ivf(index).quantizer
    graph = quantizer_graph(index)
    params = None
    if graph is not None:
        params = faiss.SearchParametersHNSW(efSearch=max(graph.efSearch, depth))  # type: ignore[attr-defined]
    return quantizer.search(np.ascontiguousarray(queries, dtype=np.float32), depth, params=params)


def search_assigned(index_slice, queries: np.ndarray, k: int, lists: np.ndarray, list_scores: np.ndarray, selector):
    """One slice scanning only `lists` [q, w] (-1: not this slice's) of each query, with the
    ids `selector` rejects skipped: (scores, ids) [q, k]. (faiss's Python wrapper of
    search_preassigned takes no search parameters, so the C function is called.)"""
    ivf = faiss.extract_index_ivf(index_slice)
    n, width = lists.shape
    queries = np.ascontiguousarray(queries, dtype=np.float32)
    lists = np.ascontiguousarray(lists, dtype=np.int64)
    list_scores = np.ascontiguousarray(list_scores, dtype=np.float32)
    scores, ids = np.empty((n, k), np.float32), np.empty((n, k), np.int64)
    params = faiss.SearchParametersIVF(sel=selector, nprobe=width)  # type: ignore[call-arg]
    ptr = faiss.swig_ptr
    ivf.search_preassigned_c(  # type: ignore[attr-defined]  # the stubs list only the wrapper
        n, ptr(queries), k, ptr(lists), ptr(list_scores), ptr(scores), ptr(ids), False, params
    )
    return scores, ids


def search_routed(slices, owner: np.ndarray, queries: np.ndarray, k: int, excluded=None, depth: int | None = None):
    """The slices searched as one index: one coarse assignment per query at `depth` (default:
    the first slice's nprobe), each query sent to the slices owning its probed lists, the hits
    merged; with `excluded` ([start, end) chunk-id ranges) those ids skipped inside faiss, and a
    query whose merged top k is short searched again at twice the depth, up to every list.
    -> (scores [q, k], ids [q, k] (-1 = none), deeper searches made, (query, slice) pairs sent)."""
    selector, _keep = exclusion_selector(excluded or [])
    queries = np.ascontiguousarray(queries, dtype=np.float32)
    ivf = faiss.extract_index_ivf(slices[0])
    sent = [0]

    def search_at(at: int):
        list_scores, lists = assign_lists(slices[0], queries, at)
        owners = np.where(lists >= 0, owner[np.maximum(lists, 0)], -1)  # -1: a slot the quantizer left empty
        results = []
        for number, index_slice in enumerate(slices):
            mine = owners == number
            rows = np.flatnonzero(mine.any(axis=1))
            scores, ids = (
                np.full((len(queries), k), np.finfo(np.float32).min, np.float32),
                np.full((len(queries), k), -1),
            )
            if len(rows):
                found = search_assigned(
                    index_slice, queries[rows], k, np.where(mine[rows], lists[rows], -1), list_scores[rows], selector
                )
                scores[rows], ids[rows] = found
            sent[0] += len(rows)
            results.append((scores, ids))
        return merge_slice_results(results, k)

    scores, ids, deeper = search_deepening(search_at, depth or ivf.nprobe, ivf.nlist if excluded is not None else None)
    return scores, ids, deeper, sent[0]
