"""`validate --sample` and the validation as a Beam job, on copies of the session's built output."""

import json
import shutil

import apache_beam as beam
import numpy as np
import pytest
from apache_beam.testing.util import assert_that, equal_to

from benchmarks.validate_sample import write_index, write_shards
from pipeline.check.facts import EmbeddingFileUnit
from pipeline.check.plan import plan_validation
from pipeline.check.problems import ValidationFailed
from pipeline.check.rules import check_generations
from pipeline.check.sample import sampled
from pipeline.check.units import units
from pipeline.check.validate import Problems, validate_path
from pipeline.check.validate_beam import ValidateOutput
from pipeline.chunks.chunk_files import ChunkFileRanges
from pipeline.cli import main
from schemas.arrow import tensor_column_to_numpy
from schemas.manifest import FILE_TABLE, FileEntry, Generation, InputFile, ShardEntry
from tests.helpers import local_pipeline, rewrite_shard, rewrite_shards_as_schema_version_1

SAMPLE = 0.2  # 2 of the built output's 6 shards


def _entries(names):
    return [FileEntry(path=f"shards/{name}", rows=1, bytes=1, sha256="") for name in names]


@pytest.mark.unit
def test_the_sample_is_the_same_every_time_and_never_empty():
    entries = _entries(f"shard-{i:05d}.arrow" for i in range(1000))
    chosen = [e.path for e in sampled(entries, 0.01)]
    assert len(chosen) == 10 and chosen == [e.path for e in sampled(entries, 0.01)]
    assert [e.path for e in sampled(entries[::-1], 0.01)] == chosen[::-1]  # by name, not by position
    assert chosen != [e.path for e in entries[:10]]  # spread, not the first ones
    assert len(sampled(entries[:3], 0.001)) == 1
    assert sampled(entries[:3], 1.0) == entries[:3]
    assert len(sampled(entries[:100], 0.07)) == 7


@pytest.mark.unit
def test_problems_keep_the_first_of_each_kind_and_count_all():
    left, right = Problems(), Problems()
    for i in range(15):
        (left if i % 2 else right).add("reference", f"seq {i:02d}: neighbour tokens differ")
    right.add("file", "shard-00001.arrow: sha256 differs from the manifest")
    verdict = left.merge(right).verdict("out", ["OK"])
    assert not verdict.passed
    assert verdict.lines[0] == "FAILED out: 16 problems (1 file, 15 reference)"
    assert verdict.lines[1] == "  file: shard-00001.arrow: sha256 differs from the manifest"
    assert verdict.lines[2:12] == tuple(f"  reference: seq {i:02d}: neighbour tokens differ" for i in range(10))
    assert verdict.lines[12:] == ("  reference: ... and 5 more",)
    assert Problems().verdict("out", ["OK"]).lines == ("OK",)


@pytest.mark.unit
def test_an_output_whose_shard_entries_are_in_a_file_table_validates_and_its_table_is_checked(tmp_path):
    rng = np.random.default_rng(0)
    db = write_index(tmp_path / "index", 12, rng)
    write_shards(tmp_path / "shards", tmp_path / "index", db, 12, rng, inline_entries=4)
    table = tmp_path / "shards" / FILE_TABLE
    assert table.exists()
    lines = validate_path(str(tmp_path))
    assert lines[-1].startswith(f"OK shards {tmp_path / 'shards'}: 12 sequences in 12 shards"), lines
    table.write_bytes(table.read_bytes()[:-1] + b"!")
    with pytest.raises(ValidationFailed, match=f"{table}: sha256 .* differs from the manifest's"):
        validate_path(str(tmp_path))


@pytest.fixture
def output(built_output, tmp_path):
    root, _, _ = built_output
    shutil.copytree(root / "out", tmp_path / "out")
    return tmp_path / "out"


def _shard_names(out, sample):
    return [entry.path for entry in units(plan_validation(str(out), sample), ShardEntry)]


def _wrong_neighbour_tokens(columns):
    columns["neighbours"][0, 0, 0, 0] += 1


@pytest.mark.e2e
def test_a_sample_says_what_it_checked(output, capsys):
    main(["validate", str(output), "--sample", str(SAMPLE)])
    index_line, shards_line = capsys.readouterr().out.splitlines()
    listed = len(json.loads((output / "index" / "manifest.json").read_text())["files"])  # faiss and sources too
    assert (
        "a sample: 1 of 2 chunk files (and the row groups of others that sampled shards reference), "
        f"1 of 2 embedding files, no search of the faiss index; sizes of all {listed} files" in index_line
    )
    assert "a sample: 2 of 6 shards and the chunk rows they reference; sizes of all 6 shards" in shards_line
    main(["validate", str(output), "--sample", str(SAMPLE), "--hash-all"])
    assert f"; sizes and sha256 of all {listed} files" in capsys.readouterr().out
    assert len(_shard_names(output, SAMPLE)) == 2 and _shard_names(output, SAMPLE) == _shard_names(output, SAMPLE)


