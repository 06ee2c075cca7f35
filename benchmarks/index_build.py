"""Index stage: build time, peak memory and recall against a single-process faiss build of the
same factory string and against autofaiss at the same memory budget, on the same vectors.

    .venv/bin/python benchmarks/index_build.py [--sizes 100000 1000000] [--dim 384]
        [--budget 64MB] [--files 16] [--workdir DIR] [--autofaiss-python /tmp/afvenv/bin/python]

Per size N:

1. Data: N float32 unit vectors from `benchmarks/synthetic.py`'s `LowRankClusters` (1000
   clusters, each spread along its own 8-dim subspace plus a little isotropic noise: a low
   intrinsic dimension, like sentence embeddings; fixed seed), written as `--files` Parquet files
   `emb-NNNNN.parquet` (chunk_id int64 = 0 … N-1 in file order, embedding
   fixed_size_list<float32>[d], zstd, row groups of `--row-group` rows). Generated block by block:
   the generator never holds more than one row group. With `--workdir` the data is kept and
   reused by later runs with the same parameters; without it everything lives in a temporary
   directory that is removed at the end.
2. Ground truth (in this process, streamed file by file, never N × d at once): the query sample
   the pipeline itself draws (`in_sample(..., 500, N, QUERY_SALT)`) and each query's exact
   nearest other vector (`exact_nearest_other` + `merge_nearest`).
3. Builders, each a subprocess of its own, run one after the other:
   - ours: `ratrain-pipeline index --embeddings '<dir>/*.parquet' --output <out>
     --memory-budget <budget>` (FnApiRunner, in-process: one OS process does all the work).
     Its factory and tuned nprobe come from `<out>/manifest.json`.
   - faiss 1-process: this file's `_baseline` mode: every vector read into one [N, d] array,
     then `pipeline.index.train.build_index(ids, vectors, <the factory ours chose>)` and
     `faiss.write_index`. Same factory, same training sample rule, same faiss.
   - autofaiss (optional, needs numpy<2, hence its own interpreter): `autofaiss.build_index`
     on the same directory, `max_index_memory_usage` = the same budget in bytes (autofaiss's
     "MB" is MiB, ours is 10^6, so bytes are passed), `current_memory_available` =
     `--autofaiss-memory`, ids column `chunk_id` (its position -> chunk_id map is used when
     measuring recall). It chooses its own index key and search parameters.
   Skip any of them with `--builders`.
4. Recall, for every index, in this process, on the same queries and ground truth:
   `1-R@10` = share of queries whose exact nearest other vector is in the index's top 10 (the
   query itself excluded; `pipeline.index.recall.one_recall_at_k`)
   - "own": at the builder's own search setting (ours: the nprobe in its manifest, which should
     reproduce the manifest's recall exactly; 1-process faiss: the same nprobe; autofaiss: its
     `index_param`);
   - "depth→target": the smallest nprobe (efSearch for HNSW) reaching `--target-recall`
     (`tune_search_depth`), so indexes of different types can be set side by side.

What the figures are:

- wall s: wall-clock time of the whole subprocess (interpreter start and imports, reading the
  files, training, adding, merging, for ours also the exact ground truth and nprobe tuning it
  does itself, writing the index). cpu s: user + system CPU time of that subprocess (less
  sensitive than wall time to other load on a shared machine).
- peak RSS MB: `ru_maxrss` of the subprocess (a tiny Python wrapper runs it and reads
  `getrusage(RUSAGE_CHILDREN)`). It is the largest resident set of one process; with a
  multi-process Beam runner (`-- --direct_num_workers=...`) it would be the largest worker's,
  not the sum, which is why the benchmark uses the default in-process runner.
- index MB: size of the written index file. N×d×4 MB: the raw vectors, for comparison.

How to read ours' peak RSS. The claim is that it is bounded by the budget plus an overhead
that does not grow with N × d × 4, unlike the single-process build, which holds every vector.
The overhead is made of (each printed per size, together with the sum, as "bound"):

- runner baseline: peak RSS of ours on 2,000 vectors as IVF16,Flat (interpreter, Beam,
  pyarrow, faiss, plus the FnApiRunner running every stage of the index pipeline); measured
  once per run, next to the RSS of a process that only imports the stage;
- the final index, once (it is streamed to its file, not serialised into a bytes object),
  plus one part at a time while merging;
- the training sample, twice: train_size = max(64 × nlist, 256 × 256 for PQ) (capped at N)
  vectors of d float32, gathered from per-file sample files into one array, and faiss's
  residuals of it for PQ training. This term is not constant: nlist ≈ 4√N, so it grows as √N
  (1M × 384, IVF4096: 262,144 vectors = 403 MB);
- one record batch of one embeddings file while filling a part (READ_BATCH = 16384 rows, or
  the file's row group when larger, as Arrow data and as float32 numpy: ×3), plus that part's
  index (≈ index bytes / files);
- the exact ground truth each part computes for the recall sample: a [queries, batch] float32
  score matrix and its temporaries (≈ 2 × 500 × 16384 × 4 B = 66 MB at the default sizes);
- only for Flat / HNSW (chosen up to 100k vectors): every vector, about three times, since
  `_build_in_one` gathers all batches, concatenates and reorders them in one worker.

The "bound" printed is that sum; it is an estimate to read the measurement against, not a
guarantee, and the script does not fail when the measurement is above it.

autofaiss environment (it needs numpy<2; autofaiss 2.18 calls `faiss.OPQMatrix(d, M=..., d2=...)`
with keywords, which the bindings of faiss-cpu 1.15.1 reject (1.8.0 accepts them), and
pyarrow ≥ 21 needs numpy ≥ 2):

    python3 -m venv /tmp/afvenv
    /tmp/afvenv/bin/pip install autofaiss "faiss-cpu==1.8.0.post1" "pyarrow<21"

Results: a table per size on stdout (plus ratios ours / 1-process faiss and ours / autofaiss)
and all numbers as JSON in benchmarks/results/index_build.json.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
from benchmarks.report import write_results  # noqa: E402
from benchmarks.synthetic import LowRankClusters  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "index_build.json"
CLUSTERS = 1000
RANK = 8
SEED = 20240601
MB = 1e6

# Runs argv[2:], writes its exit code, max RSS and CPU time as JSON to argv[1].
_MEASURE = r"""
import json, resource, subprocess, sys
rc = subprocess.call(sys.argv[2:])
ru = resource.getrusage(resource.RUSAGE_CHILDREN)
with open(sys.argv[1], "w") as f:
    json.dump({"rc": rc, "maxrss_kb": ru.ru_maxrss, "cpu_s": ru.ru_utime + ru.ru_stime}, f)
