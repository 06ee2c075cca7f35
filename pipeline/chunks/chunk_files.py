"""The chunk database as files: one file's rows as a table (`chunks_table`, what the index job
writes), which file holds a chunk id, and reading one file's columns (`chunk_arrays`: the one
reader of chunk rows, for the lookups here, `validate` and the build-shards job).

Chunk ids are dense and `chunks-NNNNN.parquet` holds the ids NNNNN·R ... in order
(`validate_index` checks both), so the manifest's row counts say where every id lives. A
lookup by chunk id is then a shuffle of the requests by file plus one read of that file.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Iterator
from dataclasses import dataclass, fields

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.chunks.chunking import Chunk
from pipeline.chunks.deleted import DELETED_DIR, DeletedFiles, DeletedRanges
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
    the transforms that look chunks up)."""

    directory: str  # the index directory
    paths: tuple[str, ...]  # chunk files relative to it, in chunk-id order
    starts: tuple[int, ...]  # file f holds ids starts[f] ... starts[f + 1] - 1
    # the embedding file of each chunk file, where a manifest lists them (a commit may have
    # numbered their names); () for files given directly: embeddings/embeddings-NNNNN.parquet
    embedding_paths: tuple[str, ...] = ()

    @classmethod
    def from_entries(cls, directory: str, entries) -> ChunkFileRanges:
        """From an index manifest's file entries (anything with .path and .rows)."""
        chunks = [e for e in entries if e.path.startswith("chunks/")]
        embeddings = [e.path for e in entries if e.path.startswith(f"{EMBEDDINGS_DIR}/")]
        return cls.from_paths(directory, [e.path for e in chunks], [e.rows for e in chunks], embeddings)

    @classmethod
    def from_paths(
        cls, directory: str, paths: list[str], rows: list[int], embedding_paths: list[str] | None = None
    ) -> ChunkFileRanges:
        """From the paths of the chunk files and their row counts (and of the embedding files),
        in any order."""
        order = sorted(range(len(paths)), key=lambda i: file_number(paths[i]))
        starts = np.cumsum([0] + [rows[i] for i in order]).tolist()
        embeddings = tuple(sorted(embedding_paths or (), key=file_number))
        return cls(directory, tuple(paths[i] for i in order), tuple(starts), embeddings)

    @property
    def num_chunks(self) -> int:
        return self.starts[-1]

    def file_of(self, chunk_id: int) -> int:
        """The number of the file holding `chunk_id`; an error for an id not in the database."""
        if not 0 <= chunk_id < self.num_chunks:
            raise ValueError(
                f"chunk id {chunk_id} is not in the chunk database at {self.directory} ({self.num_chunks} chunks)"
            )
        return bisect.bisect_right(self.starts, chunk_id) - 1

    def files_of(self, chunk_ids: np.ndarray) -> np.ndarray:
        """file_of for an array of ids (unchecked)."""
        return np.searchsorted(np.asarray(self.starts), chunk_ids, side="right") - 1

    def read(self, number: int, columns: list[str]) -> dict[str, np.ndarray]:
        """These columns of file `number` (tensor columns as [rows, width] arrays), after
        checking that it holds the ids the manifest puts there."""
        return chunk_arrays(self._read_checked(number, self.paths[number], columns), columns)

    def read_tokens(self, first: int, end: int) -> np.ndarray:
        """The tokens of chunk ids first … end - 1, int32 [end - first, m]: only the Parquet row
        groups holding them are read, each file's checked to hold the ids the manifest puts there."""
        parts = []
        for number in range(self.file_of(first), self.file_of(end - 1) + 1):
            start = self.starts[number]
            at = np.arange(max(first, start), min(end, self.starts[number + 1])) - start
            table = self._rows_checked(number, self.paths[number], at, ["tokens"])
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
            at = np.unique(chunk_ids[where] - self.starts[number])
            table = self._rows_checked(number, self._embedding_path(number), at, ["embedding"])
            rows = tensor_column_to_numpy(table["embedding"])
            if not vectors.shape[1]:
                vectors = np.zeros((len(chunk_ids), rows.shape[1]), np.float32)
            vectors[where] = rows[np.searchsorted(at, chunk_ids[where] - self.starts[number])]
        return vectors

    def _embedding_path(self, number: int) -> str:
        if self.embedding_paths:
            return self.embedding_paths[number]
        return fileio.join(EMBEDDINGS_DIR, file_name(EMBEDDINGS_DIR, file_number(self.paths[number]), "parquet"))

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
        ids = self.starts[number] + at
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
        start, end = self.starts[number], self.starts[number + 1]
        if not np.array_equal(table["chunk_id"].to_numpy(), np.arange(start, end)):
            raise ValueError(
                f"{path} does not hold the chunk ids {start}..{end - 1} its manifest "
                "implies: run `ratrain-pipeline validate` on the index"
            )
        return table


@dataclass(frozen=True)
class CommittedIndexManifest:
    """A committed index manifest named by its directory and sha256 alone (and its chunk count):
    what a job graph carries instead of the manifest (138 MB pickled at 3e10 chunks, in every
    step given it). Each process reads what it asks for once, from the current commit or a kept
    older one: the manifest whole (`read`: the steps that rewrite it, one worker each), or only
    its deleted documents (`deleted`: from the path column of its file table)."""

    directory: str
    manifest_sha256: str
    num_chunks: int

    def read(self):
        """The manifest with its file entries (IndexManifest); shared in the process: not to be changed."""
        return _whole_manifest(self.directory, self.manifest_sha256)

    def deleted(self) -> DeletedRanges:
        """The documents deleted from the index by its earlier generations."""
        return _deleted_of(self.directory, self.manifest_sha256)

    def chunk_files(self) -> CommittedChunkFiles:
        return CommittedChunkFiles(self.directory, self.num_chunks, self.manifest_sha256)


