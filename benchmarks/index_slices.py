"""An index in slices at 1M vectors: build time and peak memory of the build, and of one search
worker, for 1, 4 and 16 index slices (`--shards` gives the slice counts).

"Shard" in this script's name, options, output and results means an index slice
(docs/pipeline.md, "Index slices").

    .venv/bin/python benchmarks/index_slices.py [--n 1000000] [--shards 1 4 16] [--workdir DIR]

1. Data: `--n` 384-d `LowRankClusters` vectors in 16 embeddings files (`index_build.py`'s
   generator, reused from --workdir).
2. Per slice count S: `ratrain-pipeline index --memory-budget 64MB --slice-bytes B` with
   `--direct_num_workers=2 --direct_running_mode=multi_processing`, B the size that holds 1/S
   of the vectors (by the builder's own estimate; a slice owns whole inverted lists, so the
   build may cut one or two slices more); S = 1 builds one index file. Measured: wall time,
   the peak RSS of the largest process (the job's main process or a worker).
3. The search step: a fresh process reads one slice (whole, as from gs://) and searches 4,096
   queries at the manifest's nprobe, as a search worker holding one slice does. Measured: its
   resident memory, and what the slice and the search added to it (RSS after - before).
4. Recall: the slices searched routed (`routing.search_routed`: one coarse assignment per
   query on quantizer.faiss, each query sent to the slices list_owners.npy names for its
   probed lists), 1-recall@10 with exact ground truth on 1,000 queries; it must agree with the
   single index's within 0.01.

Results: a table on stdout, JSON in benchmarks/results/index_slices.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
from benchmarks.index_build import ensure_data, measured, tail  # noqa: E402
from benchmarks.report import write_results  # noqa: E402
from pipeline.index.files import searched_files  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "index_slices.json"
DIM, FILES, ROW_GROUP, BUDGET, QUERIES, MB = 384, 16, 16384, 64 * 10**6, 4096, 2**20
WORKERS = ["--direct_num_workers=2", "--direct_running_mode=multi_processing"]

SEARCH_ONE_SHARD = """
import json, sys
import numpy as np
from pipeline.index.files import read_index
from pipeline.index.search import set_search_depth

def rss_kb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))

path, depth, queries = sys.argv[1], int(sys.argv[2]), np.load(sys.argv[3])
before = rss_kb()
index = read_index(path, sha256=None)
set_search_depth(index, depth)
index.search(queries, 10)
print(json.dumps({"process_kb": rss_kb(), "held_kb": rss_kb() - before}))
"""


def slice_bytes_for(data: Path, shards: int) -> int | None:
    """The slice size that holds 1 / shards of the vectors, by the estimate."""
    if shards == 1:
        return None
    import pyarrow.parquet as pq

    from pipeline.index.factory import choose_index_factory, estimated_bytes

    rows = [pq.ParquetFile(p).metadata.num_rows for p in sorted(data.glob("*.parquet"))]
    factory = choose_index_factory(sum(rows), DIM, BUDGET)
    return estimated_bytes(factory, -(-sum(rows) // shards), DIM)


def build(data: Path, out: Path, shards: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    size = slice_bytes_for(data, shards)
    cli = str(Path(sys.executable).parent / "ratrain-pipeline")
    cmd = [
        cli,
        "index",
        "--embeddings",
        str(data / "*.parquet"),
        "--output",
        str(out),
        "--memory-budget",
        "64MB",
        *(["--slice-bytes", str(size)] if size else []),
        "--",
        *WORKERS,
    ]
    result = measured(cmd, out.with_suffix(".log"))
    if result["rc"] != 0:
        raise SystemExit(f"index failed:\n{tail(result['log'], 30)}")
    manifest = json.loads((out / "manifest.json").read_text())
    files = [f for f in manifest["files"] if f["path"] in searched_files([g["path"] for g in manifest["files"]])]
    return {
        "shards": len(files),
        "slice_bytes": size,
        "wall_s": result["wall_s"],
        "largest_process_mb": result["peak_rss_mb"],
        "nprobe": manifest["nprobe"],
        "factory": manifest["index_factory"],
        "largest_shard_mb": max(f["bytes"] for f in files) / MB,
        "files": [str(out / f["path"]) for f in files],
        "directory": str(out / "faiss"),
    }


def search_one_shard(path: str, depth: int, queries: Path) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", SEARCH_ONE_SHARD, path, str(depth), str(queries)],
        check=True,
        capture_output=True,
        text=True,
        cwd=REPO,
    ).stdout
    return json.loads(out)


def merged_recall(run: dict, vectors: np.ndarray, rows: np.ndarray, truth: np.ndarray) -> float:
    """1-recall@10 of the index: its one file searched, or its slices searched routed."""
    from pipeline.index.files import LIST_OWNERS_FILE, QUANTIZER_FILE, load_index, read_owners
    from pipeline.index.routing import search_routed

    depth = run["nprobe"]
    shards = [load_index(f, depth, sha256=None) for f in run["files"]]
    if len(shards) == 1:
        _, found = shards[0].search(vectors[rows], 11)
    else:
        quantizer = load_index(str(Path(run["directory"]) / QUANTIZER_FILE), depth, sha256=None)
        owner = read_owners(str(Path(run["directory"]) / LIST_OWNERS_FILE))
        _, found, _, _ = search_routed(quantizer, shards, owner, vectors[rows], k=11)
    return float(np.mean([t in [f for f in row if f != r][:10] for r, t, row in zip(rows, truth, found)]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1_000_000)
    parser.add_argument("--shards", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--workdir", help="keep (and reuse) the data here; default: a temporary one")
    args = parser.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="index_slices-"))
    data = ensure_data(workdir, args.n, DIM, FILES, ROW_GROUP)

    import faiss
    import pyarrow.parquet as pq

    from schemas.arrow import tensor_column_to_numpy

    vectors = np.concatenate(
        [tensor_column_to_numpy(pq.read_table(p)["embedding"]) for p in sorted(data.glob("*.parquet"))]
    ).astype(np.float32)
    rng = np.random.default_rng(7)
    rows = rng.choice(len(vectors), 1000, replace=False)
    exact = faiss.IndexFlatIP(DIM)
    exact.add(vectors)
    truth = exact.search(vectors[rows], 2)[1][:, 1]
    del exact
    queries = workdir / "queries.npy"
    np.save(queries, vectors[rng.choice(len(vectors), QUERIES, replace=False)])
    runs = []
    for count in args.shards:
        run = build(data, workdir / f"shards-{count}", count)
        one = search_one_shard(run["files"][0], run["nprobe"], queries)
        run["search_worker_mb"] = one["process_kb"] / 1024
        run["search_worker_index_mb"] = one["held_kb"] / 1024
        run["recall"] = merged_recall(run, vectors, rows, truth)
        runs.append(run)
        print(
            f"{run['shards']:>3} shards ({run['factory']}, largest {run['largest_shard_mb']:.1f} MB): "
            f"build {run['wall_s']:.0f} s, largest process {run['largest_process_mb']:.0f} MB; "
            f"one search worker {run['search_worker_mb']:.0f} MB, of which shard and search "
            f"{run['search_worker_index_mb']:.0f} MB; recall {run['recall']:.3f}",
            flush=True,
        )
    for run in runs:
        run.pop("files")
        run.pop("directory")
    recalls = [r["recall"] for r in runs]
    print(f"\nrecall spread over shard counts: {max(recalls) - min(recalls):.3f}")
    write_results({"n": args.n, "runs": runs}, RESULTS)
    if not args.workdir:
        shutil.rmtree(workdir)


if __name__ == "__main__":
    main()
