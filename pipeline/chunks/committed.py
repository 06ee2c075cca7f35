"""A committed index's files named by its manifest alone (directory and sha256): what a job graph
carries instead of the manifest or a file list, so it stays the same size however large the index.
Each process reads what it asks for once, from the current commit or a kept older one (a commit
no longer kept is refused): the chunk files' ranges, the files under one directory of the index,
the faiss files, or the deleted documents.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from pipeline.chunks.chunk_files import ChunkFileRanges
from pipeline.chunks.deleted import DELETED_DIR, DeletedFiles, DeletedRanges
from pipeline.common import fileio


@dataclass(frozen=True)
class CommittedIndexManifest:
    """A committed index manifest named by its directory and sha256 alone (and its chunk count):
    what a job graph carries instead of the manifest (138 MB pickled at 3e10 chunks, in every
    step given it). Each process reads what it asks for once, from the current commit or a kept
    older one: its fields without the file table (`summary`), its faiss files (`faiss_entries`),
    or its deleted documents (`deleted`); never every entry (~1.6 GB of objects at 3·10^10
    chunks, an estimate)."""

    directory: str
    manifest_sha256: str
    num_chunks: int

    def summary(self):
        """The manifest's fields; its file entries only where they are inline (at most
        INLINE_FILE_ENTRIES), else none: read them with `faiss_entries` or `chunk_files`."""
        return _summary(self.directory, self.manifest_sha256)

    def faiss_entries(self) -> list:
        """The entries (FileEntry) of its faiss files alone, in manifest order."""
        return _faiss_entries(self.directory, self.manifest_sha256)

    def deleted(self) -> DeletedRanges:
        """The documents deleted from the index by its earlier generations."""
        return _deleted_of(self.directory, self.manifest_sha256)

    def chunk_files(self) -> CommittedChunkFiles:
        return CommittedChunkFiles(self.directory, self.num_chunks, self.manifest_sha256)


@functools.lru_cache(maxsize=2)
def _summary(directory: str, manifest_sha256: str):
    return _committed_manifest(directory, manifest_sha256)


@functools.lru_cache(maxsize=2)
def _faiss_entries(directory: str, manifest_sha256: str) -> list:
    from schemas.manifest import FileEntry

    manifest = _committed_manifest(directory, manifest_sha256)
    return [FileEntry(**entry) for entry in fileio.entries_under(manifest, directory, "faiss")]


@functools.lru_cache(maxsize=2)
def _deleted_of(directory: str, manifest_sha256: str) -> DeletedRanges:
    paths, _ = fileio.entry_paths_and_rows(_committed_manifest(directory, manifest_sha256), directory, DELETED_DIR)
    return DeletedFiles(tuple(fileio.join(directory, path) for path in paths)).ranges()


@dataclass(frozen=True)
class CommittedChunkFiles:
    """The chunk files of a committed index, named by its directory alone, so a job graph that
    carries them does not depend on how the chunk files were written. Each process reads the
    ranges from the index manifest the first time it looks a chunk up, a row group of its file
    table at a time: the commit the job was built against (its sha256), current or still kept;
    a commit no longer kept is refused."""

    directory: str
    num_chunks: int
    manifest_sha256: str  # of the index manifest the job was built against

    @property
    def ranges(self) -> ChunkFileRanges:
        return _committed_ranges(self.directory, self.manifest_sha256)

    @property
    def num_files(self) -> int:
        return self.ranges.num_files

    def start(self, number: int) -> int:
        return self.ranges.start(number)

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
    prefix: str  # chunks, embeddings, sources

    def paths(self) -> Iterator[str]:
        """Streamed from the manifest's file table: the step listing them never holds them all
        (its entry count checked; its sha256 is not, which needs the whole table read: each file
        is then checked where it is read)."""
        manifest = _committed_manifest(self.directory, self.manifest_sha256)
        for path in fileio.listed_paths(manifest, self.directory, self.prefix):
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
    return ChunkFileRanges.of_manifest(_committed_manifest(directory, manifest_sha256), directory)


@functools.lru_cache(maxsize=2)
def _committed_faiss_files(directory: str, manifest_sha256: str) -> dict[str, tuple[str, str]]:
    """{name: (stored path, sha256)} of the index's faiss files (`faiss_entries`: only those, a
    file table may list millions), by the name they have whatever commit wrote them."""
    from schemas.manifest import unversioned

    return {unversioned(e.path): (e.path, e.sha256) for e in _faiss_entries(directory, manifest_sha256)}