sys.exit(rc)
"""

# Runs in the autofaiss interpreter: argv[1] = JSON of the arguments.
_AUTOFAISS = r"""
import json, os, sys
from autofaiss import build_index
a = json.loads(sys.argv[1])
index, infos = build_index(
    embeddings=a["embeddings"], index_path=a["index_path"], index_infos_path=a["infos_path"],
    ids_path=a["ids_path"], file_format="parquet", embedding_column_name="embedding",
    id_columns=["chunk_id"], max_index_memory_usage=a["budget"],
    current_memory_available=a["memory"], metric_type="ip")
if index is None or not os.path.exists(a["index_path"]):
    print("autofaiss returned no index (see its log above)", file=sys.stderr)
    sys.exit(3)
"""


# --- data ------------------------------------------------------------------------------------


def generate(
    directory: Path, n: int, dim: int, files: int, row_group: int, clusters: int = CLUSTERS, rank: int = RANK
) -> None:
    """`files` Parquet files of `LowRankClusters` vectors, written row group by row group."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from schemas.arrow import embedding_schema, fixed_size_list

    model = LowRankClusters(dim, clusters=clusters, rank=rank, seed=SEED)
    bounds = np.linspace(0, n, files + 1).astype(np.int64)
    directory.mkdir(parents=True, exist_ok=True)
    for number in range(files):
        rng = np.random.default_rng([SEED, 1, number])
        path = directory / f"emb-{number:05d}.parquet"
        with pq.ParquetWriter(path, embedding_schema(dim), compression="zstd") as writer:
            for start in range(bounds[number], bounds[number + 1], row_group):
                stop = min(start + row_group, bounds[number + 1])
                table = pa.Table.from_arrays(
                    [
                        pa.array(np.arange(start, stop, dtype=np.int64)),
                        fixed_size_list(model.sample(stop - start, rng), dim),
                    ],
                    schema=embedding_schema(dim),
                )
                writer.write_table(table, row_group_size=row_group)


