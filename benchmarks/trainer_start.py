"""Trainer start: the time from `ShardDataset(...)` to its first sample as the shard count grows.

    .venv/bin/python benchmarks/trainer_start.py [--shards 1000 10000] [--rows-per-shard 2] [--gcs]

Data: tiny shards (n = 16, m = 4, k = 2, `--rows-per-shard` sequences each, ~8 KB) written with
the project's `shard_table` under a real manifest (`tests/trainer_fixtures.py`), each `--shards`
count in turn. `--gcs` uploads them to a local gcp-storage-emulator (as the tests start it) and
reads them through gs://; its shard counts default to 100 and 1,000 (the emulator takes minutes
to take 10,000 uploads).

Each measurement is the median of `--repeats` after one untimed pass (imports, page cache):

- manifest (the baseline): manifest.json read and validated as a ShardsManifest, the one read
  that building a dataset needs;
- start: `ShardDataset(dir, shuffle=True)` and `next(iter(dataset))`: the manifest, then the
  first shard of the shuffled order opened, checked and read;
- check all: every shard opened and checked against the manifest, one after the other, as a
  constructor that checked every shard before training could start would (what start does not
  pay: each shard is checked when an epoch reaches it).

Reported per shard count, and as the ratio of the largest count to the smallest: start should
grow no faster than the manifest it reads (start − manifest flat), check all with the count.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
from benchmarks.report import write_results  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "trainer_start.json"


def timed(function, repeats: int) -> float:
    """Median seconds of `repeats` calls, after one untimed call."""
    function()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def upload(emulator, directory: Path, url: str) -> str:
    """The directory's files to gs://bucket/prefix, in parallel (one request per file)."""
    bucket_name, _, prefix = url[len("gs://") :].partition("/")
    bucket = emulator.client().bucket(bucket_name)
    with ThreadPoolExecutor(16) as pool:
        list(
            pool.map(
                lambda p: bucket.blob(f"{prefix}/{p.name}").upload_from_filename(str(p)), sorted(directory.iterdir())
            )
        )
    return url


def measure(source: str, repeats: int, check_all_repeats: int) -> dict:
    from schemas.manifest import MANIFEST_FILE, ShardsManifest, read_manifest
    from trainer import ShardDataset
    from trainer.dataset import _files_for

    def manifest():
        files = _files_for(source)  # a fresh client, as a starting trainer has
        path = f"{source}/{MANIFEST_FILE}"
        return read_manifest(lambda: files.read_text(path), path, ShardsManifest)

    def start():
        return next(iter(ShardDataset(source, shuffle=True, seed=0)))

    def check_all():
        dataset = ShardDataset(source, shuffle=True, seed=0)
        for entry in dataset.manifest.shards:
            file, _ = dataset._open_checked(entry)
            file.close()

    return {
        "manifest_s": timed(manifest, repeats),
        "start_s": timed(start, repeats),
        "check_all_s": timed(check_all, check_all_repeats),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--shards", type=int, nargs="+", help="shard counts (default 1000 10000; 100 1000 with --gcs)")
    parser.add_argument("--rows-per-shard", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9, help="timed passes of manifest and start")
    parser.add_argument("--check-all-repeats", type=int, default=3, help="timed passes of check all")
    parser.add_argument("--gcs", action="store_true", help="read the shards from a local GCS emulator")
    parser.add_argument("--output", default=str(RESULTS))
    args = parser.parse_args()
    args.shards = args.shards or ([100, 1000] if args.gcs else [1000, 10000])
    from tests.trainer_fixtures import write_shard_dir

    emulator = None
    if args.gcs:
        from tests.helpers import GcsEmulator

        emulator = GcsEmulator()
        os.environ["STORAGE_EMULATOR_HOST"] = emulator.host
    results = {
        "source": "gcs emulator" if args.gcs else "local",
        "rows_per_shard": args.rows_per_shard,
        "by_shards": [],
    }
    print(f"{'shards':>7} {'manifest ms':>12} {'start ms':>9} {'start-manifest ms':>18} {'check all ms':>13}")
    try:
        with tempfile.TemporaryDirectory(prefix="trainer-start-") as temp:
            for shards in args.shards:
                directory = Path(temp) / f"shards-{shards}"
                write_shard_dir(directory, shard_rows=[args.rows_per_shard] * shards, batch_rows=args.rows_per_shard)
                source = str(directory)
                if emulator is not None:
                    source = upload(emulator, directory, emulator.bucket(f"start-{shards}") + "/shards")
                row = {"shards": shards, **measure(source, args.repeats, args.check_all_repeats)}
                results["by_shards"].append(row)
                ms = {key: value * 1e3 for key, value in row.items() if key.endswith("_s")}
                print(
                    f"{shards:>7} {ms['manifest_s']:>12.1f} {ms['start_s']:>9.1f} "
                    f"{ms['start_s'] - ms['manifest_s']:>18.1f} {ms['check_all_s']:>13.0f}",
                    flush=True,
                )
    finally:
        if emulator is not None:
            emulator.stop()
    first, last = results["by_shards"][0], results["by_shards"][-1]
    if last["shards"] != first["shards"]:
        ratio = {key: last[key] / first[key] for key in ("manifest_s", "start_s", "check_all_s")}
        beyond = (last["start_s"] - last["manifest_s"]) / max(first["start_s"] - first["manifest_s"], 1e-9)
        results["ratio"] = {**ratio, "start_minus_manifest": beyond}
        print(
            f"{last['shards']}/{first['shards']} shards ({last['shards'] / first['shards']:.0f}x): manifest "
            f"{ratio['manifest_s']:.1f}x, start {ratio['start_s']:.1f}x, start-manifest {beyond:.1f}x, "
            f"check all {ratio['check_all_s']:.1f}x"
        )
    write_results(results, args.output)


if __name__ == "__main__":
    main()
