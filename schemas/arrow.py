"""Arrow schemas of the chunk database, the embeddings and the training shards (docs/design.md §4).

`shard_table` is the one place a training shard's columns are built, `shard_ipc_bytes` the one
place its file is written and `read_shard` / `shard_column` the one place it is read, so the
pipeline's writer, the trainer, `validate` and any other producer agree byte for byte on the
layout.

A training shard is an Arrow IPC file. Its array columns have two layouts:
- schema_version 2 (written now): plain `fixed_size_list`s of the flattened values, each field's
  metadata `shape` holding its per-row shape as JSON (e.g. `[8, 2, 128]`), so pyarrow, Hugging
  Face `datasets`, polars, duckdb and pandas read them as arrays with no extension type to know;
- schema_version 1 (still read): `arrow.fixed_shape_tensor` extension columns, which `datasets`
  refuses.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa

SCHEMA_VERSION = 2
#: Versions this code reads (manifests and shards); it writes SCHEMA_VERSION.
READABLE_SCHEMA_VERSIONS = (1, 2)
#: The field-metadata key of an array column's per-row shape (schema_version 2).
SHAPE_KEY = b"shape"

#: Metadata keys every training shard carries (docs/design.md §4: repeated from the manifest).
SHARD_METADATA_KEYS = ("schema_version", "chunk_tokens", "neighbours", "pad_id")


class SchemaVersionError(ValueError):
    """An artefact written with a schema_version this code does not know."""


def check_schema_version(version, where: str) -> int:
    """The artefact's schema_version as an int; SchemaVersionError unless this code reads it."""
    known = {str(v): v for v in READABLE_SCHEMA_VERSIONS}
    if str(version) not in known:
        raise SchemaVersionError(
            f"{where}: schema_version {version!r} is not supported (this reader knows {', '.join(known)})"
        )
    return known[str(version)]


def chunk_schema(chunk_tokens: int) -> pa.Schema:
    tokens = pa.list_(pa.int32(), chunk_tokens)
    return pa.schema(
        [
            ("chunk_id", pa.int64()),
            ("doc_id", pa.int64()),
            ("position", pa.int32()),
            ("tokens", tokens),
            ("continuation", tokens),
        ]
    )


def embedding_schema(dim: int) -> pa.Schema:
    return pa.schema([("chunk_id", pa.int64()), ("embedding", pa.list_(pa.float32(), dim))])


def shard_schema(
    sequence_tokens: int, chunk_tokens: int, neighbours: int, pad_id: int, version: int = SCHEMA_VERSION
) -> pa.Schema:
    n, m, k = sequence_tokens, chunk_tokens, neighbours
    chunks = n // m

    def array(name: str, value_type: pa.DataType, shape: list[int]) -> pa.Field:
        if version == 1:
            return pa.field(name, pa.fixed_shape_tensor(value_type, shape))
        return pa.field(
            name, pa.list_(value_type, int(np.prod(shape))), metadata={SHAPE_KEY: json.dumps(shape).encode()}
        )

    metadata = {"schema_version": version, "chunk_tokens": m, "neighbours": k, "pad_id": pad_id, "sequence_tokens": n}
    return pa.schema(
        [
            ("seq_id", pa.int64()),
            ("tokens", pa.list_(pa.int32(), n + 1)),
            array("neighbours", pa.int32(), [chunks, k, 2 * m]),
            array("neighbour_ids", pa.int64(), [chunks, k]),
            array("neighbour_scores", pa.float32(), [chunks, k]),
            ("doc_ids", pa.list_(pa.int64())),
        ],
        metadata={key: str(value) for key, value in metadata.items()},
    )


def fixed_size_list(values: np.ndarray, width: int) -> pa.FixedSizeListArray:
    return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), width)


def shard_table(
    seq_ids: np.ndarray,
    tokens: np.ndarray,
    neighbours: np.ndarray,
    neighbour_ids: np.ndarray,
    neighbour_scores: np.ndarray,
    doc_ids: list,
    *,
    pad_id: int,
    version: int = SCHEMA_VERSION,
) -> pa.Table:
    """Training-shard table from stacked rows.

    seq_ids [b] int64, tokens [b, n+1] int32, neighbours [b, n/m, k, 2m] int32,
    neighbour_ids [b, n/m, k] int64, neighbour_scores [b, n/m, k] float32, doc_ids: b lists.
    `version` 1 is for tests and tools that need the old layout.
    """
    b, chunks, k, width = neighbours.shape
    m = width // 2
    schema = shard_schema(chunks * m, m, k, pad_id, version)

    def array(name, values, dtype):
        values = np.ascontiguousarray(values, dtype=dtype)
        flat = fixed_size_list(values, int(np.prod(values.shape[1:])))
        return pa.ExtensionArray.from_storage(schema.field(name).type, flat) if version == 1 else flat

    columns = [
        pa.array(np.asarray(seq_ids, dtype=np.int64)),
        fixed_size_list(np.ascontiguousarray(tokens, dtype=np.int32), tokens.shape[1]),
        array("neighbours", neighbours, np.int32),
        array("neighbour_ids", neighbour_ids, np.int64),
        array("neighbour_scores", neighbour_scores, np.float32),
        pa.array([list(map(int, d)) for d in doc_ids], type=pa.list_(pa.int64())),
    ]
    return pa.Table.from_arrays(columns, schema=schema)


def shard_ipc_bytes(table: pa.Table, batch_rows: int | None = None) -> bytes:
    """A shard table's Arrow IPC file, in record batches of at most `batch_rows` rows
    (default: the table's chunks)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=batch_rows)
    return sink.getvalue().to_pybytes()


def read_shard(source, columns: list[str] | None = None) -> tuple[pa.Schema, list[pa.RecordBatch]]:
    """A shard's schema and record batches, from a memory map, buffer or file object; zero-copy
    from a memory map or buffer. `columns`: read only these (the schema returned is the whole
    file's). pa.ArrowInvalid if the bytes are not an Arrow IPC file."""
    reader = pa.ipc.open_file(source)
    if columns is not None:
        fields = [reader.schema.get_field_index(name) for name in columns]
        reader = pa.ipc.open_file(source, options=pa.ipc.IpcReadOptions(included_fields=fields))
    return reader.schema, [reader.get_batch(i) for i in range(reader.num_record_batches)]


def read_shard_table(source) -> pa.Table:
    """A whole shard as one table (either layout)."""
    schema, batches = read_shard(source)
    return pa.Table.from_batches(batches, schema=schema)


def tensor_column_to_numpy(column) -> np.ndarray:
    """A fixed_shape_tensor or fixed_size_list column -> numpy [rows, ...] (zero-copy if it can)."""
    if isinstance(column, pa.ChunkedArray):
        if column.num_chunks == 1:
            column = column.chunk(0)
        else:
            return np.concatenate([tensor_column_to_numpy(c) for c in column.chunks])
    if isinstance(column.type, pa.FixedShapeTensorType):
        return column.to_numpy_ndarray()
    width = column.type.list_size
    return column.flatten().to_numpy(zero_copy_only=False).reshape(-1, width)


def shard_column(data: pa.Table | pa.RecordBatch, name: str) -> np.ndarray:
    """A shard's column as numpy [rows, *shape] (zero-copy if it can): the shape from the
    field's metadata (schema_version 2) or its tensor type (1)."""
    values = tensor_column_to_numpy(data.column(name))
    metadata = data.schema.field(name).metadata or {}
    return values.reshape(-1, *json.loads(metadata[SHAPE_KEY])) if SHAPE_KEY in metadata else values
