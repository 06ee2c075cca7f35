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
from apache_beam.io.filesystems import FileSystems
from apache_beam.io.parquetio import ReadFromParquetBatched
from apache_beam.metrics.metric import MetricsFilter

from pipeline import __version__, fileio
from pipeline.chunkdb import ChunkFileRanges
from pipeline.chunking import Chunk, ChunkDocuments, load_tokenizer, pad_id_of
from pipeline.corpus import METRICS_NAMESPACE, ReadCorpus, rejected_share
from pipeline.index import BUILD_INFO_FILE, INDEX_FILE, BuildIndex, new_index
from pipeline.models import (DEFAULT_MODEL_NAMES, embedding_dim, fingerprint_path, resolve_model,
                             resolve_tokenizer)
from pipeline.options import encoder_threads, pipeline_options
from pipeline.progress import ReportProgress, StageTimer
from pipeline.neighbour_recall import MeasureNeighbourRecall
from pipeline.shards import (FILLED, DocumentSpans, PackSequences, RetrieveNeighbours, Retrieval, WriteShards,
                             overlap_histogram)
from pipeline.writers import (WriteGroupedFiles, WriteRejected, chunks_table, embeddings_table,
                              parquet_bytes)
from schemas.arrow import check_schema_version, tensor_column_to_numpy
from schemas.config import PipelineConfig, stable_hash
from schemas.manifest import (FileEntry, Fingerprint, IndexManifest, NeighbourRecall, Recall, ShardsManifest,
                              VectorIndex, VectorIndexManifest)

log = logging.getLogger("ratrain")
FILES_LIST = "_files.json"
RECALL_FILE = "_neighbour_recall.json"
MIN_FILL = 0.99          # below this share of filled neighbour slots, the stage warns
MIN_NEIGHBOUR_RECALL = 0.95
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


def _check_rejected(counters: dict[str, int], cfg: PipelineConfig, stage: str, staging: str) -> None:
    """Too many rejected records: publish them (the user needs to see why) and fail the stage
    before it commits."""
    rejected, records = rejected_share(counters)
    if records and rejected / records > cfg.max_rejected_fraction:
        _publish_rejected(staging, cfg.output)
        fileio.discard_staging(staging)
        reasons = ", ".join(f"{k[len('rejected_'):]} {v:,}" for k, v in counters.items()
                            if k.startswith("rejected_") and v)
        raise StageError(f"{stage}: {rejected:,} of {records:,} input records rejected "
                         f"({rejected / records:.0%}: {reasons}), more than max_rejected_fraction "
                         f"{cfg.max_rejected_fraction:.0%}; see {fileio.join(cfg.output, 'rejected')}")


def _publish_rejected(staging: str, output: str) -> list[dict]:
    """Move the job's rejected-record files to `<output>/rejected/`."""
    source_dir = fileio.join(staging, REJECTED_STAGING)
    moved = []
    for source in fileio.list_files(source_dir):
        target = fileio.join(output, "rejected", posixpath.basename(source))
        fileio.move(source, target)
        moved.append(target)
    fileio.delete_tree(source_dir)
    return moved


# --- build-index ----------------------------------------------------------------------------

def _index_files(staging: str, out_subdir: str = "faiss") -> tuple[dict, dict]:
    """The build info BuildIndex wrote, and the manifest entry of its index file (hashed by the
    writer: a budget-sized index is not read back)."""
    info = fileio.read_json(fileio.join(staging, out_subdir, BUILD_INFO_FILE))
    entry = {"path": f"{out_subdir}/{INDEX_FILE}", "rows": info["num_vectors"],
             "bytes": info["index_bytes"], "sha256": info["index_sha256"]}
    return info, entry


def _vector_index_fields(info: dict) -> dict:
    return {key: info[key] for key in VectorIndex.model_fields}


def _committed_index(cfg: PipelineConfig) -> IndexManifest | None:
    path = fileio.join(index_dir(cfg), fileio.MANIFEST)
    if not fileio.exists(path):
        return None
    try:
        return IndexManifest.model_validate_json(fileio.read_bytes(path))
    except ValueError:  # an older or foreign manifest: rebuild from scratch
        return None


