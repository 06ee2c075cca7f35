"""The chunk index as S faiss files by chunk-id range, without Beam: which embeddings files
(parts) go into which shard, assembling a shard, searching all shards as one index, and the
recall and depth tuning measured over them.

Every shard is the same trained IVF index (coarse quantizer and PQ) with the lists of its own
parts merged in, so each file loads and searches alone, and a vector has the same code and the
same score in its shard as in one index holding everything. Searching every shard at one
nprobe probes the same lists as that one index would; the best k of the shards' best k are
the one index's best k (faiss's IndexShards model, with the single index's tie order kept, see
`merge_shard_results`). Importing this module imports no Beam.
"""

from __future__ import annotations

import functools
import types

import faiss
import numpy as np

from pipeline.index.exact import merge_top
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


def vectors_per_shard(factory: str, dim: int, shard_bytes: int) -> int:
    """Vectors a shard of `shard_bytes` holds: every shard carries the trained tables (coarse
    quantizer, its graph, PQ codebooks), the rest is codes and ids."""
    empty = estimated_bytes(factory, 0, dim)
    if empty > shard_bytes:
        raise IndexBuildError(
            f"the trained {factory} index alone (quantizer and codebooks, no vectors) needs about "
            f"{empty:,} B, more than the shard size of {shard_bytes:,} B: use a larger shard size"
        )
    return (shard_bytes - empty) // (estimated_bytes(factory, 1, dim) - empty)


def plan_shards(part_rows: list[int], factory: str, dim: int, shard_bytes: int) -> list[range]:
    """Consecutive parts (embeddings files in chunk-id order, with their row counts) grouped
    into shards, each as many parts as fit `shard_bytes` by `estimated_bytes` (which counts the
    quantizer and PQ tables every shard carries): ranges of part positions, in order. Parts are
    the unit (a part is filled once, by one worker), so a part that alone does not fit is an
    error; greedy filling gives the fewest shards any consecutive grouping can."""
    fits = vectors_per_shard(factory, dim, shard_bytes)
    shards, start, rows = [], 0, 0
    for position, count in enumerate(part_rows):
        if count > fits:
            raise IndexBuildError(
                f"embeddings file {position} holds {count:,} vectors, but a {factory} shard of "
                f"{shard_bytes:,} B holds at most {fits:,}: lower chunk_file_rows to {fits:,} or "
                f"less, or use a larger shard size"
            )
        if rows + count > fits:
            shards.append(range(start, position))
            start, rows = position, 0
        rows += count
    if start < len(part_rows):
        shards.append(range(start, len(part_rows)))
    return shards


def assign_shards(file_rows: dict[str, int], factory: str, dim: int, shard_bytes: int | None) -> dict[str, int]:
    """{embeddings file path: shard number} (files in path order, which is chunk-id order);
    empty when the index is one file: no shard size, or everything fits one shard."""
    if shard_bytes is None:
        return {}
    paths = sorted(file_rows)
    shards = plan_shards([file_rows[p] for p in paths], factory, dim, shard_bytes)
    if len(shards) <= 1:
        return {}
    return {paths[position]: number for number, positions in enumerate(shards) for position in positions}


def assemble_shard(trained, parts):
    """A copy of the trained index with the lists of `parts` (filled from that same trained
    index, in chunk-id order) merged in; `trained` stays empty for the next shard, the parts
    are emptied (`merge_part` moves their lists)."""
    shard = faiss.clone_index(trained)
    for part in parts:
        merge_part(shard, part)
    return shard


def shard_depth(shards) -> int:
    """The nprobe every shard is set to. Shards searched at different depths would scan
    different lists, and together not what one index scans."""
    depths = {search_depth(shard) for shard in shards}
    if len(depths) != 1 or None in depths:
        raise ValueError(f"index shards must be IVF indexes set to one nprobe, have {sorted(depths, key=str)}")
    return depths.pop()


def merge_shard_results(results, k: int):
    """The per-shard (scores [q, k], ids [q, k]) of the same queries -> the best k per query,
    in one index's order. One index keeps, of vectors scoring exactly alike, the first it scans;
    its lists fill in chunk-id order, so that is the lowest id (`merge_top`: higher score, then
    lower id). It then lists exact ties highest id first (faiss's top-k heap pops them so); the
    kept k are reordered the same way. faiss's own IndexShards breaks ties by shard instead."""
    scores, ids = functools.reduce(lambda a, b: merge_top(a, b, k), results)
    order = np.lexsort((-ids, -scores), axis=1)
    return np.take_along_axis(scores, order, axis=1), np.take_along_axis(ids, order, axis=1)


def _search_all(shards, queries: np.ndarray, k: int, selector, depth: int):
    """Every shard searched at `depth` (params replace each shard's own nprobe), merged."""
    params = faiss.SearchParametersIVF(sel=selector, nprobe=depth)
    return merge_shard_results([shard.search(queries, k, params=params) for shard in shards], k)


def search_shards(
    shards, queries: np.ndarray, k: int, excluded: list[tuple[int, int]] | None = None, depth: int | None = None
):
    """`faiss_index.search_excluding` over the shards as one index: each shard searched at
    the same depth (`depth`, else the shards' own), results merged by score (inner product,
    higher first). With `excluded` ([start, end) chunk-id ranges) those ids are skipped inside
    faiss, and a query whose merged top k has empty slots is searched again at twice the depth,
    up to every list: deepening is decided on the merged result, as one index decides it (a
    shard holds few of a list's vectors, and would deepen alone far more often).
    -> (scores [q, k], ids [q, k] (-1 = none; score -FLT_MAX as faiss gives), deeper searches made)."""
    selector, _keep = exclusion_selector(excluded or [])
    queries = np.ascontiguousarray(queries, dtype=np.float32)
    deepest = faiss.extract_index_ivf(shards[0]).nlist if excluded is not None else None
    return search_deepening(
        lambda d: _search_all(shards, queries, k, selector, d), shard_depth(shards) if depth is None else depth, deepest
    )


def recall_of_shards(shards, query_ids, queries, truth, k: int = RECALL_K, depth: int | None = None) -> float:
    """`faiss_index.one_recall_at_k` of the shards searched as one index at `depth` (default:
    the shards' own). one_recall_at_k only calls `index.search(queries, k)`, so the shards go
    in behind that one method."""
    searcher = types.SimpleNamespace(search=lambda q, width: search_shards(shards, q, width, depth=depth)[:2])
    return one_recall_at_k(searcher, query_ids, queries, truth, k)


def tune_shards_depth(shards, query_ids, queries, truth, target: float):
    """The shards' nprobe tuned as one index's (all shards share the quantizer, so its
    depths), then set on every shard: (depth, recall, plateaued)."""
    depth, recall, plateau = tune_depth(
        search_depth_range(shards[0]), lambda d: recall_of_shards(shards, query_ids, queries, truth, depth=d), target
    )
    for shard in shards:
        set_search_depth(shard, depth)
    return depth, recall, plateau
