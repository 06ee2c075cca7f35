"""Small synthetic shard directories for the trainer tests: real Arrow IPC files and a real
ShardsManifest (rows, bytes and sha256 of the files as written)."""

from __future__ import annotations

import hashlib
import io
import json
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pyarrow as pa

from pipeline.shards.rows import OVERLAP_BUCKETS, chunk_overlap, overlap_bucket
from schemas.arrow import SCHEMA_VERSION, read_shard_table, shard_ipc_bytes, shard_table
from schemas.file_table import entries_arrow, entries_field, entry_model
from schemas.manifest import FILE_TABLE, INLINE_FILE_ENTRIES, MANIFEST_FILE, ShardEntry, ShardsManifest
from schemas.shard_columns import ShardDims
from schemas.table_writer import TableWriter


def split_entries(
    manifest, inline_limit: int = INLINE_FILE_ENTRIES, *, table_path: str = FILE_TABLE
) -> tuple[dict, bytes | None]:
    """The manifest as written (a JSON object) and the bytes of its file table, to be written
    at `table_path`; None when its entries, at most `inline_limit`, stay inline: a synthetic
    manifest held whole, written as a commit writes it (`TableWriter`)."""
    field = entries_field(manifest)
    if len(getattr(manifest, field)) <= inline_limit:
        return manifest.model_copy(update={"file_table": None}).model_dump(mode="json"), None
    sink = io.BytesIO()
    writer = TableWriter(sink, entry_model(manifest), table_path)
    writer.write(entries_arrow(getattr(manifest, field), entry_model(manifest)))
    reference = writer.close()
    return manifest.model_copy(update={field: [], "file_table": reference}).model_dump(mode="json"), sink.getvalue()


