"""The shuffle counter of benchmarks/bundle_peaks (what the scale rehearsal's bytes shuffled rest
on), and what it shows of the index graph: nothing per file gathered in one place for an IVF
index that one worker does not build."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.index_build import ensure_data

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.beam
CLI = str(REPO / ".venv" / "bin" / "ratrain-pipeline")

PIPELINE = """
import apache_beam as beam
with beam.Pipeline() as p:
    pairs = p | beam.Create([(i % 7, b"x" * 1000) for i in range(500)])
    _ = pairs | "Grouped" >> beam.GroupByKey() | beam.Map(len)
    _ = pairs | "NotShuffled" >> beam.Map(len)
"""


def recorded(tmp_path: Path, argv: list[str]) -> dict:
    peaks = tmp_path / "peaks"
    peaks.mkdir()
    env = {**os.environ, "BUNDLE_PEAKS_DIR": str(peaks), "PYTHONPATH": str(REPO / "benchmarks" / "bundle_peaks")}
    subprocess.run(argv, check=True, env=env, cwd=REPO, capture_output=True)
    (counted,) = peaks.glob("shuffles-*.json")
    return json.loads(counted.read_text())


def test_every_byte_into_a_group_by_key_is_counted_by_its_name(tmp_path):
    shuffles = recorded(tmp_path, [sys.executable, "-c", PIPELINE])
    assert not any(name.startswith("NotShuffled") for name in shuffles)  # a plain step's output is not a shuffle
    payload = 500 * 1000
    assert payload < shuffles["Grouped"] < payload + 500 * 32  # the values, their keys and a few bytes each


def test_an_ivf_index_gathers_no_list_of_files_on_one_worker(tmp_path):
    embeddings = ensure_data(tmp_path, 4000, 32, 40, 100)
    argv = [CLI, "index", "--embeddings", f"{embeddings}/*.parquet", "--output", str(tmp_path / "out")]
    shuffles = recorded(tmp_path, [*argv, "--type", "IVF16,Flat", "--nprobe", "4"])
    assert any("/GatherParts/" in name for name in shuffles)  # the merge's gather, counted
    # a one-worker build (Flat, HNSW) is not this index's: nothing goes to its list of every file
    # (the 40 paths did, ~2.8 KB, before)
    assert not any("/GatherPaths/" in name for name in shuffles), shuffles
