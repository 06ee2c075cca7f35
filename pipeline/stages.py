"""The two Beam jobs (build-index: stages 1-3; build-shards: stages 4-5) and their commits.

Each job writes into a staging directory under `<output>/.staging/`, and the driver commits it
after the pipeline succeeded: rejected records to `<output>/rejected/`, the files into place,
manifest.json last (DESIGN §4).
"""
from __future__ import annotations

import logging
import os
import posixpath
from dataclasses import dataclass

import apache_beam as beam
import numpy as np
from apache_beam.io.parquetio import ReadFromParquetBatched
from apache_beam.metrics.metric import MetricsFilter

from pipeline import __version__, fileio
from pipeline.chunking import Chunk, ChunkDocuments, load_tokenizer, pad_id_of
from pipeline.corpus import METRICS_NAMESPACE, ReadCorpus
from pipeline.embed import (DEFAULT_MODEL_NAMES, EmbedChunks, fingerprint_path, resolve_model,
                            resolve_tokenizer)
from pipeline.index import BUILD_INFO_FILE, INDEX_FILE, BuildIndex
from pipeline.options import pipeline_options
from pipeline.progress import ReportProgress, StageTimer
from pipeline.shards import PackSequences, RetrieveNeighbours, WriteShards
from pipeline.writers import (WriteGroupedFiles, WriteRejected, chunks_table, embeddings_table,
                              parquet_bytes)
from schemas.arrow import check_schema_version, tensor_column_to_numpy
from schemas.config import PipelineConfig
from schemas.manifest import Fingerprint, IndexManifest, ShardsManifest

log = logging.getLogger("ratrain")
FILES_LIST = "_files.json"
REJECTED_STAGING = "_rejected"


class StageError(RuntimeError):
    """A stage that cannot run on what it was given (e.g. no committed index)."""


@dataclass(frozen=True)
class Tokenization:
    name: str       # as recorded in the manifest: the config value or the default encoder's
    path: str
    pad_id: int

    @classmethod
    def of(cls, cfg: PipelineConfig) -> "Tokenization":
        name = cfg.tokenizer or DEFAULT_MODEL_NAMES[0]
        path = resolve_tokenizer(name)
        if not os.path.isfile(path):
            raise StageError(f"tokenizer: file not found: {path}")
        return cls(name, path, pad_id_of(load_tokenizer(path)))


def index_dir(cfg: PipelineConfig) -> str:
    return fileio.join(cfg.output, "index")


def shards_dir(cfg: PipelineConfig) -> str:
    return fileio.join(cfg.output, "shards")


def run_and_count(pipeline: beam.Pipeline) -> dict[str, int]:
    """Run to completion; the job's counters by name (summed over steps)."""
    result = pipeline.run()
    result.wait_until_finish()
    counters: dict[str, int] = {}
    query = result.metrics().query(MetricsFilter().with_namespace(METRICS_NAMESPACE))
    for counter in query["counters"]:
        value = counter.committed if counter.committed is not None else counter.attempted
        counters[counter.key.metric.name] = counters.get(counter.key.metric.name, 0) + int(value or 0)
    return dict(sorted(counters.items()))


def _collect_entries(pipeline_label: str, entry_lists, staging: str):
    """Write the manifest entries the writers yielded to `<staging>/_files.json`."""
    return (tuple(entry_lists)
            | f"{pipeline_label}Flatten" >> beam.Flatten()
            | f"{pipeline_label}Gather" >> beam.combiners.ToList()
            | f"{pipeline_label}Write" >> beam.Map(
                lambda entries: fileio.write_json_atomic(
                    fileio.join(staging, FILES_LIST), sorted(entries, key=lambda e: e["path"]))))


def _publish_rejected(staging: str, output: str) -> list[dict]:
    """Move the job's rejected-record files to `<output>/rejected/`."""
    source_dir = fileio.join(staging, REJECTED_STAGING)
    if not fileio.exists(source_dir):
        return []
    moved = []
    for source in fileio.list_files(source_dir):
        target = fileio.join(output, "rejected", posixpath.basename(source))
        fileio.move(source, target)
        moved.append(target)
    fileio.delete_tree(source_dir)
    return moved


def _rejected_counts(counters: dict[str, int]) -> int:
    return sum(v for name, v in counters.items() if name.startswith("rejected_"))


# --- build-index ----------------------------------------------------------------------------