def describe(pipeline: beam.Pipeline) -> dict:
    """What `--dry-run` prints: the resolved Beam options and the top-level stages with their
    resource hints (accelerator, min_ram)."""
    stages = []
    for applied in pipeline.transforms_stack[0].parts:
        hints = {urn.split(":")[2]: value.decode() for urn, value in (applied.resource_hints or {}).items()}
        stages.append({"stage": applied.full_label, **({"resource_hints": hints} if hints else {})})
    options = pipeline.options.get_all_options(drop_default=True, retain_unknown_options=True)
    return {"options": options, "stages": stages}


def new_pipeline(beam_args: list[str], dry_run: bool = False) -> beam.Pipeline:
    """A pipeline for these options. A dry run builds it on the local runner: the configured
    runner (Dataflow's checks its buckets when the pipeline is created) is never contacted."""
    options = pipeline_options(beam_args)
    if dry_run:
        from apache_beam.runners.portability.fn_api_runner import FnApiRunner

        return beam.Pipeline(runner=FnApiRunner(), options=options)
    return beam.Pipeline(options=options)


def check_index_type(cfg: PipelineConfig) -> None:
    """A faiss factory string that cannot be built fails now, not after hours of embedding
    (when the encoder's width can be read without loading it)."""
    dim = embedding_dim(cfg.embedding.model)
    if cfg.index.type != "auto" and dim is not None:
        new_index(cfg.index.type, dim)


def build_index(cfg: PipelineConfig, beam_args: list[str], force: bool = False,
                dry_run: bool = False) -> IndexManifest | dict:
    """Stages 1-3: retrieval corpus -> chunks, embeddings, faiss index, committed manifest.

    When the committed chunks and embeddings match the config (only `index.*` changed), only
    the faiss index is rebuilt from them. dry_run: build the graph, touch no input or output,
    run nothing; return `describe(pipeline)`.
    """
    check_index_type(cfg)
    previous = None if force or dry_run else _committed_index(cfg)
    if previous is not None and previous.embed_config_hash == cfg.embed_hash():
        return _rebuild_faiss(cfg, previous, beam_args)
    tok = Tokenization.of(cfg)
    staging = fileio.new_staging_dir(cfg.output, "index", dry_run)
    m = cfg.chunk_tokens
    with StageTimer("build-index") as timer:
        pipeline = new_pipeline(beam_args, dry_run)
        threads = encoder_threads(cfg.embedding.cpu_threads, cfg.embedding.device, pipeline.options)
        documents, rejected = pipeline | "ReadRetrievalCorpus" >> ReadCorpus(cfg.retrieval_corpus,
                                                                             match=not dry_run)
        chunks, unusable = (documents | "DocumentProgress" >> ReportProgress("read", "documents")
                            | "ChunkDocuments" >> ChunkDocuments(tok.path, m, tok.pad_id))
        chunk_files = chunks | "WriteChunks" >> WriteGroupedFiles(
            fileio.join(staging, "chunks"), staging, "chunks", "parquet",
            key=lambda c: c.chunk_id, rows_per_file=cfg.chunk_file_rows,
            to_bytes=lambda rows: parquet_bytes(chunks_table(rows, m)))
        from pipeline.embed import EmbedChunks  # imports torch, which the index command never needs

        embeddings = (chunks
                      | "EmbedChunks" >> EmbedChunks(cfg.embedding, tok.path, threads)
                      | "EmbedProgress" >> ReportProgress("embed", "chunks"))
        embedding_files = embeddings | "WriteEmbeddings" >> WriteGroupedFiles(
            fileio.join(staging, "embeddings"), staging, "embeddings", "parquet",
            key=lambda e: e[0], rows_per_file=cfg.chunk_file_rows,
            to_bytes=lambda rows: parquet_bytes(embeddings_table(rows)))
        _ = (embedding_files
             | "EmbeddingPaths" >> beam.Map(lambda entry: fileio.join(staging, entry["path"]))
             | "BuildIndex" >> BuildIndex(cfg.index, fileio.join(staging, "faiss")))
        _ = ((rejected, unusable) | "MergeRejected" >> beam.Flatten()
             | "WriteRejected" >> WriteRejected(fileio.join(staging, REJECTED_STAGING),
                                                "build-index"))
        _collect_entries("IndexFiles", (chunk_files, embedding_files), staging)
        if dry_run:
            return describe(pipeline)
        counters = run_and_count(pipeline)
        timer.done(counters, "chunks")
    _check_rejected(counters, cfg, "build-index", staging)

    info, index_entry = _index_files(staging)
    files = fileio.read_json(fileio.join(staging, FILES_LIST)) + [index_entry]
    beam.io.filesystems.FileSystems.delete([fileio.join(staging, FILES_LIST)])
    manifest = IndexManifest(
        config_hash=cfg.index_hash(), embed_config_hash=cfg.embed_hash(),
        tokenizer=Fingerprint(name=tok.name, fingerprint=fingerprint_path(tok.path)),
        embedding_model=Fingerprint(name=cfg.embedding.model,
                                    fingerprint=fingerprint_path(resolve_model(cfg.embedding.model))),
        encoder_threads=threads, num_documents=counters.get("documents_chunked", 0),
        num_chunks=counters.get("chunks", 0), chunk_tokens=m, pad_id=tok.pad_id,
        files=sorted(files, key=lambda f: f["path"]), counters=counters,
        created_by=f"ratrain-pipeline {__version__}", **_vector_index_fields(info))
    _publish_rejected(staging, cfg.output)
    fileio.commit_directory(staging, index_dir(cfg), manifest.model_dump(mode="json"))
    _log_index(index_dir(cfg), manifest)
    return manifest


