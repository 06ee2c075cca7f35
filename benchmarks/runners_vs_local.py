"""The quickstart on Flink and on Spark against the local runner: wall time per stage, and the
outputs compared file by file.

    .venv/bin/python benchmarks/runners_vs_local.py [--repeat N] [--workdir DIR]

1. A Flink 1.19 session cluster on this machine (`deploy/local/runners.py up`, as
   `make flink-up`: 1 JobManager, 2 TaskManagers of 2 slots, each its own JVM), on a free port
   (`tests.helpers.LocalFlinkCluster`, as the tests start it); Spark inside Beam's Spark job
   server on two cores (`runners.py spark-options`: `local[2]`).
2. The quickstart config (`examples/quickstart.yaml`, its corpus) built from nothing by `run`
   on the local runner (FnApiRunner, in-process), on the Flink cluster at parallelism 2 and on
   Spark, both with LOOPBACK workers, `--repeat` times each, in turn, each run into a new output.
3. Reported per runner: each stage's wall time from its manifest (the driver's start to the
   commit) and the whole `run`; each runner's ratio to the local runner's medians. Checked: the
   sha256 of every chunk, embedding, faiss and shard file equal across runners and runs,
   `validate` passing on every output, and Flink's REST API listing each Flink job FINISHED
   with subtasks on both TaskManagers.

Results: a table on stdout, JSON in benchmarks/results/runners_vs_local.json. The Flink cluster
is stopped at the end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
from benchmarks.report import timed, write_results  # noqa: E402
from pipeline.check.validate import validate_path  # noqa: E402
from pipeline.common import fileio  # noqa: E402
from pipeline.embed.encoder import cpu_summary  # noqa: E402
from pipeline.run import run_all  # noqa: E402
from schemas.config import load_config  # noqa: E402
from tests.helpers import DATA_STAGES, LocalFlinkCluster, local_runners  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
STAGES = ("build-index", "build-shards")


def data_digests(out: Path) -> dict[str, str]:
    return {
        str(p.relative_to(out)): fileio.sha256_file(str(p))[0]
        for stage in DATA_STAGES
        for p in sorted((out / stage).iterdir())
        if p.suffix != ".json"
    }


def stage_seconds(out: Path) -> dict[str, float]:
    """Each stage's wall time as its manifest records it (the driver's start to the commit)."""
    manifests = {stage: out / stage.removeprefix("build-") / "manifest.json" for stage in STAGES}
    return {stage: json.loads(path.read_text())["timings"]["wall_seconds"] for stage, path in manifests.items()}


def flink_job(cluster: LocalFlinkCluster, job: str) -> dict:
    return {"state": cluster.rest(f"/jobs/{job}")["state"], "task_managers": sorted(cluster.task_managers_of(job))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="runners-vs-local-"))
    config = load_config(REPO / "examples" / "quickstart.yaml")
    corpus = config.retrieval_corpus.model_copy(update={"paths": [str(REPO / "examples/corpus/*.jsonl")]})
    spark = [*local_runners("spark-options").split(), "--environment_type=LOOPBACK"]
    cluster = LocalFlinkCluster(workdir / "cluster")
    runners = {"local": [], "flink": [*cluster.options, "--environment_type=LOOPBACK"], "spark": spark}
    runs: dict[str, list[dict]] = {runner: [] for runner in runners}
    try:
        for i in range(args.repeat):
            for runner, options in runners.items():
                out = workdir / f"{runner}-{i}"
                cfg = config.model_copy(update={"output": str(out), "retrieval_corpus": corpus})
                before = cluster.job_ids()
                _, seconds = timed(lambda cfg=cfg, options=options: run_all(cfg, options))
                runs[runner].append(
                    {
                        "run_seconds": round(seconds, 1),
                        **stage_seconds(out),
                        "digests": data_digests(out),
                        "validate_ok": all(line.startswith("OK") for line in validate_path(str(out))),
                        "flink_jobs": [flink_job(cluster, job) for job in sorted(cluster.job_ids() - before)],
                    }
                )
                print(f"{runner} run {i + 1}: {seconds:.1f} s", file=sys.stderr)
    finally:
        cluster.stop()

    reference = runs["local"][0]["digests"]
    identical = all(run["digests"] == reference for r in runs.values() for run in r)
    results = {
        "cpu": cpu_summary(),
        "repeat": args.repeat,
        "files_compared": len(reference),
        "byte_identical": identical,
        "validate_ok": all(run["validate_ok"] for r in runs.values() for run in r),
        "flink_jobs": [job for run in runs["flink"] for job in run["flink_jobs"]],
        "median_seconds": {
            runner: {key: statistics.median(run[key] for run in r) for key in ("run_seconds", *STAGES)}
            for runner, r in runs.items()
        },
    }
    print(f"CPU: {results['cpu']}; quickstart, median of {args.repeat}")
    print(f"{'':14}{'local s':>9}{'Flink s':>9}{'Spark s':>9}{'Flink/local':>13}{'Spark/local':>13}")
    for key in ("run_seconds", *STAGES):
        local, flink, spark = (results["median_seconds"][runner][key] for runner in ("local", "flink", "spark"))
        print(f"{key:14}{local:9.1f}{flink:9.1f}{spark:9.1f}{flink / local:12.2f}x{spark / local:12.2f}x")
    print(f"{len(reference)} data files byte-identical: {identical}; validate OK: {results['validate_ok']}")
    print(f"Flink jobs: {results['flink_jobs']}")
    write_results(results, REPO / "benchmarks" / "results" / "runners_vs_local.json")


if __name__ == "__main__":
    main()
