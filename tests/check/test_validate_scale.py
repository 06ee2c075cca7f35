"""`validate` as outputs grow: the job's graph does not grow with the files, a sample reads only
the chunk rows it checks, the in-process check holds nothing per document."""

import json
import pickle

import numpy as np
import pytest

from benchmarks.validate_sample import L, Layout, write_index, write_shards
from pipeline.check.facts import ChunkFileUnit
from pipeline.check.plan import plan_validation
from pipeline.check.problems import ValidationFailed
from pipeline.check.shard_rules import ShardsTogether
from pipeline.check.units import units
from pipeline.check.validate import run_in_process, validate_path
from pipeline.check.validate_beam import validate_job_graph_bytes
from pipeline.common.fileio import sha256_bytes
from schemas.manifest import IndexManifest, ShardEntry, ShardsManifest
from tests.helpers import rewrite_shard
from tests.trainer_fixtures import write_manifest


def _output_listing(root, files: int, inline_entries: int | None = None):
    """An output whose manifests list `files` chunk files and `files` shards (a tiny output's
    manifests, their entries multiplied: no data files behind them); with `inline_entries`,
    written as the commit writes them (past that many entries, in a file table)."""
    rng = np.random.default_rng(0)
    write_shards(root / "shards", root / "index", write_index(root / "index", 4, rng), 2, rng)
    index = json.loads((root / "index" / "manifest.json").read_text())
    faiss = [e for e in index["files"] if e["path"].startswith("faiss/")]
    chunk = {"rows": 1, "bytes": 1000}  # and a sha256 of its own (a repeated string pickles once)
    index["files"] = [{"path": f"chunks/chunks-{i:05d}.parquet", **chunk, "sha256": f"{i:064x}"} for i in range(files)]
    index["files"] += [{"path": "embeddings/embeddings-00000.parquet", "rows": files, "bytes": 1, "sha256": "e" * 64}]
    index["files"] += faiss
    index.update(num_chunks=files, num_documents=files // L)
    _write(root / "index", index, IndexManifest, inline_entries)
    shards = json.loads((root / "shards" / "manifest.json").read_text())
    entry = {**shards["shards"][0], "rows": 1, "neighbour_slots_filled": None}
    shards["shards"] = [{**entry, "path": f"shard-{i:06d}.arrow", "sha256": f"{i:064x}"} for i in range(files)]
    data = (root / "index" / "manifest.json").read_bytes()
    shards.update(num_sequences=files, index_manifest_sha256=sha256_bytes(data))
    _write(root / "shards", shards, ShardsManifest, inline_entries)
    return root


def _write(directory, manifest: dict, model, inline_entries: int | None) -> None:
    if inline_entries is None:
        (directory / "manifest.json").write_text(json.dumps(manifest))
    else:
        write_manifest(directory, model.model_validate(manifest), inline_entries)


@pytest.mark.unit
def test_the_jobs_graph_does_not_grow_with_the_files(tmp_path):
    """Before, every chunk file's entry was an argument of several steps (2.8 MB of graph at
    5,000 chunk files); Dataflow refuses a job over 20 MB. 10^4 files here (10^5 take ~4 s,
    most of it parsing the manifests: docs/scale.md has that size)."""
    small = validate_job_graph_bytes(str(_output_listing(tmp_path / "small", 1_000)))
    large = validate_job_graph_bytes(str(_output_listing(tmp_path / "large", 10_000)))
    assert abs(large - small) <= 0.1 * small, (small, large)


@pytest.mark.unit
def test_the_plan_holds_no_entry_per_file(tmp_path):
    """The plan (the job's side input, and what its Plan step holds) keeps facts and the file
    tables' row groups, not entries: its pickled size does not grow from 2·10^4 to 8·10^4 chunk
    files and shards listed in file tables, in full or sampled."""
    small = _output_listing(tmp_path / "small", 20_000, inline_entries=1_000)
    large = _output_listing(tmp_path / "large", 80_000, inline_entries=1_000)
    for sample in (1.0, 0.01):
        sizes = [len(pickle.dumps(plan_validation(str(root), sample))) for root in (small, large)]
        assert sizes[1] <= 1.1 * sizes[0] and sizes[0] < 100_000, (sample, sizes)
    plan = plan_validation(str(large), 0.01)
    assert plan.samples["shards"].count == 800 == len(list(units(plan, ShardEntry)))
    assert (
        len(plan.chunks.chunks) == 1 and [group.role for group in plan.entry_groups] == ["index"] * 2 + ["shards"] * 2
    )


def _output(root):
    """100 shards of 2 sequences into 8,192 chunks (m = 64) in 128 files of 64 rows, in row
    groups of 16."""
    rng = np.random.default_rng(1)
    db = write_index(root / "index", 4096, rng, Layout(m=64, chunk_file_rows=64, row_group_rows=16))
    write_shards(root / "shards", root / "index", db, 100, rng, rows=2)
    return root


def _bytes_read(check) -> int:
    """The bytes this process reads while `check` runs (/proc/self/io rchar: files, hashing
    included, whether from disk or the page cache)."""

    def rchar():
        with open("/proc/self/io") as io:
            return int(next(line for line in io if line.startswith("rchar")).split()[1])

    before = rchar()
    check()
    return rchar() - before


@pytest.mark.unit
def test_a_sample_reads_a_twentieth_of_what_a_full_check_reads_unless_told_to_hash_all(tmp_path):
    """`validate --sample 0.01` reads the sampled shards, chunk and embedding files, the chunk
    row groups the shards reference and the manifests, and lists the rest for their sizes; a
    full check (or --hash-all) reads every file."""
    output = str(_output(tmp_path))
    validate_path(output, 0.01), validate_path(output)  # lazy imports done before counting
    sampled = _bytes_read(lambda: validate_path(output, 0.01))
    full = _bytes_read(lambda: validate_path(output))
    hashed = _bytes_read(lambda: validate_path(output, 0.01, hash_all=True))
    assert sampled <= 0.05 * full, (sampled, full)
    assert hashed >= 0.8 * full, (hashed, full)  # every file hashed; the faiss index not searched


@pytest.mark.unit
def test_a_sample_reads_only_the_chunk_rows_it_checks_and_finds_a_wrong_neighbour(tmp_path):
    output = _output(tmp_path)
    plan = plan_validation(str(output), 0.01)
    (sampled,) = units(plan, ShardEntry)
    read = run_in_process(plan).chunk_bytes_read
    assert 0 < read <= 0.05 * sum(unit.entry.bytes for unit in units(plan, ChunkFileUnit))

    def wrong_token(columns):
        columns["neighbours"][1, 1, 1, 3] += 1  # a neighbour of the second sequence

    rewrite_shard(output / "shards", wrong_token, sampled.path)
    with pytest.raises(ValidationFailed, match="neighbour tokens differ from the chunk database"):
        validate_path(str(output), 0.01)

    unsampled = next(e.path for e in units(plan_validation(str(output)), ShardEntry) if e != sampled)
    (output / "shards" / unsampled).write_bytes(b"short")  # not read by a sample: its size is checked
    with pytest.raises(ValidationFailed, match=f"{unsampled}: 5 bytes, manifest says"):
        validate_path(str(output / "shards"), 0.01)


@pytest.mark.unit
def test_a_reference_carries_a_hash_of_its_tokens_that_any_one_changed_token_changes():
    """A reference travels to its chunk file with 8 bytes for its tokens, not 2m tokens (512
    bytes at m = 64); a row that differs in any one token, by any amount, hashes differently."""
    from pipeline.check.shard_rules import REFERENCE, token_hash

    assert REFERENCE.itemsize == 8 + 8 + 1 + 8 + 4 + 8
    rng = np.random.default_rng(3)
    rows = rng.integers(0, 50_000, (2_000, 128)).astype(np.int32)
    changed = rows.copy()
    at = rng.integers(0, 128, len(rows))
    changed[np.arange(len(rows)), at] += rng.integers(1, 2**20, len(rows)).astype(np.int32)
    assert (token_hash(changed) != token_hash(rows)).all()
    swapped = rows.copy()
    swapped[:, [0, 1]] = swapped[:, [1, 0]]  # the same tokens in another order
    moved = rows[:, 0] != rows[:, 1]
    assert (token_hash(swapped)[moved] != token_hash(rows)[moved]).all()
    assert (token_hash(rows.copy()) == token_hash(rows)).all()


@pytest.mark.unit
def test_shards_together_find_an_overlap_whatever_the_order_and_hold_one_interval_for_dense_ids():
    rng = np.random.default_rng(2)
    for case in range(60):
        starts = np.cumsum(rng.integers(1, 4, 40))  # shards of 1-3 sequences
        ranges = [(int(a), int(b) - 1, f"shard-{i:05d}.arrow") for i, (a, b) in enumerate(zip(starts, starts[1:]))]
        if case % 2:  # a sequence in two shards
            i = int(rng.integers(0, len(ranges) - 1))
            ranges[i] = (ranges[i][0], ranges[i + 1][0], ranges[i][2])
        want = case % 2 == 1
        parts = [ShardsTogether() for _ in range(3)]
        for at in rng.permutation(len(ranges)):
            parts[int(rng.integers(0, 3))].add(*ranges[at], ((1, 2),))
        together = ShardsTogether()
        for part in rng.permutation(3):
            together.merge(parts[part])
        assert (together.overlap is not None) == want, case
        if not want:
            assert [interval[:2] for interval in together.intervals] == [[ranges[0][0], ranges[-1][1]]]
            assert together.source_counts.tolist() == [[len(ranges), 2 * len(ranges)]]
    merged = ShardsTogether().add(0, 49, "a", ()).add(50, 99, "b", ()).add(30, 40, "c", ())
    assert merged.overlap == "c: seq_ids 30..40 overlap 0..99 of the shards a ... b (a duplicate sequence?)"
