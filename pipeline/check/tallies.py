"""What `validate`'s plan sums over a manifest's entries, streamed from its file table a row group
at a time (`fileio.entry_batches`): an index's files as runs (`IndexFiles`), a shards manifest's
rows and filled slots (`ShardTotals`). No object per entry but the few faiss entries.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from pipeline.check.problems import manifest_problem
from pipeline.check.sample import Sample
from pipeline.chunks.chunk_files import ChunkFileRanges
from pipeline.chunks.deleted import DELETED_DIR
from pipeline.common import fileio
from schemas.file_table import entry_count
from schemas.manifest import FileEntry


@dataclass
class IndexFiles:
    """An index manifest's files as the plan needs them: its chunk and embedding files as runs
    (`ChunkFileRanges`), its faiss entries, its deleted-document files (full paths), and how
    many files it lists."""

    ranges: ChunkFileRanges
    faiss: list[FileEntry]
    deleted: list[str]
    listed: int

    @classmethod
    def of(cls, manifest, directory: str) -> IndexFiles:
        try:
            ranges = ChunkFileRanges.of_manifest(manifest, directory)
        except ValueError as err:  # a file number listed twice, a file without rows
            raise manifest_problem(f"{directory}: {err}") from None
        faiss, deleted = [], []
        for table in fileio.entry_batches(manifest, directory, list(FileEntry.model_fields), ("faiss", DELETED_DIR)):
            faiss += [FileEntry(**entry) for entry in fileio.under(table, "faiss").to_pylist()]
            deleted += [fileio.join(directory, p) for p in fileio.under(table, DELETED_DIR)["path"].to_pylist()]
        return cls(ranges, faiss, deleted, entry_count(manifest))


@dataclass
class ShardTotals:
    """The sums of a shards manifest's entries (those a sample chooses, or all): rows, and the
    neighbour slots filled where every entry counts them (else None)."""

    shards: int = 0
    rows: int = 0
    filled: int | None = 0

    @classmethod
    def of(cls, manifest, directory: str, sample: Sample | None = None) -> ShardTotals:
        totals = cls()
        for table in fileio.entry_batches(manifest, directory, ["path", "rows", "neighbour_slots_filled"]):
            if sample is not None and not sample.complete:
                table = table.filter(pa.array([sample.chooses(path) for path in table["path"].to_pylist()]))
            if table["rows"].null_count:
                raise manifest_problem(f"{directory}: a shard entry without rows in its file table")
            totals.shards += table.num_rows
            totals.rows += pc.sum(table["rows"]).as_py() or 0
            filled = table["neighbour_slots_filled"]
            totals.filled = (
                None if totals.filled is None or filled.null_count else totals.filled + (pc.sum(filled).as_py() or 0)
            )
        return totals
