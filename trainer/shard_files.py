"""A shard directory's files, local or gs:// (`files_for`): local ones memory-mapped, remote ones
fetched whole with a read-ahead of one shard; and `OpenShard`, one opened shard's rows as numpy
views, gathered in an epoch's row order."""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

from schemas.arrow import shard_column
from schemas.shard_columns import array_columns


class LocalFiles:
    """Local files, shards memory-mapped."""

    def read_text(self, path: str) -> str:
        with open(path, encoding="utf-8") as f:
            return f.read()

    def open(self, path: str) -> pa.NativeFile:
        return pa.memory_map(path, "r")

    open_random = open  # a file read in parts (the manifest's file table): a mapping already is

    def prefetch(self, path: str) -> None:
        """Nothing to do: the page cache reads ahead."""


class RemoteFiles:
    """gs:// through pyarrow's GCS filesystem. A shard is fetched whole into memory (one
    sequential read, then zero-copy views), and `prefetch` fetches the next shard in a
    background thread while the current one is consumed: at most two shards are held."""

    def __init__(self) -> None:
        self._pid: int | None = None  # the process that owns the client and the thread (DataLoader workers fork)
        self._fs: pafs.GcsFileSystem | None = None
        self._pending: dict[str, Future] = {}
        self._pool: ThreadPoolExecutor | None = None

    def _own(self) -> pafs.GcsFileSystem:
        """This process's client (a forked DataLoader worker makes its own)."""
        if self._fs is None or self._pid != os.getpid():
            self._pid, self._fs, self._pool, self._pending = os.getpid(), gcs_filesystem(), None, {}
        return self._fs

    @staticmethod
    def _key(path: str) -> str:
        return path.split("://", 1)[1]

    def read_text(self, path: str) -> str:
        return self._fetch(path).decode("utf-8")

    def _fetch(self, path: str) -> bytes:
        """The whole object (pyarrow raises FileNotFoundError for a missing one)."""
        with self._own().open_input_stream(self._key(path)) as f:
            return f.read()

    def prefetch(self, path: str) -> None:
        self._own()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1)
        if path not in self._pending:
            self._pending = {path: self._pool.submit(self._fetch, path)}  # one shard ahead at most

    def open_random(self, path: str) -> pa.NativeFile:
        """A file read in parts, by ranged requests (the manifest's file table)."""
        return self._own().open_input_file(self._key(path))

    def open(self, path: str) -> pa.NativeFile:
        self._own()
        pending = self._pending.pop(path, None)
        return pa.BufferReader(pending.result() if pending is not None else self._fetch(path))

    def __getstate__(self):  # spawned DataLoader workers: a fresh client and thread each
        return {"_pid": None, "_fs": None, "_pending": {}, "_pool": None}


def gcs_filesystem() -> pafs.GcsFileSystem:
    """pyarrow's GCS client; against the emulator named by STORAGE_EMULATOR_HOST, anonymous."""
    emulator = os.environ.get("STORAGE_EMULATOR_HOST")
    if emulator:
        scheme, _, host = emulator.rpartition("://")
        return pafs.GcsFileSystem(anonymous=True, endpoint_override=host, scheme=scheme or "http")
    return pafs.GcsFileSystem()


def files_for(source: str):
    if source.startswith("gs://"):
        return RemoteFiles()
    if "://" in source:
        raise ValueError(f"{source}: shard directories are local paths or gs:// URLs")
    return LocalFiles()


class OpenShard:
    """One shard's record batches as numpy views of the mapped (or fetched) file: every column
    of one shape per row (`schemas/shard_columns.py`; not doc_ids) and its source's number."""

    def __init__(
        self, file: pa.NativeFile, batches: list[pa.RecordBatch], sources: list[np.ndarray], row_order: np.ndarray
    ):
        """`sources`: each batch's rows' source numbers (their names' among the manifest's)."""
        self._file = file
        self._batches = []  # per record batch: column name -> numpy [rows, ...] (zero-copy view)
        batch_rows = []
        for batch, numbers in zip(batches, sources):
            columns = {column.name: shard_column(batch, column.name) for column in array_columns()}
            columns["source"] = numbers
            self._batches.append(columns)
            batch_rows.append(batch.num_rows)
        self._batch_starts = np.concatenate([[0], np.cumsum(batch_rows)])
        self.row_order = row_order

    def rows(self, offsets: np.ndarray) -> dict[str, np.ndarray]:
        """The rows at `offsets` in this epoch's row order, copied out of the mapping (safe to
        keep after the shard is unmapped, and writable); tokens and neighbours widened to int64
        as they are copied, row by row, so each byte is touched once."""
        rows = self.row_order[offsets]
        which = np.searchsorted(self._batch_starts, rows, side="right") - 1
        local = rows - self._batch_starts[which]
        out = {  # integer columns as int64, what torch's embeddings take
            name: np.empty((len(rows), *column.shape[1:]), np.int64 if column.dtype.kind in "iu" else column.dtype)
            for name, column in self._batches[0].items()
        }
        for b in np.unique(which).tolist():
            mine = np.flatnonzero(which == b)
            for name, column in self._batches[b].items():
                if column.ndim == 1 or column[0].nbytes < 4096:  # small: one fancy-indexing copy
                    out[name][mine] = column[local[mine]]
                else:  # large rows: copy (and widen) each once, no temporary
                    for i, row in zip(mine.tolist(), local[mine].tolist()):
                        out[name][i] = column[row]
        return out

    def close(self) -> None:
        self._batches = []  # drop the views before the mapping
        self._file.close()
