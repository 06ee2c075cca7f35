"""Arrow schemas of the chunk database, the embeddings and the training shards (docs/design.md §4).

A training shard's columns are declared once, in `schemas/shard_columns.py`; `shard_schema`,
`shard_table` (the one place its columns are built) and `shard_column_problems` are derived from
that spec, `shard_ipc_bytes` is the one place its file is written and `read_shard` /
`shard_column` the one place it is read, so the pipeline's writer, the trainer, `validate` and
any other producer agree byte for byte on the layout.

A training shard is an Arrow IPC file. Its array columns have two layouts:
- schema_version 2 and 3 (3 written now, 2 still read): plain `fixed_size_list`s of the flattened
  values, each field's metadata `shape` holding its per-row shape as JSON (e.g. `[8, 2, 128]`), so
  pyarrow, Hugging Face `datasets`, polars, duckdb and pandas read them as arrays with no extension
  type to know; 3 adds the `source` column (dictionary-encoded names: those readers see strings);
- schema_version 1 (still read): `arrow.fixed_shape_tensor` extension columns, which `datasets`
  refuses.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa

from schemas import shard_columns
from schemas.shard_columns import ShardColumn, ShardDims

SCHEMA_VERSION = 3
#: Versions this code reads (manifests and shards); it writes SCHEMA_VERSION.
READABLE_SCHEMA_VERSIONS = (1, 2, 3)
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
    """A training shard's schema: the spec's columns (`schemas/shard_columns.py`) in its order."""
    dims = ShardDims(sequence_tokens, chunk_tokens, neighbours)
    metadata = {
        "schema_version": version,
        "chunk_tokens": chunk_tokens,
        "neighbours": neighbours,
        "pad_id": pad_id,
        "sequence_tokens": sequence_tokens,
    }
    return pa.schema(
        [_shard_field(column, dims, version) for column in shard_columns.columns_in(version)],
        metadata={key: str(value) for key, value in metadata.items()},
    )


def _shard_field(column: ShardColumn, dims: ShardDims, version: int) -> pa.Field:
    value_type = pa.from_numpy_dtype(column.dtype)
    shape = [int(size) for size in column.shape(dims)]
    if column.kind == "scalar":
        return pa.field(column.name, value_type)
    if column.kind == "list":
        return pa.field(column.name, pa.list_(value_type))
    if column.kind == "dictionary":
        return pa.field(column.name, pa.dictionary(value_type, pa.string()))
    if column.kind == "tensor" and version == 1:
        return pa.field(column.name, pa.fixed_shape_tensor(value_type, shape))
    width = pa.list_(value_type, math.prod(shape))
    if column.kind == "vector":
        return pa.field(column.name, width)
    return pa.field(column.name, width, metadata={SHAPE_KEY: json.dumps(shape).encode()})


def shard_column_problems(schema: pa.Schema, dims: ShardDims, version: int) -> list[str]:
    """How a shard's columns disagree with the spec at these sizes and this layout: other
    columns, or a column of another type or `shape`; [] when they agree."""
    expected = [_shard_field(column, dims, version) for column in shard_columns.columns_in(version)]
    if schema.names != [field.name for field in expected]:
        return [f"columns {schema.names}, the spec's {[field.name for field in expected]}"]
    return [
        f"column {want.name} is {_described(got)}, the spec's {_described(want)}"
        for got, want in zip(schema, expected)
        if not got.type.equals(want.type) or _shape_metadata(got) != _shape_metadata(want)
    ]


def _shape_metadata(field: pa.Field) -> bytes | None:
    return (field.metadata or {}).get(SHAPE_KEY)


def _described(field: pa.Field) -> str:
    shape = _shape_metadata(field)
    return f"{field.type}" + (f" of shape {shape.decode()}" if shape is not None else "")


def fixed_size_list(values: np.ndarray, width: int) -> pa.FixedSizeListArray:
    return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), width)


def shard_table(
    columns: Mapping[str, Any],
    *,
    dims: ShardDims,
    pad_id: int,
    sources: tuple[str, ...] = ("training",),
    version: int = SCHEMA_VERSION,
) -> pa.Table:
    """Training-shard table from each spec column's rows (`shard_columns.columns_of`): a
    [rows, *shape] array (cast to the column's dtype) or, for a list column, one sequence per
    row; a dictionary column's rows index `sources`, every shard's dictionary whole and in that
    order. ValueError names a column whose rows do not have the spec's shape at `dims`.
    `version` 1 and 2 are for tests and tools that need the old layouts."""
    schema = shard_schema(dims.n, dims.m, dims.k, pad_id, version)
    arrays = []
    for column, field in zip(shard_columns.columns_in(version), schema):
        if column.kind == "list":
            arrays.append(pa.array([np.asarray(row, column.dtype) for row in columns[column.name]], field.type))
            continue
        if column.kind == "dictionary":
            indices = np.asarray(columns[column.name], column.dtype)
            if len(indices) and not 0 <= indices.min() <= indices.max() < len(sources):
                raise ValueError(f"{column.name}: values outside the {len(sources)} names {list(sources)}")
            arrays.append(pa.DictionaryArray.from_arrays(pa.array(indices), pa.array(sources, pa.string())))
            continue
        values = np.ascontiguousarray(columns[column.name], dtype=column.dtype)
        if values.shape[1:] != column.shape(dims):
            raise ValueError(f"{column.name}: rows of shape {values.shape[1:]}, the spec's is {column.shape(dims)}")
        if column.kind == "scalar":
            arrays.append(pa.array(values))
            continue
        flat = fixed_size_list(values, math.prod(values.shape[1:]))
        tensor = isinstance(field.type, pa.FixedShapeTensorType)  # schema_version 1
        arrays.append(pa.ExtensionArray.from_storage(field.type, flat) if tensor else flat)
    return pa.Table.from_arrays(arrays, schema=schema)


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


def shard_sources(data: pa.Table | pa.RecordBatch) -> tuple[tuple[str, ...], np.ndarray]:
    """A shard's source names and each row's index into them; a shard of schema_version 2 or
    1, written before the column, is one source, unnamed (`("",)`)."""
    if "source" not in data.schema.names:
        return ("",), np.zeros(data.num_rows, np.int8)
    column = data.column("source")
    if isinstance(column, pa.ChunkedArray):
        column = column.unify_dictionaries().combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    return tuple(column.dictionary.to_pylist()), column.indices.to_numpy(zero_copy_only=False)


def shard_column(data: pa.Table | pa.RecordBatch, name: str) -> np.ndarray:
    """A shard's scalar or array column as numpy [rows, *shape] (zero-copy if it can): the
    shape from the field's metadata (schema_version 2) or its tensor type (1)."""
    column = data.column(name)
    if not (pa.types.is_fixed_size_list(column.type) or isinstance(column.type, pa.FixedShapeTensorType)):
        return column.to_numpy()
    values = tensor_column_to_numpy(column)
    metadata = data.schema.field(name).metadata or {}
    return values.reshape(-1, *json.loads(metadata[SHAPE_KEY])) if SHAPE_KEY in metadata else values