@pytest.mark.e2e
def test_a_sample_catches_a_corrupt_sampled_shard(output):
    rewrite_shard(output / "shards", _wrong_neighbour_tokens, _shard_names(output, SAMPLE)[0])
    with pytest.raises(ValidationFailed, match="neighbour tokens differ from the chunk database"):
        validate_path(str(output), SAMPLE)


@pytest.mark.e2e
def test_a_sample_reads_only_the_sampled_shards(output):
    """A re-signed corrupt shard outside the sample passes a sampled check; the full check
    finds it."""
    unsampled = next(name for name in _shard_names(output, 1.0) if name not in _shard_names(output, SAMPLE))
    rewrite_shard(output / "shards", _wrong_neighbour_tokens, unsampled)
    assert all(line.startswith("OK") for line in validate_path(str(output), SAMPLE))
    with pytest.raises(ValidationFailed, match="neighbour tokens differ"):
        validate_path(str(output))


@pytest.mark.e2e
def test_an_output_with_schema_version_1_shards_validates_and_its_faults_are_found(output):
    rewrite_shards_as_schema_version_1(output / "shards")
    assert b"arrow.fixed_shape_tensor" in (output / "shards" / "shard-00000.arrow").read_bytes()
    assert all(line.startswith("OK") for line in validate_path(str(output)))
    rewrite_shard(output / "shards", _wrong_neighbour_tokens, version=1)
    with pytest.raises(ValidationFailed, match="neighbour tokens differ from the chunk database"):
        validate_path(str(output))


@pytest.mark.e2e
def test_a_shard_in_another_layout_than_its_manifest_says_fails(output):
    rewrite_shard(output / "shards", lambda columns: None, version=1)
    with pytest.raises(ValidationFailed, match="metadata schema_version=1 disagrees with the manifest"):
        validate_path(str(output))


@pytest.mark.parametrize("damaged", ["unsampled shard", "faiss/index.faiss", "embedding file"])
@pytest.mark.e2e
def test_a_sample_checks_every_files_size_and_with_hash_all_its_sha256(output, damaged, capsys):
    plan = plan_validation(str(output), SAMPLE)
    if damaged == "unsampled shard":
        name = next(name for name in _shard_names(output, 1.0) if name not in _shard_names(output, SAMPLE))
        path = output / "shards" / name
    elif damaged == "embedding file":
        sampled_embeddings = {unit.entry.path for unit in units(plan, EmbeddingFileUnit)}
        path = next(
            p
            for p in sorted((output / "index" / "embeddings").iterdir())
            if f"embeddings/{p.name}" not in sampled_embeddings
        )
    else:
        path = output / "index" / damaged
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    assert all(line.startswith("OK") for line in validate_path(str(output), SAMPLE))  # its bytes are not read
    with pytest.raises(SystemExit) as exit_info:
        main(["validate", str(output), "--sample", str(SAMPLE), "--hash-all"])
    assert exit_info.value.code == 1
    assert f"{path.name}: sha256 differs from the manifest" in capsys.readouterr().err
    path.write_bytes(bytes(data) + b"\0")
    with pytest.raises(SystemExit):
        main(["validate", str(output), "--sample", str(SAMPLE)])
    assert f"{path.name}: {len(data) + 1} bytes, manifest says {len(data)}" in capsys.readouterr().err


def _passed_and_lines(verdict):
    return verdict.passed, verdict.lines


@pytest.mark.e2e
def test_the_beam_job_passes_a_sound_output_in_full_and_sampled(output):
    for sample in (1.0, SAMPLE):
        plan = plan_validation(str(output), sample)
        with local_pipeline() as pipeline:
            verdict = pipeline | ValidateOutput.of(plan) | beam.Map(_passed_and_lines)
            assert_that(verdict, equal_to([(True, tuple(plan.lines))]))


def _same_document_neighbour(out):
    """Seq 0's first neighbour becomes its own first chunk, tokens and all."""
    import pyarrow.parquet as pq

    chunks = pq.read_table(out / "index" / "chunks" / "chunks-00000.parquet")
    value = np.concatenate(
        [tensor_column_to_numpy(chunks["tokens"])[0], tensor_column_to_numpy(chunks["continuation"])[0]]
    )

    def leak(columns):
        columns["neighbour_ids"][0, 0, 0] = 0
        columns["neighbours"][0, 0, 0] = value

    rewrite_shard(out / "shards", leak, "shard-00000.arrow")


