"""The whole path on real text: run -> committed index and shards -> docs/design.md §5 invariants."""

import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.build_shards.job import build_shards
from pipeline.check.problems import ValidationFailed
from pipeline.check.validate import validate_index, validate_path, validate_shards
from pipeline.cli import main
from pipeline.common.fileio import sha256_bytes
from pipeline.common.writers import parquet_bytes
from pipeline.jobs import job, options
from pipeline.run import run_all
from schemas.arrow import fixed_size_list, read_shard_table, shard_column, tensor_column_to_numpy
from schemas.config import config_from_dict
from schemas.manifest import ShardsManifest
from tests.helpers import (
    BAD_REASONS,
    current_manifest,
    is_manifest,
    read_rejected,
    rewrite_manifest,
    rewrite_shard,
    sample_documents,
    suite_precision,
    write_jsonl,
)

pytestmark = pytest.mark.e2e


def _shard_tables(shards_dir):
    manifest = ShardsManifest.model_validate_json((shards_dir / "manifest.json").read_text())
    for entry in manifest.shards:
        yield entry, read_shard_table(pa.memory_map(str(shards_dir / entry.path)))


class _ChunkDatabase:
    """The whole chunk database in memory, by chunk id (small test corpora only)."""

    def __init__(self, out):
        table = pa.concat_tables([pq.read_table(p) for p in sorted((out / "index" / "chunks").glob("*.parquet"))])
        order = np.argsort(table["chunk_id"].to_numpy())
        self.docs = table["doc_id"].to_numpy()[order]
        self.tokens = shard_column(table, "tokens")[order]
        self.continuations = tensor_column_to_numpy(table["continuation"])[order]

    def values(self, ids):
        return np.concatenate([self.tokens[ids], self.continuations[ids]], axis=-1)


def _chunk_db(out):
    return _ChunkDatabase(out)


def test_run_commits_both_stages_and_validate_passes(built_output):
    root, config, report = built_output
    out = root / "out"
    assert [status for status, _ in report.values()] == ["built", "built"]
    index = json.loads((out / "index" / "manifest.json").read_text())
    shards = json.loads((out / "shards" / "manifest.json").read_text())
    assert index["num_documents"] == 16 and index["dim"] == 384 and index["index_factory"] == "Flat"
    assert index["recall_at_k"]["value"] == 1.0 and index["recall_at_k"]["sample_size"] > 0
    assert shards["neighbour_tokens"] == 64 and shards["num_sequences"] > 10
    assert len(shards["shards"]) > 1 and not (out / ".staging").exists()
    lines = validate_path(str(out))
    assert len(lines) == 2 and all(line.startswith("OK") for line in lines)


def test_every_input_record_is_in_the_index_or_rejected(built_output):
    root, _, _ = built_output
    out = root / "out"
    rejected = read_rejected(out, "build-index")
    assert sorted(r["reason"] for r in rejected) == sorted(BAD_REASONS)
    assert all(r["source"].endswith("b.jsonl") and r["position"] > 0 for r in rejected)
    index = json.loads((out / "index" / "manifest.json").read_text())
    records = sum(len(p.read_text().splitlines()) for p in (root / "corpus").glob("*.jsonl"))
    assert index["num_documents"] + len(rejected) == records
    assert index["counters"]["rejected_duplicate_id"] == 1


def test_neighbours_are_real_chunks_from_other_documents(built_output):
    root, config, _ = built_output
    out = root / "out"
    db = _chunk_db(out)
    L = config["sequence_tokens"] // config["chunk_tokens"]
    checked = absent = 0
    for _, table in _shard_tables(out / "shards"):
        ids = shard_column(table, "neighbour_ids")
        neighbours = shard_column(table, "neighbours")
        tokens = shard_column(table, "tokens")
        for row, (seq_id, doc_ids) in enumerate(zip(table["seq_id"].to_pylist(), table["doc_ids"].to_pylist())):
            own_chunks = np.arange(seq_id * L, seq_id * L + L)
            assert set(db.docs[own_chunks].tolist()) <= set(doc_ids)
            assert tokens[row, :-1].tolist() == db.tokens[own_chunks].reshape(-1).tolist()
            for j in range(L):
                for q in range(config["neighbours"]):
                    nid = ids[row, j, q]
                    if nid < 0:  # every candidate came from the sequence's own documents
                        assert (neighbours[row, j, q] == 0).all()
                        absent += 1
                        continue
                    assert db.docs[nid] not in doc_ids
                    assert neighbours[row, j, q].tolist() == db.values(np.array([nid]))[0].tolist()
                    checked += 1
    assert checked > 100 and absent <= 0.05 * (checked + absent)