def _log_index(directory: str, manifest) -> None:
    recall = manifest.recall_at_k
    log.info("committed %s (%s, %s = %.3f at depth %s, %s bytes)", directory,
             manifest.index_factory, recall.measure, recall.value, manifest.nprobe,
             f"{manifest.index_bytes:,}")
    if recall.target is not None and recall.value < recall.target:
        where = (f"and doubling the search depth beyond {manifest.nprobe} gained less than 0.005 "
                 "(a plateau: the codes limit recall, not the depth)" if recall.plateau
                 else "even at the deepest search")
        log.warning("%s: %s = %.3f misses the target %.2f %s; a larger index.memory_budget "
                    "(bigger codes) or another index.type would reach it",
                    directory, recall.measure, recall.value, recall.target, where)


def _run_build_index(paths: list[str], cfg_index, staging: str, beam_args: list[str], name: str):
    with StageTimer(name) as timer:
        pipeline = new_pipeline(beam_args)
        _ = (pipeline | "EmbeddingFiles" >> beam.Create(paths)
             | "BuildIndex" >> BuildIndex(cfg_index, fileio.join(staging, "faiss")))
        counters = run_and_count(pipeline)
        timer.done(counters, "index_vectors_added")
    return counters


def _rebuild_faiss(cfg: PipelineConfig, previous: IndexManifest, beam_args: list[str]) -> IndexManifest:
    """Only `index.*` changed: a new faiss index from the committed embeddings."""
    log.info("build-index: chunks and embeddings match the config; rebuilding the faiss index only")
    directory = index_dir(cfg)
    kept = [f for f in previous.files if not f.path.startswith("faiss/")]
    paths = [fileio.join(directory, f.path) for f in kept if f.path.startswith("embeddings/")]
    staging = fileio.new_staging_dir(cfg.output, "faiss")
    counters = _run_build_index(paths, cfg.index, staging, beam_args, "build-index (faiss only)")
    info, index_entry = _index_files(staging)
    merged_counters = {**{k: v for k, v in previous.counters.items() if not k.startswith("index_")},
                       **counters}
    manifest = previous.model_copy(update={
        "config_hash": cfg.index_hash(), "files": sorted([*kept, FileEntry(**index_entry)], key=lambda f: f.path),
        "counters": dict(sorted(merged_counters.items())),
        "created_by": f"ratrain-pipeline {__version__}",
        **{key: (Recall(**value) if key == "recall_at_k" else value)
           for key, value in _vector_index_fields(info).items()}})
    fileio.commit_directory(staging, directory, manifest.model_dump(mode="json"), replace=("faiss",))
    _log_index(directory, manifest)
    return manifest


