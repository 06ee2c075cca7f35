"""Trainer start: the time from `ShardDataset(...)` to its first sample as the shard count grows.

    .venv/bin/python benchmarks/trainer_start.py [--shards 1000 10000] [--rows-per-shard 2] [--gcs]
    .venv/bin/python benchmarks/trainer_start.py --entries 1000000 [--starts 3]

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

`--entries N` (a trainer rank's start at 30B-chunk scale): a synthetic manifest of N shard
entries (distinct paths, sizes and sha256s), written twice by the project's writer: with its
entries in the file table (what the commit writes above INLINE_FILE_ENTRIES) and inline in
manifest.json (the format before the table: the baseline).
Only the shard the first sample reads exists as a file. Each start runs in a fresh process
(`--starts` times per format, after one untimed run for the page cache): seconds from
`ShardDataset(dir, shuffle=True)` to its first sample, and the peak resident memory (VmHWM)
above the process's resident memory once torch, pyarrow, pandas (which pyarrow's to_numpy
imports at the first shard read), the pipeline's file access and the trainer are imported;
then the same for reading the manifest with every entry (`fileio.committed_manifest`, as
validate, report and inspect do).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
from benchmarks.report import peak_rss_kb, write_results  # noqa: E402

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
    from trainer.shard_files import files_for

    def manifest():
        files = files_for(source)  # a fresh client, as a starting trainer has
        path = f"{source}/{MANIFEST_FILE}"
        return read_manifest(lambda: files.read_text(path), path, ShardsManifest)

    def start():
        return next(iter(ShardDataset(source, shuffle=True, seed=0)))

    def check_all():
        dataset = ShardDataset(source, shuffle=True, seed=0)
        for shard in range(len(dataset._shard_rows)):
            file, _ = dataset._open_checked(dataset._entry(shard))
            file.close()

    return {
        "manifest_s": timed(manifest, repeats),
        "start_s": timed(start, repeats),
        "check_all_s": timed(check_all, check_all_repeats),
    }


def _resident_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def read_in_this_process(kind: str, source: str) -> None:
    """One read (a fresh process: `--start` or `--whole`): prints seconds and peak MB above the
    imports. start: a trainer's construction to first sample; whole: the manifest with every
    entry, as validate, report and inspect read it."""
    import pandas  # noqa: F401  pyarrow's to_numpy imports it at the first shard read, whatever the manifest

    from pipeline.common import fileio
    from schemas.manifest import ShardsManifest
    from trainer import ShardDataset

    reads = {
        "start": lambda: next(iter(ShardDataset(source, shuffle=True, seed=0))),
        "whole": lambda: fileio.committed_manifest(source, ShardsManifest),
    }
    before = _resident_kb()
    began = time.perf_counter()
    reads[kind]()
    seconds = time.perf_counter() - began
    print(json.dumps({"seconds": seconds, "peak_above_imports_mb": (peak_rss_kb() - before) / 1024}))


def write_synthetic(directories: dict[str, Path], entries: int, work: Path) -> None:
    """Shards directories whose manifests list `entries` tiny shards, with distinct paths, sizes
    and sha256s as real ones have; only the one the first sample reads exists (a real shard,
    its entry true). `directories`: format name -> directory, "file table" or "inline"."""
    from tests.trainer_fixtures import write_manifest, write_shard_dir
    from trainer import ShardDataset

    real = write_shard_dir(work / "real", shard_rows=[2], batch_rows=2)
    one = real.shards[0]
    rng = np.random.default_rng(0)
    digests = rng.bytes(32 * entries).hex()
    sizes = rng.integers(one.bytes // 2, one.bytes * 2, entries).tolist()
    shards = [
        one.model_construct(
            path=f"shard-{i:07d}.arrow", rows=one.rows, bytes=sizes[i], sha256=digests[64 * i : 64 * i + 64]
        )
        for i in range(entries)
    ]
    manifest = real.model_copy(update={"shards": shards, "num_sequences": entries * one.rows})
    limits = {"file table": 0, "inline": entries}
    write_manifest(directories["file table"], manifest, 0)
    first = int(ShardDataset(directories["file table"], shuffle=True, seed=0)._shard_order()[0][0])
    shards[first] = one.model_copy(update={"path": f"shard-{first:07d}.arrow"})
    for name, directory in directories.items():
        write_manifest(directory, manifest, limits[name])
        shutil.copyfile(work / "real" / one.path, directory / shards[first].path)


def measure_entries(entries: int, starts: int) -> dict:
    """Start time and memory over a synthetic manifest of `entries` shards, table and inline."""
    from schemas.manifest import FILE_TABLE, MANIFEST_FILE

    results: dict = {"entries": entries, "formats": []}
    with tempfile.TemporaryDirectory(prefix="trainer-start-entries-") as temp:
        directories = {name: Path(temp) / name.replace(" ", "-") for name in ("file table", "inline")}
        for directory in directories.values():
            directory.mkdir()
        write_synthetic(directories, entries, Path(temp))
        for name, directory in directories.items():
            sizes = {f: (directory / f).stat().st_size for f in (MANIFEST_FILE, FILE_TABLE) if (directory / f).exists()}
            row: dict = {"format": name, "bytes": sizes}
            for kind in ("start", "whole"):
                runs = []
                for run in range(starts + 1):
                    child = subprocess.run(
                        [sys.executable, __file__, f"--{kind}", str(directory)],
                        check=True,
                        capture_output=True,
                        text=True,
                    )
                    if run:  # the first warms the page cache
                        runs.append(json.loads(child.stdout.splitlines()[-1]))
                row[f"{kind}_s"] = statistics.median(r["seconds"] for r in runs)
                row[f"{kind}_peak_above_imports_mb"] = max(r["peak_above_imports_mb"] for r in runs)
            results["formats"].append(row)
            print(
                f"{entries:,} shards, {name} (files {sizes}), median of {starts}: trainer start "
                f"{row['start_s']:.2f} s, peak {row['start_peak_above_imports_mb']:.0f} MB above the imports; "
                f"every entry {row['whole_s']:.2f} s, peak {row['whole_peak_above_imports_mb']:.0f} MB",
                flush=True,
            )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--shards", type=int, nargs="+", help="shard counts (default 1000 10000; 100 1000 with --gcs)")
    parser.add_argument("--rows-per-shard", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9, help="timed passes of manifest and start")
    parser.add_argument("--check-all-repeats", type=int, default=3, help="timed passes of check all")
    parser.add_argument("--gcs", action="store_true", help="read the shards from a local GCS emulator")
    parser.add_argument("--output", default=str(RESULTS))
    parser.add_argument("--entries", type=int, help="a synthetic manifest of this many shards, table and inline")
    parser.add_argument("--starts", type=int, default=3, help="timed starts per format with --entries")
    parser.add_argument("--start", help=argparse.SUPPRESS)  # one read in this process (a child of --entries)
    parser.add_argument("--whole", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.start or args.whole:
        read_in_this_process("start" if args.start else "whole", args.start or args.whole)
        return
    if args.entries:
        write_results(measure_entries(args.entries, args.starts), args.output)
        return
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