def build_index(cfg: PipelineConfig, beam_args: list[str]) -> IndexManifest:
    """Stages 1-3: retrieval corpus -> chunks, embeddings, faiss index, committed manifest."""
    tok = Tokenization.of(cfg)
    staging = fileio.new_staging_dir(cfg.output, "index")
    m = cfg.chunk_tokens
    with StageTimer("build-index") as timer:
        pipeline = beam.Pipeline(options=pipeline_options(beam_args))
        documents, rejected = pipeline | "ReadRetrievalCorpus" >> ReadCorpus(cfg.retrieval_corpus)
        chunks, unusable = (documents | "DocumentProgress" >> ReportProgress("read", "documents")
                            | "ChunkDocuments" >> ChunkDocuments(tok.path, m, tok.pad_id))
        chunk_files = chunks | "WriteChunks" >> WriteGroupedFiles(
            fileio.join(staging, "chunks"), staging, "chunks", "parquet",
            key=lambda c: c.chunk_id, rows_per_file=cfg.chunk_file_rows,
            to_bytes=lambda rows: parquet_bytes(chunks_table(rows, m)))
        embeddings = (chunks
                      | "EmbedChunks" >> EmbedChunks(cfg.embedding, tok.path)
                      | "EmbedProgress" >> ReportProgress("embed", "chunks"))
        embedding_files = embeddings | "WriteEmbeddings" >> WriteGroupedFiles(
            fileio.join(staging, "embeddings"), staging, "embeddings", "parquet",
            key=lambda e: e[0], rows_per_file=cfg.chunk_file_rows,
            to_bytes=lambda rows: parquet_bytes(embeddings_table(rows)))
        _ = embeddings | "BuildIndex" >> BuildIndex(cfg.index, fileio.join(staging, "faiss"))
        _ = ((rejected, unusable) | "MergeRejected" >> beam.Flatten()
             | "WriteRejected" >> WriteRejected(fileio.join(staging, REJECTED_STAGING),
                                                "build-index"))
        _collect_entries("IndexFiles", (chunk_files, embedding_files), staging)
        counters = run_and_count(pipeline)
        timer.done(counters, "chunks")

    info = fileio.read_json(fileio.join(staging, "faiss", BUILD_INFO_FILE))
    files = fileio.read_json(fileio.join(staging, FILES_LIST))
    index_path = fileio.join(staging, "faiss", INDEX_FILE)
    index_data = fileio.read_bytes(index_path)
    files.append({"path": f"faiss/{INDEX_FILE}", "rows": info["num_vectors"],
                  "bytes": len(index_data), "sha256": fileio.sha256_bytes(index_data)})
    beam.io.filesystems.FileSystems.delete([fileio.join(staging, FILES_LIST)])
    model_path = resolve_model(cfg.embedding.model)
    manifest = IndexManifest(
        config_hash=cfg.index_hash(),
        tokenizer=Fingerprint(name=tok.name, fingerprint=fingerprint_path(tok.path)),
        embedding_model=Fingerprint(name=cfg.embedding.model,
                                    fingerprint=fingerprint_path(model_path)),
        dim=info["dim"], metric=info["metric"],
        num_documents=counters.get("documents_chunked", 0),
        num_chunks=counters.get("chunks", 0), chunk_tokens=m, pad_id=tok.pad_id,
        index_factory=info["index_factory"], nprobe=info["nprobe"],
        recall_at_k=info["recall_at_k"], queries_per_second=info["queries_per_second"],
        index_bytes=info["index_bytes"], files=sorted(files, key=lambda f: f["path"]),
        counters=counters, created_by=f"ratrain-pipeline {__version__}")
    _publish_rejected(staging, cfg.output)
    fileio.commit_directory(staging, index_dir(cfg), manifest.model_dump(mode="json"))
    log.info("committed %s (%d chunks from %d documents, %s, %s = %.3f)", index_dir(cfg),
             manifest.num_chunks, manifest.num_documents, manifest.index_factory,
             manifest.recall_at_k.measure, manifest.recall_at_k.value)
    return manifest


# --- build-shards ---------------------------------------------------------------------------

def load_index_manifest(cfg: PipelineConfig) -> tuple[IndexManifest, str]:
    """The committed index manifest and its sha256, or a clear error."""
    path = fileio.join(index_dir(cfg), fileio.MANIFEST)
    if not fileio.exists(path):
        raise StageError(f"no committed index at {index_dir(cfg)}: run build-index first")
    data = fileio.read_bytes(path)
    manifest = IndexManifest.model_validate_json(data)
    check_schema_version(manifest.schema_version, path)
    if manifest.chunk_tokens != cfg.chunk_tokens:
        raise StageError(f"index at {index_dir(cfg)} has chunk_tokens={manifest.chunk_tokens}, "
                         f"config asks for {cfg.chunk_tokens}: rebuild the index")
    return manifest, fileio.sha256_bytes(data)


