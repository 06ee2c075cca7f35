"""The chunk database as files: one file's rows as a table (`chunks_table`, what the index job
writes), which file holds a chunk id, and reading one file's columns (`chunk_arrays`: the one
reader of chunk rows, for the lookups here, `validate` and the build-shards job).

Chunk ids are dense and `chunks-NNNNN.parquet` holds the ids NNNNN·R ... in order
(`validate_index` checks both), so the manifest's row counts say where every id lives. A
lookup by chunk id is then a shuffle of the requests by file plus one read of that file.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.chunks.chunking import Chunk
from pipeline.chunks.deleted import DeletedRanges
from pipeline.chunks.file_runs import FileRuns, FileRunsBuilder
from pipeline.common import fileio
from pipeline.common.arrays import groups
from pipeline.common.names import file_name, file_number
from schemas.arrow import chunk_schema, fixed_size_list, tensor_column_to_numpy

CHUNK_COLUMNS = ("chunk_id", "doc_id", "position", "tokens", "continuation")  # schemas.arrow.chunk_schema
TENSOR_COLUMNS = ("tokens", "continuation")
EMBEDDINGS_DIR = "embeddings"  # beside chunks/: embeddings/embeddings-NNNNN.parquet, the same ids as chunks-NNNNN
# Rows a chunk file's Parquet row group holds: `validate --sample` reads only the row groups its
# references point into. Smaller groups cost bytes (each repeats its dictionary pages): +15%
# at 1,024 rows against one group for a 65,536-row file of m = 64 Zipf-like tokens.
CHUNK_ROW_GROUP_ROWS = 1024


def chunks_table(chunks: list[Chunk], m: int) -> pa.Table:
    return pa.Table.from_arrays(
        [
            pa.array([c.chunk_id for c in chunks], pa.int64()),
            pa.array([c.doc_id for c in chunks], pa.int64()),
            pa.array([c.position for c in chunks], pa.int32()),
            fixed_size_list(np.stack([c.tokens for c in chunks]), m),
            fixed_size_list(np.stack([c.continuation for c in chunks]), m),
        ],
        schema=chunk_schema(m),
    )


def chunk_arrays(table, columns=CHUNK_COLUMNS) -> dict[str, np.ndarray]:
    """Columns of a chunk file's table (or of a batch of its rows) as numpy arrays by column
    name: chunk_id, doc_id, position [rows]; tokens, continuation [rows, m] (zero-copy if it can)."""
    return {c: (tensor_column_to_numpy(table[c]) if c in TENSOR_COLUMNS else table[c].to_numpy()) for c in columns}


@dataclass(frozen=True)
class ChunkRows:
    """The rows of one chunk file, column by column."""

    chunk_id: np.ndarray  # [rows]
    doc_id: np.ndarray  # [rows]
    position: np.ndarray  # [rows], the chunk's place in its document
    tokens: np.ndarray  # [rows, m]
    continuation: np.ndarray  # [rows, m], the document's next chunk or padding

    @classmethod
    def of(cls, table) -> ChunkRows:
        return cls(**chunk_arrays(table))

    def __len__(self) -> int:
        return len(self.chunk_id)


@dataclass(frozen=True)
class TrainingChunks:
    """Training chunks as sequences are packed from them: no continuation (a sequence holds
    its own chunks' tokens only; the continuation is a neighbour's) and no position, so the
    shuffle that packs them carries half the tokens a chunk file holds."""

    chunk_id: np.ndarray  # [rows]
    doc_id: np.ndarray  # [rows]
    tokens: np.ndarray  # [rows, m]

    @classmethod
    def of(cls, table, deleted: DeletedRanges | None = None) -> TrainingChunks:
        """From a table (or batch) of chunk rows with at least TRAINING_COLUMNS, the `deleted`
        documents' chunks left out (they are in no sequence)."""
        block = cls(**chunk_arrays(table, TRAINING_COLUMNS))
        if deleted is None or not len(deleted):
            return block
        return block.take(np.flatnonzero(~deleted.contains(block.chunk_id)))

    @classmethod
    def of_chunks(cls, chunks: list[Chunk]) -> TrainingChunks:
        return cls(
            np.array([c.chunk_id for c in chunks], np.int64),
            np.array([c.doc_id for c in chunks], np.int64),
            np.stack([c.tokens for c in chunks]).astype(np.int32),
        )

    @classmethod
    def concatenate(cls, blocks: list[TrainingChunks]) -> TrainingChunks:
        return cls(*(np.concatenate([getattr(b, c) for b in blocks]) for c in TRAINING_COLUMNS))

    def take(self, rows: np.ndarray) -> TrainingChunks:
        return TrainingChunks(*(getattr(self, c)[rows] for c in TRAINING_COLUMNS))

    def heads(self) -> TrainingChunks:
        """Each chunk's first token alone (tokens [rows, 1]): what packing needs of chunks
        whose tokens the rows' assembly reads again from their chunk files
        (`ChunkFileRanges.read_tokens`), so the shuffles between carry 4 B a chunk, not 4·m."""
        return TrainingChunks(self.chunk_id, self.doc_id, np.ascontiguousarray(self.tokens[:, :1]))

    def __len__(self) -> int:
        return len(self.chunk_id)


