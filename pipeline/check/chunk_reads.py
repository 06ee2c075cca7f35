"""Reading a chunk file for `validate`: whole (its sha256 checked on the bytes read), or only the
Parquet row groups holding some of its rows, counting the bytes the Parquet reader asks for.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.check.problems import ValidationFailed, checked_parquet, require
from pipeline.chunks.chunk_files import ChunkRows
from pipeline.common import fileio
from schemas.manifest import FileEntry

PARQUET_MAGIC = b"PAR1"


@dataclass(frozen=True)
class ChunkRowsRead:
    rows: ChunkRows  # the rows read, in file order
    asked: np.ndarray  # the rows asked for (0 = the file's first row), sorted
    at: np.ndarray  # where each of them is in `rows`
    bytes_read: int


def read_whole(directory: str, entry: FileEntry) -> ChunkRowsRead:
    rows = ChunkRows.of(checked_parquet(directory, entry))
    every = np.arange(len(rows.chunk_id))
    return ChunkRowsRead(rows, every, every, entry.bytes)


class _CountingReader:
    """A binary reader that counts the bytes read through it (what pyarrow asks for)."""

    def __init__(self, f):
        self.f, self.bytes_read, self.closed = f, 0, False

    def read(self, size=-1):
        data = self.f.read(size)
        self.bytes_read += len(data)
        return data

    def seek(self, offset, whence=0):
        return self.f.seek(offset, whence)

    def tell(self):
        return self.f.tell()

    def seekable(self):
        return True

    def readable(self):
        return True


def _footer(f, path: str, size: int) -> pq.FileMetaData:
    """The Parquet footer alone (pyarrow on its own reads the last 64 KiB)."""
    f.seek(size - 8)
    tail = f.read(8)
    require(tail[4:] == PARQUET_MAGIC, f"{path}: not a Parquet file", "file")
    (length,) = struct.unpack("<I", tail[:4])
    require(length <= size - 12, f"{path}: not a Parquet file", "file")
    f.seek(size - 8 - length)
    return pq.read_metadata(pa.BufferReader(PARQUET_MAGIC + f.read(length) + tail))


def read_row_groups(directory: str, entry: FileEntry, local_rows: np.ndarray) -> ChunkRowsRead:
    """The row groups of a chunk file that hold rows `local_rows` (sorted, unique), located
    by the row counts in the file's footer. Not hash-checked here: validating the index hashes
    the file as a listed file; a shards directory validated alone hashes none of the index's
    files (docs/pipeline.md, "Checking an output")."""
    path = fileio.join(directory, entry.path)
    require(fileio.exists(path), f"{path}: listed in the manifest but missing", "file")
    try:
        return _read_row_groups(path, entry, local_rows)
    except (pa.ArrowException, OSError) as err:  # what its sha256 check reports too
        raise ValidationFailed(f"{path}: cannot be read as Parquet: {err}", "file") from None


def _read_row_groups(path: str, entry: FileEntry, local_rows: np.ndarray) -> ChunkRowsRead:
    with fileio.open_read(path) as raw:
        counting = _CountingReader(raw)
        size = raw.seek(0, 2)
        require(size == entry.bytes, f"{path}: {size} bytes, manifest says {entry.bytes}", "file")
        meta = _footer(counting, path, size)
        parquet = pq.ParquetFile(counting, metadata=meta)
        sizes = np.array([meta.row_group(g).num_rows for g in range(meta.num_row_groups)], np.int64)
        require(sizes.sum() == entry.rows, f"{path}: {sizes.sum()} rows, manifest says {entry.rows}", "file")
        starts = np.cumsum(sizes) - sizes
        group = np.searchsorted(starts, local_rows, side="right") - 1
        chosen = np.unique(group)
        rows = ChunkRows.of(parquet.read_row_groups(chosen.tolist()))
        offset = np.zeros(len(sizes), np.int64)
        offset[chosen] = np.cumsum(sizes[chosen]) - sizes[chosen]  # where each chosen group starts in `rows`
        at = offset[group] + local_rows - starts[group]
    return ChunkRowsRead(rows, local_rows, at, counting.bytes_read)