def ensure_data(
    workdir: Path, n: int, dim: int, files: int, row_group: int, clusters: int = CLUSTERS, rank: int = RANK
) -> Path:
    params = {
        "n": n,
        "dim": dim,
        "files": files,
        "row_group": row_group,
        "clusters": clusters,
        "rank": rank,
        "seed": SEED,
        "generator": "LowRankClusters",
    }
    root = workdir / f"data-n{n}-d{dim}-f{files}-c{clusters}-r{rank}"
    done = root / "params.json"
    if done.exists() and json.loads(done.read_text()) == params:
        print(f"[data] reusing {root}", flush=True)
        return root / "embeddings"
    shutil.rmtree(root, ignore_errors=True)
    start = time.perf_counter()
    generate(root / "embeddings", n, dim, files, row_group, clusters, rank)
    done.write_text(json.dumps(params))
    print(f"[data] {n:,} x {dim} in {files} files: {time.perf_counter() - start:.1f} s", flush=True)
    return root / "embeddings"


def data_files(directory: Path) -> list[str]:
    return sorted(glob.glob(str(directory / "*.parquet")))


# --- ground truth and recall -----------------------------------------------------------------


def ground_truth(directory: Path, n: int, sample: int):
    """(query ids, query vectors, exact nearest other id) with the pipeline's own query rule."""
    from pipeline.common.sampling import QUERY_SALT, in_sample
    from pipeline.index.exact import exact_nearest_other, merge_nearest
    from pipeline.index.files import read_embeddings

    size = min(sample, n)
    q_ids, q_vecs = [], []
    for path in data_files(directory):
        for ids, vectors in read_embeddings(path):
            keep = in_sample(ids, size, n, QUERY_SALT)
            q_ids.append(ids[keep])
            q_vecs.append(vectors[keep])
    query_ids = np.concatenate(q_ids)
    order = np.argsort(query_ids, kind="stable")
    query_ids, queries = query_ids[order], np.concatenate(q_vecs)[order]
    truth = None
    for path in data_files(directory):
        for ids, vectors in read_embeddings(path):
            found = exact_nearest_other(query_ids, queries, ids, vectors)
            truth = found if truth is None else merge_nearest(truth, found)
    return query_ids, queries, truth[1]


class _Remapped:
    """An index whose search answers chunk ids through a position -> id table (autofaiss)."""

    def __init__(self, index, position_to_id: np.ndarray):
        self.index, self.position_to_id = index, position_to_id

    def search(self, queries, k):
        scores, found = self.index.search(queries, k)
        return scores, np.where(found >= 0, self.position_to_id[np.maximum(found, 0)], -1)


def measure_recall(index_path: str, truth, own_depth=None, own_params=None, position_to_id=None, target=0.95) -> dict:
    import faiss

    from pipeline.index.recall import one_recall_at_k
    from pipeline.index.search import search_depth_range, set_search_depth
    from pipeline.index.tuning import tune_search_depth

    query_ids, queries, truth_ids = truth
    index = faiss.read_index(index_path)
    searcher = index if position_to_id is None else _Remapped(index, position_to_id)
    if own_params:
        faiss.ParameterSpace().set_index_parameters(index, own_params)
        setting = own_params
    elif own_depth is not None and search_depth_range(index) is not None:
        set_search_depth(index, own_depth)
        setting = f"nprobe={own_depth}" if faiss.try_extract_index_ivf(index) else f"efSearch={own_depth}"
    else:
        setting = "exact" if search_depth_range(index) is None else "default"
    own = one_recall_at_k(searcher, query_ids, queries, truth_ids)
    depths = search_depth_range(index)
    if depths is None:
        tuned_depth, tuned = None, own
    else:
        if position_to_id is None:
            tuned_depth, tuned, _ = tune_search_depth(index, query_ids, queries, truth_ids, target=target)
        else:  # tune_search_depth searches `index` itself: same loop through the id table
            for tuned_depth in depths:
                set_search_depth(index, tuned_depth)
                tuned = one_recall_at_k(searcher, query_ids, queries, truth_ids)
                if tuned >= target:
                    break
    return {
        "recall_own": own,
        "own_setting": setting,
        "depth_for_target": tuned_depth,
        "recall_at_depth_for_target": tuned,
        "target": target,
        "queries": int(len(query_ids)),
    }


