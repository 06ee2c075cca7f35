"""A committed index directory as retrieval reads it (`read_committed_index`): its faiss files,
routing files and deleted documents, without its file entries; for build-shards and for the
online `Retriever`.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.chunks.deleted import DELETED_DIR, DeletedFiles
from pipeline.common import fileio
from pipeline.common.errors import StageError
from pipeline.common.names import file_number
from pipeline.index.factory import ivf_lists
from pipeline.index.files import INDEX_FILE, LIST_OWNERS_FILE, QUANTIZER_FILE, searched_files
from pipeline.retrieve.search import Routing
from schemas.manifest import IndexManifest, read_manifest, unversioned


def faiss_files(paths: list[str]) -> list[str]:
    """Of an index manifest's file paths, the faiss files (index.faiss, or its shards in
    chunk-id order)."""
    return [path for path in paths if path.startswith("faiss/")]


@dataclass(frozen=True)
class GenerationSpan:
    """Of one generation of an index: its chunk ids [first_chunk_id, first_chunk_id +
    num_chunks), how many documents it deleted, and the sha256 of the index manifest it changed
    (None: a build from scratch)."""

    number: int
    first_chunk_id: int
    num_chunks: int
    deleted_documents: int
    based_on: str | None


@dataclass(frozen=True)
class IndexChange:
    """What an index gained and lost in the generations after `since`, up to `newest`: their
    chunk ids, [start, end) each (the new vectors, less any a later generation deleted), and
    the deleted-document files they wrote (relative to the index directory)."""

    since: int
    newest: int
    new_chunks: tuple[tuple[int, int], ...]
    deleted_paths: tuple[str, ...]
    deleted_documents: int

    def __str__(self) -> str:
        added = sum(end - start for start, end in self.new_chunks)
        later = (
            f"generation {self.newest}"
            if self.newest == self.since + 1
            else f"generations {self.since + 1}-{self.newest}"
        )
        return f"{later}: {added:,} chunks added, {self.deleted_documents:,} documents deleted"


def generation_spans(manifest: IndexManifest) -> tuple[GenerationSpan, ...]:
    return tuple(
        GenerationSpan(g.number, g.first_chunk_id, g.num_chunks, g.deleted_documents, g.based_on)
        for g in manifest.generations
    )


def change_since(
    generations: tuple[GenerationSpan, ...], deleted_paths: tuple[str, ...], since: int | None, manifest_sha256: str
) -> IndexChange | None:
    """What an index's generations after `since` changed, where the first of them changed the
    index manifest of sha256 `manifest_sha256` (what shards built at `since` record); None when
    none came after, or the index's history does not go through that manifest (it was rebuilt,
    its faiss files rebuilt, or it is another index). `deleted_paths`: its deleted-document
    files, of which those the later generations wrote are kept."""
    if since is None:
        return None
    later = [g for g in generations if g.number > since]
    if not later or later[0].based_on != manifest_sha256:
        return None
    numbers = {g.number for g in later}
    return IndexChange(
        since=since,
        newest=later[-1].number,
        new_chunks=tuple((g.first_chunk_id, g.first_chunk_id + g.num_chunks) for g in later if g.num_chunks),
        deleted_paths=tuple(p for p in deleted_paths if file_number(unversioned(p)) in numbers),
        deleted_documents=sum(g.deleted_documents for g in later),
    )


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
    generations: tuple[GenerationSpan, ...] = ()  # none in a manifest from before generations

    @property
    def generation(self) -> int | None:
        """Its newest generation (None: a manifest without generations)."""
        return self.generations[-1].number if self.generations else None

    def change_since(self, since: int | None, manifest_sha256: str) -> IndexChange | None:
        """`change_since` of this index's generations and deleted-document files."""
        return change_since(self.generations, self.deleted_paths, since, manifest_sha256)

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
    paths = [  # the faiss and deletion files alone, a row group of the file table at a time
        path
        for table in fileio.entry_batches(manifest, directory, ["path"], ("faiss", DELETED_DIR))
        for path in table["path"].to_pylist()
    ]
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
        generations=generation_spans(manifest),
    )
    return index, manifest
