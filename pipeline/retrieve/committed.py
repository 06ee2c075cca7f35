"""A committed index directory as retrieval reads it (`read_committed_index`): its faiss files,
routing files and deleted documents, without its file entries; for build-shards and for the
online `Retriever`.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.chunks.deleted import DELETED_DIR, DeletedFiles
from pipeline.common import fileio
from pipeline.common.errors import StageError
from pipeline.index.factory import ivf_lists
from pipeline.index.files import INDEX_FILE, LIST_OWNERS_FILE, QUANTIZER_FILE, searched_files
from pipeline.retrieve.search import Routing
from schemas.manifest import IndexManifest, read_manifest, unversioned


def faiss_files(paths: list[str]) -> list[str]:
    """Of an index manifest's file paths, the faiss files (index.faiss, or its shards in
    chunk-id order)."""
    return [path for path in paths if path.startswith("faiss/")]


@dataclass(frozen=True, kw_only=True)
class CommittedIndex:
    """What build-shards needs of a committed index, read without its file entries (only the
    faiss files' paths, from the path column of a file table of however many entries)."""

    directory: str
    manifest_sha256: str
    num_chunks: int
    nprobe: int | None  # the depth the index stage tuned
    faiss_paths: list[str]  # index.faiss, or its slices in number order, relative, by name (`unversioned`)
    routing_paths: tuple[str, str] | None  # slices: quantizer.faiss and list_owners.npy, relative
    nlist: int | None  # inverted lists (IVF)
    deleted_paths: tuple[str, ...] = ()  # deleted/*.parquet, relative to the directory
    generation: int | None = None  # its newest generation (None: a manifest without generations)

    def deleted(self) -> DeletedFiles:
        """The documents deleted from it (their chunks are in no search), as their files."""
        return DeletedFiles(tuple(fileio.join(self.directory, path) for path in self.deleted_paths))

    def searched(self) -> tuple[str | None, Routing | None]:
        """What a search reads: (index.faiss, None), or (None, the Routing of its slices by lists)."""
        faiss_dir = fileio.join(self.directory, "faiss")
        if self.routing_paths is not None and self.nlist is not None:
            return None, Routing(faiss_dir, len(self.faiss_paths), self.nlist)
        return fileio.join(faiss_dir, INDEX_FILE), None


def read_committed_index(directory: str, commit: int | None = None) -> tuple[CommittedIndex, IndexManifest]:
    """The committed index in `directory` (its current commit, or commit `commit` while it is
    kept) and its manifest, or a clear error (StageError): none there, or in slices by chunk-id
    range (which nothing searches any more)."""
    found = fileio.current_manifest(directory, commit)
    if found is None:
        if commit is not None:
            raise StageError(fileio.no_commit(directory, commit))
        raise StageError(f"no committed index at {directory}: run build-index first")
    path, data = found
    manifest = read_manifest(data, path, IndexManifest)
    paths, _ = fileio.entry_paths_and_rows(manifest, directory)  # one read of a file table
    names = [unversioned(path) for path in paths]  # faiss files are looked up by name
    routing = (f"faiss/{QUANTIZER_FILE}", f"faiss/{LIST_OWNERS_FILE}")
    searched = searched_files(faiss_files(names))
    routed = set(routing) <= set(names)
    if len(searched) > 1 and not routed:
        raise StageError(
            f"index at {directory} is in slices by chunk-id range, which build-shards no longer searches: "
            "rebuild it with build-index into a new output directory"
        )
    index = CommittedIndex(
        directory=directory,
        manifest_sha256=fileio.sha256_bytes(data),
        num_chunks=manifest.num_chunks,
        nprobe=manifest.nprobe,
        faiss_paths=searched,
        routing_paths=routing if routed else None,
        nlist=ivf_lists(manifest.index_factory),
        deleted_paths=tuple(path for path in paths if path.startswith(f"{DELETED_DIR}/")),
        generation=manifest.generations[-1].number if manifest.generations else None,
    )
    return index, manifest
