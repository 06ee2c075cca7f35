"""Appending and deleting: a corpus that gains files gets only them read, chunked, embedded
and added to the committed index as a new generation; what was written stays byte for byte;
an appended document replaces the indexed one of its id; deleted documents' chunks are in no
neighbour and no sequence, and `validate` checks it; build-shards and `validate` work over the
changed index; a changed or removed file, or other settings, mean a build from scratch."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pipeline.build_index.append import change_index
from pipeline.build_index.job import build_index
from pipeline.build_shards.job import build_shards
from pipeline.check.html import write_report
from pipeline.check.problems import ValidationFailed
from pipeline.check.validate import validate_path
from pipeline.chunks.chunk_files import ChunkFileRanges
from pipeline.chunks.deleted import read_deleted
from pipeline.common.errors import StageError
from pipeline.common.fileio import committed
from pipeline.corpus.records import doc_id_for
from pipeline.index.files import read_embeddings, read_index, read_owners
from pipeline.index.routing import list_blocks
from pipeline.index.search import set_search_depth
from pipeline.jobs.reuse import committed_index, corpus_changes, index_action, listed_corpus_files
from pipeline.run import run_all
from schemas.config import config_from_dict
from schemas.manifest import IndexManifest, ShardsManifest, unversioned
from tests.helpers import (
    REPO,
    rewrite_shard,
    sample_documents,
    sliced_corpus_config,
    small_config,
    write_config,
    write_jsonl,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _entries(out):
    manifest = json.loads((out / "index" / "manifest.json").read_text())
    return {e["path"]: e for e in manifest["files"]}


def test_an_append_reads_only_the_new_files_and_keeps_what_was_written(tmp_path):
    first, second = sample_documents(16), sample_documents(8, start=16)
    write_jsonl(tmp_path / "corpus" / "a.jsonl", first)
    out = tmp_path / "out"
    config = small_config(out, str(tmp_path / "corpus" / "*.jsonl"), index={"type": "IVF8,Flat", "nprobe": 2})
    cfg = config_from_dict(config)
    run_all(cfg, [])
    before = _entries(out)
    base = committed(str(out / "index"), IndexManifest)
    assert base is not None and [g.number for g in base.generations] == [0]

    # the new file holds fresh documents and one the index already has
    replacement = {**first[3], "text": sample_documents(1, start=60)[0]["text"]}  # new text, same id
    write_jsonl(tmp_path / "corpus" / "b.jsonl", second + [replacement])
    assert index_action(cfg, base, listed_corpus_files(cfg)) == "append"
    report = run_all(cfg, [])
    assert report["build-index"][0] == "built" and report["build-shards"][0] == "built"
    grown = committed(str(out / "index"), IndexManifest)
    assert grown is not None
    latest = grown.generations[-1]
    assert [g.number for g in grown.generations] == [0, 1]
    assert [f.path for f in latest.inputs] == [str(tmp_path / "corpus" / "b.jsonl")]
    assert latest.first_chunk_id == base.num_chunks and grown.num_chunks == base.num_chunks + latest.num_chunks
    # the repeated document is appended too, and counted once more in the chunk database
    assert latest.num_documents == len(second) + 1 and grown.num_documents == len(first) + len(second) + 1
    assert grown.generations[0].timings == base.timings  # the first generation keeps its job's record
    assert latest.new_vector_recall is not None and 0.0 < latest.new_vector_recall <= 1.0

    after = _entries(out)
    (index_file,) = [p for p in after if unversioned(p) == "faiss/index.faiss"]
    for path, entry in before.items():  # every chunk and embedding file stays as it was
        if not path.startswith("faiss/"):
            assert after[path] == entry
    added = sorted(set(after) - set(before))
    assert added and all(
        p.startswith(("chunks/", "embeddings/", "deleted/", "sources/")) for p in added if p != index_file
    )
    assert index_file == "faiss/index.c000002.faiss"  # written anew, under the commit's number: the first stays whole

    # the repeated document replaces the indexed one: its old chunks are deleted
    assert (latest.deleted_documents, grown.deleted_documents) == (1, 1)
    old_run = read_deleted([str(out / "index" / "deleted" / "deleted-00001.parquet")])
    assert old_run.doc_ids.tolist() == [doc_id_for(first[3]["id"])] and old_run.ends[0] <= base.num_chunks

    # the index holds every chunk once, by its id, and answers as one filled from scratch with
    # the same trained lists would
    index = read_index(str(out / "index" / index_file), sha256=None)
    assert index.ntotal == grown.num_chunks - grown.deleted_chunks
    batches = [b for p in sorted((out / "index" / "embeddings").glob("*.parquet")) for b in read_embeddings(str(p))]
    ids = np.concatenate([b[0] for b in batches])
    vectors = np.concatenate([b[1] for b in batches])
    assert np.array_equal(np.sort(ids), np.arange(grown.num_chunks))
    live = ~old_run.contains(ids)
    refilled = read_index(str(out / "index" / index_file), sha256=None)
    refilled.reset()
    refilled.add_with_ids(vectors[live], ids[live])
    for searched in (index, refilled):
        set_search_depth(searched, grown.nprobe)
    assert np.array_equal(index.search(vectors[::7], 4)[1], refilled.search(vectors[::7], 4)[1])

    # the replaced document's new chunks are what a search finds, its old ones never
    ranges = ChunkFileRanges.from_entries(str(out / "index"), grown.files)
    doc_of = np.concatenate([ranges.read(n, ["doc_id"])["doc_id"] for n in range(ranges.num_files)])
    new_chunks = np.flatnonzero((doc_of == doc_id_for(first[3]["id"])) & ~old_run.contains(np.arange(len(doc_of))))
    assert len(new_chunks) and new_chunks.min() >= latest.first_chunk_id
    order = np.argsort(ids)
    _, found = index.search(vectors[order][new_chunks], 1)
    assert np.array_equal(found[:, 0], new_chunks)
    _, found = index.search(vectors[order][old_run.chunk_ids()], 10)
    assert not old_run.contains(found[found >= 0]).any()

    # chunk ids dense across generations, shards checked against the grown index
    assert [line.split()[:2] for line in validate_path(str(out))] == [["OK", "index"], ["OK", "shards"]]
    assert index_action(cfg, grown, listed_corpus_files(cfg)) == "reuse"
    assert committed(str(out / "shards"), ShardsManifest).index_generation == 1
    assert not old_run.contains(_neighbour_ids(out)).any()


def _shard_column(out, column: str) -> np.ndarray:
    import pyarrow as pa

    from schemas.arrow import read_shard_table, shard_column

    tables = [read_shard_table(pa.memory_map(str(p))) for p in sorted((out / "shards").glob("shard-*.arrow"))]
    return np.concatenate([shard_column(t, column) if column != "seq_id" else t[column].to_numpy() for t in tables])


def _neighbour_ids(out) -> np.ndarray:
    ids = _shard_column(out, "neighbour_ids").ravel()
    return ids[ids >= 0]


def test_deleted_documents_are_in_no_neighbour_and_no_sequence(tmp_path, caplog):
    docs = sample_documents(20)
    write_jsonl(tmp_path / "corpus" / "a.jsonl", docs)
    out = tmp_path / "out"
    cfg = config_from_dict(small_config(out, str(tmp_path / "corpus" / "*.jsonl"), index={"type": "Flat"}))
    run_all(cfg, [])
    before = _neighbour_ids(out)
    base = committed(str(out / "index"), IndexManifest)
    assert base is not None
    # the documents most often retrieved, so the delete changes neighbours
    ranges = ChunkFileRanges.from_entries(str(out / "index"), base.files)
    doc_of = np.concatenate([ranges.read(n, ["doc_id"])["doc_id"] for n in range(ranges.num_files)])
    retrieved, counts = np.unique(doc_of[before], return_counts=True)
    identity = {doc_id_for(d["id"]): d["id"] for d in docs}
    chosen = [identity[int(d)] for d in retrieved[np.argsort(-counts, kind="stable")[:3]]] + ["not-in-the-index"]
    build_index(cfg, [], delete=tuple(chosen))
    changed = committed(str(out / "index"), IndexManifest)
    assert changed is not None and changed.deleted_documents == 3 and changed.counters["delete_ids_not_found"] == 1
    deleted = read_deleted([str(p) for p in sorted((out / "index" / "deleted").glob("*.parquet"))])
    assert sorted(deleted.doc_ids.tolist()) == sorted(doc_id_for(i) for i in chosen[:3])
    assert deleted.contains(before).any()  # they were neighbours before

    with caplog.at_level(logging.INFO, logger="ratrain"):
        run_all(cfg, [])  # build-shards again: the index changed
    said = "generation 0 of the index, which has changed since (generation 1: 0 chunks added, 3 documents deleted)"
    assert said in caplog.text
    assert not deleted.contains(_neighbour_ids(out)).any()
    seq_ids = _shard_column(out, "seq_id")
    L = cfg.chunks_per_sequence
    assert not deleted.contains((seq_ids[:, None] * L + np.arange(L)).ravel()).any()
    assert all(line.startswith("OK") for line in validate_path(str(out)))
    page = Path(write_report(str(out))).read_text()  # the report lists the generations
    assert "Index generations" in page and "3 (" in page

    # validate notices a deleted chunk put back as a neighbour
    def put_back(columns):
        columns["neighbour_ids"][0, 0, 0] = deleted.starts[0]

    # a rebuild would read the deleted documents again from the corpus files: refused, unless forced
    with pytest.raises(StageError, match="bring back the 3 documents deleted"):
        build_index(
            config_from_dict(small_config(out, str(tmp_path / "corpus" / "*.jsonl"), index={"type": "IVF4,Flat"})), []
        )
    assert build_index(cfg, []) == changed  # nothing changed: nothing to build

    rewrite_shard(out / "shards", put_back)
    with pytest.raises(ValidationFailed, match="deleted from the index"):
        validate_path(str(out))


def test_a_changed_or_gone_file_has_its_documents_replaced_or_deleted(tmp_path):
    docs = sample_documents(24)
    write_jsonl(tmp_path / "corpus" / "a.jsonl", docs[:12])
    write_jsonl(tmp_path / "corpus" / "b.jsonl", docs[12:])
    out = tmp_path / "out"
    config = small_config(out, str(tmp_path / "corpus" / "*.jsonl"), index={"type": "Flat"})
    cfg = config_from_dict(config)
    run_all(cfg, [])
    base = committed(str(out / "index"), IndexManifest)
    assert base is not None
    other_chunks = config_from_dict({**config, "chunk_tokens": 16})  # other settings: from scratch
    write_jsonl(tmp_path / "corpus" / "c.jsonl", sample_documents(4, start=24))
    assert index_action(other_chunks, base, listed_corpus_files(other_chunks)) == "build"
    (tmp_path / "corpus" / "c.jsonl").unlink()

    # a.jsonl: one document dropped, one rewritten, the rest as they were; b.jsonl gone
    rewritten = {**docs[1], "text": sample_documents(1, start=60)[0]["text"]}
    write_jsonl(tmp_path / "corpus" / "a.jsonl", [docs[0], rewritten] + docs[3:12])
    (tmp_path / "corpus" / "b.jsonl").unlink()
    changes = corpus_changes(base, listed_corpus_files(cfg))
    assert [f.path for f in changes.changed] == [str(tmp_path / "corpus" / "a.jsonl")] and not changes.new
    assert changes.gone == [str(tmp_path / "corpus" / "b.jsonl")]
    assert index_action(cfg, base, listed_corpus_files(cfg)) == "append"
    run_all(cfg, [])
    changed = committed(str(out / "index"), IndexManifest)
    assert changed is not None
    latest = changed.generations[-1]
    assert latest.removed_inputs == [str(tmp_path / "corpus" / "b.jsonl")]
    deleted = read_deleted([str(p) for p in sorted((out / "index" / "deleted").glob("*.parquet"))])
    # every document of the two files was deleted: a.jsonl's 11 read again replace theirs
    assert sorted(deleted.doc_ids.tolist()) == sorted(doc_id_for(d["id"]) for d in docs)
    assert latest.num_documents == 11 and changed.num_documents - changed.deleted_documents == 11
    assert all(line.startswith("OK") for line in validate_path(str(out)))
    assert index_action(cfg, changed, listed_corpus_files(cfg)) == "reuse"


def test_of_two_changes_built_on_one_manifest_the_second_commits_nothing(tmp_path):
    write_jsonl(tmp_path / "corpus" / "a.jsonl", sample_documents(12))
    out = tmp_path / "out"
    cfg = config_from_dict(small_config(out, str(tmp_path / "corpus" / "*.jsonl"), index={"type": "Flat"}))
    build_index(cfg, [])
    base, base_sha = committed_index(str(out / "index"))  # what a second change starts from
    assert base is not None and base_sha is not None

    write_jsonl(tmp_path / "corpus" / "b.jsonl", sample_documents(6, start=12))
    first = build_index(cfg, [])  # the first change commits
    assert isinstance(first, IndexManifest) and len(first.generations) == 2
    write_jsonl(tmp_path / "corpus" / "c.jsonl", sample_documents(6, start=18))
    changes = corpus_changes(base, listed_corpus_files(cfg))
    # refused at the commit, or already where it reads the index the first change replaced
    with pytest.raises(
        (StageError, ValueError), match="no longer kept|changed while this job ran|a run committed over it: run again"
    ):
        change_index(cfg, base, previous_sha256=base_sha, changes=changes, beam_args=[])
    assert committed(str(out / "index"), IndexManifest) == first  # the first change stands, whole
    assert all(line.startswith("OK") for line in validate_path(str(out / "index")))
    assert not (out / ".staging").exists()


def _change_in_another_process(config_path: Path) -> subprocess.CompletedProcess:
    """What a second user does meanwhile: `build-index` over the grown corpus."""
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "build-index", "--config", str(config_path)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def _built_with_a_change_to_come(tmp_path):
    write_jsonl(tmp_path / "corpus" / "a.jsonl", sample_documents(16))
    out = tmp_path / "out"
    config = small_config(out, str(tmp_path / "corpus" / "*.jsonl"), index={"type": "IVF4,Flat", "nprobe": 2})
    config_path = write_config(tmp_path / "config.yaml", config)
    cfg = config_from_dict(config)
    build_index(cfg, [])
    write_jsonl(tmp_path / "corpus" / "b.jsonl", sample_documents(8, start=16))  # the change to come
    return out, config_path, cfg


def test_a_change_committed_after_build_shards_read_the_index_fails_it_and_leaves_no_mixed_shards(
    tmp_path, monkeypatch
):
    """build-shards reads the index manifest before its job takes the output's lease: a change
    committed then (generation 1) fails the job where it next reads the index (its commit no
    longer kept) or at its commit, not mixing generations."""
    out, config_path, cfg = _built_with_a_change_to_come(tmp_path)
    import pipeline.build_shards.job as shards_module

    original = shards_module.load_committed_index

    def with_a_change(*args, **kwargs):
        result = original(*args, **kwargs)  # generation 0's manifest read
        done = _change_in_another_process(config_path)
        assert done.returncode == 0, done.stderr[-2000:]
        return result

    monkeypatch.setattr(shards_module, "load_committed_index", with_a_change)
    with pytest.raises(Exception, match="no longer kept|changed while"):
        build_shards(cfg, [])
    assert committed(str(out / "shards"), ShardsManifest) is None  # nothing of it committed
    assert not (out / ".staging").exists() or not any((out / ".staging").iterdir())
    assert len(committed(str(out / "index"), IndexManifest).generations) == 2  # type: ignore[union-attr]  # the change stands

    monkeypatch.undo()  # run again, it builds on the change
    shards = build_shards(cfg, [])
    assert isinstance(shards, ShardsManifest) and shards.index_generation == 1
    assert all(line.startswith("OK") for line in validate_path(str(out)))


def test_a_change_tried_while_build_shards_runs_is_refused_by_its_lease(tmp_path, monkeypatch):
    """Once its job runs, build-shards holds the output's lease: a change tried before its
    commit fails at once, naming it, and build-shards commits over generation 0."""
    out, config_path, cfg = _built_with_a_change_to_come(tmp_path)
    import pipeline.jobs.job as job_module

    original = job_module.commit_stage

    def with_a_change_tried(*args, **kwargs):  # the commit step runs a pickled copy: it asserts here
        done = _change_in_another_process(config_path)
        assert done.returncode != 0 and "is being written by build-shards" in done.stderr, done.stderr[-2000:]
        return original(*args, **kwargs)

    monkeypatch.setattr(job_module, "commit_stage", with_a_change_tried)
    shards = build_shards(cfg, [])
    assert isinstance(shards, ShardsManifest) and shards.index_generation == 0
    assert len(committed(str(out / "index"), IndexManifest).generations) == 1  # type: ignore[union-attr]
    assert all(line.startswith("OK") for line in validate_path(str(out)))


def test_an_index_in_slices_takes_appended_and_deleted_documents_slice_by_slice(tmp_path):
    docs = sample_documents(32)
    out = tmp_path / "out"
    cfg = config_from_dict(sliced_corpus_config(tmp_path, docs[:24]))
    run_all(cfg, [])
    base = committed(str(out / "index"), IndexManifest)
    assert base is not None and sum(e.path.startswith("faiss/slice-") for e in base.files) >= 3

    write_jsonl(tmp_path / "corpus" / "b.jsonl", docs[24:])
    grown = build_index(cfg, [], delete=(docs[0]["id"],))  # an append and a delete in one generation
    assert isinstance(grown, IndexManifest) and [g.number for g in grown.generations] == [0, 1]
    assert grown.deleted_documents == 1 and grown.generations[1].new_vector_recall is not None
    # by name: a slice written anew takes the commit's number in its file name
    before, after = ({unversioned(e.path): e for e in m.files if e.path.startswith("faiss/")} for m in (base, grown))
    assert after["faiss/quantizer.faiss"] == before["faiss/quantizer.faiss"]  # the trained lists stay
    # a third more vectors: slices outgrow 400 KB and are cut, the new ones numbered after the last
    assert set(after) > set(before) and all(e.bytes <= 400_000 for e in after.values())

    # each slice holds in each of its lists what one index refilled from scratch with the same
    # trained lists holds there, deleted chunks left out, in chunk-id order
    stored = {name: out / "index" / entry.path for name, entry in after.items()}
    owner = read_owners(str(stored["faiss/list_owners.npy"]))
    reference = read_index(str(stored["faiss/quantizer.faiss"]), sha256=None)
    deleted = read_deleted([str(p) for p in sorted((out / "index" / "deleted").glob("*.parquet"))])
    for path in sorted((out / "index" / "embeddings").glob("*.parquet")):
        for ids, vectors in read_embeddings(str(path)):
            kept = ~deleted.contains(ids)
            reference.add_with_ids(vectors[kept], ids[kept])
    expected = {block.index_slice: block for block in list_blocks(reference, owner)}
    for number in range(int(owner.max()) + 1):
        held = list_blocks(read_index(str(stored[f"faiss/slice-{number:05d}.faiss"]), sha256=None), owner)
        assert len(held) == 1 and held[0].index_slice == number
        for field in ("lists", "sizes", "ids"):
            assert np.array_equal(getattr(held[0], field), getattr(expected[number], field))

    run_all(cfg, [])  # build-shards over the changed slices
    assert not deleted.contains(_neighbour_ids(out)).any()
    assert all(line.startswith("OK") for line in validate_path(str(out)))


def test_commits_kept_by_keep_commits_are_readable_until_gc_deletes_them(tmp_path, capsys):
    from pipeline.cli import main

    write_jsonl(tmp_path / "corpus" / "a.jsonl", sample_documents(8))
    out = tmp_path / "out"
    cfg = config_from_dict(small_config(out, str(tmp_path / "corpus" / "*.jsonl"), keep_commits=2))
    build_index(cfg, [])
    write_jsonl(tmp_path / "corpus" / "b.jsonl", sample_documents(4, start=8))
    build_index(cfg, [])  # an append: commit 2, and commit 1 kept whole beside it
    index = out / "index"
    assert sorted(p.name for p in index.glob("manifest-*.json")) == ["manifest-000001.json", "manifest-000002.json"]
    assert (index / "faiss" / "index.faiss").exists() and (index / "faiss" / "index.c000002.faiss").exists()
    orphan = index / "chunks" / "chunks-00099.parquet"  # moved into place by a commit that died before its put
    orphan.write_bytes(b"PAR1")
    mine = [index / "notes.txt", index / "chunks" / ".partial.parquet", out / "rejected" / "kept.jsonl"]
    for path in mine:  # of no kind a commit writes, or not in the index: no orphans
        path.parent.mkdir(exist_ok=True)
        path.write_text("mine")
    main(["gc", str(out), "--keep", "1"])
    assert f"{index}: 1 commit kept; 1 file listed by no commit" in capsys.readouterr().out
    assert sorted(p.name for p in index.glob("manifest-*.json")) == ["manifest-000002.json"]
    assert not (index / "faiss" / "index.faiss").exists()  # only commit 1 listed it
    assert orphan.exists()  # counted, kept until asked
    main(["gc", str(out), "--orphans"])
    assert f"{index}: 1 commit kept; 1 file listed by no commit deleted" in capsys.readouterr().out
    assert not orphan.exists() and all(path.read_text() == "mine" for path in mine)
    assert all(line.startswith("OK") for line in validate_path(str(index)))
    assert not (out / ".lease.json").exists()
