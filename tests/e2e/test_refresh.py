"""build-shards over an index that changed since the shards were built refreshes them from what
changed: a delete rewrites only the shards that held a deleted document's sequence or a
neighbour from one, and keeps the others' files; an append plus deletes gives the shards a full
build gives (Flat index), a replaced document included; two refreshes in turn give what one
over both changes gives; a sliced IVF index searches again only the chunks that lost a
neighbour."""

import logging
import shutil

import numpy as np
import pyarrow as pa
import pytest

from pipeline.build_index.job import build_index
from pipeline.build_shards.job import build_shards
from pipeline.check.validate import validate_path
from pipeline.chunks.chunk_files import ChunkFileRanges
from pipeline.chunks.deleted import read_deleted
from pipeline.common.fileio import committed
from pipeline.common.names import file_number
from pipeline.corpus.records import doc_id_for
from pipeline.run import run_all
from schemas.arrow import read_shard_table, shard_column
from schemas.config import config_from_dict
from schemas.manifest import IndexManifest, ShardsManifest, unversioned
from tests.helpers import sample_documents, sliced_corpus_config, small_config, write_jsonl

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

COLUMNS = ("seq_id", "tokens", "neighbour_ids", "neighbour_scores", "neighbours", "doc_ids")


def _shards(out) -> dict[str, dict]:
    """{shard path: its columns}, from the committed manifest."""
    manifest = committed(str(out / "shards"), ShardsManifest)
    assert manifest is not None
    found = {}
    for entry in manifest.shards:
        table = read_shard_table(pa.memory_map(str(out / "shards" / entry.path)))
        found[entry.path] = {c: shard_column(table, c) if c != "doc_ids" else table[c].to_pylist() for c in COLUMNS}
    return found


def _rows(out) -> dict[str, np.ndarray]:
    """Every shard's array columns, concatenated in seq id order."""
    shards = sorted(_shards(out).values(), key=lambda s: s["seq_id"][0])
    return {c: np.concatenate([s[c] for s in shards]) for c in COLUMNS[:-1]}


def _config(tmp_path, out, **overrides):
    return config_from_dict(
        small_config(out, str(tmp_path / "corpus" / "*.jsonl"), index={"type": "Flat"}, shard_rows=4, **overrides)
    )


def _most_retrieved(out, ids: np.ndarray, docs: list[dict], count: int) -> list[str]:
    """The identities of the `count` documents whose chunks are most often among `ids`."""
    base = committed(str(out / "index"), IndexManifest)
    ranges = ChunkFileRanges.from_entries(str(out / "index"), base.files)
    doc_of = np.concatenate([ranges.read(n, ["doc_id"])["doc_id"] for n in range(ranges.num_files)])
    retrieved, counts = np.unique(doc_of[ids[ids >= 0]], return_counts=True)
    identity = {doc_id_for(d["id"]): d["id"] for d in docs}
    return [identity[int(d)] for d in retrieved[np.argsort(-counts, kind="stable")[:count]]]


def _same_neighbours(refreshed: dict, full: dict) -> None:
    """The refresh's rows are the full build's, slot by slot: an exact index scores ties alike
    in any search call, and the chunk id decides among them."""
    for column in ("seq_id", "tokens", "neighbour_ids", "neighbour_scores", "neighbours"):
        assert np.array_equal(refreshed[column], full[column]), column


def test_a_delete_rewrites_only_the_shards_it_touches_and_equals_a_full_build(tmp_path, caplog):
    docs = sample_documents(40)
    write_jsonl(tmp_path / "corpus" / "a.jsonl", docs)
    out = tmp_path / "out"
    cfg = _config(tmp_path, out)
    run_all(cfg, [])
    before = _shards(out)
    chosen = _most_retrieved(out, np.concatenate([s["neighbour_ids"].ravel() for s in before.values()]), docs, 3)
    build_index(cfg, [], delete=tuple(chosen))
    deleted = read_deleted([str(p) for p in sorted((out / "index" / "deleted").glob("*.parquet"))])
    L = cfg.chunks_per_sequence
    touched = {
        path
        for path, s in before.items()
        if deleted.contains(s["neighbour_ids"].ravel()).any()
        or any(set(d) & set(deleted.doc_ids.tolist()) for d in s["doc_ids"])
        or deleted.contains((s["seq_id"][:, None] * L + np.arange(L + 1)).ravel()).any()
    }
    assert 0 < len(touched) < len(before)  # the test means something: some shards change, some not

    reference = tmp_path / "reference"
    shutil.copytree(out, reference)
    with caplog.at_level(logging.INFO, logger="ratrain"):
        refreshed = build_shards(cfg, [])
    assert "the shards are refreshed from what changed" in caplog.text
    (record,) = refreshed.refreshes
    assert (record.from_generation, record.to_generation) == (0, 1)
    rewritten = {n for first, last in record.rewritten for n in range(first, last + 1)}
    assert rewritten <= {file_number(unversioned(p)) for p in touched}
    after = {e.path: e for e in refreshed.shards}
    stored = {e.path: e for e in committed(str(reference / "shards"), ShardsManifest).shards}
    kept = {p for p in stored if p in after and after[p].sha256 == stored[p].sha256}
    assert record.kept == len(kept) and kept == set(stored) - touched  # every untouched shard kept its file
    assert rewritten == {file_number(unversioned(p)) for p in after if p not in kept}
    for path in kept:
        assert (out / "shards" / path).read_bytes() == (reference / "shards" / path).read_bytes()
    assert refreshed.counters["sequences_dropped"] > 0 and refreshed.counters["sequences_searched_again"] > 0

    full = build_shards(config_from_dict({**cfg.model_dump(), "output": str(reference)}), [], full=True)
    assert full.refreshes == []
    _same_neighbours(_rows(out), _rows(reference))
    assert refreshed.num_sequences == full.num_sequences and refreshed.overlap == full.overlap
    assert refreshed.neighbour_recall.value >= full.neighbour_recall.value
    assert all(line.startswith("OK") for line in validate_path(str(out)))


