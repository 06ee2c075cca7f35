"""Shuffle loss on Beam's local multi-process runner, and its avoidance: run the build-shards
transforms again and again with 2 worker processes and hash the shards each run writes.

    .venv/bin/python benchmarks/shuffle_loss.py [--runs 5] [--chunks 200000]
        [--query-chunks 199992] [--workers 2] [--widen SECONDS] [--timed-flush] [--workdir DIR]

The data and the job are `retrieve_join.py`'s (`ours`: PackSequences -> RetrieveNeighbours ->
WriteShards over a synthetic chunk database, IVF256,PQ32x8np), each run a subprocess of its own
with `--direct_num_workers=N --direct_running_mode=multi_processing`, its options made by the
project's `new_pipeline` (which turns off the runner's timed flush: the cause of the loss,
see `pipeline/jobs/options.py` `no_timed_flush_on_local_runner`). Per run: committed or failed (the
stage's own check that every hit and neighbour sent through a shuffle came back), wall time,
and the sha256 of all shards; at the end, whether every run committed the same bytes.

`--widen S` forces the race window open (`shuffle_loss_minimal.widen_race_window`: the runner
pauses S seconds after each input message it writes, timing only), so a run that survives it
survives the worst timing; `--timed-flush` puts Beam's 1 s timed flush back, to see the loss.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
from benchmarks import retrieve_join  # noqa: E402
from benchmarks.report import write_results  # noqa: E402
from benchmarks.shuffle_loss_minimal import widen_race_window  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "shuffle_loss.json"


def ours_with_timing(
    root: str, out: str, query_chunks: int, widen: float, timed_flush: bool, beam_args: list[str]
) -> None:
    """The job, with the race window widened and/or Beam's timed flush put back."""
    if widen:
        widen_race_window(widen)
    if timed_flush:
        from apache_beam.runners.portability.fn_api_runner import worker_handlers

        from pipeline.jobs import options

        def keep_timed_flush() -> None:  # the project's avoidance, undone
            worker_handlers.DATA_BUFFER_TIME_LIMIT_MS = 1000

        options.no_timed_flush_on_local_runner = keep_timed_flush
    retrieve_join.ours_main(root, out, query_chunks, beam_args)


def shards_digest(directory: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(directory.glob("shard-*.arrow")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_ours":
        return ours_with_timing(
            sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5]), sys.argv[6] == "timed-flush", sys.argv[7:]
        )
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--chunks", type=int, default=200_000)
    parser.add_argument(
        "--query-chunks",
        type=int,
        help="training chunks, a multiple of 8 below "
        "--chunks; default: all but the last 8 (the whole database as the training set)",
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--widen",
        type=float,
        default=0.0,
        help="seconds the runner pauses after each input message it writes (timing only; opens the race window)",
    )
    parser.add_argument(
        "--timed-flush",
        action="store_true",
        help="keep Beam's 1 s timed flush (the cause of the loss) instead of the project's avoidance",
    )
    parser.add_argument("--workdir", help="keep (and reuse) the data here; default: a temp dir")
    parser.add_argument("--output", default=str(RESULTS))
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
        job = subprocess.run(
            [
                sys.executable,
                __file__,
                "_ours",
                str(root),
                str(out),
                str(query_chunks),
                str(args.widen),
                "timed-flush" if args.timed_flush else "no-timed-flush",
                *beam_args,
            ],
            capture_output=True,
            text=True,
        )
        wall = time.perf_counter() - start
        log = job.stdout + job.stderr
        (workdir / f"run-{run}.log").write_text(log)
        failure = [line for line in log.splitlines() if "Error" in line or "lost data" in line]
        result = {
            "run": run,
            "committed": job.returncode == 0,
            "wall_s": round(wall, 1),
            "failure": failure[-1][-300:] if job.returncode and failure else None,
            "shards_sha256": shards_digest(out) if job.returncode == 0 else None,
        }
        runs.append(result)
        print(
            f"run {run}: {'committed' if result['committed'] else 'FAILED'} in {wall:.0f} s"
            + (
                f", shards {result['shards_sha256'][:16]}"
                if result["committed"]
                else f": {result['failure']} ({workdir}/run-{run}.log)"
            ),
            flush=True,
        )
    digests = {r["shards_sha256"] for r in runs if r["committed"]}
    summary = {
        "chunks": args.chunks,
        "query_chunks": query_chunks,
        "workers": args.workers,
        "widen_s": args.widen,
        "timed_flush": args.timed_flush,
        "runs": runs,
        "committed": sum(r["committed"] for r in runs),
        "byte_identical": len(digests) == 1 and all(r["committed"] for r in runs),
    }
    print(
        f"{summary['committed']}/{args.runs} runs committed; shards byte-identical across all runs: "
        f"{summary['byte_identical']}"
    )
    write_results(summary, args.output)


if __name__ == "__main__":
    main()
