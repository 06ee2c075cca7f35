"""Per-step rates of the index on this machine (train, fill, search), the inputs of docs/scale.md's
plan for 100M and 30B chunks.

    .venv/bin/python benchmarks/index_rates.py [--n 1000000] [--factory IVF4096,PQ32x8np] [--workdir DIR]

In one process, with faiss using every core here, on `--n` 384-d `LowRankClusters` vectors
(`index_build.py`'s data, reused from --workdir):

- train: `train_index` on the build's own sample size (64 vectors per list) -> seconds; k-means
  work grows as sample x lists, so as lists^2 at 64 per list;
- fill: `add_with_ids` of 65,536 vectors (one embeddings file) into the trained index ->
  vectors per second (coarse assignment + PQ encoding);
- search: 4,096 queries, k = 10, at nprobe 16 over the filled index, and the coarse
  assignment alone (the quantizer searched for 16 lists) -> queries per second for both: with
  S index slices the coarse part is paid S times, the list scans once.

Results: a table on stdout, JSON in benchmarks/results/index_rates.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
from benchmarks.index_build import ensure_data  # noqa: E402
from benchmarks.report import timed, write_results  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "index_rates.json"
DIM, FILES, ROW_GROUP, FILE_ROWS, QUERIES, NPROBE = 384, 16, 16384, 65536, 4096, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1_000_000)
    parser.add_argument("--factory", default="IVF4096,PQ32x8np")
    parser.add_argument("--workdir", help="keep (and reuse) the data here; default: a temporary one")
    args = parser.parse_args()
    import faiss
    import pyarrow.parquet as pq

    from pipeline.index.factory import ivf_lists, training_size
    from pipeline.index.search import set_search_depth
    from pipeline.index.train import train_index
    from schemas.arrow import tensor_column_to_numpy

    data = ensure_data(Path(args.workdir or tempfile.mkdtemp(prefix="index_rates-")), args.n, DIM, FILES, ROW_GROUP)
    vectors = np.concatenate(
        [tensor_column_to_numpy(pq.read_table(p)["embedding"]) for p in sorted(data.glob("*.parquet"))]
    ).astype(np.float32)
    rng = np.random.default_rng(5)
    sample = vectors[np.sort(rng.choice(len(vectors), training_size(len(vectors), args.factory), replace=False))]
    trained, train_s = timed(lambda: train_index(args.factory, sample))
    index = faiss.clone_index(trained)
    _, fill_one_s = timed(lambda: index.add_with_ids(vectors[:FILE_ROWS], np.arange(FILE_ROWS)))
    index.add_with_ids(vectors[FILE_ROWS:], np.arange(FILE_ROWS, len(vectors)))
    set_search_depth(index, NPROBE)
    queries = vectors[rng.choice(len(vectors), QUERIES, replace=False)]
    _, search_s = timed(lambda: index.search(queries, 10))
    quantizer = faiss.extract_index_ivf(index).quantizer
    _, coarse_s = timed(lambda: quantizer.search(queries, NPROBE))
    result = {
        "n": len(vectors),
        "factory": args.factory,
        "lists": ivf_lists(args.factory),
        "cores": os.cpu_count(),
        "faiss_threads": faiss.omp_get_max_threads(),
        "training_vectors": len(sample),
        "train_s": train_s,
        "fill_vectors_per_s": FILE_ROWS / fill_one_s,
        "search_queries_per_s": QUERIES / search_s,
        "coarse_queries_per_s": QUERIES / coarse_s,
        "nprobe": NPROBE,
    }
    print(
        f"{args.factory} on {len(vectors):,} x {DIM}, {result['faiss_threads']} faiss threads:\n"
        f"  train on {len(sample):,} vectors: {train_s:.1f} s\n"
        f"  fill: {result['fill_vectors_per_s']:,.0f} vectors/s\n"
        f"  search at nprobe {NPROBE}: {result['search_queries_per_s']:,.0f} queries/s, of which the coarse "
        f"assignment alone runs at {result['coarse_queries_per_s']:,.0f} queries/s"
    )
    write_results(result, RESULTS)


if __name__ == "__main__":
    main()
