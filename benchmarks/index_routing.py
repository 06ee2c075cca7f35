"""Search over index slices: by chunk-id range (every query to every slice) against slices by
groups of nearby lists with one coarse assignment per query (`pipeline/index/routing.py`).

    .venv/bin/python benchmarks/index_routing.py [--n 1000000] [--slices 1 4 16 64] [--factory F]

Data: `--n` 384-d `LowRankClusters` unit vectors (1,000 clusters of rank 8; with `--topics T`
the clusters gather in T topics, as texts on one subject do; without, every cluster is as far
from every other: the worst case for grouping nearby lists), an index of
`--factory` (default `IVF4096,PQ48x8np`) trained on 262,144 of them and filled with all, and
4,096 queries (indexed vectors plus a little noise), k = 10 at nprobe `--nprobe` (16).

Per slice count S, in this one process (faiss on every core), CPU seconds of the search alone
(`time.process_time`, slices already in memory, as a worker holding its slice has them):
- one index: the reference, searched once;
- id-range: S slices by chunk-id range, every query searched on every slice (each repeats the
  coarse assignment and the per-list tables), merged;
- routed: S slices by groups of nearby lists (`list_owners`), one coarse assignment per query,
  each query searched only on the slices owning its probed lists (`search_routed`).
The index is built on every core; every search runs on one thread (faiss's OpenMP set to 1),
as one worker core does. And per query the bytes a shuffle carries: id-range, the float32
query vector and its row to every slice (a lower bound: build-shards sent whole search
batches, tokens included); routed, to each slice reached the vector, its row and its probed
lists with their coarse scores (`SliceQueries`), plus the batch's own state to the merge (the
vector again and the k hits); and the share of the k slots equal to one index's (ties within
1e-6 counted equal).

Results: a table on stdout, JSON in benchmarks/results/index_routing.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import faiss
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.report import write_results  # noqa: E402
from benchmarks.synthetic import LowRankClusters  # noqa: E402
from pipeline.index.routing import list_owners, list_sizes, search_routed, slice_by_lists  # noqa: E402
from pipeline.index.slices import merge_slice_results  # noqa: E402

DIM, K, QUERIES, TRAIN = 384, 10, 4096, 262_144
RESULTS = Path(__file__).resolve().parent / "results" / "index_routing.json"


def cpu_seconds(run) -> tuple[float, object]:
    started = time.process_time()
    result = run()
    return time.process_time() - started, result


def id_range_slices(index, n: int, count: int) -> list:
    slices = []
    for number in range(count):
        index_slice = faiss.clone_index(index)
        start, end = number * n // count, (number + 1) * n // count
        index_slice.remove_ids(faiss.IDSelectorNot(faiss.IDSelectorRange(start, end)))
        slices.append(index_slice)
    return slices


def same_slots(ids, scores, want_ids, want_scores) -> float:
    return float(((ids == want_ids) | (np.abs(scores - want_scores) <= 1e-6)).mean())


def measure(index, queries: np.ndarray, count: int, nprobe: int, reference) -> dict:
    """Both ways of slicing `index` into `count` slices, against one index (`reference`: its
    CPU seconds, scores and ids)."""
    one_cpu, want_scores, want_ids = reference
    vector_bytes = DIM * 4 + 8  # a float32 query and its row
    by_id = id_range_slices(index, index.ntotal, count)
    id_cpu, (scores, ids) = cpu_seconds(
        lambda: merge_slice_results([index_slice.search(queries, K) for index_slice in by_id], K)
    )
    ivf = faiss.extract_index_ivf(index)
    owner = list_owners(ivf.quantizer.reconstruct_n(0, ivf.nlist), list_sizes(index), count)
    by_lists = slice_by_lists(index, owner)
    routed_cpu, (r_scores, r_ids, _, sent) = cpu_seconds(lambda: search_routed(index, by_lists, owner, queries, k=K))
    row = {
        "slices": count,
        "one_index_cpu_s": one_cpu,
        "id_range_cpu_s": id_cpu,
        "routed_cpu_s": routed_cpu,
        "id_range_ratio": id_cpu / one_cpu,
        "routed_ratio": routed_cpu / one_cpu,
        "id_range_bytes_per_query": count * vector_bytes,
        "routed_bytes_per_query": sent / len(queries) * (vector_bytes + nprobe * 12) + vector_bytes + K * 12,
        "routed_slices_per_query": sent / len(queries),
        "id_range_equal": same_slots(ids, scores, want_ids, want_scores),
        "routed_equal": same_slots(r_ids, r_scores, want_ids, want_scores),
    }
    print(
        f"S={count:>3}: CPU one index {one_cpu:.2f} s, id-range {id_cpu:.2f} s ({row['id_range_ratio']:.2f}x), "
        f"routed {routed_cpu:.2f} s ({row['routed_ratio']:.2f}x); bytes/query id-range "
        f"{row['id_range_bytes_per_query']:,.0f}, routed {row['routed_bytes_per_query']:,.0f} "
        f"({row['routed_slices_per_query']:.1f} slices); equal to one index: id-range {row['id_range_equal']:.4f}, "
        f"routed {row['routed_equal']:.4f}",
        flush=True,
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=1_000_000)
    parser.add_argument("--slices", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--factory", default="IVF4096,PQ48x8np")
    parser.add_argument("--nprobe", type=int, default=16)
    parser.add_argument("--topics", type=int, default=None)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    data = LowRankClusters(DIM, topics=args.topics).sample(args.n, rng)
    started = time.perf_counter()
    index = faiss.index_factory(DIM, args.factory, faiss.METRIC_INNER_PRODUCT)
    index.train(data[rng.choice(args.n, min(TRAIN, args.n), replace=False)])
    index.add(data)
    ivf = faiss.extract_index_ivf(index)
    ivf.nprobe = args.nprobe
    print(f"[index] {args.factory} over {args.n:,}: {time.perf_counter() - started:.0f} s", flush=True)
    faiss.omp_set_num_threads(1)  # every search on one core
    queries = data[rng.integers(0, args.n, QUERIES)] + 0.02 * rng.normal(size=(QUERIES, DIM)).astype(np.float32)
    queries = np.ascontiguousarray(queries / np.linalg.norm(queries, axis=1, keepdims=True), dtype=np.float32)
    one_cpu, (want_scores, want_ids) = cpu_seconds(lambda: index.search(queries, K))
    reference = (one_cpu, want_scores, want_ids)
    rows = [measure(index, queries, count, args.nprobe, reference) for count in args.slices]
    results = {"n": args.n, "factory": args.factory, "nprobe": args.nprobe, "topics": args.topics, "rows": rows}
    write_results(results, RESULTS.with_name(f"index_routing{'' if args.topics is None else '_topics'}.json"))


if __name__ == "__main__":
    main()