def build_vector_index(embeddings: list[str], output: str, cfg_index, beam_args: list[str]) -> VectorIndexManifest:
    """`ratrain-pipeline index`: a faiss index over existing embedding files -> `<output>/faiss/`
    and `<output>/manifest.json`. Nothing else in `output` is touched."""
    paths = sorted({m.path for pattern, result in zip(embeddings, FileSystems.match(embeddings))
                    for m in _nonempty(pattern, result)})
    sizes = {m.path: m.size_in_bytes for r in FileSystems.match(paths) for m in r.metadata_list}
    staging = fileio.new_staging_dir(output, "faiss")
    counters = _run_build_index(paths, cfg_index, staging, beam_args, "index")
    info, index_entry = _index_files(staging)
    inputs = [{"path": p, "bytes": sizes[p]} for p in paths]
    manifest = VectorIndexManifest(
        config_hash=stable_hash({"index": cfg_index.model_dump(), "inputs": inputs}),
        num_vectors=info["num_vectors"], inputs=inputs, files=[index_entry], counters=counters,
        created_by=f"ratrain-pipeline {__version__}", **_vector_index_fields(info))
    fileio.commit_directory(staging, output, manifest.model_dump(mode="json"), replace=("faiss",))
    _log_index(output, manifest)
    return manifest


def _nonempty(pattern, result):
    if not result.metadata_list:
        raise FileNotFoundError(f"embeddings glob matches no file: {pattern}")
    return result.metadata_list


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


def build_shards(cfg: PipelineConfig, beam_args: list[str], dry_run: bool = False) -> ShardsManifest | dict:
    """Stages 4-5: training sequences + retrieved neighbours -> Arrow shards, committed.
    dry_run: as for `build_index` (no committed index is needed)."""
    index_manifest, index_sha = (None, None) if dry_run else load_index_manifest(cfg)
    tok = Tokenization.of(cfg)
    staging = fileio.new_staging_dir(cfg.output, "shards", dry_run)
    L, m, k = cfg.chunks_per_sequence, cfg.chunk_tokens, cfg.neighbours
    idx = index_dir(cfg)
    with StageTimer("build-shards") as timer:
        pipeline = new_pipeline(beam_args, dry_run)
        threads = None
        chunk_files = ChunkFileRanges.from_entries(idx, [] if dry_run else index_manifest.files)
        if cfg.training_corpus == "same":
            training_chunks = (pipeline
                               | "ReadChunkDatabase" >> ReadFromParquetBatched(
                                   fileio.join(idx, "chunks", "*.parquet"), validate=not dry_run)
                               | "ChunkRows" >> beam.FlatMap(_chunks_from_table))
            queries = (pipeline
                       | "ReadEmbeddings" >> ReadFromParquetBatched(
                           fileio.join(idx, "embeddings", "*.parquet"), validate=not dry_run)
                       | "EmbeddingRows" >> beam.FlatMap(_embeddings_from_table))
            rejected = pipeline | "NoRejected" >> beam.Create([])
        else:
            documents, read_rejected = (pipeline
                                        | "ReadTrainingCorpus" >> ReadCorpus(cfg.training_corpus,
                                                                             match=not dry_run))
            training_chunks, unusable = documents | "ChunkTrainingDocuments" >> ChunkDocuments(
                tok.path, m, tok.pad_id)
            from pipeline.embed import EmbedChunks  # imports torch: only when embedding

            threads = encoder_threads(cfg.embedding.cpu_threads, cfg.embedding.device, pipeline.options)
            queries = training_chunks | "EmbedTrainingChunks" >> EmbedChunks(cfg.embedding, tok.path, threads)
            rejected = (read_rejected, unusable) | "MergeRejected" >> beam.Flatten()
        sequences = training_chunks | "PackSequences" >> PackSequences(L, tok.pad_id)
        spans = pipeline | "DocumentSpans" >> DocumentSpans(fileio.join(idx, "chunks", "*.parquet"),
                                                            validate=not dry_run)
        spec = Retrieval(fileio.join(idx, "faiss", INDEX_FILE), None if dry_run else index_manifest.nprobe,
                         chunk_files, L, m, k, cfg.neighbour_candidates, tok.pad_id, cfg.dedupe_neighbours,
                         cfg.neighbour_recall_sample)
        rows, probes = (sequences, queries, spans) | "RetrieveNeighbours" >> RetrieveNeighbours(
            spec, cfg.index.min_ram)
        rows = rows | "ShardProgress" >> ReportProgress("retrieve", "sequences")
        shard_files = rows | "WriteShards" >> WriteShards(staging, cfg.rows_per_shard(), tok.pad_id)
        if cfg.neighbour_recall_sample:
            _ = ((probes, rows)
                 | "MeasureNeighbourRecall" >> MeasureNeighbourRecall(
                     fileio.join(idx, "embeddings", "*.parquet"), k, cfg.neighbour_recall_sample,
                     validate=not dry_run)
                 | "WriteNeighbourRecall" >> beam.Map(
                     lambda result: fileio.write_json_atomic(fileio.join(staging, RECALL_FILE), result)))
        _ = rejected | "WriteRejected" >> WriteRejected(
            fileio.join(staging, REJECTED_STAGING), "build-shards")
        _collect_entries("ShardFiles", (shard_files,), staging)
        if dry_run:
            return describe(pipeline)
        counters = run_and_count(pipeline)
        timer.done(counters, "sequences")
    _check_rejected(counters, cfg, "build-shards", staging)

    shards = fileio.read_json(fileio.join(staging, FILES_LIST))
    recall = None
    if cfg.neighbour_recall_sample:
        recall = fileio.read_json(fileio.join(staging, RECALL_FILE))
        beam.io.filesystems.FileSystems.delete([fileio.join(staging, RECALL_FILE)])
    beam.io.filesystems.FileSystems.delete([fileio.join(staging, FILES_LIST)])
    num_sequences = sum(s["rows"] for s in shards)
    slots = num_sequences * L * k
    manifest = ShardsManifest(
        config_hash=cfg.shards_hash(), index_manifest_sha256=index_sha,
        training_corpus="same" if cfg.training_corpus == "same" else "separate",
        encoder_threads=threads, sequence_tokens=cfg.sequence_tokens, chunk_tokens=m, neighbours=k,
        neighbour_tokens=2 * m, pad_id=tok.pad_id,
        num_sequences=num_sequences, shards=shards,
        neighbour_fill=sum(s[FILLED] for s in shards) / slots if slots else 1.0,
        neighbour_recall=None if recall is None else NeighbourRecall(**recall),
        overlap=overlap_histogram(counters), counters=counters,
        created_by=f"ratrain-pipeline {__version__}")
    _publish_rejected(staging, cfg.output)
    fileio.commit_directory(staging, shards_dir(cfg), manifest.model_dump(mode="json"))
    log.info("committed %s (%d sequences in %d shards, %s)", shards_dir(cfg),
             manifest.num_sequences, len(shards), manifest.neighbour_summary())
    for warning in neighbour_warnings(manifest, cfg):
        log.warning("%s: %s", shards_dir(cfg), warning)
    return manifest


