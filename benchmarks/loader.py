"""Trainer input: `ShardDataset` + DataLoader against a raw pyarrow read-and-convert of the same
files, and peak memory as the number of shards grows.

    .venv/bin/python benchmarks/loader.py [--rows-per-shard 1024] [--shards 4 16] [--batch-size 16]

Data: synthetic shards with RETRO's training shape (n = 2048, m = 64, k = 2: 40 KB a row),
written with the project's `shard_table` under a real manifest (`tests/trainer_fixtures.py`),
`--rows-per-shard` sequences a shard (1024: 42 MB, the pipeline's default shard size) and each
`--shards` count in turn, so the data grows with the count.

Each reader runs in a subprocess of its own over the same directory, after one untimed pass
that warms the page cache (then the median of 5 timed passes counts), and turns every sequence
into the int64 tensors the trainer uses:

- raw (the ceiling): for each file in order, `pa.ipc.open_stream(pa.memory_map(...))` (`open_file` for
  schema_version 1 shards), each column
  converted whole to numpy and then to torch (tokens and neighbours widened to int64), and
  batches sliced out of those tensors;
- ours: `DataLoader(ShardDataset(dir, shuffle=True, batch_size=B, batched=True),
  batch_size=None)` (what `ratrain-train` uses) with `--workers` worker processes: a shuffled
  order, each shard opened and checked against the manifest as the epoch reaches it, each batch
  copied row by row out of the mapped file. The dataset is built once, outside the timed passes
  (as a trainer builds it once per run): a pass is an epoch.

Reported: sequences/s for each, the ratio ours/raw (goal ≥ 0.8), peak RSS (VmHWM) of each
reader, and ours' RSS for each shard count, which should not grow with the count (one shard is
mapped at a time). For scale:
the quickstart's reference model on CPU consumes a few sequences/s of n = 512 (docs/trainer.md).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
from benchmarks.report import peak_rss_kb, write_results  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "loader.json"
N, M, K, VOCAB = 2048, 64, 2, 30000
PASSES = 5  # timed passes per reader; the median counts


def make_shards(directory: Path, rows_per_shard: int, shards: int, schema_version: int) -> None:
    from tests.trainer_fixtures import write_shard_dir

    write_shard_dir(
        directory,
        shard_rows=[rows_per_shard] * shards,
        sequence_tokens=N,
        chunk_tokens=M,
        neighbours=K,
        vocab_size=VOCAB,
        batch_rows=256,
        schema_version=schema_version,
    )


def read_raw(directory: str, batch_size: int) -> int:
    import pyarrow as pa
    import torch

    from schemas.arrow import read_shard_table, shard_column

    manifest = json.loads(Path(directory, "manifest.json").read_text())
    seen = 0
    for entry in manifest["shards"]:
        table = read_shard_table(pa.memory_map(str(Path(directory, entry["path"]))))
        columns = {
            "seq_id": torch.from_numpy(table["seq_id"].to_numpy()),
            "tokens": torch.from_numpy(shard_column(table, "tokens").astype(np.int64)),
            "neighbours": torch.from_numpy(shard_column(table, "neighbours").astype(np.int64)),
            "neighbour_ids": torch.from_numpy(shard_column(table, "neighbour_ids").copy()),
            "neighbour_scores": torch.from_numpy(shard_column(table, "neighbour_scores").copy()),
        }
        for start in range(0, table.num_rows, batch_size):
            batch = {name: column[start : start + batch_size] for name, column in columns.items()}
            seen += len(batch["seq_id"])
    return seen


def read_ours(dataset, workers: int) -> int:
    from torch.utils.data import DataLoader

    return sum(len(batch["seq_id"]) for batch in DataLoader(dataset, batch_size=None, num_workers=workers))


def reader_main(kind: str, directory: str, batch_size: int, workers: int) -> None:
    if kind == "raw":

        def read():
            return read_raw(directory, batch_size)
    else:
        from trainer import ShardDataset

        # built once, as a trainer does (its constructor reads the manifest)
        dataset = ShardDataset(directory, shuffle=True, seed=0, batch_size=batch_size, batched=True)

        def read():
            return read_ours(dataset, workers)

    read()  # warm the page cache and the imports
    times = []
    for _ in range(PASSES):
        start = time.perf_counter()
        seen = read()
        times.append(time.perf_counter() - start)
    print(json.dumps({"sequences": seen, "seconds": float(np.median(times)), "peak_rss_mb": peak_rss_kb() / 1024}))


def run_reader(kind: str, directory: Path, batch_size: int, workers: int) -> dict:
    out = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "_read", kind, str(directory), str(batch_size), str(workers)],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    if out.returncode != 0:
        raise SystemExit(f"{kind} reader failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["sequences_per_s"] = result["sequences"] / result["seconds"]
    return result


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_read":
        return reader_main(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--rows-per-shard", type=int, default=1024)
    parser.add_argument("--shards", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--workers", type=int, default=0, help="DataLoader worker processes for ours")
    parser.add_argument(
        "--schema-versions",
        type=int,
        nargs="+",
        default=[1, 2],
        help="shard layouts to measure, each on its own copy of the data",
    )
    parser.add_argument("--output", default=str(RESULTS))
    args = parser.parse_args()
    results = {
        "rows_per_shard": args.rows_per_shard,
        "n": N,
        "m": M,
        "k": K,
        "batch_size": args.batch_size,
        "workers": args.workers,
        "by_shards": [],
    }
    with tempfile.TemporaryDirectory(prefix="loader-bench-") as temp:
        for shards, version in [(s, v) for s in args.shards for v in args.schema_versions]:
            directory = Path(temp) / f"shards-{shards}-v{version}"
            shutil.rmtree(Path(temp), ignore_errors=True)  # one data set on disk at a time
            make_shards(directory, args.rows_per_shard, shards, version)
            size = sum(p.stat().st_size for p in directory.glob("*.arrow")) / 1e6
            raw = run_reader("raw", directory, args.batch_size, 0)
            ours = run_reader("ours", directory, args.batch_size, args.workers)
            entry = {
                "shards": shards,
                "schema_version": version,
                "megabytes": size,
                "raw": raw,
                "ours": ours,
                "ratio": ours["sequences_per_s"] / raw["sequences_per_s"],
            }
            results["by_shards"].append(entry)
            print(
                f"v{version} {shards:>3} shards, {shards * args.rows_per_shard:,} sequences, {size:,.0f} MB: "
                f"raw {raw['sequences_per_s']:,.0f} "
                f"seq/s ({raw['peak_rss_mb']:.0f} MB), ours {ours['sequences_per_s']:,.0f} seq/s "
                f"({ours['peak_rss_mb']:.0f} MB): ours/raw = {entry['ratio']:.2f}",
                flush=True,
            )
    write_results(results, args.output)


if __name__ == "__main__":
    main()