@functools.lru_cache(maxsize=2)
def _whole_manifest(directory: str, manifest_sha256: str):
    return fileio.whole(_committed_manifest(directory, manifest_sha256), directory)


@functools.lru_cache(maxsize=2)
def _deleted_of(directory: str, manifest_sha256: str) -> DeletedRanges:
    paths, _ = fileio.entry_paths_and_rows(_committed_manifest(directory, manifest_sha256), directory, DELETED_DIR)
    return DeletedFiles(tuple(fileio.join(directory, path) for path in paths)).ranges()


@dataclass(frozen=True)
class CommittedChunkFiles:
    """The chunk files of a committed index, named by its directory alone, so a job graph that
    carries them stays the same size however many chunk files there are (a `ChunkFileRanges`
    holds a path and a start per file: ~15 MB pickled at 457k files, copied into every transform
    that looks chunks up). Each process reads the ranges from the index manifest the first time
    it looks a chunk up: the commit the job was built against (its sha256), current or still
    kept; a commit no longer kept is refused."""

    directory: str
    num_chunks: int
    manifest_sha256: str  # of the index manifest the job was built against

    @property
    def ranges(self) -> ChunkFileRanges:
        return _committed_ranges(self.directory, self.manifest_sha256)

    @property
    def starts(self) -> tuple[int, ...]:
        return self.ranges.starts

    def file_of(self, chunk_id: int) -> int:
        return self.ranges.file_of(chunk_id)

    def files_of(self, chunk_ids: np.ndarray) -> np.ndarray:
        return self.ranges.files_of(chunk_ids)

    def read(self, number: int, columns: list[str]) -> dict[str, np.ndarray]:
        return self.ranges.read(number, columns)

    def read_embeddings(self, number: int) -> np.ndarray:
        return self.ranges.read_embeddings(number)

    def read_embedding_rows(self, chunk_ids: np.ndarray) -> np.ndarray:
        return self.ranges.read_embedding_rows(chunk_ids)

    def read_tokens(self, first: int, end: int) -> np.ndarray:
        return self.ranges.read_tokens(first, end)

    def stored(self, path: str) -> tuple[str, str]:
        """The faiss file the index manifest lists as `path` (in `directory`, by the name it has
        whatever commit wrote it: `schemas.manifest.unversioned`): (where it is stored, the
        sha256 the manifest signs it with, which it is checked against before faiss reads it)."""
        relative = path[len(self.directory.rstrip("/")) + 1 :]
        listed = _committed_faiss_files(self.directory, self.manifest_sha256)
        if relative not in listed:
            raise ValueError(f"{path}: not a faiss file of the index manifest in {self.directory}")
        stored, sha256 = listed[relative]
        return fileio.join(self.directory, stored), sha256

    def check_kept(self) -> None:
        """Look for the index manifest again: an error if its commit is no longer kept. No commit
        overwrites a file an earlier one lists, and their deletion ends with the manifest, so a
        file loaded before this check passes is the one this manifest describes."""
        _committed_manifest(self.directory, self.manifest_sha256)


@dataclass(frozen=True)
class CommittedFiles:
    """The files a committed index manifest lists under one directory of it (`prefix`), named by
    the manifest alone: a job reads them by the paths the manifest gives (a glob would also
    find files of another commit), listed on a worker, so the job graph does not grow with them."""

    directory: str
    manifest_sha256: str
    prefix: str  # chunks, embeddings

    def paths(self) -> Iterator[str]:
        """Streamed from the manifest's file table: the step listing them never holds them all."""
        manifest = _committed_manifest(self.directory, self.manifest_sha256)
        for path in fileio.entry_paths_streamed(manifest, self.directory, self.prefix):
            yield fileio.join(self.directory, path)


def _no_longer_kept(directory: str) -> ValueError:
    return ValueError(
        f"{directory}: the commit of the index a job was reading is no longer kept (a later commit "
        "replaced it; keep_commits keeps more): run the job again"
    )


def _committed_manifest(directory: str, manifest_sha256: str):
    """The index manifest in `directory` of this sha256: the current commit's, or an older one
    while it is kept (what a reader that started from it pins); else an error."""
    from schemas.manifest import IndexManifest, read_manifest

    found = fileio.kept_commit_of(directory, manifest_sha256)
    if found is None:
        raise _no_longer_kept(directory)
    return read_manifest(found[1], found[0], IndexManifest)


@functools.lru_cache(maxsize=2)
def _committed_ranges(directory: str, manifest_sha256: str) -> ChunkFileRanges:
    manifest = _committed_manifest(directory, manifest_sha256)
    paths, rows = fileio.entry_paths_and_rows(manifest, directory, "chunks")
    embeddings, _ = fileio.entry_paths_and_rows(manifest, directory, EMBEDDINGS_DIR)
    return ChunkFileRanges.from_paths(directory, paths, rows, embeddings)


@functools.lru_cache(maxsize=2)
def _committed_faiss_files(directory: str, manifest_sha256: str) -> dict[str, tuple[str, str]]:
    """{name: (stored path, sha256)} of the index's faiss files (only those: a file table may
    list millions), by the name they have whatever commit wrote them."""
    from schemas.manifest import unversioned

    manifest = _committed_manifest(directory, manifest_sha256)
    return {unversioned(p): (p, h) for p, h in fileio.entry_paths_and_sha256(manifest, directory, "faiss")}
