"""Two runs on one output at once, with different configs: the second is refused at once,
naming the first, and leaves nothing behind; the first commits. A run killed with SIGKILL
leaves its lease behind, and the next run takes it over."""

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.cli import main
from pipeline.common.fileio import committed
from schemas.config import config_from_dict
from schemas.manifest import IndexManifest, ShardsManifest
from tests.helpers import sample_documents, small_config, write_config, write_jsonl

pytestmark = pytest.mark.e2e

CLI = str(Path(sys.executable).parent / "ratrain-pipeline")


def _wait_for(condition, process) -> None:
    while not condition():
        assert process.poll() is None, "the first run ended before the condition held"
        time.sleep(0.01)  # polling a condition, not timing anything


def test_a_second_run_on_the_output_is_refused_at_once_naming_the_first(tmp_path):
    write_jsonl(tmp_path / "corpus" / "a.jsonl", sample_documents(30))
    out = tmp_path / "out"
    first = small_config(out, str(tmp_path / "corpus" / "*.jsonl"))
    second = {**first, "chunk_tokens": 16}
    write_config(tmp_path / "first.yaml", first)
    write_config(tmp_path / "second.yaml", second)
    running = subprocess.Popen(
        [CLI, "run", "--config", str(tmp_path / "first.yaml")], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    _wait_for(lambda: (out / ".staging").exists(), running)  # the first run holds the lease and writes
    staged_before = sorted(p.name for p in (out / ".staging").iterdir())

    refused = subprocess.run([CLI, "run", "--config", str(tmp_path / "second.yaml")], capture_output=True, text=True)
    assert running.poll() is None, "the second run was refused only once the first had ended"
    assert refused.returncode != 0
    assert f"is being written by run (pid {running.pid} on " in refused.stderr
    assert sorted(p.name for p in (out / ".staging").iterdir()) == staged_before  # nothing of the second run's

    _, errors = running.communicate()
    assert running.returncode == 0, errors[-2000:]
    index = committed(str(out / "index"), IndexManifest)
    assert index is not None and index.config_hash == config_from_dict(first).index_hash()
    assert committed(str(out / "shards"), ShardsManifest) is not None
    assert not (out / ".lease.json").exists() and not (out / ".staging").exists()


def test_the_lease_of_a_killed_run_is_taken_over_by_the_next(tmp_path, caplog):
    write_jsonl(tmp_path / "corpus" / "a.jsonl", sample_documents(12))
    out = tmp_path / "out"
    config = write_config(tmp_path / "config.yaml", small_config(out, str(tmp_path / "corpus" / "*.jsonl")))
    killed = subprocess.Popen([CLI, "run", "--config", str(config)], start_new_session=True)
    _wait_for(lambda: (out / ".staging").exists(), killed)
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()
    assert json.loads((out / ".lease.json").read_text())["pid"] == killed.pid  # left behind
    with caplog.at_level(logging.INFO, logger="ratrain"):  # the rerun in this process
        main(["run", "--config", str(config)])
    assert f"took over the lease of run (pid {killed.pid} on " in caplog.text
    assert f"process {killed.pid} on this host has ended" in caplog.text
    assert not (out / ".lease.json").exists()