def neighbour_warnings(manifest: ShardsManifest, cfg: PipelineConfig) -> list[str]:
    """What makes the shards worse than they look, with the cause."""
    warnings = []
    fill = manifest.neighbour_fill
    if fill is not None and fill < MIN_FILL:
        slots = manifest.num_sequences * manifest.sequence_tokens // manifest.chunk_tokens * manifest.neighbours
        empty = slots - sum(entry.neighbour_slots_filled or 0 for entry in manifest.shards)
        if cfg.dedupe_neighbours and manifest.counters.get("candidates_dropped_duplicate_tokens", 0):
            cause = (f"after dropping repeated tokens fewer than k of the {cfg.neighbour_candidates} "
                     "candidates were left (raise neighbour_candidates)")
        else:
            cause = ("the chunk database holds fewer than k chunks outside a sequence's own "
                     "documents for these chunks (a database of few, long documents)")
        warnings.append(f"only {fill:.1%} of neighbour slots are filled ({empty:,} empty): {cause}; "
                        "a RETRO model sees these slots as padding")
    recall = manifest.neighbour_recall
    if recall is not None and recall.value < MIN_NEIGHBOUR_RECALL:
        warnings.append(f"neighbour recall {recall.value:.3f} against exact search is below "
                        f"{MIN_NEIGHBOUR_RECALL}: the index misses near neighbours (raise "
                        "index.target_recall or index.nprobe, or a larger index.memory_budget)")
    return warnings
