"""`index`, and build-index when only faiss settings changed: a faiss index rebuilt over
embeddings already written, without reading or embedding the corpus again.
"""

from __future__ import annotations

import logging

import apache_beam as beam
from apache_beam.io.filesystems import FileSystems
from apache_beam.io.parquetio import ReadFromParquetBatched

from pipeline.common import fileio
from pipeline.index.build import BuildIndex
from pipeline.index.build_info import BuildInfo
from pipeline.index.recall import RECALL_K
from pipeline.jobs.commit import StageError
from pipeline.jobs.index_files import _index_counters, _index_entries, _index_staged, _log_index, _nonempty
from pipeline.jobs.job import Job, Submitted, _sorted_entries, index_dir
from schemas.config import PipelineConfig, stable_hash
from schemas.manifest import (
    CREATED_BY,
    IndexManifest,
    VectorIndexManifest,
)

log = logging.getLogger("ratrain")


def _index_only_job(job: Job, paths: list[str], cfg_index, to_manifest, chunk_files: str | None, neighbours: int):
    """The graph of a job that builds a faiss index from embedding files and commits it into
    `<job.directory>/faiss/` (the rest of the directory stays): `to_manifest(info)` makes the
    manifest. `chunk_files` (a glob; None: unknown): where the vectors' documents are read from."""
    documents = None
    if chunk_files is not None:
        documents = (
            job.pipeline
            | "ReadDocumentIds" >> ReadFromParquetBatched(chunk_files, columns=["chunk_id", "doc_id"])
            | "DocumentOfChunk"
            >> beam.FlatMap(lambda t: zip(t["chunk_id"].to_numpy().tolist(), t["doc_id"].to_numpy().tolist()))
        )
    manifest = (
        job.pipeline
        | "EmbeddingFiles" >> beam.Create(paths)
        | "BuildIndex" >> BuildIndex(cfg_index, fileio.join(job.staging, "faiss"), documents, neighbours)
        | "Manifest" >> beam.Map(to_manifest)
    )
    job.commit(manifest, staged_of=_index_staged)


def _rebuild_faiss(
    cfg: PipelineConfig, previous: IndexManifest, beam_args: list[str], detach: bool = False
) -> IndexManifest | Submitted:
    """Only `index.*` changed: a new faiss index from the committed embeddings."""
    log.info("build-index: chunks and embeddings match the config; rebuilding the faiss index only")
    directory = index_dir(cfg)
    kept = [f for f in previous.files if not f.path.startswith("faiss/")]
    paths = [fileio.join(directory, f.path) for f in kept if f.path.startswith("embeddings/")]
    earlier = {k: v for k, v in previous.counters.items() if not k.startswith("index_")}
    base = previous.model_dump(mode="json")
    index_hash = cfg.index_hash()

    def to_manifest(info: BuildInfo) -> IndexManifest:
        return IndexManifest.model_validate(
            {
                **base,
                "config_hash": index_hash,
                "files": _sorted_entries(kept + _index_entries(info)),
                "counters": dict(sorted({**earlier, **_index_counters(info)}.items())),
                "created_by": CREATED_BY,
                **info.vector_index(),
            }
        )

    job = Job(
        "build-index (faiss only)",
        "index_vectors_added",
        cfg.output,
        directory,
        IndexManifest,
        beam_args,
        staging="faiss",
        detach=detach,
        replace=("faiss",),
    )
    _index_only_job(job, paths, cfg.index, to_manifest, fileio.join(directory, "chunks", "*.parquet"), cfg.neighbours)
    manifest = job.run()
    if isinstance(manifest, IndexManifest):
        _log_index(directory, manifest)
    return manifest


def build_vector_index(embeddings: list[str], output: str, cfg_index, beam_args: list[str]) -> VectorIndexManifest:
    """`ratrain-pipeline index`: a faiss index over existing embedding files -> `<output>/faiss/`
    and `<output>/manifest.json`. Nothing else in `output` is touched."""
    paths = sorted(
        {
            m.path
            for pattern, result in zip(embeddings, FileSystems.match(embeddings))
            for m in _nonempty(pattern, result)
        }
    )
    sizes = {m.path: m.size_in_bytes for r in FileSystems.match(paths) for m in r.metadata_list}
    inputs = [{"path": p, "bytes": sizes[p]} for p in paths]
    config_hash = stable_hash({"index": cfg_index.model_dump(), "inputs": inputs})

    def to_manifest(info: BuildInfo) -> VectorIndexManifest:
        return VectorIndexManifest(
            config_hash=config_hash,
            num_vectors=info.num_vectors,
            inputs=inputs,
            files=_index_entries(info),
            counters=_index_counters(info),
            created_by=CREATED_BY,
            **info.vector_index(),
        )

    job = Job(
        "index",
        "index_vectors_added",
        output,
        output,
        VectorIndexManifest,
        beam_args,
        staging="faiss",
        replace=("faiss",),
    )
    _index_only_job(job, paths, cfg_index, to_manifest, None, RECALL_K)
    manifest = job.run()
    if not isinstance(manifest, VectorIndexManifest):
        raise StageError(f"index: expected the committed manifest of {output}, got {manifest!r}")
    _log_index(output, manifest)
    return manifest
