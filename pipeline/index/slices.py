"""The chunk index as S faiss files by chunk-id range, without Beam: which embeddings files
(parts) go into which slice, assembling a slice, searching all slices as one index, and the
recall and depth tuning measured over them.

Every slice is the same trained IVF index (coarse quantizer and PQ) with the lists of its own
parts merged in, so each file loads and searches alone, and a vector has the same code and the
same score in its slice as in one index holding everything. Searching every slice at one
nprobe probes the same lists as that one index would; the best k of the slices' best k are
the one index's best k (faiss's IndexShards model, with the single index's tie order kept, see
`merge_slice_results`). Importing this module imports no Beam.
"""

from __future__ import annotations

import types

import faiss
import numpy as np

from pipeline.common.names import file_number
from pipeline.index.factory import IndexBuildError, estimated_bytes
from pipeline.index.recall import RECALL_K, one_recall_at_k
from pipeline.index.search import (
    exclusion_selector,
    search_deepening,
    search_depth,
    search_depth_range,
    set_search_depth,
)
from pipeline.index.train import merge_part
from pipeline.index.tuning import tune_depth

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


def plan_slices(part_rows: list[int], factory: str, dim: int, slice_bytes: int) -> list[range]:
    """Consecutive parts (embeddings files in chunk-id order, with their row counts) grouped
    into slices, each as many parts as fit `slice_bytes` by `estimated_bytes` (which counts the
    quantizer and PQ tables every slice carries): ranges of part positions, in order. Parts are
    the unit (a part is filled once, by one worker), so a part that alone does not fit is an
    error; greedy filling gives the fewest slices any consecutive grouping can."""
    fits = vectors_per_slice(factory, dim, slice_bytes)
    slices, start, rows = [], 0, 0
    for position, count in enumerate(part_rows):
        if count > fits:
            raise IndexBuildError(
                f"embeddings file {position} holds {count:,} vectors, but a {factory} slice of "
                f"{slice_bytes:,} B holds at most {fits:,}: lower chunk_file_rows to {fits:,} or "
                f"less, or use a larger slice size"
            )
        if rows + count > fits:
            slices.append(range(start, position))
            start, rows = position, 0
        rows += count
    if start < len(part_rows):
        slices.append(range(start, len(part_rows)))
    return slices


def assign_slices(file_rows: dict[str, int], factory: str, dim: int, slice_bytes: int | None) -> dict[str, int]:
    """{embeddings file path: slice number} (files in number order, which is chunk-id order);
    empty when the index is one file: no slice size, or everything fits one slice."""
    if slice_bytes is None:
        return {}
    paths = sorted(file_rows, key=file_number)  # chunk-id order
    slices = plan_slices([file_rows[p] for p in paths], factory, dim, slice_bytes)
    if len(slices) <= 1:
        return {}
    return {paths[position]: number for number, positions in enumerate(slices) for position in positions}


def assemble_slice(trained, parts):
    """A copy of the trained index with the lists of `parts` (filled from that same trained
    index, in chunk-id order) merged in; `trained` stays empty for the next slice, the parts
    are emptied (`merge_part` moves their lists)."""
    index_slice = faiss.clone_index(trained)
    for part in parts:
        merge_part(index_slice, part)
    return index_slice


def slice_depth(slices) -> int:
    """The nprobe every slice is set to. Slices searched at different depths would scan
    different lists, and together not what one index scans."""
    depths = {search_depth(index_slice) for index_slice in slices}
    depth = next(iter(depths)) if len(depths) == 1 else None
    if depth is None:
        raise ValueError(f"index slices must be IVF indexes set to one nprobe, have {sorted(depths, key=str)}")
    return depth


def merge_slice_results(results, k: int):
    """The per-slice (scores [q, k], ids [q, k]) of the same queries -> the best k per query as
    one index returns them (`one_index_order`), empty slots id -1 and score EMPTY_SCORE as faiss
    leaves them. faiss's own IndexShards breaks ties by shard instead."""
    queries = results[0][1].shape[0]
    scores = np.concatenate([r[0] for r in results], axis=1).ravel()
    ids = np.concatenate([r[1] for r in results], axis=1).ravel()
    query = np.repeat(np.arange(queries), len(ids) // max(queries, 1))
    found = np.flatnonzero(ids >= 0)
    listed, rank = one_index_order((query[found],), ids[found], scores[found], k)
    kept = found[listed]
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


def _search_all(slices, queries: np.ndarray, k: int, selector, depth: int):
    """Every slice searched at `depth` (params replace each slice's own nprobe), merged."""
    params = faiss.SearchParametersIVF(sel=selector, nprobe=depth)  # type: ignore[call-arg]  # stubs lack the kwargs
    return merge_slice_results([index_slice.search(queries, k, params=params) for index_slice in slices], k)


def search_slices(
    slices, queries: np.ndarray, k: int, excluded: list[tuple[int, int]] | None = None, depth: int | None = None
):
    """`search.search_excluding` over the slices as one index: each slice searched at
    the same depth (`depth`, else the slices' own), results merged by score (inner product,
    higher first). With `excluded` ([start, end) chunk-id ranges) those ids are skipped inside
    faiss, and a query whose merged top k has empty slots is searched again at twice the depth,
    up to every list: deepening is decided on the merged result, as one index decides it (a
    slice holds few of a list's vectors, and would deepen alone far more often).
    -> (scores [q, k], ids [q, k] (-1 = none; score -FLT_MAX as faiss gives), deeper searches made)."""
    selector, _keep = exclusion_selector(excluded or [])
    queries = np.ascontiguousarray(queries, dtype=np.float32)
    deepest = faiss.extract_index_ivf(slices[0]).nlist if excluded is not None else None
    return search_deepening(
        lambda d: _search_all(slices, queries, k, selector, d), slice_depth(slices) if depth is None else depth, deepest
    )


def recall_of_slices(slices, query_ids, queries, truth, k: int = RECALL_K, depth: int | None = None) -> float:
    """`recall.one_recall_at_k` of the slices searched as one index at `depth` (default:
    the slices' own). one_recall_at_k only calls `index.search(queries, k)`, so the slices go
    in behind that one method."""
    searcher = types.SimpleNamespace(search=lambda q, width: search_slices(slices, q, width, depth=depth)[:2])
    return one_recall_at_k(searcher, query_ids, queries, truth, k)


def tune_slices_depth(slices, query_ids, queries, truth, target: float):
    """The slices' nprobe tuned as one index's (all slices share the quantizer, so its
    depths), then set on every slice: (depth, recall, plateaued)."""
    depths = search_depth_range(slices[0])
    if depths is None:
        raise ValueError("index slices must be IVF indexes: an index without lists has no nprobe to tune")
    depth, recall, plateau = tune_depth(
        depths, lambda d: recall_of_slices(slices, query_ids, queries, truth, depth=d), target
    )
    for index_slice in slices:
        set_search_depth(index_slice, depth)
    return depth, recall, plateau
