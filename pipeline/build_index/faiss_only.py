"""`index`, and build-index when only faiss settings changed: a faiss index rebuilt over
embeddings already written, without reading or embedding the corpus again.
"""

from __future__ import annotations

import functools
import logging

import apache_beam as beam
from apache_beam.io.filesystems import FileSystems

from pipeline.build_index.files import index_staged, log_index, nonempty
from pipeline.build_index.manifest import faiss_rebuilt_manifest, vector_index_manifest
from pipeline.chunks.beam import ListedPaths, ReadParquetFiles
from pipeline.chunks.chunk_files import EMBEDDINGS_DIR
from pipeline.chunks.committed import CommittedFiles, CommittedIndexManifest
from pipeline.common import fileio
from pipeline.common.errors import StageError
from pipeline.index.build import BuildIndex
from pipeline.index.recall import RECALL_K
from pipeline.jobs.entry_pieces import KeptEntries
from pipeline.jobs.job import Committed, Job, Submitted, index_dir
from schemas.config import PipelineConfig, stable_hash
from schemas.manifest import (
    IndexManifest,
    VectorIndexManifest,
)

log = logging.getLogger("ratrain")


def _index_only_graph(
    pipeline,
    staging: str,
    *,
    paths: list[str] | CommittedFiles,
    cfg_index,
    to_manifest,
    chunk_files: CommittedFiles | None,
    neighbours: int,
    kept: KeptEntries | None = None,
) -> Committed:
    """The graph of a job that builds a faiss index from embedding files and commits it into
    `faiss/` of its directory (the rest of the directory stays): `to_manifest(info)` makes the
    manifest. `paths`: the files, or those a committed manifest lists (listed on a worker: the
    graph does not grow with them). `chunk_files` (None: unknown): where the vectors' documents
    are read from."""
    documents = None
    if chunk_files is not None:
        documents = (
            pipeline
            | "ReadDocumentIds" >> ReadParquetFiles(chunk_files, columns=["chunk_id", "doc_id"])
            | "DocumentOfChunk"
            >> beam.FlatMap(lambda t: zip(t["chunk_id"].to_numpy().tolist(), t["doc_id"].to_numpy().tolist()))
        )
    listed = ListedPaths(paths) if isinstance(paths, CommittedFiles) else beam.Create(paths)
    files = pipeline | "EmbeddingFiles" >> listed
    manifest = (
        files
        | "BuildIndex" >> BuildIndex(cfg_index, fileio.join(staging, "faiss"), documents, neighbours)
        | "Manifest" >> beam.Map(to_manifest)
    )
    kept_entries = None if kept is None else pipeline | "KeptEntries" >> beam.Create([kept])
    return Committed(manifest=manifest, kept=kept_entries, staged_of=index_staged)


def rebuild_faiss(
    cfg: PipelineConfig,
    previous: IndexManifest,
    beam_args: list[str],
    detach: bool = False,
    *,
    previous_sha256: str,
    dry_run: bool = False,
) -> IndexManifest | Submitted | dict:
    """Only `index.*` changed: a new faiss index from the committed embeddings (`previous`, the
    manifest of sha256 `previous_sha256`). The graph names that manifest by its sha256 alone: its
    embedding files are listed on a worker, its fields read in the manifest step, and what it
    keeps (all but its faiss files) read by the commit a row group at a time (`KeptEntries`)."""
    log.info("build-index: chunks and embeddings match the config; rebuilding the faiss index only")
    directory = index_dir(cfg)
    committed = CommittedIndexManifest(directory, previous_sha256, previous.num_chunks)
    index_hash = cfg.index_hash()

    job = Job(
        "build-index (faiss only)",
        records="index_vectors_added",
        output=cfg.output,
        directory=directory,
        model=IndexManifest,
        beam_args=beam_args,
        staging="faiss",
        dry_run=dry_run,
        detach=detach,
        keep_commits=cfg.keep_commits,
    )
    graph = functools.partial(
        _index_only_graph,
        paths=CommittedFiles(directory, previous_sha256, EMBEDDINGS_DIR),
        cfg_index=cfg.index,
        to_manifest=lambda info: faiss_rebuilt_manifest(info, previous=committed.summary(), index_hash=index_hash),
        kept=KeptEntries(committed, dropped_folders=("faiss",)),
        chunk_files=CommittedFiles(directory, previous_sha256, "chunks"),
        neighbours=cfg.neighbours,
    )
    manifest = job.run(graph)
    if isinstance(manifest, IndexManifest):
        log_index(directory, manifest)
    return manifest


def build_vector_index(embeddings: list[str], output: str, cfg_index, beam_args: list[str]) -> VectorIndexManifest:
    """`ratrain-pipeline index`: a faiss index over existing embedding files -> `<output>/faiss/`
    and `<output>/manifest.json`. Nothing else in `output` is touched."""
    paths = sorted(
        {
            m.path
            for pattern, result in zip(embeddings, FileSystems.match(embeddings))
            for m in nonempty(pattern, result)
        }
    )
    sizes = {m.path: m.size_in_bytes for r in FileSystems.match(paths) for m in r.metadata_list}
    inputs = [{"path": p, "bytes": sizes[p]} for p in paths]
    config_hash = stable_hash({"index": cfg_index.model_dump(), "inputs": inputs})
    to_manifest = functools.partial(vector_index_manifest, config_hash=config_hash, inputs=inputs)

    job = Job(
        "index",
        records="index_vectors_added",
        output=output,
        directory=output,
        model=VectorIndexManifest,
        beam_args=beam_args,
        staging="faiss",
    )
    graph = functools.partial(
        _index_only_graph,
        paths=paths,
        cfg_index=cfg_index,
        to_manifest=to_manifest,
        chunk_files=None,
        neighbours=RECALL_K,
    )
    manifest = job.run(graph)
    if not isinstance(manifest, VectorIndexManifest):
        raise StageError(f"index: expected the committed manifest of {output}, got {manifest!r}")
    log_index(output, manifest)
    return manifest