# --- running measured subprocesses -----------------------------------------------------------


def measured(cmd: list[str], log_path: Path) -> dict:
    """Run cmd in its own process tree; wall time, peak RSS of the process, CPU time, exit code."""
    stats = log_path.with_suffix(".rusage.json")
    start = time.perf_counter()
    with open(log_path, "w") as log:
        rc = subprocess.call(
            [sys.executable, "-c", _MEASURE, str(stats), *cmd], stdout=log, stderr=subprocess.STDOUT, cwd=REPO
        )
    wall = time.perf_counter() - start
    usage = json.loads(stats.read_text()) if stats.exists() else {"maxrss_kb": 0, "cpu_s": 0.0}
    return {
        "rc": rc,
        "wall_s": wall,
        "peak_rss_mb": usage["maxrss_kb"] * 1024 / MB,
        "cpu_s": usage["cpu_s"],
        "log": str(log_path),
    }


def tail(path: str, lines: int = 8) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def run_ours(data: Path, out: Path, budget: int, target: float) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    cli = str(Path(sys.executable).parent / "ratrain-pipeline")
    result = measured(
        [
            cli,
            "index",
            "--embeddings",
            str(data / "*.parquet"),
            "--output",
            str(out),
            "--memory-budget",
            str(budget),
            "--target-recall",
            str(target),
        ],
        out.with_suffix(".log"),
    )
    if result["rc"] != 0:
        raise SystemExit(f"ratrain-pipeline index failed (exit {result['rc']}):\n{tail(result['log'], 30)}")
    manifest = json.loads((out / "manifest.json").read_text())
    index_path = out / "faiss" / "index.faiss"
    return {
        **result,
        "factory": manifest["index_factory"],
        "nprobe": manifest["nprobe"],
        "manifest_recall": manifest["recall_at_k"],
        "training_vectors": manifest["training_vectors"],
        "index_bytes": manifest["index_bytes"],
        "index_path": str(index_path),
    }


def run_baseline(data: Path, out: Path, factory: str) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    index_path, info_path = out / "index.faiss", out / "info.json"
    result = measured(
        [
            sys.executable,
            str(Path(__file__).resolve()),
            "_baseline",
            str(data),
            factory,
            str(index_path),
            str(info_path),
        ],
        out.with_suffix(".log"),
    )
    if result["rc"] != 0:
        return {**result, "skipped": f"exit {result['rc']}: {tail(result['log'], 3)}"}
    return {
        **result,
        **json.loads(info_path.read_text()),
        "factory": factory,
        "index_bytes": index_path.stat().st_size,
        "index_path": str(index_path),
    }


def run_autofaiss(python: str | None, data: Path, out: Path, budget: int, memory: str) -> dict:
    if not python:
        return {"skipped": "no --autofaiss-python given"}
    if not Path(python).exists():
        return {"skipped": f"{python} does not exist"}
    check = subprocess.run([python, "-c", "import autofaiss, faiss"], capture_output=True, text=True)
    if check.returncode != 0:
        return {"skipped": f"{python} cannot import autofaiss: {check.stderr.strip().splitlines()[-1:]}"}
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    args = {
        "embeddings": str(data),
        "index_path": str(out / "knn.index"),
        "infos_path": str(out / "index_infos.json"),
        "ids_path": str(out / "ids"),
        "budget": f"{budget}B",
        "memory": memory,
    }
    result = measured([python, "-c", _AUTOFAISS, json.dumps(args)], out.with_suffix(".log"))
    if result["rc"] != 0:
        return {**result, "skipped": f"autofaiss failed (exit {result['rc']}): {tail(result['log'], 4)}"}
    infos = json.loads(Path(args["infos_path"]).read_text())
    return {
        **result,
        "factory": infos.get("index_key"),
        "index_param": infos.get("index_param"),
        "autofaiss_infos": infos,
        "index_bytes": Path(args["index_path"]).stat().st_size,
        "index_path": args["index_path"],
        "ids_path": args["ids_path"],
        "memory": memory,
    }