TRAINING_COLUMNS = tuple(f.name for f in fields(TrainingChunks))  # what packing a sequence reads of a chunk


def in_file_order(entries, prefix: str) -> list:
    """The manifest entries of `prefix/` files by their number (`name-NNNNN.ext`)."""
    return sorted((e for e in entries if e.path.startswith(prefix + "/")), key=lambda e: file_number(e.path))


@dataclass(frozen=True)
class ChunkFileRanges:
    """Where each chunk id of an index directory lives (small and picklable: it travels with
    the transforms that look chunks up): the chunk files as runs (`FileRuns`), a few a
    generation however many files there are."""

    directory: str  # the index directory
    chunks: FileRuns  # chunk files relative to it, in chunk-id order: file f holds ids start(f) ... start(f + 1) - 1
    # the embedding file of each chunk file, where a manifest lists them (a commit may have
    # numbered their names); None for files given directly: embeddings/embeddings-NNNNN.parquet
    embeddings: FileRuns | None = None

    @classmethod
    def from_entries(cls, directory: str, entries) -> ChunkFileRanges:
        """From an index manifest's file entries (anything with .path and .rows)."""
        chunks = [e for e in entries if e.path.startswith("chunks/")]
        embeddings = [e for e in entries if e.path.startswith(f"{EMBEDDINGS_DIR}/")]
        return cls.from_paths(
            directory, [e.path for e in chunks], [e.rows for e in chunks], [e.path for e in embeddings]
        )

    @classmethod
    def of_manifest(cls, manifest, directory: str) -> ChunkFileRanges:
        """From an index manifest's file table (or inline entries), its `path` and `rows` columns
        a row group at a time: no object per entry. ValueError for a file number listed twice."""
        runs = {prefix: FileRunsBuilder() for prefix in ("chunks", EMBEDDINGS_DIR)}
        for table in fileio.entry_batches(manifest, directory, ["path", "rows"], tuple(runs)):
            for prefix, builder in runs.items():
                listed = fileio.under(table, prefix)
                builder.add(listed["path"], listed["rows"])
        embeddings = runs[EMBEDDINGS_DIR].build()
        return cls(directory, runs["chunks"].build(), embeddings if embeddings.num_files else None)

    @classmethod
    def from_paths(
        cls, directory: str, paths: list[str], rows: list[int], embedding_paths: list[str] | None = None
    ) -> ChunkFileRanges:
        """From the paths of the chunk files and their row counts (and of the embedding files),
        in any order."""
        embeddings = FileRuns.of(embedding_paths, [0] * len(embedding_paths)) if embedding_paths else None
        return cls(directory, FileRuns.of(paths, rows), embeddings)

    @property
    def num_chunks(self) -> int:
        return self.chunks.num_rows

    @property
    def num_files(self) -> int:
        return self.chunks.num_files

    def start(self, number: int) -> int:
        """The first chunk id of file `number` (num_chunks for number num_files)."""
        return self.chunks.start(number)

    def file_of(self, chunk_id: int) -> int:
        """The number of the file holding `chunk_id`; an error for an id not in the database."""
        if not 0 <= chunk_id < self.num_chunks:
            raise ValueError(
                f"chunk id {chunk_id} is not in the chunk database at {self.directory} ({self.num_chunks} chunks)"
            )
        return int(self.chunks.positions_of(np.array([chunk_id]))[0])

    def files_of(self, chunk_ids: np.ndarray) -> np.ndarray:
        """file_of for an array of ids (unchecked)."""
        return self.chunks.positions_of(chunk_ids)

    def starts_a_file(self, chunk_id: int) -> bool:
        """Whether `chunk_id` is a file's first id, or num_chunks (where the last file ends)."""
        if not 0 <= chunk_id < self.num_chunks:
            return chunk_id == self.num_chunks
        return self.start(self.file_of(chunk_id)) == chunk_id

    def read(self, number: int, columns: list[str]) -> dict[str, np.ndarray]:
        """These columns of file `number` (tensor columns as [rows, width] arrays), after
        checking that it holds the ids the manifest puts there."""
        return chunk_arrays(self._read_checked(number, self.chunks.path(number), columns), columns)

    def read_tokens(self, first: int, end: int) -> np.ndarray:
        """The tokens of chunk ids first … end - 1, int32 [end - first, m]: only the Parquet row
        groups holding them are read, each file's checked to hold the ids the manifest puts there."""
        parts = []
        for number in range(self.file_of(first), self.file_of(end - 1) + 1):
            start = self.start(number)
            at = np.arange(max(first, start), min(end, self.start(number + 1))) - start
            table = self._rows_checked(number, self.chunks.path(number), at, ["tokens"])
            parts.append(chunk_arrays(table, ["tokens"])["tokens"])
        return np.concatenate(parts).astype(np.int32, copy=False)

    def read_embeddings(self, number: int) -> np.ndarray:
        """The embeddings of file `number`'s chunks, float32 [rows, d]: the embedding file of
        the same number (the index stage writes both from one chunk-id bucketing), checked
        to hold the same ids."""
        table = self._read_checked(number, self._embedding_path(number), ["embedding"])
        return np.ascontiguousarray(tensor_column_to_numpy(table["embedding"]), np.float32)

    def read_embedding_rows(self, chunk_ids: np.ndarray) -> np.ndarray:
        """The embeddings of these chunk ids (any order), float32 [n, d]: only the Parquet row
        groups holding them are read, each checked as `read_tokens` checks its."""
        chunk_ids = np.asarray(chunk_ids, np.int64)
        for chunk_id in (chunk_ids.min(), chunk_ids.max()) if len(chunk_ids) else ():
            self.file_of(int(chunk_id))  # an error naming an id the database does not hold
        vectors = np.zeros((len(chunk_ids), 0), np.float32)
        for number, where in groups(self.files_of(chunk_ids)):
            at = np.unique(chunk_ids[where] - self.start(number))
            table = self._rows_checked(number, self._embedding_path(number), at, ["embedding"])
            rows = tensor_column_to_numpy(table["embedding"])
            if not vectors.shape[1]:
                vectors = np.zeros((len(chunk_ids), rows.shape[1]), np.float32)
            vectors[where] = rows[np.searchsorted(at, chunk_ids[where] - self.start(number))]
        return vectors

    def _embedding_path(self, number: int) -> str:
        if self.embeddings is not None:
            return self.embeddings.path(number)
        return fileio.join(EMBEDDINGS_DIR, file_name(EMBEDDINGS_DIR, self.chunks.number(number), "parquet"))

    def _rows_checked(self, number: int, relative: str, at: np.ndarray, columns: list[str]):
        """Rows `at` (positions in file `number`, ascending, distinct) of these columns, from
        the Parquet row groups holding them alone, checked to hold the ids the manifest puts there."""
        path = fileio.join(self.directory, relative)
        with fileio.open_read(path) as f:
            parquet = pq.ParquetFile(f)
            sizes = np.array([parquet.metadata.row_group(g).num_rows for g in range(parquet.num_row_groups)])
            group_of = np.searchsorted(np.cumsum(sizes), at, side="right")
            read = np.unique(group_of)
            table = parquet.read_row_groups(read.tolist(), columns=["chunk_id", *columns])
        # a row's place in the groups read: where its group starts among them, plus its place in the group
        first_of_read = np.concatenate([[0], np.cumsum(sizes[read])[:-1]])
        first_of_group = np.cumsum(sizes) - sizes
        places = first_of_read[np.searchsorted(read, group_of)] + at - first_of_group[group_of]
        contiguous = len(places) and places[-1] - places[0] == len(places) - 1
        table = table.slice(int(places[0]), len(places)) if contiguous else table.take(places)
        ids = self.start(number) + at
        if not np.array_equal(table["chunk_id"].to_numpy(), ids):
            raise ValueError(
                f"{path} does not hold the chunk ids {ids[0]}..{ids[-1]} its manifest implies: "
                "run `ratrain-pipeline validate` on the index"
            )
        return table

    def _read_checked(self, number: int, relative: str, columns: list[str]):
        path = fileio.join(self.directory, relative)
        with fileio.open_read(path) as f:
            table = pq.ParquetFile(f).read(columns=["chunk_id", *columns])
        start, end = self.start(number), self.start(number + 1)
        if not np.array_equal(table["chunk_id"].to_numpy(), np.arange(start, end)):
            raise ValueError(
                f"{path} does not hold the chunk ids {start}..{end - 1} its manifest "
                "implies: run `ratrain-pipeline validate` on the index"
            )
        return table
