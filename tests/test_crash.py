"""A run killed with SIGKILL at any point leaves no directory whose manifest exists over
incomplete content, and the next run finishes the work with the bytes of an uninterrupted run."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.validate import validate_index, validate_shards
from tests.conftest import BAD_RECORDS, sample_documents, small_config, write_config, write_jsonl

CLI = str(Path(sys.executable).parent / "ratrain-pipeline")


def _staged(out: Path, stage: str, suffix: str) -> bool:
    return any((out / ".staging").glob(f"{stage}-*/**/*{suffix}"))


KILL_POINTS = {  # when to kill: a condition on the output directory, polled
    "chunks staged": lambda out: _staged(out, "index", ".parquet"),
    "index committed": lambda out: (out / "index" / "manifest.json").exists(),
    "shards staged": lambda out: _staged(out, "shards", ".arrow"),
}


def _run_until(config: Path, out: Path, condition) -> bool:
    """Start `run`; SIGKILL its process group once `condition(out)` holds. False if the run
    ended first (the condition never held while it ran)."""
    process = subprocess.Popen([CLI, "run", "--config", str(config)], start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while process.poll() is None:
            if condition(out):
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                return True
            time.sleep(0.01)  # polling a condition, not timing anything
        return False
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)


def _data_files(out: Path) -> dict:
    return {p.relative_to(out): p.read_bytes() for p in out.rglob("*")
            if p.is_file() and p.suffix in (".parquet", ".faiss", ".arrow")}


@pytest.mark.parametrize("point", list(KILL_POINTS))
def test_killed_run_leaves_nothing_half_committed_and_a_rerun_finishes_it(point, built_output, tmp_path):
    root, _, _ = built_output
    docs = sample_documents(16)  # the corpus of `built_output`
    write_jsonl(tmp_path / "corpus" / "a.jsonl", docs[:8])
    write_jsonl(tmp_path / "corpus" / "b.jsonl", docs[8:] + BAD_RECORDS)
    out = tmp_path / "out"
    config = write_config(tmp_path / "c.yaml", small_config(out, str(tmp_path / "corpus" / "*.jsonl")))

    assert _run_until(config, out, KILL_POINTS[point]), f"the run finished before '{point}'"
    if (out / "index" / "manifest.json").exists():  # whatever claims to be committed is whole
        validate_index(str(out / "index"))
    if (out / "shards" / "manifest.json").exists():
        validate_shards(str(out / "shards"))

    subprocess.run([CLI, "run", "--config", str(config)], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert _data_files(out) == _data_files(root / "out")
    assert not (out / ".staging").exists()