def _truncated_shard(out):
    path = out / "shards" / "shard-00002.arrow"
    path.write_bytes(path.read_bytes()[:-10])


def _own_tokens_changed(out):
    def change(columns):
        columns["tokens"][0, 3] += 1

    rewrite_shard(out / "shards", change, "shard-00001.arrow")


@pytest.mark.parametrize("corrupt", [_same_document_neighbour, _truncated_shard, _own_tokens_changed])
@pytest.mark.e2e
def test_the_beam_job_reports_what_the_in_process_check_finds(output, corrupt):
    corrupt(output)
    with pytest.raises(ValidationFailed) as in_process:
        validate_path(str(output))
    plan = plan_validation(str(output))
    with local_pipeline() as pipeline:
        verdict = pipeline | ValidateOutput.of(plan) | beam.Map(_passed_and_lines)
        assert_that(
            verdict,
            equal_to(
                [
                    (
                        False,
                        (
                            f"FAILED {output}: 1 problem (1 {in_process.value.kind})",
                            f"  {in_process.value.kind}: {in_process.value}",
                        ),
                    )
                ]
            ),
        )


@pytest.mark.e2e
def test_the_beam_job_reports_every_problem_and_fails_the_command(output, capsys):
    """Where the in-process check stops at the first problem, the job reports them all."""
    _truncated_shard(output)
    rewrite_shard(output / "shards", _wrong_neighbour_tokens, "shard-00004.arrow")
    with pytest.raises(SystemExit) as exit_info:
        main(["validate", str(output), "--", "--runner=FnApiRunner"])
    err = capsys.readouterr().err.splitlines()
    assert exit_info.value.code == 1
    assert err[0] == f"error: FAILED {output}: 2 problems (1 file, 1 reference)"
    assert err[1].startswith(f"  file: {output}/shards/shard-00002.arrow: ") and "bytes, manifest says" in err[1]
    assert err[2].startswith("  reference: seq ") and "neighbour tokens differ from the chunk database" in err[2]


@pytest.mark.unit
def test_inspect_reads_the_shard_paths_from_the_file_table(tmp_path, monkeypatch):
    """inspect lists sequences of an output whose shard entries are in a file table, reading
    the manifests' summaries and the table's path column, never every entry as an object."""
    from pipeline.check.inspect import inspect_shards
    from pipeline.common import fileio
    from pipeline.common.models import DEFAULT_MODEL_NAMES

    rng = np.random.default_rng(0)
    db = write_index(tmp_path / "index", 12, rng)
    index_manifest = tmp_path / "index" / "manifest.json"
    raw = json.loads(index_manifest.read_text())
    raw["tokenizer"]["name"] = DEFAULT_MODEL_NAMES[0]  # a tokenizer inspect can load
    index_manifest.write_text(json.dumps(raw))
    write_shards(tmp_path / "shards", tmp_path / "index", db, 12, rng, inline_entries=4)
    assert json.loads((tmp_path / "shards" / "manifest.json").read_text())["shards"] == []
    monkeypatch.setattr(fileio, "whole", lambda *_, **__: pytest.fail("every entry read"))
    lines = inspect_shards(str(tmp_path / "shards"), 3)
    assert [line.split(" (")[0] for line in lines if line.startswith("== sequence")] == [
        "== sequence 0",
        "== sequence 1",
        "== sequence 2",
    ]


def _generation(number: int, first: int, chunks: int, documents: int, path: str):
    return Generation(
        number=number,
        inputs=[InputFile(path=path, bytes=1)],
        first_chunk_id=first,
        num_chunks=chunks,
        num_documents=documents,
    )


@pytest.mark.unit
def test_generations_must_follow_each_other_from_file_boundaries():
    chunks = ChunkFileRanges.from_paths("idx", [f"chunks/chunks-{n:05d}.parquet" for n in range(3)], [10, 5, 10])
    good = [_generation(0, 0, 15, 3, "a"), _generation(1, 15, 10, 2, "b")]
    check_generations("idx", good, chunks, 5)
    check_generations("idx", [], chunks, 5)  # an older manifest: nothing to check
    wrong = {
        "gap": [good[0], _generation(1, 16, 9, 2, "b")],
        "mid-file": [_generation(0, 0, 12, 3, "a"), _generation(1, 12, 13, 2, "b")],
        "documents": [good[0], _generation(1, 15, 10, 1, "b")],
        "numbers": [good[0], _generation(2, 15, 10, 2, "b")],
    }
    for case, generations in wrong.items():
        with pytest.raises(ValidationFailed):
            check_generations("idx", generations, chunks, 5)
            pytest.fail(case)
