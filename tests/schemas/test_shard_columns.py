"""The shard column spec (`schemas/shard_columns.py`): the schema it gives is docs/design.md §4's,
its bytes per row what `shard_bytes` has always sized shards with, and a column added to the
spec alone reaches the written shards, the sizes, `validate` and the trainer."""

from __future__ import annotations

import hashlib

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pytest

from pipeline.check.facts import ShardsFacts
from pipeline.check.problems import ValidationFailed
from pipeline.check.shard_rules import check_shard
from pipeline.chunks.chunk_files import ChunkFileRanges
from pipeline.jobs.memory_model import Corpus, stage_memory
from pipeline.shards.rows import RowBatch, ShardRow
from pipeline.shards.write import WriteShards, rows_to_ipc
from schemas import shard_columns
from schemas.arrow import SHARD_METADATA_KEYS, read_shard_table, shard_column, shard_schema
from schemas.config import config_from_dict
from schemas.manifest import ShardEntry, ShardsManifest
from schemas.shard_columns import ShardColumn, ShardDims, row_bytes
from tests.helpers import local_pipeline, small_config
from tests.trainer_fixtures import write_manifest
from trainer.dataset import ShardDataset

M, L, K, PAD = 4, 2, 2, 0
N = L * M


@pytest.mark.unit
@pytest.mark.parametrize("version", [1, 2])
def test_the_spec_gives_the_schema_of_design_md(version):
    def array(name, value_type, shape):
        if version == 1:
            return pa.field(name, pa.fixed_shape_tensor(value_type, shape))
        return pa.field(name, pa.list_(value_type, int(np.prod(shape))), metadata={b"shape": str(shape).encode()})

    expected = pa.schema(
        [
            ("seq_id", pa.int64()),
            ("tokens", pa.list_(pa.int32(), N + 1)),
            array("neighbours", pa.int32(), [L, K, 2 * M]),
            array("neighbour_ids", pa.int64(), [L, K]),
            array("neighbour_scores", pa.float32(), [L, K]),
            ("doc_ids", pa.list_(pa.int64())),
        ],
        metadata={
            "schema_version": str(version),
            "chunk_tokens": "4",
            "neighbours": "2",
            "pad_id": "0",
            "sequence_tokens": "8",
        },
    )
    assert shard_schema(N, M, K, PAD, version).equals(expected, check_metadata=True)


@pytest.mark.unit
def test_bytes_per_row_count_every_column():
    """seq_id, n + 1 tokens, L·k neighbours of 2m tokens with an id and a score each, 4 doc
    ids (the size rows per shard were cut with before schema_version 3) and a source's index."""
    n, m, k = 128, 32, 2
    slots = n // m * k
    assert row_bytes(ShardDims(n, m, k)) == 8 + 4 * (n + 1) + slots * (4 * 2 * m + 8 + 4) + 4 * 8 + 1 == 2701


def _rows() -> list[ShardRow]:
    """Seven rows with 0 to 4 neighbour slots filled (an absent slot is padding, as validate wants)."""
    rows = []
    for s in range(7):
        ids = np.full(L * K, -1, np.int64)
        ids[: s % (L * K + 1)] = 10 + s
        ids = ids.reshape(L, K)
        neighbours = np.where(ids[..., None] >= 0, 3, PAD).astype(np.int32) * np.ones((L, K, 2 * M), np.int32)
        scores = np.where(ids >= 0, 0.5, 0).astype(np.float32)
        rows.append(
            ShardRow(
                seq_id=s,
                tokens=np.arange(N + 1, dtype=np.int32) + 1,
                neighbours=neighbours,
                neighbour_ids=ids,
                neighbour_scores=scores,
                doc_ids=(s,),
            )
        )
    return rows


def _entry(directory, path: str, rows: int) -> ShardEntry:
    data = (directory / path).read_bytes()
    return ShardEntry(path=path, rows=rows, bytes=len(data), sha256=hashlib.sha256(data).hexdigest())


def _facts(directory) -> ShardsFacts:
    schema = shard_schema(N, M, K, PAD)
    metadata = tuple((key, schema.metadata[key.encode()].decode()) for key in SHARD_METADATA_KEYS)
    chunks = ChunkFileRanges.from_paths("unused", ["chunks/chunks-00000.parquet"], [1000])  # holds ids 10 ... 16
    return ShardsFacts(
        directory=str(directory),
        sequence_tokens=N,
        chunk_tokens=M,
        neighbours=K,
        pad_id=PAD,
        same_corpus=False,
        metadata=metadata,
        chunks=chunks,
    )


