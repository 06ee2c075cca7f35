"""Trainer throughput on a CPU by precision and thread count: tokens/s of `ratrain-train`.

    .venv/bin/python benchmarks/trainer_precision.py [--rounds 3] [--steps 12] [--threads 2 1]

Data: synthetic shards with the quickstart's shapes (n = 512, m = 64, k = 2, vocab 30,522;
`tests/trainer_fixtures.py`). Model: the quickstart's (`--dim 128 --depth 4 --heads 4
--batch-size 4`). Each run is `ratrain-train` in a subprocess of its own with
`OMP_NUM_THREADS` set to the thread count, `--log-every 3` and `--metrics FILE`; its rate is the
median `tokens_per_s` over the logged intervals after the first (which holds the start). Runs
alternate between precisions, `--rounds` times, so a machine that gets busier during the run
slows every precision alike; each precision's rate is the median over its runs, and its ratio
is against fp32 (the baseline) at the same thread count.

fp16 has no native arithmetic on most CPUs and runs emulated, many times slower: it gets one
run of `--fp16-steps` steps, at the most threads. `--compile` adds one compiled fp32 run there;
its wall time includes the compile.

Results: a table on stdout, JSON in benchmarks/results/trainer_precision.json, with the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
from benchmarks.report import write_results  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "trainer_precision.json"
N, M, K, VOCAB, SEQUENCES = 512, 64, 2, 30_522, 256
MODEL = ["--dim", "128", "--depth", "4", "--heads", "4", "--batch-size", "4", "--vocab-size", str(VOCAB)]


def write_shards(directory: Path) -> None:
    from tests.trainer_fixtures import write_shard_dir

    write_shard_dir(
        directory,
        shard_rows=[SEQUENCES // 4] * 4,
        sequence_tokens=N,
        chunk_tokens=M,
        neighbours=K,
        vocab_size=VOCAB,
        batch_rows=16,
    )


def run(shards: Path, precision: str, threads: int, steps: int, workdir: Path, compile_: bool = False) -> dict:
    """One `ratrain-train` run: the median tokens/s after its first logged interval, and the
    seconds from its start to its first logged step."""
    metrics = workdir / f"metrics-{precision}-{threads}-{time.monotonic_ns()}.jsonl"
    cmd = [sys.executable, "-m", "trainer.train", "--shards", str(shards), "--steps", str(steps)]
    cmd += ["--precision", precision, "--log-every", "3", "--metrics", str(metrics), *MODEL]
    cmd += ["--compile"] if compile_ else []
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    start = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    rates = [r["tokens_per_s"] for r in records if "tokens_per_s" in r]
    return {
        "tokens_per_s": statistics.median(rates[1:] or rates),
        "intervals": len(rates),
        "wall_s": round(time.perf_counter() - start, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--fp16-steps", type=int, default=4)
    parser.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    parser.add_argument("--compile", action="store_true", help="also one compiled fp32 run, at the most threads")
    args = parser.parse_args()

    from pipeline.embed.encoder import cpu_summary

    with tempfile.TemporaryDirectory(prefix="trainer_precision-") as tmp:
        workdir = Path(tmp)
        write_shards(workdir / "shards")
        runs: dict[tuple[str, int], list[dict]] = {}
        for _ in range(args.rounds):
            for threads in args.threads:
                for precision in ("fp32", "bf16"):
                    runs.setdefault((precision, threads), []).append(
                        run(workdir / "shards", precision, threads, args.steps, workdir)
                    )
        most = max(args.threads)  # the slow variants once, at the most threads
        runs[("fp16", most)] = [run(workdir / "shards", "fp16", most, args.fp16_steps, workdir)]
        if args.compile:
            runs[("fp32 compiled", most)] = [run(workdir / "shards", "fp32", most, args.steps, workdir, True)]

    rows = []
    for (precision, threads), measured in runs.items():
        rate = statistics.median(m["tokens_per_s"] for m in measured)
        baseline = statistics.median(m["tokens_per_s"] for m in runs[("fp32", threads)])
        rows.append(
            {
                "precision": precision,
                "threads": threads,
                "runs": len(measured),
                "tokens_per_s": round(rate, 1),
                "x_fp32": round(rate / baseline, 2),
                "wall_s": [m["wall_s"] for m in measured],
            }
        )
    print(f"{'precision':<14}{'threads':>8}{'runs':>6}{'tokens/s':>10}{'x fp32':>8}")
    for row in rows:
        print(
            f"{row['precision']:<14}{row['threads']:>8}{row['runs']:>6}{row['tokens_per_s']:>10,.0f}{row['x_fp32']:>8.2f}"
        )
    write_results({"cpu": cpu_summary(), "model": MODEL, "sequence_tokens": N, "rows": rows}, RESULTS)
    print(f"CPU: {cpu_summary()}")


if __name__ == "__main__":
    main()
