"""Appending: a corpus that gains files gets only them read, chunked, embedded and added to
the committed index as a new generation; what was written stays byte for byte; build-shards and
`validate` work over the grown index; a document the index already holds is refused; a changed
or removed file, or other settings, mean a build from scratch."""

import json

import numpy as np
import pytest

from pipeline.check.validate import validate_path
from pipeline.corpus.records import ALREADY_INDEXED, doc_id_for
from pipeline.index.files import read_embeddings, read_index
from pipeline.index.search import set_search_depth
from pipeline.jobs.reuse import committed, index_action, listed_corpus_files
from pipeline.jobs.run import run_all
from schemas.config import config_from_dict
from schemas.manifest import IndexManifest
from tests.helpers import read_rejected, sample_documents, small_config, write_jsonl

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _entries(out):
    manifest = json.loads((out / "index" / "manifest.json").read_text())
    return {e["path"]: e for e in manifest["files"]}


def test_an_append_reads_only_the_new_files_and_keeps_what_was_written(tmp_path):
    first, second = sample_documents(24), sample_documents(16, start=24)
    write_jsonl(tmp_path / "corpus" / "a.jsonl", first)
    out = tmp_path / "out"
    config = small_config(out, str(tmp_path / "corpus" / "*.jsonl"), index={"type": "IVF8,Flat", "nprobe": 2})
    cfg = config_from_dict(config)
    run_all(cfg, [])
    before = _entries(out)
    base = committed(str(out / "index"), IndexManifest)
    assert base is not None and [g.number for g in base.generations] == [0]

    # the new file holds fresh documents and one the index already has
    write_jsonl(tmp_path / "corpus" / "b.jsonl", second + [first[3]])
    assert index_action(cfg, base, listed_corpus_files(cfg)) == "append"
    report = run_all(cfg, [])
    assert report["build-index"][0] == "built" and report["build-shards"][0] == "built"
    grown = committed(str(out / "index"), IndexManifest)
    assert grown is not None
    latest = grown.generations[-1]
    assert [g.number for g in grown.generations] == [0, 1]
    assert [f.path for f in latest.inputs] == [str(tmp_path / "corpus" / "b.jsonl")]
    assert latest.first_chunk_id == base.num_chunks and grown.num_chunks == base.num_chunks + latest.num_chunks
    assert latest.num_documents == len(second) and grown.num_documents == len(first) + len(second)
    assert grown.generations[0].timings == base.timings  # the first generation keeps its job's record
    assert latest.new_vector_recall is not None and 0.0 < latest.new_vector_recall <= 1.0

    after = _entries(out)
    for path, entry in before.items():  # every chunk and embedding file stays as it was
        if not path.startswith("faiss/"):
            assert after[path] == entry
    added = sorted(set(after) - set(before))
    assert added and all(p.startswith(("chunks/", "embeddings/")) for p in added)

    # the repeated document is refused with its reason, counted, and chunked once
    refused = [r for r in read_rejected(out, "build-index") if r["reason"] == ALREADY_INDEXED]
    assert [r["doc_id"] for r in refused] == [doc_id_for(first[3]["id"])]
    assert grown.counters[f"rejected_{ALREADY_INDEXED}"] == 1

    # the index holds every chunk once, by its id, and answers as one filled from scratch with
    # the same trained lists would
    index = read_index(str(out / "index" / "faiss" / "index.faiss"))
    assert index.ntotal == grown.num_chunks
    batches = [b for p in sorted((out / "index" / "embeddings").glob("*.parquet")) for b in read_embeddings(str(p))]
    ids = np.concatenate([b[0] for b in batches])
    vectors = np.concatenate([b[1] for b in batches])
    assert np.array_equal(np.sort(ids), np.arange(grown.num_chunks))
    refilled = read_index(str(out / "index" / "faiss" / "index.faiss"))
    refilled.reset()
    refilled.add_with_ids(vectors, ids)
    for searched in (index, refilled):
        set_search_depth(searched, grown.nprobe)
    assert np.array_equal(index.search(vectors[::7], 4)[1], refilled.search(vectors[::7], 4)[1])

    # chunk ids dense across generations, shards checked against the grown index
    assert [line.split()[:2] for line in validate_path(str(out))] == [["OK", "index"], ["OK", "shards"]]
    assert index_action(cfg, grown, listed_corpus_files(cfg)) == "reuse"


def test_a_changed_file_or_other_settings_rebuild_instead_of_appending(tmp_path):
    write_jsonl(tmp_path / "corpus" / "a.jsonl", sample_documents(12))
    config = small_config(tmp_path / "out", str(tmp_path / "corpus" / "*.jsonl"), index={"type": "Flat"})
    cfg = config_from_dict(config)
    run_all(cfg, [])
    base = committed(str(tmp_path / "out" / "index"), IndexManifest)
    assert base is not None
    write_jsonl(tmp_path / "corpus" / "b.jsonl", sample_documents(4, start=12))
    assert index_action(cfg, base, listed_corpus_files(cfg)) == "append"
    other_chunks = config_from_dict({**config, "chunk_tokens": 16})
    assert index_action(other_chunks, base, listed_corpus_files(other_chunks)) == "build"
    write_jsonl(tmp_path / "corpus" / "a.jsonl", sample_documents(11))  # a file read before, now shorter
    assert index_action(cfg, base, listed_corpus_files(cfg)) == "build"
