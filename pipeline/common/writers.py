"""Deterministic file writers: rows are grouped by id range, sorted, and written under stable
names, so a file's bytes never depend on bundling or on the number of workers."""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.common import fileio
from pipeline.common.names import file_name
from schemas.arrow import embedding_schema, fixed_size_list
from schemas.manifest import FileEntry


def embeddings_table(rows: list[tuple[int, np.ndarray]]) -> pa.Table:
    vectors = np.stack([r[1] for r in rows]).astype(np.float32, copy=False)
    return pa.Table.from_arrays(
        [pa.array([r[0] for r in rows], pa.int64()), fixed_size_list(vectors, vectors.shape[1])],
        schema=embedding_schema(vectors.shape[1]),
    )


def parquet_bytes(table: pa.Table, row_group_rows: int | None = None) -> bytes:
    """`row_group_rows`: rows a Parquet row group holds (pyarrow's default: up to 1Mi)."""
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd", row_group_size=row_group_rows)
    return sink.getvalue()


def write_file(directory: str, name: str, data: bytes, rows: int, relative_to: str) -> FileEntry:
    """Write one file; return its manifest entry (path relative to the stage directory)."""
    path = fileio.join(directory, name)
    fileio.write_bytes(path, data)
    relative = path[len(relative_to.rstrip("/")) + 1 :]
    return FileEntry(path=relative, rows=rows, bytes=len(data), sha256=fileio.sha256_bytes(data))


@dataclass(frozen=True)
class _FilePart:
    """Rows of a batch that go to one file, as one element (a list is pickled item by item)."""

    rows: list


class WriteGroupedFiles(beam.PTransform):
    """Rows (or batches of them, `rows_of(batch)` their rows; `grouped`: each batch all of one
    file's rows) -> files `<directory>/<prefix>-NNNNN.<ext>`, file
    NNNNN holding the rows with `key(row) // rows_per_file == NNNNN`, sorted by key. Yields
    manifest entries (`entry`, a FileEntry model), with what `facts(rows)` says of the rows
    written added to each (facts from the data, not metrics)."""

    def __init__(
        self,
        directory: str,
        *,
        relative_to: str,
        prefix: str,
        extension: str,
        key: Callable,
        rows_per_file: int,
        to_bytes: Callable[[list], bytes],
        facts: Callable[[list], dict] | None = None,
        entry: type[FileEntry] = FileEntry,
        rows_of: Callable[[Any], list] | None = None,
        grouped: bool = False,
    ):
        super().__init__()
        if grouped and rows_of is None:
            raise ValueError("grouped: each element is one file's rows, a batch `rows_of` reads")
        self.rows_of, self.grouped = rows_of, grouped
        self.directory, self.relative_to = directory, relative_to
        self.prefix, self.extension = prefix, extension
        self.key, self.rows_per_file, self.to_bytes = key, rows_per_file, to_bytes
        self.facts, self.entry = facts, entry

    def expand(self, rows):
        key, per_file, rows_of = self.key, self.rows_per_file, self.rows_of

        def write(group):
            number, members = group
            if rows_of is not None:
                members = [row for part in members for row in part.rows]
            members = sorted(members, key=key)
            entry = write_file(
                self.directory,
                file_name(self.prefix, number, self.extension),
                self.to_bytes(members),
                len(members),
                self.relative_to,
            )
            return self.entry(**entry.model_dump(), **(self.facts(members) if self.facts else {}))

        def parts_by_file(batch):
            by_file: dict[int, list] = {}
            for row in rows_of(batch):
                by_file.setdefault(key(row) // per_file, []).append(row)
            for number, rows in by_file.items():
                yield number, _FilePart(rows)

        def one_file(batch):
            parts = list(parts_by_file(batch))
            if len(parts) != 1:
                raise ValueError(
                    f"a batch of {self.prefix} rows for one file holds rows of files {[n for n, _ in parts]}"
                )
            return write((parts[0][0], [parts[0][1]]))

        if self.grouped:  # each batch is all of one file's rows: written where it is, not shuffled
            return rows | "WriteFile" >> beam.Map(one_file)
        keyed = (
            rows | "KeyByFile" >> beam.FlatMap(parts_by_file)
            if rows_of is not None
            else rows | "KeyByFile" >> beam.Map(lambda row: (key(row) // per_file, row))
        )
        return keyed | "GroupByFile" >> beam.GroupByKey() | "WriteFile" >> beam.Map(write)