def test_rerun_skips_committed_stages_and_leaves_files_untouched(built_output):
    root, config, _ = built_output
    out = root / "out"
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.rglob("*") if p.is_file()}
    report = run_all(config_from_dict(config), [])
    assert [status for status, _ in report.values()] == ["skipped", "skipped"]
    after = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.rglob("*") if p.is_file()}
    assert before == after


def test_shards_do_not_depend_on_the_output_location(built_output, tmp_path):
    root, config, _ = built_output
    shutil.copytree(root / "out" / "index", tmp_path / "index")
    build_shards(config_from_dict({**config, "output": str(tmp_path)}), [])
    for entry, _ in _shard_tables(root / "out" / "shards"):
        assert (tmp_path / "shards" / entry.path).read_bytes() == (root / "out" / "shards" / entry.path).read_bytes()


@pytest.fixture
def tampered(built_output, tmp_path):
    root, _, _ = built_output
    shutil.copytree(root / "out", tmp_path / "out")
    return tmp_path / "out"


def test_validate_catches_wrong_neighbour_tokens(tampered):
    def corrupt(columns):
        columns["neighbours"][0, 0, 0, 0] += 1

    rewrite_shard(tampered / "shards", corrupt)
    with pytest.raises(ValidationFailed, match="neighbour tokens differ"):
        validate_shards(str(tampered / "shards"))


def test_validate_catches_a_same_document_neighbour(tampered):
    db = _chunk_db(tampered)

    def leak(columns):  # make seq 0's first neighbour its own first chunk, tokens and all
        columns["neighbour_ids"][0, 0, 0] = 0
        columns["neighbours"][0, 0, 0] = db.values(np.array([0]))[0]

    rewrite_shard(tampered / "shards", leak)
    with pytest.raises(ValidationFailed, match="own document"):
        validate_shards(str(tampered / "shards"))


def test_validate_catches_a_changed_file(tampered, capsys):
    path = next((tampered / "shards").glob("*.arrow"))
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(SystemExit) as exit_info:
        main(["validate", str(tampered)])
    assert exit_info.value.code == 1 and path.name in capsys.readouterr().err


def test_inspect_prints_decoded_neighbours(built_output, capsys):
    root, _, _ = built_output
    main_args = ["inspect", str(root / "out" / "shards"), "--n", "2", "--chunks", "1"]
    main(main_args)  # returns normally: exit status 0
    out = capsys.readouterr().out
    assert out.count("== sequence") == 2 and out.count("neighbour 0 [chunk") == 2 and "score" in out


def test_separate_training_corpus_never_retrieves_its_own_documents(built_output, tmp_path):
    """Training and retrieval corpora share documents (same id_field values): a shared document
    is never its own neighbour."""
    root, config, _ = built_output
    shutil.copytree(root / "out" / "index", tmp_path / "index")
    shared = sample_documents(4, start=4)  # also in the retrieval corpus
    write_jsonl(tmp_path / "train" / "t.jsonl", shared + sample_documents(3, start=30))
    cfg = config_from_dict(
        {
            **config,
            "output": str(tmp_path),
            "training_corpus": {"paths": [str(tmp_path / "train" / "*.jsonl")], "id_field": "id"},
        }
    )
    manifest = build_shards(cfg, [])
    assert manifest.training_corpus == "separate" and manifest.num_sequences > 0
    from pipeline.corpus.records import doc_id_for

    shared_ids = {doc_id_for(d["id"]) for d in shared}
    db = _chunk_db(tmp_path)
    holding_shared = 0
    for _, table in _shard_tables(tmp_path / "shards"):
        ids = shard_column(table, "neighbour_ids")
        for row, doc_ids in enumerate(table["doc_ids"].to_pylist()):
            present = ids[row][ids[row] >= 0]
            assert not set(db.docs[present].tolist()) & set(doc_ids)
            holding_shared += bool(shared_ids & set(doc_ids))
    assert holding_shared > 0
    assert validate_path(str(tmp_path / "shards"))[0].startswith("OK")


