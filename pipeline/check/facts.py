"""What `validate` reads from a directory before checking it: its manifest's facts (`IndexFacts`,
`ShardsFacts`, `FaissFacts`), the units (a chunk file, an embedding file, a listed file),
the chunk files' boundary rows (`ChunkFileEnds`, `ChunkFileSummary`), and the probes the faiss check searches.
"""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass, field

import numpy as np

from pipeline.check.problems import require
from pipeline.chunks.chunk_files import ChunkFileRanges
from pipeline.chunks.deleted import DeletedRanges
from pipeline.common import fileio
from pipeline.common.rejected import NEAR_DUPLICATE
from pipeline.index.files import LIST_OWNERS_FILE, QUANTIZER_FILE, searched_files
from schemas.manifest import FileEntry, unversioned


@dataclass(frozen=True)
class EntryGroup:
    """A row group of a manifest's file table (group 0: its inline entries), whose entries one
    worker turns into units (`pipeline.check.units.units_of`) as its `role` says: "index" (chunk
    files, embedding files, the rest listed), "shards", "chunks" (the chunk files alone, of an
    index not validated), "listed" (every file listed)."""

    directory: str
    role: str
    group: int


@dataclass(frozen=True)
class ListedFile:
    """A listed file no check reads, checked by its size and sha256."""

    directory: str
    entry: FileEntry


@dataclass(frozen=True)
class ListedSizes:
    """Listed files no check reads, checked by their sizes alone (a sample): a row group's."""

    directory: str
    entries: tuple[FileEntry, ...]


@dataclass(frozen=True)
class ChunkFileUnit:
    """One chunk file to check: read whole against the rules when `sampled`, otherwise only
    the row groups that references point into (its sha256 is then checked as a listed file)."""

    number: int
    entry: FileEntry
    sampled: bool


@dataclass(frozen=True)
class EmbeddingFileUnit:
    position: int  # in chunk-id order
    entry: FileEntry
    start: int  # its first chunk id


@dataclass(frozen=True, kw_only=True)
class IndexFacts:
    directory: str
    chunk_tokens: int
    pad_id: int
    num_documents: int  # not deleted
    chunks: ChunkFileRanges
    dim: int  # the embeddings' width
    removed_doc_ids: tuple[int, ...] = ()  # removed as near-duplicates of evaluation documents: in no chunk file
    deleted: DeletedRanges = field(default_factory=DeletedRanges.none)  # deleted documents: in no search
    generation_starts: tuple[int, ...] = ()  # each generation's first chunk id


@dataclass(frozen=True, kw_only=True)
class ShardsFacts:
    directory: str
    sequence_tokens: int
    chunk_tokens: int
    neighbours: int
    pad_id: int
    same_corpus: bool
    metadata: tuple  # (key, value) every shard's schema metadata must hold
    chunks: ChunkFileRanges  # the chunk database the neighbours point into
    removed_doc_ids: tuple[int, ...] = ()  # training documents removed as near-duplicates: in no sequence
    deleted: DeletedRanges = field(default_factory=DeletedRanges.none)  # the index's deleted documents: no neighbour
    sources: tuple[str, ...] = ()  # a blend's source names, every shard's source dictionary (else any one name)
    # a blend's (rows, tokens) per source as its manifest counts them, where every shard is checked
    source_totals: tuple[tuple[int, int], ...] | None = None

    @property
    def chunks_per_sequence(self) -> int:
        return self.sequence_tokens // self.chunk_tokens


@dataclass(frozen=True, kw_only=True)
class FaissFacts:
    directory: str
    nprobe: int | None
    num_vectors: int
    dim: int
    files: tuple  # (path, vectors, bytes) of index.faiss or of each slice, in number order
    sha256: dict[str, str]  # {path: sha256} of every faiss file, as the manifest signs it
    slice_bytes: int | None
    routing: tuple[str, str] | None  # slices by lists: quantizer.faiss and list_owners.npy
    deleted: DeletedRanges = field(default_factory=DeletedRanges.none)  # ids removed: never returned

    @property
    def num_ids(self) -> int:
        """Ids lie in [0, num_ids): the vectors held and those removed."""
        return self.num_vectors + self.deleted.num_chunks

    @classmethod
    def of(
        cls, directory: str, manifest, entries: list[FileEntry], num_vectors: int, deleted: DeletedRanges
    ) -> FaissFacts:
        faiss_entries = {f.path: f for f in entries if f.path.startswith("faiss/")}
        searched = searched_files(list(faiss_entries))
        files = tuple((path, faiss_entries[path].rows, faiss_entries[path].bytes) for path in searched)
        named = {unversioned(path): path for path in faiss_entries}  # a commit may have numbered them
        quantizer, owners = (f"faiss/{QUANTIZER_FILE}", f"faiss/{LIST_OWNERS_FILE}")
        routing = (named[quantizer], named[owners]) if {quantizer, owners} <= set(named) else None
        return cls(
            directory=directory,
            nprobe=manifest.nprobe,
            num_vectors=num_vectors,
            dim=manifest.dim,
            files=files,
            sha256={path: entry.sha256 for path, entry in faiss_entries.items()},
            slice_bytes=manifest.slice_bytes,
            routing=routing,
            deleted=deleted,
        )


@dataclass(frozen=True, kw_only=True)
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
class ChunkFileChecked:
    """What reading a chunk file gave: its summary when the rules were checked, and the
    bytes read from it (the whole file, or the row groups references point into)."""

    bytes_read: int
    summary: ChunkFileSummary | None


@dataclass(frozen=True)
class Probes:
    ids: np.ndarray  # chunk ids
    vectors: np.ndarray  # their embeddings


def removed_documents(stage_directory: str, stage: str, counted: int) -> tuple[int, ...]:
    """The doc ids a stage removed as near-duplicates of evaluation documents, from its
    rejected records (`<output>/rejected/<stage>-*.jsonl`, beside the stage's directory);
    a problem when they are not the `counted` its manifest says."""
    if not counted:
        return ()
    rejected = fileio.join(posixpath.dirname(stage_directory.rstrip("/")), "rejected")
    found = []
    for path in fileio.list_files(rejected):
        if posixpath.basename(path).startswith(f"{stage}-"):
            with fileio.open_read(path) as f:
                found += [r["doc_id"] for r in map(json.loads, f) if r["reason"] == NEAR_DUPLICATE]
    require(
        len(found) == counted,
        f"{stage_directory}: {len(found)} rejected records of near-duplicates of evaluation documents in "
        f"{rejected}, the manifest counts {counted}",
        "manifest",
    )
    return tuple(sorted(found))
