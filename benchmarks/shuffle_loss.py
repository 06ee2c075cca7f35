"""Shuffle loss on Beam's local multi-process runner: run the build-shards transforms again and
again with 2 worker processes, and watch the runner's buffers.

    .venv/bin/python benchmarks/shuffle_loss.py [--runs 5] [--chunks 200000]
        [--query-chunks 199992] [--workers 2] [--workdir DIR]

The data and the job are `retrieve_join.py`'s (`ours`: PackSequences -> RetrieveNeighbours ->
WriteShards over a synthetic chunk database, IVF256,PQ32x8np), each run a subprocess of its own
with `--direct_num_workers=N --direct_running_mode=multi_processing`. Per run: committed or
failed (the stage's own check that every hit and neighbour sent through a shuffle came back),
wall time, and the sha256 of all shards; at the end, whether every committed run wrote the same
bytes. Inside each run the runner's buffers are traced: every place where Beam 2.77's
FnApiRunner can drop data without an error (a grouped buffer extended with a list buffer, or
extended after it was partitioned among the workers; the data plane discarding elements that
arrive for a finished instruction) prints a `[beam-buffers]` line.
"""
from __future__ import annotations

import argparse
import hashlib
import logging
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
from benchmarks import retrieve_join  # noqa: E402
from benchmarks.report import write_results  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "shuffle_loss.json"


def trace_beam_buffers() -> None:
    """Print a line wherever the local runner's buffers would drop elements silently."""
    from apache_beam.runners.portability.fn_api_runner import execution

    grouping, listing = execution.GroupingBuffer, execution.ListBuffer
    extend = grouping.extend

    def traced_extend(self, other):
        if isinstance(other, listing) and other._inputs:
            print(f"[beam-buffers] GroupingBuffer.extend(ListBuffer): {len(other._inputs)} data "
                  "messages ignored", file=sys.stderr, flush=True)
        if isinstance(other, grouping) and other is not self and other._table and self._grouped_output:
            print(f"[beam-buffers] GroupingBuffer extended after partition: {len(other._table)} keys "
                  "never read", file=sys.stderr, flush=True)
        return extend(self, other)

    grouping.extend = traced_extend
    # the data plane drops elements that arrive for an instruction it has finished reading, and
    # says so only at INFO
    data_plane = logging.getLogger("apache_beam.runners.worker.data_plane")
    data_plane.setLevel(logging.INFO)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[beam-buffers] data plane: %(message)s"))
    handler.addFilter(lambda record: "Discard" in record.getMessage())
    data_plane.addHandler(handler)


def shards_digest(directory: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(directory.glob("shard-*.arrow")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_ours":
        trace_beam_buffers()
        return retrieve_join.ours_main(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--chunks", type=int, default=200_000)
    parser.add_argument("--query-chunks", type=int, help="training chunks, a multiple of 8 below "
                        "--chunks; default: all but the last 8 (the whole database as the training set)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--workdir", help="keep (and reuse) the data here; default: a temp dir")
    args = parser.parse_args()
    query_chunks = args.query_chunks or args.chunks - retrieve_join.L
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="shuffle-loss-")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    root = retrieve_join.ensure_data(workdir, args.chunks)
    beam_args = [f"--direct_num_workers={args.workers}", "--direct_running_mode=multi_processing"]
    runs = []
    for run in range(args.runs):
        out = workdir / f"run-{run}"
        start = time.perf_counter()
        job = subprocess.run([sys.executable, __file__, "_ours", str(root), str(out), str(query_chunks),
                              *beam_args], capture_output=True, text=True)
        wall = time.perf_counter() - start
        log = job.stdout + job.stderr
        (workdir / f"run-{run}.log").write_text(log)
        traced = [line for line in log.splitlines() if line.startswith("[beam-buffers]")]
        lost = [line for line in log.splitlines() if "the runner lost data" in line]
        result = {"run": run, "committed": job.returncode == 0, "wall_s": round(wall, 1),
                  "lost": lost[-1][-300:] if lost else None, "buffer_events": traced,
                  "shards_sha256": shards_digest(out) if job.returncode == 0 else None}
        runs.append(result)
        print(f"run {run}: {'committed' if result['committed'] else 'FAILED'} in {wall:.0f} s"
              + (f", shards {result['shards_sha256'][:16]}" if result["committed"] else f" ({workdir}/run-{run}.log)")
              + "".join(f"\n  {line}" for line in traced), flush=True)
    digests = {r["shards_sha256"] for r in runs if r["committed"]}
    summary = {"chunks": args.chunks, "query_chunks": query_chunks, "workers": args.workers,
               "runs": runs, "committed": sum(r["committed"] for r in runs),
               "byte_identical": len(digests) == 1 and all(r["committed"] for r in runs)}
    print(f"{summary['committed']}/{args.runs} runs committed; shards byte-identical across all runs: "
          f"{summary['byte_identical']}")
    write_results(summary, RESULTS)


if __name__ == "__main__":
    main()