def test_changing_only_the_index_rebuilds_only_the_faiss_index(built_output, tmp_path):
    root, config, _ = built_output
    shutil.copytree(root / "out", tmp_path / "out")
    out = tmp_path / "out"
    kept = {p: p.stat().st_mtime_ns for d in ("chunks", "embeddings") for p in (out / "index" / d).iterdir()}
    cfg = config_from_dict({**config, "output": str(out), "index": {"type": "IVF8,Flat", "target_recall": 0.9}})
    report = run_all(cfg, [])
    assert [status for status, _ in report.values()] == ["built", "built"]  # shards follow the new index
    assert {p: p.stat().st_mtime_ns for p in kept} == kept  # chunks, embeddings reused
    manifest = json.loads((out / "index" / "manifest.json").read_text())
    assert manifest["index_factory"] == "IVF8,Flat" and manifest["recall_at_k"]["value"] >= 0.9
    assert (
        manifest["counters"]["chunks"]
        == json.loads((root / "out" / "index" / "manifest.json").read_text())["counters"]["chunks"]
    )
    assert all(line.startswith("OK") for line in validate_path(str(out)))


def _without_timings(manifest_path):
    manifest = json.loads(manifest_path.read_text())
    manifest.pop("queries_per_second", None)  # a measurement of this run's machine load
    manifest.pop("timings", None)  # this run's wall time
    manifest.pop("index_manifest_sha256", None)  # pins the index manifest, which holds that
    return manifest


def test_two_worker_processes_write_byte_identical_outputs(built_output, tmp_path, monkeypatch):
    root, config, _ = built_output
    assert config["embedding"]["cpu_threads"] == 1  # both runs encode on one thread per process
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # new_pipeline shares the cores
    run_all(
        config_from_dict({**config, "output": str(tmp_path / "out")}),
        ["--direct_num_workers=2", "--direct_running_mode=multi_processing"],
    )

    def timed(name):
        return is_manifest(name)

    def files(out):
        return {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file() and not timed(p.name)}

    assert files(tmp_path / "out") == files(root / "out")
    for path in (root / "out").rglob("*.json"):
        if timed(path.name):
            assert _without_timings(tmp_path / "out" / path.relative_to(root / "out")) == _without_timings(path)


def test_beam_type_inference_changes_no_byte_of_the_shards(built_output, tmp_path, monkeypatch):
    """build-shards over its own chunks builds its graph without Beam's type inference; with
    it Beam picks other coders for some shuffles, and nothing written may change."""
    root, config, _ = built_output
    assert config.get("training_corpus", "same") == "same"  # the case that leaves inference off
    shutil.copytree(root / "out" / "index", tmp_path / "out" / "index")
    asked = []

    def with_inference(args, dry_run, type_check):
        asked.append(type_check)
        return options.new_pipeline(args, dry_run)

    monkeypatch.setattr(job, "new_pipeline", with_inference)
    build_shards(config_from_dict({**config, "output": str(tmp_path / "out")}), [])
    assert asked == [False]  # the job asks for none; this run has it
    shards, ours = root / "out" / "shards", tmp_path / "out" / "shards"
    written = sorted(p.relative_to(shards) for p in shards.rglob("*") if p.is_file())
    assert written == sorted(p.relative_to(ours) for p in ours.rglob("*") if p.is_file())
    for path in written:
        if is_manifest(path.name):
            assert _without_timings(ours / path) == _without_timings(shards / path)
        else:
            assert (ours / path).read_bytes() == (shards / path).read_bytes(), path


BFLOAT16_STEP = 2e-3  # two bfloat16 rounding steps of an embedding's largest components (~0.25)


def test_another_encoder_thread_count_gives_the_same_neighbours(built_output, tmp_path):
    """What the README promises for each precision. Bytes are promised for equal encoder
    threads only (CPU kernels split sums by thread count). In float32 another count moves
    embeddings by float rounding (1e-5) and keeps >= 99.9% of neighbour slots; in bfloat16
    (AMX kernels round intermediate sums to bfloat16 differently per count) embeddings move by
    up to BFLOAT16_STEP and only near-ties swap: a slot that differs holds a neighbour as
    similar as the other run's, within BFLOAT16_STEP."""
    root, config, _ = built_output
    out = tmp_path / "out"
    embedding = {**config["embedding"], "cpu_threads": 2}
    run_all(config_from_dict({**config, "output": str(out), "embedding": embedding}), [])
    one, two = (json.loads((o / "index" / "manifest.json").read_text()) for o in (root / "out", out))
    assert (one["encoder_threads"], two["encoder_threads"]) == (1, 2)
    assert one["embed_config_hash"] == two["embed_config_hash"]  # placement, not content
    precision = one["embedding_precision"]["precision"]
    assert precision == two["embedding_precision"]["precision"]

    def embeddings(o):
        files = sorted((o / "index" / "embeddings").glob("*.parquet"))
        return np.concatenate([tensor_column_to_numpy(pq.read_table(f)["embedding"]) for f in files])

    def neighbours(o, column):
        return np.concatenate([shard_column(t, column).ravel() for _, t in _shard_tables(o / "shards")])

    ids_one, ids_two = neighbours(root / "out", "neighbour_ids"), neighbours(out, "neighbour_ids")
    assert ids_one.shape == ids_two.shape
    if precision == "float32":
        np.testing.assert_allclose(embeddings(out), embeddings(root / "out"), atol=1e-5)
        assert np.mean(ids_one == ids_two) >= 0.999
    else:
        np.testing.assert_allclose(embeddings(out), embeddings(root / "out"), atol=BFLOAT16_STEP)
        moved = ids_one != ids_two
        scores_one, scores_two = neighbours(root / "out", "neighbour_scores"), neighbours(out, "neighbour_scores")
        np.testing.assert_allclose(scores_one[moved], scores_two[moved], atol=BFLOAT16_STEP)
        assert np.mean(~moved) >= 0.95