def _chunks_from_table(table) -> list[Chunk]:
    ids = table["chunk_id"].to_numpy()
    docs = table["doc_id"].to_numpy()
    positions = table["position"].to_numpy()
    tokens = tensor_column_to_numpy(table["tokens"])
    continuations = tensor_column_to_numpy(table["continuation"])
    return [Chunk(int(i), int(d), int(p), t, c)
            for i, d, p, t, c in zip(ids, docs, positions, tokens, continuations)]


def _embeddings_from_table(table) -> list[tuple[int, np.ndarray]]:
    vectors = tensor_column_to_numpy(table["embedding"])
    return list(zip(table["chunk_id"].to_numpy().tolist(), vectors))


def build_shards(cfg: PipelineConfig, beam_args: list[str]) -> ShardsManifest:
    """Stages 4-5: training sequences + retrieved neighbours -> Arrow shards, committed."""
    index_manifest, index_sha = load_index_manifest(cfg)
    tok = Tokenization.of(cfg)
    staging = fileio.new_staging_dir(cfg.output, "shards")
    L, m, k = cfg.chunks_per_sequence, cfg.chunk_tokens, cfg.neighbours
    idx = index_dir(cfg)
    with StageTimer("build-shards") as timer:
        pipeline = beam.Pipeline(options=pipeline_options(beam_args))
        chunk_db = (pipeline
                    | "ReadChunkDatabase" >> ReadFromParquetBatched(fileio.join(idx, "chunks", "*.parquet"))
                    | "ChunkRows" >> beam.FlatMap(_chunks_from_table))
        if cfg.training_corpus == "same":
            training_chunks = chunk_db
            queries = (pipeline
                       | "ReadEmbeddings" >> ReadFromParquetBatched(
                           fileio.join(idx, "embeddings", "*.parquet"))
                       | "EmbeddingRows" >> beam.FlatMap(_embeddings_from_table))
            rejected = pipeline | "NoRejected" >> beam.Create([])
        else:
            documents, read_rejected = (pipeline
                                        | "ReadTrainingCorpus" >> ReadCorpus(cfg.training_corpus))
            training_chunks, unusable = documents | "ChunkTrainingDocuments" >> ChunkDocuments(
                tok.path, m, tok.pad_id)
            queries = training_chunks | "EmbedTrainingChunks" >> EmbedChunks(cfg.embedding, tok.path)
            rejected = (read_rejected, unusable) | "MergeRejected" >> beam.Flatten()
        sequences = training_chunks | "PackSequences" >> PackSequences(L, tok.pad_id)
        rows = ((sequences, queries, chunk_db)
                | "RetrieveNeighbours" >> RetrieveNeighbours(
                    fileio.join(idx, "faiss", INDEX_FILE), index_manifest.nprobe, L, m, k,
                    cfg.neighbour_candidates, tok.pad_id)
                | "ShardProgress" >> ReportProgress("retrieve", "sequences"))
        shard_files = rows | "WriteShards" >> WriteShards(staging, cfg.shard_rows, tok.pad_id)
        _ = rejected | "WriteRejected" >> WriteRejected(
            fileio.join(staging, REJECTED_STAGING), "build-shards")
        _collect_entries("ShardFiles", (shard_files,), staging)
        counters = run_and_count(pipeline)
        timer.done(counters, "sequences")

    shards = fileio.read_json(fileio.join(staging, FILES_LIST))
    beam.io.filesystems.FileSystems.delete([fileio.join(staging, FILES_LIST)])
    manifest = ShardsManifest(
        config_hash=cfg.shards_hash(), index_manifest_sha256=index_sha,
        training_corpus="same" if cfg.training_corpus == "same" else "separate",
        sequence_tokens=cfg.sequence_tokens, chunk_tokens=m, neighbours=k,
        neighbour_tokens=2 * m, pad_id=tok.pad_id,
        num_sequences=sum(s["rows"] for s in shards), shards=shards, counters=counters,
        created_by=f"ratrain-pipeline {__version__}")
    _publish_rejected(staging, cfg.output)
    fileio.commit_directory(staging, shards_dir(cfg), manifest.model_dump(mode="json"))
    log.info("committed %s (%d sequences in %d shards)", shards_dir(cfg),
             manifest.num_sequences, len(shards))
    return manifest
