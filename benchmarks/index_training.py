"""Training the IVF lists: one k-means over all lists against two-level k-means (faiss's
scheme plus Lloyd refinement, `pipeline/index/kmeans.py`), for time and for the recall of the
index they give.

    .venv/bin/python benchmarks/index_training.py [--n 1000000]
        [--factories IVF1024,PQ32x8np IVF4096,PQ32x8np] [--two-level-only IVF16384_HNSW32,PQ32x8np]

In one process (faiss on every core), on `--n` 384-d `LowRankClusters` vectors: for each factory
and each clustering ('flat', 'two_level'), `train_index` on the build's own sample size (64
vectors per list) -> seconds; the index filled with all vectors; 1,000 held-out queries (same
distribution, not indexed) searched at nprobe 8 … 64 -> 1-recall@10 against exact search, ties
within the pipeline's tolerance counted as hits. `--two-level-only` factories are trained only
with two_level (one k-means there takes too long to wait for: its work grows as lists²).

Results: a table on stdout, JSON in benchmarks/results/index_training.json.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
from benchmarks.report import timed, write_results  # noqa: E402
from benchmarks.synthetic import LowRankClusters  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "index_training.json"
DIM, QUERIES, K, NPROBES = 384, 1000, 10, (8, 16, 32, 64)


def recall_at_k(index, vectors: np.ndarray, queries: np.ndarray, best: np.ndarray) -> float:
    """Share of queries with a top-K hit truly as similar as the exact best (within the
    tolerance): the hits' exact similarities, not the index's compressed ones."""
    from pipeline.index.recall import TIE_TOLERANCE

    _, ids = index.search(queries, K)
    exact = np.where(ids >= 0, np.einsum("qkd,qd->qk", vectors[np.maximum(ids, 0)], queries), -np.inf)
    return float(np.mean(exact.max(axis=1) >= best - TIE_TOLERANCE))


def measure(factory: str, clustering: str, vectors, queries, best) -> dict:
    import faiss

    from pipeline.index.factory import training_size
    from pipeline.index.search import set_search_depth
    from pipeline.index.train import train_index

    rng = np.random.default_rng(5)
    chosen = np.sort(rng.choice(len(vectors), training_size(len(vectors), factory), replace=False))
    sample = vectors[chosen]  # two-level draws its subsets by these ids, as the index stage's workers do
    index, train_s = timed(lambda: train_index(factory, sample, clustering, ids=chosen, population=len(vectors)))
    _, fill_s = timed(lambda: index.add_with_ids(vectors, np.arange(len(vectors))))
    recall = {}
    for nprobe in NPROBES:
        set_search_depth(index, nprobe)
        recall[nprobe] = recall_at_k(index, vectors, queries, best)
    sizes = faiss.extract_index_ivf(index).invlists
    lengths = np.array([sizes.list_size(i) for i in range(sizes.nlist)])
    row = {
        "factory": factory,
        "clustering": clustering,
        "training_vectors": len(sample),
        "train_s": round(train_s, 2),
        "fill_s": round(fill_s, 2),
        "largest_list_x_mean": round(float(lengths.max() / lengths.mean()), 2),
        "recall_at_nprobe": recall,
    }
    print(
        f"{factory:<28} {clustering:<9} train {train_s:7.1f} s on {len(sample):>9,}  fill {fill_s:6.1f} s  "
        f"largest list {row['largest_list_x_mean']:5.1f}x mean  recall "
        + "  ".join(f"@{p}: {r:.3f}" for p, r in recall.items()),
        flush=True,
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1_000_000)
    parser.add_argument("--factories", nargs="*", default=["IVF1024,PQ32x8np", "IVF4096,PQ32x8np"])
    parser.add_argument("--two-level-only", nargs="*", default=["IVF16384_HNSW32,PQ32x8np"])
    args = parser.parse_args()
    import faiss

    data = LowRankClusters(DIM)
    vectors = data.sample(args.n, np.random.default_rng(1))
    queries = data.sample(QUERIES, np.random.default_rng(2))
    exact = faiss.IndexFlatIP(DIM)
    exact.add(vectors)
    best = exact.search(queries, 1)[0][:, 0]
    del exact
    print(
        f"{args.n:,} x {DIM} vectors, {QUERIES:,} held-out queries, {faiss.omp_get_max_threads()} faiss threads",
        flush=True,
    )
    rows = [
        measure(factory, clustering, vectors, queries, best)
        for factory in args.factories
        for clustering in ("flat", "two_level")
    ]
    rows += [measure(factory, "two_level", vectors, queries, best) for factory in args.two_level_only]
    write_results({"n": args.n, "dim": DIM, "queries": QUERIES, "cores": os.cpu_count(), "rows": rows}, RESULTS)


if __name__ == "__main__":
    main()
