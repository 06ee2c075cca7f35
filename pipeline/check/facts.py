"""What `validate` reads from a directory before checking it: its manifest's facts (`IndexFacts`,
`ShardsFacts`, `FaissFacts`), the chunk files and their boundary rows (`ChunkFiles`,
`ChunkFileEnds`, `ChunkFileSummary`), and the probes the faiss check searches.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeline.check.problems import _parquet, _require
from pipeline.chunks.chunk_files import ChunkFileRanges, ChunkRows, in_file_order
from pipeline.common import fileio
from schemas.manifest import (
    IndexManifest,
)


class ChunkFiles:
    """The chunk files of an index directory, in chunk-id order, located as every reader
    locates them (`ChunkFileRanges`: file f holds the dense ids starts[f] ... starts[f + 1] - 1,
    checked against the rules by `check_chunk_file`), read after checking their sha256."""

    def __init__(self, directory: str, manifest: IndexManifest):
        self.directory = directory
        self.entries = in_file_order(manifest.files, "chunks")
        _require(self.entries, f"{directory}: manifest lists no chunk files", "manifest")
        self.ranges = ChunkFileRanges.from_entries(directory, manifest.files)
        self.starts = self.ranges.starts

    @property
    def num_chunks(self) -> int:
        return self.ranges.num_chunks

    def file_of(self, chunk_ids: np.ndarray) -> np.ndarray:
        return self.ranges.files_of(chunk_ids)

    def path(self, number: int) -> str:
        return fileio.join(self.directory, self.entries[number].path)

    def read(self, number: int) -> ChunkRows:
        return ChunkRows.of(_parquet(self.directory, self.entries[number]))


@dataclass(frozen=True)
class IndexFacts:
    directory: str
    chunk_tokens: int
    pad_id: int
    num_documents: int
    chunks: ChunkFiles
    embeddings: tuple  # the embedding files' entries, in chunk-id order
    embedding_starts: tuple  # embedding file e holds chunk ids from embedding_starts[e]
    dim: int  # the embeddings' width


@dataclass(frozen=True)
class ShardsFacts:
    directory: str
    sequence_tokens: int
    chunk_tokens: int
    neighbours: int
    pad_id: int
    same_corpus: bool
    metadata: tuple  # (key, value) every shard's schema metadata must hold
    chunks: ChunkFiles  # the chunk database the neighbours point into

    @property
    def chunks_per_sequence(self) -> int:
        return self.sequence_tokens // self.chunk_tokens


@dataclass(frozen=True)
class FaissFacts:
    directory: str
    nprobe: int | None
    num_vectors: int
    dim: int
    files: tuple  # (path, vectors, bytes) of index.faiss or of each slice, in chunk-id order
    slice_bytes: int | None

    @classmethod
    def of(cls, directory: str, manifest, num_vectors: int) -> FaissFacts:
        files = tuple((f.path, f.rows, f.bytes) for f in manifest.files if f.path.startswith("faiss/"))
        return cls(directory, manifest.nprobe, num_vectors, manifest.dim, files, manifest.slice_bytes)


@dataclass(frozen=True)
class ChunkFileEnds:
    """The first and last rows of a chunk file: what the check across its boundaries needs."""

    number: int
    first_doc: int
    first_position: int
    first_tokens: np.ndarray
    last_doc: int
    last_position: int
    last_continuation: np.ndarray


@dataclass(frozen=True)
class ChunkFileSummary:
    ends: ChunkFileEnds
    doc_starts: np.ndarray  # doc ids of the documents whose first chunk it holds


@dataclass(frozen=True)
class Probes:
    ids: np.ndarray  # chunk ids
    vectors: np.ndarray  # their embeddings