def synthetic_rows(
    num_sequences: int,
    *,
    sequence_tokens: int,
    chunk_tokens: int,
    neighbours: int,
    vocab_size: int,
    pad_id: int,
    seed: int,
    pad_tails: bool = False,
    random_tokens: bool = False,
) -> dict[str, np.ndarray]:
    """Rows whose tokens count up by one (mod vocab, skipping pad_id) from a random start: a
    pattern a tiny model learns in a few steps. Neighbour 0 of each chunk is the chunk that
    follows it plus its continuation; the last neighbour of every other chunk is absent (pad).
    pad_tails: each sequence ends in 0 to n/2 pad tokens, so batches differ in their count of
    non-pad targets.
    random_tokens: tokens drawn at random instead (nothing before a token predicts it), neighbour
    0 still the next chunk and its continuation: only a model that reads its neighbours can
    predict the tokens after the first chunk."""
    rng = np.random.default_rng(seed)
    n, m, k = sequence_tokens, chunk_tokens, neighbours
    chunks = n // m
    usable = vocab_size - 1  # every id but pad_id

    def ids(values):
        values = values % usable
        return values + (values >= pad_id)

    starts = rng.integers(0, usable, size=num_sequences)
    tokens = ids(starts[:, None] + np.arange(n + 1)).astype(np.int32)
    if pad_tails:
        pads = rng.integers(0, n // 2 + 1, size=(num_sequences, 1))  # trailing pad tokens per sequence
    neighbours_ = ids(rng.integers(0, usable, size=(num_sequences, chunks, k, 2 * m))).astype(np.int32)
    chunk_starts = starts[:, None] + (np.arange(chunks)[None, :] + 1) * m
    neighbours_[:, :, 0, :] = ids(chunk_starts[:, :, None] + np.arange(2 * m))
    neighbour_ids = rng.integers(0, 10_000, size=(num_sequences, chunks, k))
    absent = np.zeros((chunks, k), dtype=bool)
    absent[1::2, k - 1] = k > 1
    neighbours_[:, absent] = pad_id
    neighbour_ids[:, absent] = -1
    scores = rng.random((num_sequences, chunks, k), dtype=np.float32)
    if random_tokens:  # drawn last: every other draw stays what it was
        stream = ids(rng.integers(0, usable, size=(num_sequences, n + 2 * m))).astype(np.int32)
        tokens = stream[:, : n + 1].copy()
        neighbours_[:, :, 0, :] = stream[:, (np.arange(chunks)[:, None] + 1) * m + np.arange(2 * m)]
    if pad_tails:
        tokens[np.arange(n + 1) > n - pads] = pad_id
    return {"tokens": tokens, "neighbours": neighbours_, "neighbour_ids": neighbour_ids, "neighbour_scores": scores}


def write_shard_dir(
    directory: Path,
    *,
    shard_rows: list[int],
    sequence_tokens: int = 16,
    chunk_tokens: int = 4,
    neighbours: int = 2,
    vocab_size: int = 64,
    pad_id: int = 0,
    batch_rows: int = 3,
    seed: int = 0,
    first_seq_id: int = 1000,
    pad_tails: bool = False,
    random_tokens: bool = False,
    schema_version: int = SCHEMA_VERSION,
    inline_entries: int = INLINE_FILE_ENTRIES,
) -> ShardsManifest:
    """Write shards of `shard_rows` rows each (record batches of `batch_rows`) and the manifest
    (with more than `inline_entries` shards, its entries in a file table, as the commit writes).

    Sequence ids count up from first_seq_id in manifest order; doc_ids are [seq_id].
    schema_version 1 writes the old layout (IPC file, tensor extension columns).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    total = sum(shard_rows)
    rows = synthetic_rows(
        total,
        sequence_tokens=sequence_tokens,
        chunk_tokens=chunk_tokens,
        neighbours=neighbours,
        vocab_size=vocab_size,
        pad_id=pad_id,
        seed=seed,
        pad_tails=pad_tails,
        random_tokens=random_tokens,
    )
    seq_ids = np.arange(first_seq_id, first_seq_id + total, dtype=np.int64)
    entries, start = [], 0
    for i, count in enumerate(shard_rows):
        part = slice(start, start + count)
        table = shard_table(
            {
                "seq_id": seq_ids[part],
                **{name: values[part] for name, values in rows.items()},
                "doc_ids": [[s] for s in seq_ids[part]],
                "source": np.zeros(count, np.int8),
            },
            dims=ShardDims(sequence_tokens, chunk_tokens, neighbours),
            pad_id=pad_id,
            version=schema_version,
        )
        path = directory / f"shard-{i:05d}.arrow"
        data = shard_ipc_bytes(table, batch_rows)
        path.write_bytes(data)
        entries.append(
            ShardEntry(
                path=path.name,
                rows=count,
                bytes=len(data),
                sha256=hashlib.sha256(data).hexdigest(),
                neighbour_slots_filled=int((rows["neighbour_ids"][part] >= 0).sum()),
            )
        )
        start += count
    L = sequence_tokens // chunk_tokens
    overlap = Counter(
        overlap_bucket(r)
        for tokens, values in zip(rows["tokens"], rows["neighbours"])
        for r in chunk_overlap(tokens[:-1].reshape(L, chunk_tokens), values, pad_id)
    )
    manifest = ShardsManifest(
        overlap={str(t): overlap[str(t)] for t in OVERLAP_BUCKETS},
        config_hash="test",
        index_manifest_sha256="test",
        training_corpus="separate",
        sequence_tokens=sequence_tokens,
        chunk_tokens=chunk_tokens,
        neighbours=neighbours,
        neighbour_tokens=2 * chunk_tokens,
        pad_id=pad_id,
        num_sequences=total,
        shards=entries,
        counters={"sequences_written": total},
        created_by="tests/trainer_fixtures.py",
        schema_version=schema_version,
    )
    write_manifest(directory, manifest, inline_entries)
    return manifest


def write_manifest(directory: Path, manifest, inline_entries: int = INLINE_FILE_ENTRIES) -> None:
    """A manifest model into `directory` as the commit writes it: its file table first, if any."""
    data, table = split_entries(manifest, inline_entries)
    if table is not None:
        (directory / FILE_TABLE).write_bytes(table)
    (directory / MANIFEST_FILE).write_text(json.dumps(data, indent=2))


def _row(table: pa.Table, name: str, i: int) -> np.ndarray:
    """Row i of an array column through Python lists, reshaped by the field's `shape` metadata
    (schema_version 2) or its tensor type (1)."""
    column, field = table.column(name).combine_chunks(), table.schema.field(name)
    if isinstance(column, pa.ExtensionArray):
        return np.array(column.storage[i].as_py()).reshape(column.type.shape)
    return np.array(column[i].as_py()).reshape(json.loads(field.metadata[b"shape"]))


def source_rows(directory: Path) -> dict[int, dict[str, np.ndarray]]:
    """seq_id -> the row's columns, read back with plain pyarrow (the reference the dataset must match)."""
    out = {}
    for path in sorted(Path(directory).glob("shard-*.arrow")):
        with pa.OSFile(str(path)) as source:
            table = read_shard_table(source)
        columns = {name: table.column(name).combine_chunks() for name in table.column_names}
        for i, seq_id in enumerate(columns["seq_id"].to_pylist()):
            out[seq_id] = {
                "tokens": np.array(columns["tokens"][i].as_py()),
                "neighbours": _row(table, "neighbours", i),
                "neighbour_ids": _row(table, "neighbour_ids", i),
                "neighbour_scores": _row(table, "neighbour_scores", i).astype(np.float32),
            }
    return out


def write_checkpoint(path: Path, step: int = 0, seed: int = 0, **config) -> Path:
    """An untrained model (RetroConfig(**config)) as `ratrain-train` checkpoints it: model,
    model_config, step."""
    import torch  # here: the benchmarks that import this module need no torch

    from trainer.model import Retro, RetroConfig

    torch.manual_seed(seed)
    model_config = RetroConfig(**config)
    model = Retro(model_config)
    torch.save({"model": model.state_dict(), "model_config": asdict(model_config), "step": step}, path)
    return path
