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
from pipeline.chunks.chunk_files import EMBEDDINGS_DIR
from pipeline.chunks.deleted import DELETED_DIR
from pipeline.chunks.file_runs import FileRuns, FileRunsBuilder
from pipeline.common import fileio
from schemas.manifest import FileEntry


@dataclass
class IndexFiles:
    """What one pass over an index manifest's entries gives: its chunk and embedding files as
    runs, its faiss entries, its deleted-document files, and how many files it lists."""

    chunks: FileRuns
    embeddings: FileRuns
    faiss: list[FileEntry]
    deleted: list[str]  # full paths
    listed: int

    @classmethod
    def of(cls, manifest, directory: str) -> IndexFiles:
        chunks, embeddings, faiss, deleted, listed = FileRunsBuilder(), FileRunsBuilder(), [], [], 0
        for table in fileio.entry_batches(manifest, directory, list(FileEntry.model_fields)):
            listed += table.num_rows
            if table["rows"].null_count or table["path"].null_count:
                raise manifest_problem(f"{directory}: a file entry without a path or rows in its file table")
            for prefix, runs in (("chunks", chunks), (EMBEDDINGS_DIR, embeddings)):
                part = fileio.under(table, prefix)
                runs.add(part["path"], part["rows"])
            faiss += [FileEntry(**entry) for entry in fileio.under(table, "faiss").to_pylist()]
            deleted += [fileio.join(directory, p) for p in fileio.under(table, DELETED_DIR)["path"].to_pylist()]
        try:
            return cls(chunks.build(), embeddings.build(), faiss, deleted, listed)
        except ValueError as err:  # a file number listed twice
            raise manifest_problem(f"{directory}: {err}") from None


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