def autofaiss_ids(ids_path: str, n: int) -> np.ndarray:
    import pyarrow.parquet as pq

    table = pq.read_table(ids_path)
    position_to_id = np.full(n, -1, dtype=np.int64)
    position_to_id[table["i"].to_numpy()] = table["chunk_id"].to_numpy()
    return position_to_id


def import_baseline(workdir: Path) -> float:
    """Peak RSS of a process that only imports the index stage and its CLI."""
    result = measured(
        [sys.executable, "-c", "import pipeline.cli, pipeline.build_index.job, pipeline.index.build"],
        workdir / "import-baseline.log",
    )
    return result["peak_rss_mb"]


RUNNER_BASELINE_VECTORS = 2000


def runner_baseline(workdir: Path, dim: int, row_group: int) -> float:
    """Peak RSS of ours on 2,000 vectors as `IVF16,Flat` (train, fill, merge and tune really
    run, on ~3 MB of vectors): interpreter, imports and the Beam runner, i.e. the part that does
    not grow with N."""
    data = ensure_data(workdir, RUNNER_BASELINE_VECTORS, dim, 1, row_group)
    out = workdir / "runner-baseline"
    shutil.rmtree(out, ignore_errors=True)
    cli = str(Path(sys.executable).parent / "ratrain-pipeline")
    result = measured(
        [cli, "index", "--embeddings", str(data / "*.parquet"), "--output", str(out), "--type", "IVF16,Flat"],
        workdir / "runner-baseline.log",
    )
    if result["rc"] != 0:
        raise SystemExit(
            f"ratrain-pipeline index failed on {RUNNER_BASELINE_VECTORS} vectors "
            f"(exit {result['rc']}):\n{tail(result['log'], 30)}"
        )
    return result["peak_rss_mb"]


# --- the single-process baseline (runs as its own subprocess) --------------------------------


def baseline_main(data: str, factory: str, index_path: str, info_path: str) -> None:
    import faiss

    from pipeline.index.files import embedding_file_info, read_embeddings
    from pipeline.index.train import build_index

    start = time.perf_counter()
    paths = data_files(Path(data))
    infos = [embedding_file_info(p) for p in paths]
    n, dim = sum(i.rows for i in infos), infos[0].dim
    ids, vectors = np.empty(n, np.int64), np.empty((n, dim), np.float32)  # all of them, once
    at = 0
    for path in paths:
        for batch_ids, batch in read_embeddings(path):
            ids[at : at + len(batch_ids)], vectors[at : at + len(batch_ids)] = batch_ids, batch
            at += len(batch_ids)
    read_s = time.perf_counter() - start
    index = build_index(ids, vectors, factory)
    build_s = time.perf_counter() - start - read_s
    faiss.write_index(index, index_path)
    Path(info_path).write_text(json.dumps({"read_s": read_s, "build_s": build_s, "num_vectors": int(index.ntotal)}))


# --- report ----------------------------------------------------------------------------------


def memory_bound(ours: dict, n: int, dim: int, files: int, row_group: int, runner_mb: float) -> dict:
    from pipeline.index.exact import EXACT_BLOCK
    from pipeline.index.factory import ivf_lists
    from pipeline.index.files import READ_BATCH

    index = ours["index_bytes"] / MB
    train = ours["training_vectors"] * dim * 4 / MB
    batch = max(READ_BATCH, row_group) * dim * 4 / MB
    part = index / files if ivf_lists(ours["factory"]) is not None else 0.0  # Flat / HNSW: no parts
    queries = ours["manifest_recall"]["sample_size"]
    parts = {
        "runner_baseline_mb": runner_mb,
        "index_mb": index,
        "training_sample_x2_mb": 2 * train,
        "read_batch_x3_mb": 3 * batch,
        "part_mb": part,
        "truth_scores_x2_mb": 2 * queries * min(max(READ_BATCH, row_group), EXACT_BLOCK, n) * 4 / MB,
    }
    if ivf_lists(ours["factory"]) is None:  # Flat / HNSW: one worker holds every vector (N ≤ 100k)
        parts["all_vectors_x3_mb"] = 3 * n * dim * 4 / MB
    return {**{k: round(v, 1) for k, v in parts.items()}, "bound_mb": round(sum(parts.values()), 1)}