@pytest.mark.beam
def test_a_column_added_to_the_spec_alone_reaches_shards_sizes_validate_and_the_trainer(tmp_path, monkeypatch):
    """One entry in SHARD_COLUMNS (the filled neighbour slots of each chunk, taken from the row)
    and nothing else: WriteShards writes it with its shape, bytes per row count it (rows per
    shard, the memory model), validate refuses it in another shape, the trainer's batches hold it."""
    cfg = config_from_dict(
        small_config(tmp_path, "x", chunk_tokens=M, sequence_tokens=N, neighbours=K, neighbour_candidates=K)
    )
    sized = cfg.model_copy(update={"shard_bytes": 100_000})

    def write_step(config) -> int:
        return next(
            s["bytes"] for s in stage_memory(config, Corpus.of(1e6)) if s["stage"] == "build-shards: write one shard"
        )

    bytes_before, rows_before, step_before = row_bytes(cfg.shard_dims), sized.rows_per_shard(), write_step(cfg)

    spec = shard_columns.SHARD_COLUMNS

    def filled(shape=lambda d: (d.L,), value=lambda row: (row.neighbour_ids >= 0).sum(axis=1)):
        """The spec with the new column before doc_ids: the one change."""
        column = ShardColumn(
            name="neighbours_filled", dtype=np.dtype(np.int32), kind="tensor", shape=shape, value=value
        )
        monkeypatch.setattr(shard_columns, "SHARD_COLUMNS", (*spec[:-2], column, *spec[-2:]))

    filled()
    rows = _rows()
    expected = np.array([(r.neighbour_ids >= 0).sum(axis=1) for r in rows], np.int32)  # [rows, L]

    # bytes per row: 4 bytes per chunk more, in rows per shard and in the memory model
    assert row_bytes(cfg.shard_dims) == bytes_before + 4 * L
    assert sized.rows_per_shard() == 100_000 // (bytes_before + 4 * L) < rows_before
    assert write_step(cfg) > step_before

    # written shards: the column, its shape metadata and values, before doc_ids and source
    directory = tmp_path / "shards"
    with local_pipeline() as p:
        _ = p | beam.Create([RowBatch(rows[:4]), RowBatch(rows[4:])]) | WriteShards(str(directory), 4, PAD)
    tables = [read_shard_table(pa.memory_map(str(directory / f"shard-0000{i}.arrow"))) for i in (0, 1)]
    field = tables[0].schema.field("neighbours_filled")
    assert tables[0].column_names[-3:] == ["neighbours_filled", "doc_ids", "source"]
    assert field.type == pa.list_(pa.int32(), L) and field.metadata == {b"shape": f"[{L}]".encode()}
    assert np.array_equal(np.concatenate([shard_column(t, "neighbours_filled") for t in tables]), expected)

    # the trainer: its dataset checks the shards against the spec's schema and batches the column
    entries = [_entry(directory, f"shard-0000{i}.arrow", rows) for i, rows in ((0, 4), (1, 3))]
    manifest = ShardsManifest(
        config_hash="test",
        index_manifest_sha256="test",
        training_corpus="separate",
        sequence_tokens=N,
        chunk_tokens=M,
        neighbours=K,
        neighbour_tokens=2 * M,
        pad_id=PAD,
        num_sequences=7,
        shards=entries,
        created_by="tests/schemas/test_shard_columns.py",
        counters={},
        overlap={},
    )
    write_manifest(directory, manifest)
    (batch,) = ShardDataset(directory, shuffle=False, batched=True, batch_size=7)
    assert np.array_equal(batch["neighbours_filled"].numpy(), expected)

    # validate: the spec's shape passes; a shard whose column has another shape ([L, k]) fails
    assert check_shard(_facts(directory), entries[0]).first_seq == 0
    filled(shape=lambda d: (d.L, d.k), value=lambda row: (row.neighbour_ids >= 0).astype(np.int32))
    (directory / "shard-00000.arrow").write_bytes(rows_to_ipc(rows[:4], PAD))
    filled()
    with pytest.raises(ValidationFailed, match=r"column neighbours_filled is .*\[2, 2\].*the spec's .*\[2\]"):
        check_shard(_facts(directory), _entry(directory, "shard-00000.arrow", 4))
