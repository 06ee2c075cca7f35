"""What an index directory holds, for the jobs that write and read it: its file entries and
faiss files, the counters from its tallies, the committed manifest (and waiting for it).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import apache_beam as beam

from pipeline.common import fileio
from pipeline.common.models import (
    embedding_dim,
)
from pipeline.common.tally import counted
from pipeline.corpus.records import NEAR_DUPLICATE
from pipeline.index.build import INDEX_FILE
from pipeline.index.build_info import BUILD_INFO_FILE, BuildInfo
from pipeline.index.deleted import DELETED_DIR, DeletedRanges, read_deleted
from pipeline.index.factory import ivf_lists, new_index, resolve_clustering
from pipeline.index.files import LIST_OWNERS_FILE, QUANTIZER_FILE, searched_files
from pipeline.index.recall import PLATEAU_GAIN
from pipeline.jobs.commit import StageError
from pipeline.jobs.job import (
    index_dir,
)
from pipeline.jobs.reuse import committed, index_action
from pipeline.retrieve.search import Routing
from schemas.config import PipelineConfig
from schemas.manifest import (
    MANIFEST_FILE,
    FileEntry,
    IndexManifest,
    VectorIndexManifest,
    read_manifest,
)

log = logging.getLogger("ratrain")


def check_index_type(cfg: PipelineConfig) -> None:
    """A faiss factory string that cannot be built, or a clustering it cannot take, fails now,
    not after hours of embedding (when the encoder's width can be read without loading it)."""
    dim = embedding_dim(cfg.embedding.model)
    if cfg.index.type != "auto" and dim is not None:
        new_index(cfg.index.type, dim)
        resolve_clustering(cfg.index.clustering, cfg.index.type)


def _index_entries(info: BuildInfo) -> list[FileEntry]:
    """The manifest entries of the faiss files, index.faiss or its shards (hashed by their
    writer: they are never read back)."""
    return [entry.model_copy(update={"path": f"faiss/{entry.path}"}) for entry in info.files]


def faiss_files(paths: list[str]) -> list[str]:
    """Of an index manifest's file paths, the faiss files (index.faiss, or its shards in
    chunk-id order)."""
    return [path for path in paths if path.startswith("faiss/")]


def _index_staged(manifest: IndexManifest | VectorIndexManifest) -> list[str]:
    """What BuildIndex staged: the faiss files the manifest lists, and the build info."""
    return faiss_files([e.path for e in manifest.files]) + [f"faiss/{BUILD_INFO_FILE}"]


def _index_counters(info: BuildInfo) -> dict[str, int]:
    return {"index_vectors_added": info.num_vectors, "index_training_vectors": info.training_vectors}


def _rejected_tally(rejected, label: str):
    return rejected | label >> beam.Map(lambda r: (f"rejected_{r.reason}", 1))


_REFUSED_AFTER_PARSING = ("duplicate_id", NEAR_DUPLICATE)


def _documents_read_tally(documents, rejected, prefix: str):
    """Documents parsed: those kept, plus those refused after parsing (a duplicate id, a
    near-duplicate of an evaluation document)."""
    return (
        counted("documents_read", documents, label=f"{prefix}DocumentsKept"),
        rejected
        | f"{prefix}DuplicatesRead"
        >> beam.FlatMap(lambda r: [("documents_read", 1)] if r.reason in _REFUSED_AFTER_PARSING else []),
    )


def _log_index(directory: str, manifest) -> None:
    recall = manifest.recall_at_k
    log.info(
        "committed %s (%s, %s = %.3f at depth %s, %s bytes)",
        directory,
        manifest.index_factory,
        recall.measure,
        recall.value,
        manifest.nprobe,
        f"{manifest.index_bytes:,}",
    )
    if recall.target is not None and recall.value < recall.target:
        where = (
            f"and two doublings of the search depth beyond {manifest.nprobe} gained less than {PLATEAU_GAIN} "
            "(a plateau: the codes limit recall, not the depth)"
            if recall.plateau
            else "even at the deepest search"
        )
        log.warning(
            "%s: %s = %.3f misses the target %.2f %s; a larger index.memory_budget "
            "(bigger codes) or another index.type would reach it",
            directory,
            recall.measure,
            recall.value,
            recall.target,
            where,
        )


def _nonempty(pattern, result):
    if not result.metadata_list:
        raise FileNotFoundError(f"embeddings glob matches no file: {pattern}")
    return result.metadata_list


@dataclass(frozen=True)
class CommittedIndex:
    """What build-shards needs of a committed index, read without its file entries (only the
    faiss files' paths, from the path column of a file table of however many entries)."""

    directory: str
    manifest_sha256: str
    num_chunks: int
    nprobe: int | None  # the depth the index stage tuned
    faiss_paths: list[str]  # index.faiss, or its slices in number order, relative to the directory
    routing_paths: tuple[str, str] | None  # slices: quantizer.faiss and list_owners.npy, relative
    nlist: int | None  # inverted lists (IVF)
    deleted_paths: tuple[str, ...] = ()  # deleted/*.parquet, relative to the directory
    generation: int | None = None  # its newest generation (None: a manifest without generations)

    def deleted(self) -> DeletedRanges:
        """The documents deleted from it (their chunks are in no search)."""
        return read_deleted([fileio.join(self.directory, path) for path in self.deleted_paths])

    def searched(self) -> tuple[str | None, Routing | None]:
        """What a search reads: (index.faiss, None), or (None, the Routing of its slices by lists)."""
        faiss_dir = fileio.join(self.directory, "faiss")
        if self.routing_paths is not None and self.nlist is not None:
            return None, Routing(faiss_dir, len(self.faiss_paths), self.nlist)
        return fileio.join(faiss_dir, INDEX_FILE), None


def read_committed_index(directory: str) -> tuple[CommittedIndex, IndexManifest]:
    """The committed index in `directory` and its manifest, or a clear error (StageError): none
    there, or in slices by chunk-id range (which nothing searches any more)."""
    path = fileio.join(directory, MANIFEST_FILE)
    if not fileio.exists(path):
        raise StageError(f"no committed index at {directory}: run build-index first")
    data = fileio.read_bytes(path)
    manifest = read_manifest(data, path, IndexManifest)
    paths, _ = fileio.entry_paths_and_rows(manifest, directory, "faiss")
    routing = (f"faiss/{QUANTIZER_FILE}", f"faiss/{LIST_OWNERS_FILE}")
    if len(searched_files(faiss_files(paths))) > 1 and not set(routing) <= set(paths):
        raise StageError(
            f"index at {directory} is in slices by chunk-id range, which build-shards no longer searches: "
            "rebuild it (delete its manifest.json and run build-index)"
        )
    index = CommittedIndex(
        directory,
        fileio.sha256_bytes(data),
        manifest.num_chunks,
        manifest.nprobe,
        searched_files(faiss_files(paths)),
        routing if set(routing) <= set(paths) else None,
        ivf_lists(manifest.index_factory),
        tuple(fileio.entry_paths_and_rows(manifest, directory, DELETED_DIR)[0]),
        manifest.generations[-1].number if manifest.generations else None,
    )
    return index, manifest


def load_committed_index(cfg: PipelineConfig) -> CommittedIndex:
    """The committed index this config reads, or a clear error."""
    directory = index_dir(cfg)
    index, manifest = read_committed_index(directory)
    if manifest.chunk_tokens != cfg.chunk_tokens:
        raise StageError(
            f"index at {directory} has chunk_tokens={manifest.chunk_tokens}, "
            f"config asks for {cfg.chunk_tokens}: rebuild the index"
        )
    return index


def wait_for_index(cfg: PipelineConfig, timeout_s: float, poll_s: float = 30.0) -> None:
    """Wait until the index this config describes is committed (a detached build-index on a
    cluster): its manifest exists with this config's index hash."""
    path = fileio.join(index_dir(cfg), MANIFEST_FILE)
    deadline = time.monotonic() + timeout_s
    while True:
        index = committed(index_dir(cfg), IndexManifest)
        if index is not None and index_action(cfg, index) == "reuse":
            return
        if time.monotonic() >= deadline:
            raise StageError(f"no index matching the config was committed at {path} within {timeout_s:.0f} s")
        log.info("build-shards: waiting for %s", path)
        time.sleep(poll_s)