def test_an_append_and_a_delete_refresh_to_a_full_build_and_two_refreshes_equal_one(tmp_path):
    docs = sample_documents(32)
    write_jsonl(tmp_path / "corpus" / "a.jsonl", docs[:24])
    out = tmp_path / "out"
    cfg = _config(tmp_path, out)
    run_all(cfg, [])
    both = tmp_path / "both"
    shutil.copytree(out, both)

    # an append: 8 new documents, and the first one again with other text, which replaces it (its
    # old chunks deleted, its id's new ones appended: a search must exclude the new ones alone);
    # and two verbatim copies under new ids, whose chunks tie with the stored ones exactly
    replaced = {"id": docs[0]["id"], "text": " ".join(reversed(docs[0]["text"].split()))}
    copies = [{"id": f"copy of {d['id']}", "text": d["text"]} for d in docs[5:7]]
    write_jsonl(tmp_path / "corpus" / "b.jsonl", [*docs[24:], replaced, *copies])
    build_index(cfg, [])
    once = build_shards(cfg, [])
    assert once.refreshes[-1].to_generation == 1 and once.counters["sequences_new"] > 0
    assert committed(str(out / "index"), IndexManifest).deleted_documents == 1  # the one replaced
    delete = (docs[3]["id"], docs[28]["id"])  # an old document and a new one
    build_index(cfg, [], delete=delete)
    twice = build_shards(cfg, [])
    assert [(r.from_generation, r.to_generation) for r in twice.refreshes] == [(0, 1), (1, 2)]

    # the same two changes as one: the index both changes made (the same bytes a build_index of
    # each over `both` writes), under the shards of generation 0
    shutil.rmtree(both / "index")
    shutil.copytree(out / "index", both / "index")
    both_cfg = config_from_dict({**cfg.model_dump(), "output": str(both)})
    over_both = build_shards(both_cfg, [])
    assert [(r.from_generation, r.to_generation) for r in over_both.refreshes] == [(0, 2)]
    two, one = _rows(out), _rows(both)
    for column in ("seq_id", "tokens", "neighbour_ids", "neighbours"):
        assert np.array_equal(two[column], one[column]), column

    full_dir = tmp_path / "full"
    shutil.copytree(both, full_dir)
    build_shards(config_from_dict({**cfg.model_dump(), "output": str(full_dir)}), [], full=True)
    _same_neighbours(one, _rows(full_dir))
    assert all(line.startswith("OK") for line in validate_path(str(both)))


def test_a_refresh_over_an_index_in_slices_searches_only_the_chunks_that_lost_a_neighbour(tmp_path):
    docs = sample_documents(32)
    out = tmp_path / "out"
    config = sliced_corpus_config(tmp_path, docs[:24], shard_rows=4, neighbour_recall_sample=400)
    # workers of 1 GB: the new vectors fit where they would not fit in a 400 KB slice
    cfg = config_from_dict({**config, "index": {**config["index"], "min_ram": "1GB"}})
    run_all(cfg, [])
    before = _shards(out)
    chosen = _most_retrieved(out, np.concatenate([s["neighbour_ids"].ravel() for s in before.values()]), docs, 2)
    write_jsonl(tmp_path / "corpus" / "b.jsonl", docs[24:])
    build_index(cfg, [], delete=tuple(chosen))  # an append and a delete in one generation
    reference = tmp_path / "reference"
    shutil.copytree(out, reference)

    refreshed = build_shards(cfg, [])
    counters = refreshed.counters
    L = cfg.chunks_per_sequence
    # only the chunks that lost a stored neighbour are searched again, not their sequences' others
    assert 0 < counters["chunks_searched_again"] < L * counters["sequences_searched_again"]
    full = build_shards(config_from_dict({**cfg.model_dump(), "output": str(reference)}), [], full=True)
    ours, theirs = _rows(out), _rows(reference)
    assert np.array_equal(ours["seq_id"], theirs["seq_id"]) and np.array_equal(ours["tokens"], theirs["tokens"])
    assert refreshed.neighbour_recall.sample_size == full.neighbour_recall.sample_size
    assert refreshed.neighbour_recall.value >= full.neighbour_recall.value
    deleted = read_deleted([str(p) for p in sorted((out / "index" / "deleted").glob("*.parquet"))])
    assert not deleted.contains(ours["neighbour_ids"].ravel()).any()
    assert all(line.startswith("OK") for line in validate_path(str(out)))
