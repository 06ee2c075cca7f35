"""The training shard's columns, declared once (docs/design.md §4).

`SHARD_COLUMNS` lists them in file order: each a name, a numpy dtype (its Arrow type follows),
a kind, a per-row shape as a function of the shard's sizes (`ShardDims`: n sequence tokens, m
chunk tokens, k neighbours, L = n/m chunks) and how its value is taken from a row (a `ShardRow`:
its attribute of the column's name unless `value` says otherwise). Everything else is derived
from it: the Arrow schema and the table builder (`schemas/arrow.py`), the column checks of
`validate` and of the trainer, the trainer's arrays, and `row_bytes` (rows per shard under
`shard_bytes`, the memory model). A new column is one entry here.

Readers look `SHARD_COLUMNS` up when they run (`shard_columns.SHARD_COLUMNS` or the functions
here), never import the name, so each sees the one spec there is. Imports numpy only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

#: scalar: one value per row (a plain column); vector: a fixed_size_list whose shape is its
#: width (no `shape` metadata); tensor: a fixed_size_list of the row-major values with field
#: metadata `shape` (schema_version 1: arrow.fixed_shape_tensor); list: a variable-length list;
#: dictionary: a name per row, dictionary-encoded (the value is its index, `dtype` the index's).
Kind = Literal["scalar", "vector", "tensor", "list", "dictionary"]


@dataclass(frozen=True)
class ShardDims:
    """A shard's sizes: n tokens per sequence, m per chunk, k neighbours per chunk."""

    n: int
    m: int
    k: int

    @property
    def L(self) -> int:  # the design's name: chunks per sequence
        return self.n // self.m


def _no_shape(dims: ShardDims) -> tuple[int, ...]:
    return ()


@dataclass(frozen=True, kw_only=True)
class ShardColumn:
    """One column of a training shard (the kinds: `Kind`)."""

    name: str
    dtype: np.dtype
    kind: Kind
    shape: Callable[[ShardDims], tuple[int, ...]] = _no_shape  # per row; () for scalar and list
    value: Callable[[Any], Any] | None = None  # a row -> its value; None: the row's attribute `name`
    # list: the items a row is counted with in `row_bytes` (an estimate: the length varies)
    estimated_items: int = 0
    since: int = 1  # the schema_version that added it: files of earlier versions lack it

    def of(self, row: Any) -> Any:
        return getattr(row, self.name) if self.value is None else self.value(row)

    def row_bytes(self, dims: ShardDims) -> int:
        items = self.estimated_items if self.kind == "list" else math.prod(self.shape(dims))
        return items * self.dtype.itemsize


SHARD_COLUMNS: tuple[ShardColumn, ...] = (
    ShardColumn(name="seq_id", dtype=np.dtype(np.int64), kind="scalar"),
    # and the next-token target
    ShardColumn(name="tokens", dtype=np.dtype(np.int32), kind="vector", shape=lambda d: (d.n + 1,)),
    ShardColumn(name="neighbours", dtype=np.dtype(np.int32), kind="tensor", shape=lambda d: (d.L, d.k, 2 * d.m)),
    ShardColumn(name="neighbour_ids", dtype=np.dtype(np.int64), kind="tensor", shape=lambda d: (d.L, d.k)),
    ShardColumn(name="neighbour_scores", dtype=np.dtype(np.float32), kind="tensor", shape=lambda d: (d.L, d.k)),
    # 4 doc ids: the 32 bytes rows per shard have always been sized with
    ShardColumn(name="doc_ids", dtype=np.dtype(np.int64), kind="list", estimated_items=4),
    # the training source of a blend (one name otherwise), its index into the names
    ShardColumn(name="source", dtype=np.dtype(np.int8), kind="dictionary", since=3),
)


def columns_in(version: int) -> tuple[ShardColumn, ...]:
    """The columns of a shard of this schema_version, in file order."""
    return tuple(column for column in SHARD_COLUMNS if column.since <= version)


def array_columns() -> tuple[ShardColumn, ...]:
    """The columns of one fixed shape per row, which read as numpy [rows, *shape] (the trainer's)."""
    return tuple(column for column in SHARD_COLUMNS if column.kind not in ("list", "dictionary"))


def row_bytes(dims: ShardDims) -> int:
    """The bytes of one row's values (list columns at their estimated length): what sizes a
    shard under `shard_bytes` and a row in the memory model."""
    return sum(column.row_bytes(dims) for column in SHARD_COLUMNS)


def columns_of(rows: Iterable[Any]) -> dict[str, Any]:
    """Each column's values over `rows`, taken as the spec says: [rows, *shape] arrays (in the
    values' own dtypes; the table builder casts), a list of sequences for a list column."""
    rows = list(rows)
    return {
        column.name: (
            [column.of(row) for row in rows] if column.kind == "list" else np.stack([column.of(row) for row in rows])
        )
        for column in SHARD_COLUMNS
    }
