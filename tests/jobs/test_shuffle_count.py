"""The shuffle counter and the bundle recorder of benchmarks/bundle_peaks (what the scale
rehearsal's bytes shuffled and bundle peaks rest on), and what the counter shows of the index
graph: nothing per file gathered in one place for an IVF index that one worker does not build."""

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


# Beam's BundleProcessor.process_bundle stood in for by one that runs a bundle when told to:
# bundles "a" and "b" overlap (b starts while a runs), "c" runs alone after both
OVERLAPPING = """
import threading, types
from apache_beam.runners.worker import bundle_processor
gates = {name: threading.Event() for name in "abc"}
started = {name: threading.Event() for name in "abc"}
def process_bundle(self):
    started[self.name].set()
    gates[self.name].wait()
bundle_processor.BundleProcessor.process_bundle = process_bundle
import sitecustomize  # the recorder, over the stand-in above
sitecustomize._record_bundles(sitecustomize.Path(PEAKS))
def bundle(name):
    transforms = {name: types.SimpleNamespace(unique_name="Step" + name.upper())}
    self = types.SimpleNamespace(name=name, process_bundle_descriptor=types.SimpleNamespace(transforms=transforms))
    return threading.Thread(target=bundle_processor.BundleProcessor.process_bundle, args=(self,))
a, b = bundle("a"), bundle("b")
a.start(); started["a"].wait(); b.start(); started["b"].wait()
gates["a"].set(); a.join(); gates["b"].set(); b.join()
c = bundle("c"); gates["c"].set(); c.start(); c.join()
"""


def test_bundles_that_overlap_are_one_record_and_none_waits_for_another(tmp_path):
    peaks = tmp_path / "peaks"
    peaks.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO / "benchmarks" / "bundle_peaks")}
    env.pop("BUNDLE_PEAKS_DIR", None)  # the stand-in is put in place first, then the recorder over it
    script = f"PEAKS = {str(peaks)!r}\n" + OVERLAPPING
    subprocess.run([sys.executable, "-c", script], check=True, env=env, cwd=REPO, capture_output=True, timeout=60)
    (log,) = peaks.glob("*.jsonl")
    records = [json.loads(line) for line in log.read_text().splitlines()]
    # b started while a ran (a lock would have held it back, and the script would not end)
    assert [(r["transforms"], r["bundles"]) for r in records] == [(["StepA", "StepB"], 2), (["StepC"], 1)]
    assert all(r["rise_kb"] >= 0 and r["rss_kb"] > 0 for r in records)


# 1 GB through a GroupByKey in 500 groups of 2 MB, read by two worker processes: each worker's
# share of the grouped stage is ~500 MB
SHARE = """
import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions
options = PipelineOptions(["--direct_num_workers=2", "--direct_running_mode=multi_processing"])
with beam.Pipeline(options=options) as p:
    made = p | beam.Create(range(20)) | "Make" >> beam.FlatMap(lambda _: ((j % 500, b"x" * 10**4) for j in range(5000)))
    _ = made | beam.GroupByKey() | "ReadGroups" >> beam.Map(lambda kv: sum(len(v) for v in kv[1]))
"""


def test_a_step_after_a_shuffle_holds_its_groups_not_its_share_of_the_stage(tmp_path):
    """Beam's local runner would send a worker its ~500 MB share of the grouped stage as one
    message before the bundle starts (the worker held 935-3,800 MB for a 500 MB to 2 GB stage);
    the recorder streams it in ~1 MB messages, so the bundle holds a few 2 MB groups and Beam's
    fixed buffers."""
    peaks = tmp_path / "peaks"
    peaks.mkdir()
    env = {**os.environ, "BUNDLE_PEAKS_DIR": str(peaks), "PYTHONPATH": str(REPO / "benchmarks" / "bundle_peaks")}
    subprocess.run([sys.executable, "-c", SHARE], check=True, env=env, cwd=REPO, capture_output=True, timeout=300)
    records = [json.loads(line) for log in peaks.glob("[0-9]*.jsonl") for line in log.read_text().splitlines()]
    reads = [r["rise_kb"] / 1024 for r in records if "ReadGroups" in r["transforms"]]
    makes = [r["rise_kb"] / 1024 for r in records if "Make" in r["transforms"]]
    assert len(reads) == 2 and len(makes) == 2  # a bundle per worker
    assert max(reads) < 250, reads  # half the share at most
    assert max(makes) < 100, makes  # the output streams out too: 1 MB flushes, a 1 MB send queue


# a bundle that makes a 64 MB array and lets it go: its Python objects' peak, not what they left
ALLOCATES = """
import apache_beam as beam
with beam.Pipeline() as p:
    _ = p | beam.Create([1]) | "Allocate" >> beam.Map(lambda _: len(bytearray(64 << 20)))
"""


def test_a_traced_bundle_records_the_most_its_python_objects_held(tmp_path):
    peaks = tmp_path / "peaks"
    peaks.mkdir()
    env = {
        **os.environ,
        "BUNDLE_PEAKS_DIR": str(peaks),
        "BUNDLE_PEAKS_TRACE": "1",
        "PYTHONPATH": str(REPO / "benchmarks" / "bundle_peaks"),
    }
    subprocess.run([sys.executable, "-c", ALLOCATES], check=True, env=env, cwd=REPO, capture_output=True, timeout=300)
    records = [json.loads(line) for log in peaks.glob("[0-9]*.jsonl") for line in log.read_text().splitlines()]
    (allocating,) = [r for r in records if "Allocate" in r["transforms"]]
    assert 64 << 10 <= allocating["traced_rise_kb"] < 80 << 10
    assert all(r["traced_rise_kb"] < 32 << 10 for r in records if r is not allocating)