def test_bfloat16_and_float32_give_the_same_neighbours_and_the_manifest_says_which(built_output, tmp_path):
    from pipeline.embed.encoder import resolve_precision

    root, config, _ = built_output
    built = json.loads((root / "out" / "index" / "manifest.json").read_text())
    assert built["embedding_precision"]["precision"] == resolve_precision(suite_precision(), "cpu")
    other = "float32" if built["embedding_precision"]["precision"] == "bfloat16" else "bfloat16"
    out = tmp_path / "out"
    run_all(
        config_from_dict({**config, "output": str(out), "embedding": {**config["embedding"], "precision": other}}), []
    )
    again = json.loads((out / "index" / "manifest.json").read_text())
    by_precision = {m["embedding_precision"]["precision"]: m for m in (built, again)}
    assert set(by_precision) == {"bfloat16", "float32"}
    assert built["embed_config_hash"] != again["embed_config_hash"]  # the precision is part of it
    check = by_precision["bfloat16"]["embedding_precision"]
    assert check["sample_size"] == min(256, built["num_chunks"])
    assert check["agreement_upper_bound"] >= check["min_agreement"] and check["top2_agreement"] >= 0.95
    assert check["min_cosine"] > 0.99 and by_precision["float32"]["embedding_precision"]["top2_agreement"] == 1.0

    def neighbour_ids(o):
        return np.concatenate([shard_column(t, "neighbour_ids").ravel() for _, t in _shard_tables(o / "shards")])

    assert np.mean(neighbour_ids(root / "out") == neighbour_ids(out)) >= 0.95


def test_shards_manifest_carries_the_overlap_audit(built_output):
    root, config, _ = built_output
    manifest = json.loads((root / "out" / "shards" / "manifest.json").read_text())
    L = config["sequence_tokens"] // config["chunk_tokens"]
    assert list(manifest["overlap"]) == ["0.0", "0.125", "0.25", "0.5", "0.75", "1.0"]
    assert sum(manifest["overlap"].values()) == manifest["num_sequences"] * L
    assert not any(name.startswith("overlap") for name in manifest["counters"])


def test_validate_catches_own_tokens_that_differ_from_the_chunks(tampered):
    def corrupt(columns):
        columns["tokens"][0, 3] += 1

    rewrite_shard(tampered / "shards", corrupt)
    with pytest.raises(ValidationFailed, match="tokens differ from its chunks"):
        validate_shards(str(tampered / "shards"))


def test_validate_catches_a_continuation_across_chunk_files(tampered):
    manifest = json.loads(current_manifest(tampered / "index").read_text())
    entry = next(e for e in manifest["files"] if e["path"] == "chunks/chunks-00000.parquet")
    table = pq.read_table(tampered / "index" / entry["path"])
    continuations = tensor_column_to_numpy(table["continuation"]).copy()
    continuations[-1] += 1  # the last chunk of file 0: its continuation is checked against file 1
    table = table.set_column(
        table.schema.get_field_index("continuation"),
        table.schema.field("continuation"),
        fixed_size_list(continuations, continuations.shape[1]),
    )
    data = parquet_bytes(table)
    (tampered / "index" / entry["path"]).write_bytes(data)
    entry.update(bytes=len(data), sha256=sha256_bytes(data))
    rewrite_manifest(tampered / "index", json.dumps(manifest))
    with pytest.raises(ValidationFailed, match="chunk 199 continuation"):
        validate_index(str(tampered / "index"))


def test_validate_checks_references_in_blocks(built_output, monkeypatch):
    import pipeline.check.validate as validate

    root, _, _ = built_output
    monkeypatch.setattr(validate, "REFERENCE_BLOCK", 7)  # many blocks per chunk file
    assert all(line.startswith("OK") for line in validate.validate_path(str(root / "out")))
