"""build-shards over an index in slices by groups of lists (the sample corpus): each query is
sent only to the slices owning its probed lists, a process loads one slice per group of
batches, and each batch's hits are merged as one index ranks them; the neighbours are those of
the same index in one file (ties within 1e-6 counted equal)."""

import json
import shutil
import weakref

import numpy as np
import pyarrow as pa
import pytest

import pipeline.index.build_slices as build_slices
import pipeline.index.slices as index_slices
import pipeline.retrieve.depth as retrieve_depth
import pipeline.retrieve.search_beam as search_beam
from pipeline.build_shards.job import build_shards
from pipeline.check.validate import validate_path
from pipeline.index.build_slices import merged_pieces
from pipeline.retrieve.online import Retriever
from pipeline.retrieve.search import LOST_DATA
from pipeline.run import run_all
from schemas.arrow import read_shard_table
from schemas.config import config_from_dict
from tests.helpers import sample_documents, shard_rows, small_config, tie_tolerance, write_jsonl

pytestmark = pytest.mark.e2e


def neighbours_of(out):
    """(neighbour ids, their scores), one row per sequence, over every shard."""
    tables = [read_shard_table(pa.memory_map(str(p))) for p in sorted((out / "shards").glob("*.arrow"))]
    return tuple(
        np.concatenate([np.stack(t[column].to_numpy(zero_copy_only=False)).reshape(len(t), -1) for t in tables])
        for column in ("neighbour_ids", "neighbour_scores")
    )


@pytest.fixture(scope="module")
def sliced(tmp_path_factory):
    """An output built with its index in one file, then rebuilt with it in slices (only index.*
    changes: the chunks and embeddings are kept), each slice from pieces of one file's blocks:
    (root, config, the one-file neighbours, the second run's report). PIECES: each slice's
    pieces."""
    root = tmp_path_factory.mktemp("sliced")
    write_jsonl(root / "corpus" / "a.jsonl", sample_documents(24))
    index = {"type": "IVF8,Flat", "nprobe": 2}
    config = small_config(root / "out", str(root / "corpus" / "*.jsonl"), index=index)
    run_all(config_from_dict(config), [])
    one = neighbours_of(root / "out")
    config["index"] = {**index, "slice_bytes": "400KB"}

    def merged(trained_path, pieces):
        PIECES.append(len(pieces))
        return merged_pieces(trained_path, pieces)

    with pytest.MonkeyPatch.context() as patch:  # the in-process runner: its steps see the patches
        patch.setattr(index_slices, "PIECE_BYTES", 1)  # a piece per file
        patch.setattr(build_slices, "merged_pieces", merged)
        report = run_all(config_from_dict(config), [])
    return root, config, one, report


PIECES: list[int] = []


def test_build_shards_over_a_sliced_index_finds_the_neighbours_of_one_index(sliced):
    root, _, one, report = sliced
    assert [status for status, _ in report.values()] == ["built", "built"]
    manifest = json.loads((root / "out" / "index" / "manifest.json").read_text())
    slices = [f for f in manifest["files"] if f["path"].startswith("faiss/slice-")]
    assert len(slices) >= 3 and all(f["bytes"] <= 400_000 for f in slices)
    assert len(PIECES) == len(slices) and min(PIECES) >= 2  # each slice merged from its pieces
    routing = {f["path"] for f in manifest["files"] if f["path"].startswith("faiss/")} - {f["path"] for f in slices}
    assert routing == {"faiss/quantizer.faiss", "faiss/list_owners.npy"}
    (ids, scores), (one_ids, one_scores) = neighbours_of(root / "out"), one
    assert ids.shape == one_ids.shape and (ids >= 0).all()
    assert np.mean((ids == one_ids) | (np.abs(scores - one_scores) <= 1e-6)) >= 0.999  # ties counted equal
    assert all(line.startswith("OK") for line in validate_path(str(root / "out")))


def test_build_shards_fails_uncommitted_when_an_index_slices_results_are_lost(sliced, tmp_path, monkeypatch):
    root, config, _, _ = sliced
    shutil.copytree(root / "out" / "index", tmp_path / "out" / "index")
    search = search_beam.SearchRouted.process

    def without_slice_1(self, keyed):  # as if the runner dropped what slice 1 sent
        (index_slice, _), _ = keyed
        if index_slice != 1:
            yield from search(self, keyed)

    # the search step's DoFn is the one place to drop a slice's results from inside the job
    monkeypatch.setattr(search_beam.SearchRouted, "process", without_slice_1)
    with pytest.raises(Exception, match=rf"index slices \[0, 2.*answered.*{LOST_DATA}"):
        build_shards(config_from_dict({**config, "output": str(tmp_path / "out")}), [])
    assert not (tmp_path / "out" / "shards" / "manifest.json").exists()


def test_the_retriever_searches_the_slices_one_at_a_time_and_finds_the_one_index_neighbours(sliced, monkeypatch):
    root, config, (one_ids, one_scores), _ = sliced
    retriever = Retriever.open(str(root / "out" / "index"))
    assert retriever.routing is not None and retriever.routing.slices >= 3
    loaded, held, most_held = [], set(), []
    load_index = retrieve_depth.load_index

    def load_and_count(path, depth=None, *, sha256):  # the real load, counted, and each slice watched until freed
        index = load_index(path, depth, sha256=sha256)
        if "/slice-" in path:
            loaded.append(path)
            held.add(len(loaded))
            weakref.finalize(index, held.discard, len(loaded))
            most_held.append(len(held))
        return index

    monkeypatch.setattr(retrieve_depth, "load_index", load_and_count)
    n = config["sequence_tokens"]
    rows = list(shard_rows(root / "out" / "shards"))
    found = [retriever.retrieve(tokens[:n], exclude_documents=doc_ids) for tokens, doc_ids, *_ in rows]
    ids = np.stack([f.ids.ravel() for f in found])
    scores = np.stack([f.scores.ravel() for f in found])
    assert len(set(loaded)) >= 2 and max(most_held) == 1  # several slices searched, never two held at once
    assert ids.shape == one_ids.shape and (ids >= 0).all()
    manifest = json.loads((root / "out" / "index" / "manifest.json").read_text())
    tie = tie_tolerance(manifest["embedding_precision"]["precision"])  # its queries are embedded afresh
    assert np.mean((ids == one_ids) | (np.abs(scores - one_scores) <= tie)) >= 0.999  # ties counted equal