def ratio(a, b):
    return round(a / b, 3) if a is not None and b else None


def print_table(entry: dict) -> None:
    n, dim = entry["n"], entry["dim"]
    print()
    print(
        f"== N = {n:,}  d = {dim}  budget = {entry['budget_bytes'] / MB:,.1f} MB  files = {entry['files']}"
        f"  N×d×4 = {n * dim * 4 / MB:,.1f} MB  RSS baselines: imports {entry['import_baseline_mb']:.0f} MB,"
        f" ours on {RUNNER_BASELINE_VECTORS:,} vectors {entry['runner_baseline_mb']:.0f} MB"
    )
    header = (
        f"{'builder':<16} {'factory':<34} {'wall s':>7} {'cpu s':>7} {'peak RSS MB':>11} "
        f"{'index MB':>8} {'1-R@10 own':>10} {'own setting':<26} {'depth→' + str(entry['target']):>11} "
        f"{'1-R@10':>6}"
    )
    print(header)
    print("-" * len(header))
    for name, row in entry["builders"].items():
        if "skipped" in row:
            print(f"{name:<16} skipped: {row['skipped']}")
            continue
        r = row.get("recall", {})
        print(
            f"{name:<16} {row['factory']:<34} {row['wall_s']:>7.1f} {row['cpu_s']:>7.1f} "
            f"{row['peak_rss_mb']:>11.0f} {row['index_bytes'] / MB:>8.2f} {r.get('recall_own', float('nan')):>10.3f} "
            f"{str(r.get('own_setting')):<26} {str(r.get('depth_for_target')):>11} "
            f"{r.get('recall_at_depth_for_target', float('nan')):>6.3f}"
        )
    for name, values in entry["ratios"].items():
        print(f"ratio {name}: " + "  ".join(f"{k} {v}" for k, v in values.items()))
    ours = entry["builders"].get("ours")
    if ours and "memory_bound" in entry:
        b = entry["memory_bound"]
        print(
            f"ours peak RSS {ours['peak_rss_mb']:.0f} MB = runner baseline + "
            f"{ours['peak_rss_mb'] - b['runner_baseline_mb']:.0f} MB; documented bound {b['bound_mb']:.0f} MB "
            f"(runner baseline {b['runner_baseline_mb']:.0f} + index {b['index_mb']:.0f} + 2×training sample "
            f"{b['training_sample_x2_mb']:.0f} + 3×read batch {b['read_batch_x3_mb']:.0f} + part "
            f"{b['part_mb']:.0f} + 2×truth scores {b['truth_scores_x2_mb']:.0f}"
            + (f" + 3×all vectors {b['all_vectors_x3_mb']:.0f}" if "all_vectors_x3_mb" in b else "")
            + f"); N×d×4 = {n * dim * 4 / MB:,.0f} MB"
            + (
                f"; manifest recall {ours['manifest_recall']['value']:.3f} at nprobe {ours['nprobe']}"
                if ours.get("manifest_recall")
                else ""
            )
        )


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_baseline":
        return baseline_main(*sys.argv[2:6])
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--budget", default="64MB", help="index memory budget (ours' syntax: MB = 10^6 B)")
    parser.add_argument("--files", type=int, default=16, help="Parquet files per size")
    parser.add_argument("--row-group", type=int, default=16384, help="rows per Parquet row group")
    parser.add_argument("--clusters", type=int, default=CLUSTERS, help="clusters of the synthetic data")
    parser.add_argument("--rank", type=int, default=RANK, help="dimensions each cluster spreads along")
    parser.add_argument("--workdir", help="keep (and reuse) data and indexes here; default: a temp dir")
    parser.add_argument(
        "--builders", nargs="+", default=["ours", "faiss", "autofaiss"], choices=["ours", "faiss", "autofaiss"]
    )
    parser.add_argument("--autofaiss-python", help="interpreter with autofaiss installed (numpy<2)")
    parser.add_argument(
        "--autofaiss-memory", default="2G", help="autofaiss current_memory_available (its syntax; G = GiB)"
    )
    parser.add_argument("--target-recall", type=float, default=0.95)
    parser.add_argument("--queries", type=int, default=500, help="query sample (the pipeline's default)")
    parser.add_argument("--output", default=str(RESULTS))
    args = parser.parse_args()

    from schemas.stage_config import parse_size

    budget = parse_size(args.budget)
    temp = None if args.workdir else tempfile.TemporaryDirectory(prefix="index-bench-")
    workdir = Path(args.workdir or temp.name).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    imports_mb = import_baseline(workdir)
    runner_mb = runner_baseline(workdir, args.dim, args.row_group) if "ours" in args.builders else 0.0
    print(
        f"[baseline] imports only: {imports_mb:.0f} MB; ours on {RUNNER_BASELINE_VECTORS:,} vectors: "
        f"{runner_mb:.0f} MB peak RSS",
        flush=True,
    )
    results = {
        "budget": args.budget,
        "budget_bytes": budget,
        "dim": args.dim,
        "files": args.files,
        "clusters": args.clusters,
        "rank": args.rank,
        "seed": SEED,
        "row_group": args.row_group,
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
        "sizes": [],
    }
    try:
        for n in args.sizes:
            data = ensure_data(workdir, n, args.dim, args.files, args.row_group, args.clusters, args.rank)
            runs = workdir / f"runs-n{n}"
            runs.mkdir(exist_ok=True)
            start = time.perf_counter()
            truth = ground_truth(data, n, args.queries)
            print(f"[truth] {len(truth[0])} queries, exact: {time.perf_counter() - start:.1f} s", flush=True)
            builders: dict[str, dict] = {}
            factory = None
            if "ours" in args.builders:
                print("[ours] ratrain-pipeline index ...", flush=True)
                ours = run_ours(data, runs / "ours", budget, args.target_recall)
                ours["recall"] = measure_recall(
                    ours["index_path"], truth, own_depth=ours["nprobe"], target=args.target_recall
                )
                builders["ours"] = ours
                factory = ours["factory"]
            if "faiss" in args.builders:
                if factory is None:
                    from pipeline.index.factory import choose_index_factory

                    factory = choose_index_factory(n, args.dim, budget)
                print(f"[faiss] single process, {factory} ...", flush=True)
                base = run_baseline(data, runs / "faiss", factory)
                if "skipped" not in base:
                    base["recall"] = measure_recall(
                        base["index_path"],
                        truth,
                        own_depth=builders.get("ours", {}).get("nprobe"),
                        target=args.target_recall,
                    )
                builders["faiss 1-process"] = base
            if "autofaiss" in args.builders:
                print("[autofaiss] ...", flush=True)
                auto = run_autofaiss(args.autofaiss_python, data, runs / "autofaiss", budget, args.autofaiss_memory)
                if "skipped" not in auto:
                    auto["recall"] = measure_recall(
                        auto["index_path"],
                        truth,
                        own_params=auto["index_param"],
                        position_to_id=autofaiss_ids(auto["ids_path"], n),
                        target=args.target_recall,
                    )
                builders["autofaiss"] = auto
            entry = {
                "n": n,
                "dim": args.dim,
                "files": args.files,
                "budget_bytes": budget,
                "raw_vectors_mb": n * args.dim * 4 / MB,
                "import_baseline_mb": imports_mb,
                "runner_baseline_mb": runner_mb,
                "target": args.target_recall,
                "builders": builders,
                "ratios": {},
            }
            ours = builders.get("ours")
            for name, other in builders.items():
                if ours is None or name == "ours" or "skipped" in other:
                    continue
                entry["ratios"][f"ours/{name}"] = {
                    "wall": ratio(ours["wall_s"], other["wall_s"]),
                    "cpu": ratio(ours["cpu_s"], other["cpu_s"]),
                    "peak_rss": ratio(ours["peak_rss_mb"], other["peak_rss_mb"]),
                    "index_bytes": ratio(ours["index_bytes"], other["index_bytes"]),
                    "recall_own": ratio(ours["recall"]["recall_own"], other["recall"]["recall_own"]),
                }
            if ours:
                entry["memory_bound"] = memory_bound(ours, n, args.dim, args.files, args.row_group, runner_mb)
                entry["memory_bound"]["measured_above_runner_baseline_mb"] = round(ours["peak_rss_mb"] - runner_mb, 1)
            results["sizes"].append(entry)
            print_table(entry)
    finally:
        if temp is not None:
            temp.cleanup()
    write_results(results, args.output)


if __name__ == "__main__":
    main()
