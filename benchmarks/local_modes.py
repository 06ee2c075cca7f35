"""One machine, two local modes: what Beam's multi-process runner buys over the in-process one,
stage by stage.

    .venv/bin/python benchmarks/local_modes.py [--config examples/quickstart.yaml]
        [--chunks 200000] [--query-chunks 8192] [--workers 2] [--workdir DIR]

Each job runs twice, in a subprocess of its own: in one process (`FnApiRunner`, the default;
torch and faiss use every core through their own threads) and with `--direct_num_workers=W
--direct_running_mode=multi_processing` (W SDK worker processes, each given cores ÷ W threads).

- The whole `ratrain-pipeline run --force` on `--config` (the quickstart corpus: ~4.5k chunks):
  build-index (read, chunk, embed, index) and build-shards, their wall time and records/s
  as each manifest's `timings` records them.
- At `--chunks` (retrieve_join.py's synthetic database, 384-d, `IVF256,PQ32x8np`):
  the index stage alone (`ratrain-pipeline index` over the database's embeddings, same factory)
  and the build-shards transforms (retrieve_join's `ours`: `--query-chunks` training chunks).
  Embedding is left out at this size: it is the encoder's arithmetic, the same per chunk as in
  the quickstart run in either mode (~143 chunks/s in bfloat16 on 2 cores of an AMD EPYC with
  AVX512-BF16, `embed_vs_encoder.py`), so about 25 minutes at 200k (an estimate).

Reported per job: wall seconds in each mode and the ratio in-process ÷ multi-process (above 1:
the multi-process mode is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
from benchmarks import retrieve_join  # noqa: E402
from benchmarks.report import write_results  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "local_modes.json"
CLI = str(Path(sys.executable).with_name("ratrain-pipeline"))
MODES = ("in-process", "multi-process")


def timed(cmd: list[str], log: Path) -> float:
    start = time.perf_counter()
    with open(log, "w") as out:
        code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO).returncode
    if code:
        raise SystemExit(f"{' '.join(cmd[:3])} ... failed, see {log}")
    return time.perf_counter() - start


def whole_run(config: Path, workdir: Path, beam_args: list[str], mode: str) -> dict:
    cfg = yaml.safe_load(config.read_text())
    cfg["output"] = str(workdir / f"run-{mode}")
    cfg["retrieval_corpus"]["paths"] = [str(REPO / p) for p in cfg["retrieval_corpus"]["paths"]]
    path = workdir / f"config-{mode}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    wall = timed(
        [CLI, "run", "--config", str(path), "--force", *(["--", *beam_args] if beam_args else [])],
        workdir / f"run-{mode}.log",
    )
    stages = {}
    for stage in ("index", "shards"):
        timings = json.loads((Path(cfg["output"]) / stage / "manifest.json").read_text())["timings"]
        stages[f"build-{stage}"] = {
            "wall_s": timings["wall_seconds"],
            "records": timings["records"],
            "records_per_second": timings["records_per_second"],
        }
    return {"wall_s": wall, "stages": stages}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "examples" / "quickstart.yaml"))
    parser.add_argument("--chunks", type=int, default=200_000)
    parser.add_argument("--query-chunks", type=int, default=8192)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--workdir", help="keep (and reuse) the synthetic database here; default: a temp dir")
    parser.add_argument("--output", default=str(RESULTS))
    args = parser.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="local-modes-")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    multi = [f"--direct_num_workers={args.workers}", "--direct_running_mode=multi_processing"]
    beam_args = {"in-process": [], "multi-process": multi}
    results = {"workers": args.workers, "cores": os.cpu_count(), "jobs": {}}

    def record(job: str, walls: dict) -> None:
        ratio = walls["in-process"] / walls["multi-process"]
        results["jobs"][job] = {**{f"{m}_wall_s": round(walls[m], 1) for m in MODES}, "speedup": round(ratio, 2)}
        print(
            f"{job:<40} in-process {walls['in-process']:7.1f} s   multi-process {walls['multi-process']:7.1f} s"
            f"   in ÷ multi {ratio:.2f}",
            flush=True,
        )

    runs = {mode: whole_run(Path(args.config), workdir, beam_args[mode], mode) for mode in MODES}
    results["quickstart"] = runs
    for stage in ("build-index", "build-shards"):
        record(f"quickstart {stage}", {m: runs[m]["stages"][stage]["wall_s"] for m in MODES})
    record("quickstart run (both stages, process start included)", {m: runs[m]["wall_s"] for m in MODES})

    root = retrieve_join.ensure_data(workdir, args.chunks)
    walls = {
        m: timed(
            [
                CLI,
                "index",
                "--embeddings",
                str(root / "embeddings" / "*.parquet"),
                "--output",
                str(workdir / f"index-{m}"),
                "--type",
                retrieve_join.FACTORY,
                *(["--", *beam_args[m]] if beam_args[m] else []),
            ],
            workdir / f"index-{m}.log",
        )
        for m in MODES
    }
    record(f"index stage, {args.chunks:,} vectors", walls)
    walls = {
        m: timed(
            [
                sys.executable,
                str(REPO / "benchmarks" / "retrieve_join.py"),
                "_ours",
                str(root),
                str(workdir / f"shards-{m}"),
                str(args.query_chunks),
                *beam_args[m],
            ],
            workdir / f"shards-{m}.log",
        )
        for m in MODES
    }
    record(
        f"build-shards transforms, {args.chunks:,} chunks, {args.query_chunks // retrieve_join.L:,} sequences", walls
    )
    write_results(results, args.output)


if __name__ == "__main__":
    main()
