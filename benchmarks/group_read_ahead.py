"""What a step after a GroupByKey holds when its groups are large: the group it works on, and
the groups Beam's data plane has read ahead of it.

    .venv/bin/python benchmarks/group_read_ahead.py [--group-mb 16] [--per-worker 1 2 4 8]

A job of two local worker processes groups G × `--group-mb` MB (values of 100 KB) into G
groups and reads each in a step that takes 2 s (the assembly of an index slice, say: a
slow consumer of one large group), G = 2 × each `--per-worker`, so each worker's bundle gets
that many groups. With the bundle recorder (`benchmarks/bundle_peaks`: input streamed to the
worker in ~1 MB messages, as a cluster's shuffle reads stream) each bundle's rise of its
worker's resident memory and its Python objects' peak (`BUNDLE_PEAKS_TRACE`) are recorded.
A group is one element however large: the worker receives it whole, decodes it whole, and
while it works on one the data plane's reader holds the next and gRPC has received more. The
table: per groups a bundle gets, the largest rise, in MB and in group sizes. A piece of an
index slice was such a group (its blocks' codes); its step now receives the blocks' places and
reads them itself. Results: a table on stdout, JSON in benchmarks/results/group_read_ahead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
from benchmarks.report import write_results  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "group_read_ahead.json"
VALUE = 10**5  # bytes per grouped value

JOB = """
import sys, time
import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions
groups, values, value = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
options = PipelineOptions(["--direct_num_workers=2", "--direct_running_mode=multi_processing"])

def consume(keyed):
    time.sleep(2)  # a slow step: the next groups arrive meanwhile
    return sum(len(v) for v in keyed[1])

with beam.Pipeline(options=options) as p:
    made = p | beam.Create(range(groups)) | "Make" >> beam.FlatMap(lambda g: ((g, b"x" * value) for _ in range(values)))
    _ = made | beam.GroupByKey() | "Consume" >> beam.Map(consume)
"""


def measure(per_worker: int, group_mb: int, work: Path) -> dict:
    peaks = work / f"peaks-{per_worker}"
    peaks.mkdir()
    env = {
        **os.environ,
        "BUNDLE_PEAKS_DIR": str(peaks),
        "BUNDLE_PEAKS_TRACE": "1",
        "PYTHONPATH": str(REPO / "benchmarks" / "bundle_peaks"),
    }
    values = group_mb * 10**6 // VALUE
    subprocess.run(
        [sys.executable, "-c", JOB, str(2 * per_worker), str(values), str(VALUE)],
        check=True,
        env=env,
        cwd=REPO,
        capture_output=True,
    )
    records = [json.loads(line) for f in peaks.glob("[0-9]*.jsonl") for line in f.read_text().splitlines()]
    consuming = [r for r in records if "Consume" in r["transforms"]]
    rise = max(r["rise_kb"] for r in consuming) * 1024 / 1e6
    traced = max(r["traced_rise_kb"] for r in consuming) * 1024 / 1e6
    return {
        "groups_per_bundle": per_worker,
        "bundles": len(consuming),
        "rise_mb": rise,
        "python_objects_mb": traced,
        "rise_in_groups": rise / group_mb,
        "python_objects_in_groups": traced / group_mb,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--group-mb", type=int, default=16)
    parser.add_argument("--per-worker", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--output", default=str(RESULTS))
    args = parser.parse_args()
    from pipeline.embed.encoder import cpu_summary

    print(f"CPU: {cpu_summary()}; groups of {args.group_mb} MB, 2 workers", flush=True)
    print(f"{'groups a bundle gets':>21} {'rise MB':>8} {'x group':>8} {'Python MB':>10} {'x group':>8}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="group-read-ahead-") as work:
        for per_worker in args.per_worker:
            row = measure(per_worker, args.group_mb, Path(work))
            rows.append(row)
            print(
                f"{per_worker:>21} {row['rise_mb']:>8.0f} {row['rise_in_groups']:>8.1f} "
                f"{row['python_objects_mb']:>10.0f} {row['python_objects_in_groups']:>8.1f}",
                flush=True,
            )
    write_results({"cpu": cpu_summary(), "group_mb": args.group_mb, "rows": rows}, args.output)


if __name__ == "__main__":
    main()
