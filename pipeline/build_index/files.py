"""What an index directory holds, for the jobs that write and read it: its file entries and
faiss files, the counters from its tallies, the committed manifest (and waiting for it).
"""

from __future__ import annotations

import logging
import time

import apache_beam as beam

from pipeline.common import fileio
from pipeline.common.errors import StageError
from pipeline.common.fileio import committed
from pipeline.common.models import (
    embedding_dim,
)
from pipeline.common.rejected import REFUSED_AFTER_PARSING
from pipeline.common.tally import counted
from pipeline.index.build_info import BuildInfo
from pipeline.index.factory import new_index, resolve_clustering
from pipeline.index.recall import PLATEAU_GAIN
from pipeline.jobs.job import (
    index_dir,
)
from pipeline.jobs.reuse import index_action
from pipeline.retrieve.committed import CommittedIndex, faiss_files, read_committed_index
from schemas.config import PipelineConfig
from schemas.manifest import (
    MANIFEST_FILE,
    FileEntry,
    IndexManifest,
    VectorIndexManifest,
)

log = logging.getLogger("ratrain")


def check_index_type(cfg: PipelineConfig) -> None:
    """A faiss factory string that cannot be built, or a clustering it cannot take, fails now,
    not after hours of embedding (when the encoder's width can be read without loading it)."""
    dim = embedding_dim(cfg.embedding.model)
    if cfg.index.type != "auto" and dim is not None:
        new_index(cfg.index.type, dim)
        resolve_clustering(cfg.index.clustering, cfg.index.type)


def index_entries(info: BuildInfo) -> list[FileEntry]:
    """The manifest entries of the faiss files, index.faiss or its shards (hashed by their
    writer: they are never read back)."""
    return [entry.model_copy(update={"path": f"faiss/{entry.path}"}) for entry in info.files]


def index_staged(manifest: IndexManifest | VectorIndexManifest) -> list[str]:
    """What BuildIndex staged for the commit: the faiss files the manifest lists (its build info
    only handed their facts to the manifest, and goes with the staging)."""
    return faiss_files([e.path for e in manifest.files])


def index_counters(info: BuildInfo) -> dict[str, int]:
    return {"index_vectors_added": info.num_vectors, "index_training_vectors": info.training_vectors}


def rejected_tally(rejected, label: str):
    return rejected | label >> beam.Map(lambda r: (f"rejected_{r.reason}", 1))


def documents_read_tally(documents, rejected, prefix: str):
    """Documents parsed: those kept, plus those refused after parsing (a duplicate id, a
    near-duplicate of an evaluation document)."""
    return (
        counted("documents_read", documents, label=f"{prefix}DocumentsKept"),
        rejected
        | f"{prefix}DuplicatesRead"
        >> beam.FlatMap(lambda r: [("documents_read", 1)] if r.reason in REFUSED_AFTER_PARSING else []),
    )


def log_index(directory: str, manifest) -> None:
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


def nonempty(pattern, result):
    if not result.metadata_list:
        raise FileNotFoundError(f"embeddings glob matches no file: {pattern}")
    return result.metadata_list


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
