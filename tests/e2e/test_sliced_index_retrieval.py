"""build-shards over an index split into slices: each search batch goes to every slice, a
process loads one slice per group of batches, and each batch's hits from all slices are merged
by score; the neighbours are those of the same index in one file."""

import json

import numpy as np
import pyarrow as pa
import pytest

from pipeline.check.validate import validate_path
from pipeline.jobs.run import run_all
from schemas.arrow import read_shard_table
from schemas.config import config_from_dict
from tests.helpers import sample_documents, small_config, write_jsonl

pytestmark = pytest.mark.e2e


def neighbour_ids(out):
    tables = [read_shard_table(pa.memory_map(str(p))) for p in sorted((out / "shards").glob("*.arrow"))]
    return np.concatenate(
        [np.stack(t["neighbour_ids"].to_numpy(zero_copy_only=False)).reshape(len(t), -1) for t in tables]
    )


def test_build_shards_over_a_sliced_index_finds_the_neighbours_of_one_index(tmp_path):
    write_jsonl(tmp_path / "corpus" / "a.jsonl", sample_documents(24))
    index = {"type": "IVF8,Flat", "nprobe": 2}
    config = small_config(tmp_path / "out", str(tmp_path / "corpus" / "*.jsonl"), index=index)
    run_all(config_from_dict(config), [])
    one = neighbour_ids(tmp_path / "out")

    # only index.* changes: the chunks and embeddings are kept, the index is rebuilt in slices
    config["index"] = {**index, "slice_bytes": "400KB"}
    report = run_all(config_from_dict(config), [])
    assert [status for status, _ in report.values()] == ["built", "built"]
    manifest = json.loads((tmp_path / "out" / "index" / "manifest.json").read_text())
    slices = [f for f in manifest["files"] if f["path"].startswith("faiss/")]
    assert len(slices) >= 3 and all(f["path"].startswith("faiss/slice-") and f["bytes"] <= 400_000 for f in slices)
    sliced = neighbour_ids(tmp_path / "out")
    assert sliced.shape == one.shape and (sliced >= 0).all()
    assert np.mean(sliced == one) >= 0.995
    assert all(line.startswith("OK") for line in validate_path(str(tmp_path / "out")))
