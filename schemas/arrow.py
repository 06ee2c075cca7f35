"""Arrow schemas of the chunk database, the embeddings and the training shards (DESIGN §4).

`shard_table` is the one place a training shard's columns are built, so the pipeline's writer,
the trainer's tests and any other producer agree byte for byte on the layout.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa

SCHEMA_VERSION = 1

#: Metadata keys every training shard carries (DESIGN §4: repeated from the manifest).
SHARD_METADATA_KEYS = ("schema_version", "chunk_tokens", "neighbours", "pad_id")


class SchemaVersionError(ValueError):
    """An artefact written with a schema_version this code does not know."""


def check_schema_version(version, where: str) -> None:
    if str(version) != str(SCHEMA_VERSION):
        raise SchemaVersionError(f"{where}: schema_version {version!r} is not supported "
                                 f"(this reader knows {SCHEMA_VERSION})")


def chunk_schema(chunk_tokens: int) -> pa.Schema:
    tokens = pa.list_(pa.int32(), chunk_tokens)
    return pa.schema([("chunk_id", pa.int64()), ("doc_id", pa.int64()), ("position", pa.int32()),
                      ("tokens", tokens), ("continuation", tokens)])


def embedding_schema(dim: int) -> pa.Schema:
    return pa.schema([("chunk_id", pa.int64()), ("embedding", pa.list_(pa.float32(), dim))])


def shard_schema(sequence_tokens: int, chunk_tokens: int, neighbours: int, pad_id: int) -> pa.Schema:
    n, m, k = sequence_tokens, chunk_tokens, neighbours
    chunks = n // m
    metadata = {"schema_version": SCHEMA_VERSION, "chunk_tokens": m, "neighbours": k,
                "pad_id": pad_id, "sequence_tokens": n}
    return pa.schema(
        [("seq_id", pa.int64()),
         ("tokens", pa.list_(pa.int32(), n + 1)),
         ("neighbours", pa.fixed_shape_tensor(pa.int32(), [chunks, k, 2 * m])),
         ("neighbour_ids", pa.fixed_shape_tensor(pa.int64(), [chunks, k])),
         ("neighbour_scores", pa.fixed_shape_tensor(pa.float32(), [chunks, k])),
         ("doc_ids", pa.list_(pa.int64()))],
        metadata={key: str(value) for key, value in metadata.items()})


def fixed_size_list(values: np.ndarray, width: int) -> pa.FixedSizeListArray:
    return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), width)


def shard_table(seq_ids: np.ndarray, tokens: np.ndarray, neighbours: np.ndarray,
                neighbour_ids: np.ndarray, neighbour_scores: np.ndarray, doc_ids: list,
                *, pad_id: int) -> pa.Table:
    """Training-shard table from stacked rows.

    seq_ids [b] int64, tokens [b, n+1] int32, neighbours [b, n/m, k, 2m] int32,
    neighbour_ids [b, n/m, k] int64, neighbour_scores [b, n/m, k] float32, doc_ids: b lists.
    """
    b, chunks, k, width = neighbours.shape
    m = width // 2
    schema = shard_schema(chunks * m, m, k, pad_id)

    def tensor(name, array, dtype):
        return pa.ExtensionArray.from_storage(
            schema.field(name).type,
            fixed_size_list(np.ascontiguousarray(array, dtype=dtype), int(np.prod(array.shape[1:]))))

    columns = [
        pa.array(np.asarray(seq_ids, dtype=np.int64)),
        fixed_size_list(np.ascontiguousarray(tokens, dtype=np.int32), tokens.shape[1]),
        tensor("neighbours", neighbours, np.int32),
        tensor("neighbour_ids", neighbour_ids, np.int64),
        tensor("neighbour_scores", neighbour_scores, np.float32),
        pa.array([list(map(int, d)) for d in doc_ids], type=pa.list_(pa.int64())),
    ]
    return pa.Table.from_arrays(columns, schema=schema)


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
