"""The one writer of a manifest's file table (docs/design.md §4): `TableWriter`, the commit's,
a row group at a time, hashed as it is written. Its reader is `schemas/file_table.py`."""

from __future__ import annotations

import hashlib

import pyarrow as pa
import pyarrow.parquet as pq

from schemas.file_table import TABLE_ROW_GROUP, table_schema
from schemas.manifest import FileEntry, FileTable


class _HashingSink:
    """A binary stream that hashes and counts what it passes on to `raw`."""

    closed = False

    def __init__(self, raw):
        self.raw, self.digest, self.size = raw, hashlib.sha256(), 0

    def write(self, data) -> int:
        data = bytes(data)
        self.digest.update(data)
        self.size += len(data)
        self.raw.write(data)
        return len(data)

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        pass

    def close(self) -> None:  # its owner closes `raw`
        self.closed = True


class TableWriter:
    """The one writer of a file table: entries written in the order given, an Arrow table of them
    at a time (`write`), in row groups of TABLE_ROW_GROUP entries, hashed and counted as the bytes
    go to the binary stream `raw`; `close()` gives the manifest's reference to the table (at
    `path`). It holds at most a row group of entries: a commit of 10^6 files never holds them all."""

    def __init__(self, raw, model: type[FileEntry], path: str):
        self._schema, self._path = table_schema(model), path
        self._sink = _HashingSink(raw)
        self._writer = pq.ParquetWriter(self._sink, self._schema, compression="zstd")
        self._held: pa.Table = self._schema.empty_table()
        self._entries = 0

    def write(self, table: pa.Table) -> None:
        self._held = pa.concat_tables([self._held, table.select(self._schema.names).cast(self._schema)])
        self._entries += table.num_rows
        while self._held.num_rows >= TABLE_ROW_GROUP:
            self._writer.write_table(self._held.slice(0, TABLE_ROW_GROUP), row_group_size=TABLE_ROW_GROUP)
            self._held = self._held.slice(TABLE_ROW_GROUP)

    def close(self) -> FileTable:
        if self._held.num_rows:
            self._writer.write_table(self._held, row_group_size=TABLE_ROW_GROUP)
        self._writer.close()
        digest = self._sink.digest.hexdigest()
        return FileTable(path=self._path, sha256=digest, entries=self._entries, bytes=self._sink.size)
