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
from pipeline.index.recall import RECALL_K
from pipeline.jobs.commit import commit_stage, new_staging_dir
from pipeline.jobs.index_files import _index_counters, _index_entries, _index_staged, _log_index, _nonempty
from pipeline.jobs.job import StageClock, Submitted, _sorted_entries, index_dir, new_pipeline, run_stage
from schemas.config import PipelineConfig, stable_hash
from schemas.manifest import (
    CREATED_BY,
    IndexManifest,
    VectorIndex,
    VectorIndexManifest,
)

log = logging.getLogger("ratrain")


def _vector_index_fields(info: dict) -> dict:
    return {key: info[key] for key in VectorIndex.model_fields}


def _index_only_pipeline(
    paths: list[str],
    cfg_index,
    staging: str,
    beam_args: list[str],
    to_manifest,
    final: str,
    stage: str,
    chunk_files: str | None = None,
    neighbours: int = RECALL_K,
) -> tuple[beam.Pipeline, StageClock]:
    """A job that builds a faiss index from embedding files and commits it into `final/faiss/`
    (the rest of `final` stays): `to_manifest(info)` makes the manifest dict. `chunk_files` (a
    glob; None: unknown): where the vectors' documents are read from."""
    pipeline = new_pipeline(beam_args)
    clock = StageClock(stage, "index_vectors_added")
    documents = None
    if chunk_files is not None:
        documents = (
            pipeline
            | "ReadDocumentIds" >> ReadFromParquetBatched(chunk_files, columns=["chunk_id", "doc_id"])
            | "DocumentOfChunk"
            >> beam.FlatMap(lambda t: zip(t["chunk_id"].to_numpy().tolist(), t["doc_id"].to_numpy().tolist()))
        )
    _ = (
        pipeline
        | "EmbeddingFiles" >> beam.Create(paths)
        | "BuildIndex" >> BuildIndex(cfg_index, fileio.join(staging, "faiss"), documents, neighbours)
        | "Manifest" >> beam.Map(to_manifest)
        | "Commit"
        >> beam.Map(
            lambda manifest: commit_stage(
                manifest, staging, final, final, clock, _index_staged(manifest), replace=("faiss",)
            )
        )
    )
    return pipeline, clock


def _rebuild_faiss(
    cfg: PipelineConfig, previous: IndexManifest, beam_args: list[str], detach: bool = False
) -> IndexManifest | Submitted:
    """Only `index.*` changed: a new faiss index from the committed embeddings."""
    log.info("build-index: chunks and embeddings match the config; rebuilding the faiss index only")
    directory = index_dir(cfg)
    kept = [f.model_dump(mode="json") for f in previous.files if not f.path.startswith("faiss/")]
    paths = [fileio.join(directory, f["path"]) for f in kept if f["path"].startswith("embeddings/")]
    staging = new_staging_dir(cfg.output, "faiss")
    earlier = {k: v for k, v in previous.counters.items() if not k.startswith("index_")}
    base = previous.model_dump(mode="json")
    index_hash = cfg.index_hash()

    def to_manifest(info: dict) -> dict:
        return IndexManifest.model_validate(
            {
                **base,
                "config_hash": index_hash,
                "files": _sorted_entries(kept + _index_entries(info)),
                "counters": dict(sorted({**earlier, **_index_counters(info)}.items())),
                "created_by": CREATED_BY,
                **_vector_index_fields(info),
            }
        ).model_dump(mode="json")

    pipeline, clock = _index_only_pipeline(
        paths,
        cfg.index,
        staging,
        beam_args,
        to_manifest,
        directory,
        "build-index (faiss only)",
        fileio.join(directory, "chunks", "*.parquet"),
        cfg.neighbours,
    )
    manifest = run_stage(pipeline, clock, directory, IndexManifest, detach)
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
    staging = new_staging_dir(output, "faiss")
    inputs = [{"path": p, "bytes": sizes[p]} for p in paths]
    config_hash = stable_hash({"index": cfg_index.model_dump(), "inputs": inputs})

    def to_manifest(info: dict) -> dict:
        return VectorIndexManifest(
            config_hash=config_hash,
            num_vectors=info["num_vectors"],
            inputs=inputs,
            files=_index_entries(info),
            counters=_index_counters(info),
            created_by=CREATED_BY,
            **_vector_index_fields(info),
        ).model_dump(mode="json")

    pipeline, clock = _index_only_pipeline(paths, cfg_index, staging, beam_args, to_manifest, output, "index")
    manifest = run_stage(pipeline, clock, output, VectorIndexManifest, False)
    _log_index(output, manifest)
    return manifest
