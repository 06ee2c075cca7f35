"""The two Beam jobs (build-index: stages 1-3; build-shards: stages 4-5), each ending in its own
commit.

Each job writes into a staging directory under `<output>/.staging/`; its last step, on a worker,
builds the manifest from the data the job wrote (file entries, counts computed as data:
`pipeline.tally`) and commits (`pipeline.commit`): rejected records to `<output>/rejected/`,
the files into place, manifest.json last (docs/design.md §4). So a job submitted to a cluster and left
(`detach`) commits itself; attached, the driver waits and reads the committed manifest.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

import apache_beam as beam
import numpy as np
from apache_beam.io.filesystems import FileSystems
from apache_beam.io.parquetio import ReadFromParquetBatched

from pipeline import fileio
from pipeline.chunkdb import ChunkFileRanges, chunk_arrays
from pipeline.chunking import Chunk, ChunkDocuments, load_tokenizer, pad_id_of
from pipeline.commit import REJECTED_STAGING, StageError, commit_stage, new_staging_dir
from pipeline.corpus import ReadCorpus
from pipeline.faiss_index import PLATEAU_GAIN, RECALL_K, new_index, resolve_clustering
from pipeline.index import BUILD_INFO_FILE, INDEX_FILE, BuildIndex
from pipeline.models import DEFAULT_MODEL_NAMES, embedding_dim, fingerprint_path, resolve_model, resolve_tokenizer
from pipeline.neighbour_recall import MeasureNeighbourRecall
from pipeline.options import encoder_threads, pipeline_options
from pipeline.progress import ReportProgress, StageTimer
from pipeline.retro_rows import overlap_histogram, overlap_tally
from pipeline.shards import FILLED, LOST_DATA, DocumentSpans, PackSequences, Retrieval, RetrieveNeighbours, WriteShards
from pipeline.tally import Tally, counted
from pipeline.writers import WriteGroupedFiles, WriteRejected, chunks_table, embeddings_table, parquet_bytes
from schemas.arrow import tensor_column_to_numpy
from schemas.config import PipelineConfig, stable_hash
from schemas.manifest import (
    CREATED_BY,
    MANIFEST_FILE,
    Fingerprint,
    IndexManifest,
    NeighbourRecall,
    SearchDepth,
    ShardsManifest,
    StageTimings,
    VectorIndex,
    VectorIndexManifest,
    read_manifest,
)

log = logging.getLogger("ratrain")
MIN_FILL = 0.99  # below this share of filled neighbour slots, the stage warns


@dataclass(frozen=True)
class Submitted:
    """A detached stage: submitted, committing itself when it finishes."""

    stage: str
    manifest: str  # where its manifest appears once committed
    job: str | None = None  # the runner's job id, where it has one


@dataclass(frozen=True)
class Tokenization:
    name: str  # as recorded in the manifest: the config value or the default encoder's
    path: str
    pad_id: int

    @classmethod
    def of(cls, cfg: PipelineConfig) -> Tokenization:
        name = cfg.tokenizer or DEFAULT_MODEL_NAMES[0]
        path = resolve_tokenizer(name)
        if not os.path.isfile(path):
            raise StageError(f"tokenizer: file not found: {path}")
        return cls(name, path, pad_id_of(load_tokenizer(path)))


def stage_timings(stage: str, started: float, committed: float, counters: dict[str, int], records: str) -> dict:
    """A manifest's `timings`: the wall time from `started` to `committed` (seconds since the
    epoch) and the throughput in the counter `records` (None when the clocks disagree so far
    that the wall time is not positive)."""
    wall = committed - started
    return StageTimings(
        stage=stage,
        started=_utc(started),
        committed=_utc(committed),
        wall_seconds=round(wall, 3),
        records=records,
        records_per_second=round(counters.get(records, 0) / wall, 1) if wall > 0 else None,
    ).model_dump(mode="json")


def _utc(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat(timespec="seconds")


@dataclass(frozen=True)
class StageClock:
    """A job's name, the counter its throughput counts, and when the driver built its pipeline.
    The commit step runs on a worker, maybe long after the driver left (detached): it reads
    its own clock against `started` (wall-clock time, comparable across machines)."""

    stage: str
    records: str
    started: float = field(default_factory=time.time)

    def timings(self, counters: dict[str, int]) -> dict:
        return stage_timings(self.stage, self.started, time.time(), counters, self.records)


def index_dir(cfg: PipelineConfig) -> str:
    return fileio.join(cfg.output, "index")


def shards_dir(cfg: PipelineConfig) -> str:
    return fileio.join(cfg.output, "shards")


# --- manifests (each job's last step commits one: pipeline.commit.commit_stage) ---------------


def _sorted_entries(entries) -> list[dict]:
    return sorted(entries, key=lambda e: e["path"])


def describe(pipeline: beam.Pipeline) -> dict:
    """What `--dry-run` prints: the resolved Beam options and the top-level stages with their
    resource hints (accelerator, min_ram), and any step inside one with hints of its own."""

    def hints(applied) -> dict:
        return {urn.split(":")[2]: value.decode() for urn, value in (applied.resource_hints or {}).items()}

    def hinted_steps(applied):  # steps inside a stage that carry hints of their own
        for part in applied.parts:
            if hints(part) and hints(part) != hints(applied):
                yield {"stage": part.full_label, "resource_hints": hints(part)}
            yield from hinted_steps(part)

    stages = []
    for applied in pipeline.transforms_stack[0].parts:
        stages.append({"stage": applied.full_label, **({"resource_hints": hints(applied)} if hints(applied) else {})})
        stages += hinted_steps(applied)
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


def run_stage(pipeline: beam.Pipeline, clock: StageClock, directory: str, model, detach: bool):
    """Run a job that commits itself. Attached: wait, then read and return the committed
    manifest. Detached: return once the runner has the job (`Submitted`)."""
    name, main = clock.stage, clock.records
    manifest_path = fileio.join(directory, MANIFEST_FILE)
    with StageTimer(name) as timer:
        result = pipeline.run()
        if detach:
            job = getattr(result, "job_id", lambda: None)()
            log.info(
                "%s: submitted%s; it commits %s when it finishes", name, f" (job {job})" if job else "", manifest_path
            )
            return Submitted(name, manifest_path, job)
        result.wait_until_finish()
        manifest = fileio.committed_manifest(directory, model)
        timer.done(manifest.counters, main)
    return manifest


def check_index_type(cfg: PipelineConfig) -> None:
    """A faiss factory string that cannot be built, or a clustering it cannot take, fails now,
    not after hours of embedding (when the encoder's width can be read without loading it)."""
    dim = embedding_dim(cfg.embedding.model)
    if cfg.index.type != "auto" and dim is not None:
        new_index(cfg.index.type, dim)
        resolve_clustering(cfg.index.clustering, cfg.index.type)


# --- build-index ----------------------------------------------------------------------------


def _index_entries(info: dict) -> list[dict]:
    """The manifest entries of the faiss files, index.faiss or its shards (hashed by their
    writer: they are never read back)."""
    return [{**entry, "path": f"faiss/{entry['path']}"} for entry in info["files"]]


def faiss_files(paths: list[str]) -> list[str]:
    """Of an index manifest's file paths, the faiss files (index.faiss, or its shards in
    chunk-id order)."""
    return [path for path in paths if path.startswith("faiss/")]


def _index_staged(manifest: dict) -> list[str]:
    """What BuildIndex staged: the faiss files the manifest lists, and the build info."""
    return faiss_files([e["path"] for e in manifest["files"]]) + [f"faiss/{BUILD_INFO_FILE}"]


def _vector_index_fields(info: dict) -> dict:
    return {key: info[key] for key in VectorIndex.model_fields}


def _index_counters(info: dict) -> dict[str, int]:
    return {"index_vectors_added": info["num_vectors"], "index_training_vectors": info["training_vectors"]}


def _committed_index(cfg: PipelineConfig) -> IndexManifest | None:
    try:
        return fileio.committed_manifest(index_dir(cfg), IndexManifest)
    except ValueError:  # none, or an older or foreign manifest: rebuild from scratch
        return None


def tokens_in_chunk(chunk: Chunk, pad_id: int) -> int:
    """The document tokens a chunk holds: all m but in a document's last chunk (its
    continuation is padding), which ends at its last non-pad token."""
    if (chunk.continuation != pad_id).any():
        return len(chunk.tokens)
    held = np.flatnonzero(chunk.tokens != pad_id)
    return int(held[-1]) + 1 if len(held) else 0


def _rejected_tally(rejected, label: str):
    return rejected | label >> beam.Map(lambda r: (f"rejected_{r.reason}", 1))


def _documents_read_tally(documents, rejected, prefix: str):
    """Documents parsed: those kept, plus those refused after parsing (a duplicate id)."""
    return (
        counted("documents_read", documents, label=f"{prefix}DocumentsKept"),
        rejected
        | f"{prefix}DuplicatesRead"
        >> beam.FlatMap(lambda r: [("documents_read", 1)] if r.reason == "duplicate_id" else []),
    )


def _index_manifest(entries, info, tallies, precision, cfg: PipelineConfig, tok: Tokenization, threads) -> dict:
    files = _sorted_entries(list(entries) + _index_entries(info))
    return IndexManifest(
        config_hash=cfg.index_hash(),
        embed_config_hash=cfg.embed_hash(),
        tokenizer=Fingerprint(name=tok.name, fingerprint=fingerprint_path(tok.path)),
        embedding_model=Fingerprint(
            name=cfg.embedding.model, fingerprint=fingerprint_path(resolve_model(cfg.embedding.model))
        ),
        encoder_threads=threads,
        embedding_precision=precision,
        num_documents=tallies.get("documents_chunked", 0),
        num_chunks=sum(e["rows"] for e in files if e["path"].startswith("chunks/")),
        chunk_tokens=cfg.chunk_tokens,
        pad_id=tok.pad_id,
        files=files,
        counters=dict(sorted({**tallies, **_index_counters(info)}.items())),
        created_by=CREATED_BY,
        **_vector_index_fields(info),
    ).model_dump(mode="json")


def build_index(
    cfg: PipelineConfig, beam_args: list[str], force: bool = False, dry_run: bool = False, detach: bool = False
) -> IndexManifest | Submitted | dict:
    """Stages 1-3: retrieval corpus -> chunks, embeddings, faiss index, committed manifest.

    When the committed chunks and embeddings match the config (only `index.*` changed), only
    the faiss index is rebuilt from them. dry_run: build the graph, touch no input or output,
    run nothing; return `describe(pipeline)`. detach: submit and return.
    """
    check_index_type(cfg)
    previous = None if force or dry_run else _committed_index(cfg)
    if previous is not None and previous.embed_config_hash == cfg.embed_hash():
        return _rebuild_faiss(cfg, previous, beam_args, detach)
    tok = Tokenization.of(cfg)
    staging = new_staging_dir(cfg.output, "index", dry_run)
    m, pad = cfg.chunk_tokens, tok.pad_id
    pipeline = new_pipeline(beam_args, dry_run)
    clock = StageClock("build-index", "chunks")
    threads = encoder_threads(cfg.embedding.cpu_threads, cfg.embedding.device, pipeline.options)
    documents, rejected = pipeline | "ReadRetrievalCorpus" >> ReadCorpus(cfg.retrieval_corpus, match=not dry_run)
    chunks, unusable = (
        documents
        | "DocumentProgress" >> ReportProgress("read", "documents")
        | "ChunkDocuments" >> ChunkDocuments(tok.path, m, pad)
    )
    chunk_files = chunks | "WriteChunks" >> WriteGroupedFiles(
        fileio.join(staging, "chunks"),
        staging,
        "chunks",
        "parquet",
        key=lambda c: c.chunk_id,
        rows_per_file=cfg.chunk_file_rows,
        to_bytes=lambda rows: parquet_bytes(chunks_table(rows, m)),
    )
    from pipeline.embed import EmbedChunks  # imports torch, which the index command never needs

    embeddings, precision = chunks | "EmbedChunks" >> EmbedChunks(cfg.embedding, tok.path, threads)
    embeddings = embeddings | "EmbedProgress" >> ReportProgress("embed", "chunks")
    embedding_files = embeddings | "WriteEmbeddings" >> WriteGroupedFiles(
        fileio.join(staging, "embeddings"),
        staging,
        "embeddings",
        "parquet",
        key=lambda e: e[0],
        rows_per_file=cfg.chunk_file_rows,
        to_bytes=lambda rows: parquet_bytes(embeddings_table(rows)),
    )
    info = (
        embedding_files
        | "EmbeddingPaths" >> beam.Map(lambda entry: fileio.join(staging, entry["path"]))
        | "BuildIndex"
        >> BuildIndex(
            cfg.index,
            fileio.join(staging, "faiss"),
            chunks | "DocumentOfChunk" >> beam.Map(lambda c: (c.chunk_id, c.doc_id)),
            cfg.neighbours,
        )
    )
    all_rejected = (rejected, unusable) | "MergeRejected" >> beam.Flatten()
    rejected_files = all_rejected | "WriteRejected" >> WriteRejected(
        fileio.join(staging, REJECTED_STAGING), "build-index"
    )
    tallies = (
        *_documents_read_tally(documents, all_rejected, "Index"),
        _rejected_tally(all_rejected, "TallyRejected"),
        chunks
        | "TallyDocumentsChunked" >> beam.FlatMap(lambda c: [("documents_chunked", 1)] if c.position == 0 else []),
        counted("chunks", chunks),
        counted("tokens", chunks, lambda c: tokens_in_chunk(c, pad)),
        counted("chunks_embedded", embeddings),
    ) | "Tallies" >> Tally()
    entries = (chunk_files, embedding_files) | "FileEntries" >> beam.Flatten()
    manifest = (
        entries
        | "GatherEntries" >> beam.combiners.ToList()
        | "IndexManifest"
        >> beam.Map(
            _index_manifest,
            beam.pvalue.AsSingleton(info),
            beam.pvalue.AsDict(tallies),
            beam.pvalue.AsSingleton(precision),
            cfg,
            tok,
            threads,
        )
    )
    staged = beam.pvalue.AsSingleton(
        entries | "StagedPaths" >> beam.Map(lambda e: e["path"]) | "AllStaged" >> beam.combiners.ToList()
    )
    _ = manifest | "Commit" >> beam.Map(
        lambda manifest, staged, *after: commit_stage(
            manifest,
            staging,
            cfg.output,
            index_dir(cfg),
            clock,
            staged + _index_staged(manifest),
            cfg.max_rejected_fraction,
        ),
        staged,
        beam.pvalue.AsList(rejected_files),
    )
    if dry_run:
        return describe(pipeline)
    manifest = run_stage(pipeline, clock, index_dir(cfg), IndexManifest, detach)
    if isinstance(manifest, IndexManifest):
        _log_index(index_dir(cfg), manifest)
    return manifest


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


def _nonempty(pattern, result):
    if not result.metadata_list:
        raise FileNotFoundError(f"embeddings glob matches no file: {pattern}")
    return result.metadata_list


# --- build-shards ---------------------------------------------------------------------------


def load_index_manifest(cfg: PipelineConfig) -> tuple[IndexManifest, str]:
    """The committed index manifest and its sha256, or a clear error."""
    path = fileio.join(index_dir(cfg), MANIFEST_FILE)
    if not fileio.exists(path):
        raise StageError(f"no committed index at {index_dir(cfg)}: run build-index first")
    data = fileio.read_bytes(path)
    manifest = read_manifest(data, path, IndexManifest)
    if manifest.chunk_tokens != cfg.chunk_tokens:
        raise StageError(
            f"index at {index_dir(cfg)} has chunk_tokens={manifest.chunk_tokens}, "
            f"config asks for {cfg.chunk_tokens}: rebuild the index"
        )
    return manifest, fileio.sha256_bytes(data)


def wait_for_index(cfg: PipelineConfig, timeout_s: float, poll_s: float = 30.0) -> None:
    """Wait until the index this config describes is committed (a detached build-index on a
    cluster): its manifest exists with this config's index hash."""
    path = fileio.join(index_dir(cfg), MANIFEST_FILE)
    deadline = time.monotonic() + timeout_s
    while True:
        committed = _committed_index(cfg)
        if committed is not None and committed.config_hash == cfg.index_hash():
            return
        if time.monotonic() >= deadline:
            raise StageError(f"no index matching the config was committed at {path} within {timeout_s:.0f} s")
        log.info("build-shards: waiting for %s", path)
        time.sleep(poll_s)


def _chunks_from_table(table) -> list[Chunk]:
    rows = chunk_arrays(table)
    return [
        Chunk(int(i), int(d), int(p), t, c)
        for i, d, p, t, c in zip(
            rows["chunk_id"], rows["doc_id"], rows["position"], rows["tokens"], rows["continuation"]
        )
    ]


def _embeddings_from_table(table) -> list[tuple[int, np.ndarray]]:
    vectors = tensor_column_to_numpy(table["embedding"])
    return list(zip(table["chunk_id"].to_numpy().tolist(), vectors))


def _shards_manifest(
    entries, tallies, recall, search_depth, precision, cfg: PipelineConfig, index_sha: str, threads, pad_id: int
) -> dict:
    shards = _sorted_entries(entries)
    L, k = cfg.chunks_per_sequence, cfg.neighbours
    num_sequences = sum(s["rows"] for s in shards)
    slots = num_sequences * L * k
    counters = dict(tallies)
    counters["chunks_not_in_a_sequence"] = counters.pop("training_chunks", 0) - num_sequences * L
    return ShardsManifest(
        config_hash=cfg.shards_hash(),
        index_manifest_sha256=index_sha,
        training_corpus="same" if cfg.training_corpus == "same" else "separate",
        encoder_threads=threads,
        embedding_precision=precision,
        sequence_tokens=cfg.sequence_tokens,
        chunk_tokens=cfg.chunk_tokens,
        neighbours=k,
        neighbour_tokens=2 * cfg.chunk_tokens,
        pad_id=pad_id,
        num_sequences=num_sequences,
        shards=shards,
        neighbour_fill=sum(s[FILLED] for s in shards) / slots if slots else 1.0,
        neighbour_recall=None if recall is None else NeighbourRecall(**recall),
        search_depth=SearchDepth(**search_depth) if search_depth["curve"] else None,
        overlap=overlap_histogram(counters),
        counters=dict(sorted(counters.items())),
        created_by=CREATED_BY,
    ).model_dump(mode="json")


def build_shards(
    cfg: PipelineConfig, beam_args: list[str], dry_run: bool = False, detach: bool = False
) -> ShardsManifest | Submitted | dict:
    """Stages 4-5: training sequences + retrieved neighbours -> Arrow shards, committed.
    dry_run, detach: as for `build_index` (a dry run needs no committed index).

    A job that fails because the runner lost shuffle data committed nothing; it runs once
    more, from fresh staging, and says so, and a second loss fails the stage. (Beam 2.77's
    local multi-process runner lost data through a race in its timed flush, which
    `pipeline_options` turns off: `options.no_timed_flush_on_local_runner`. The check and
    the retry stay, for any runner.)"""
    try:
        return _build_shards(cfg, beam_args, dry_run, detach)
    except Exception as err:  # the runner reraises the worker's error wrapped in its own type
        if dry_run or detach or LOST_DATA not in str(err):
            raise
        log.warning(
            "build-shards: the runner lost shuffle data (%s); nothing was committed, so the stage runs once more",
            str(err).strip().splitlines()[-1][:300],
        )
        return _build_shards(cfg, beam_args, dry_run, detach)


def _build_shards(
    cfg: PipelineConfig, beam_args: list[str], dry_run: bool, detach: bool
) -> ShardsManifest | Submitted | dict:
    index_manifest, index_sha = (None, None) if dry_run else load_index_manifest(cfg)
    tok = Tokenization.of(cfg)
    staging = new_staging_dir(cfg.output, "shards", dry_run)
    L, m, k = cfg.chunks_per_sequence, cfg.chunk_tokens, cfg.neighbours
    idx = index_dir(cfg)
    pipeline = new_pipeline(beam_args, dry_run)
    clock = StageClock("build-shards", "sequences")
    threads = None
    chunk_files = ChunkFileRanges.from_entries(idx, [] if dry_run else index_manifest.files)
    if cfg.training_corpus == "same":
        training_chunks = (
            pipeline
            | "ReadChunkDatabase"
            >> ReadFromParquetBatched(fileio.join(idx, "chunks", "*.parquet"), validate=not dry_run)
            | "ChunkRows" >> beam.FlatMap(_chunks_from_table)
        )
        queries = (
            pipeline
            | "ReadEmbeddings"
            >> ReadFromParquetBatched(fileio.join(idx, "embeddings", "*.parquet"), validate=not dry_run)
            | "EmbeddingRows" >> beam.FlatMap(_embeddings_from_table)
        )
        rejected = pipeline | "NoRejected" >> beam.Create([])
        precision = pipeline | "NothingEmbedded" >> beam.Create([None])
        read_tallies = ()
    else:
        documents, read_rejected = pipeline | "ReadTrainingCorpus" >> ReadCorpus(cfg.training_corpus, match=not dry_run)
        training_chunks, unusable = documents | "ChunkTrainingDocuments" >> ChunkDocuments(tok.path, m, tok.pad_id)
        from pipeline.embed import EmbedChunks  # imports torch: only when embedding

        threads = encoder_threads(cfg.embedding.cpu_threads, cfg.embedding.device, pipeline.options)
        queries, precision = training_chunks | "EmbedTrainingChunks" >> EmbedChunks(cfg.embedding, tok.path, threads)
        rejected = (read_rejected, unusable) | "MergeRejected" >> beam.Flatten()
        read_tallies = _documents_read_tally(documents, rejected, "Training")
    sequences = training_chunks | "PackSequences" >> PackSequences(L, tok.pad_id)
    spans = pipeline | "DocumentSpans" >> DocumentSpans(fileio.join(idx, "chunks", "*.parquet"), validate=not dry_run)
    index_paths = [f"faiss/{INDEX_FILE}"] if dry_run else faiss_files([f.path for f in index_manifest.files])
    spec = Retrieval(
        tuple(fileio.join(idx, path) for path in index_paths),
        None if dry_run else index_manifest.nprobe,
        chunk_files,
        L,
        m,
        k,
        cfg.neighbour_candidates,
        tok.pad_id,
        cfg.dedupe_neighbours,
        cfg.neighbour_recall_sample,
        fileio.join(idx, "embeddings", "*.parquet"),
        cfg.index.target_recall,
        cfg.recall_below_target,
    )
    retrieved = (sequences, queries, spans) | "RetrieveNeighbours" >> RetrieveNeighbours(
        spec, cfg.index.min_ram, validate=not dry_run
    )
    rows = retrieved.rows | "ShardProgress" >> ReportProgress("retrieve", "sequences")
    shard_files = rows | "WriteShards" >> WriteShards(staging, cfg.rows_per_shard(), tok.pad_id)
    rejected_files = rejected | "WriteRejected" >> WriteRejected(fileio.join(staging, REJECTED_STAGING), "build-shards")
    recall = (retrieved.probes, retrieved.truth, rows) | "MeasureNeighbourRecall" >> MeasureNeighbourRecall(k)
    tallies = (
        *read_tallies,
        retrieved.tallies,
        _rejected_tally(rejected, "TallyRejected"),
        counted("training_chunks", training_chunks),
        counted("sequences", rows),
        counted("neighbour_slots_padded", rows, lambda r: (r.neighbour_ids < 0).sum()),
        rows | "TallyOverlap" >> beam.FlatMap(overlap_tally, m, tok.pad_id),
    ) | "Tallies" >> Tally()
    manifest = (
        shard_files
        | "GatherShards" >> beam.combiners.ToList()
        | "ShardsManifest"
        >> beam.Map(
            _shards_manifest,
            beam.pvalue.AsDict(tallies),
            beam.pvalue.AsSingleton(recall),
            beam.pvalue.AsSingleton(retrieved.search_depth),
            beam.pvalue.AsSingleton(precision),
            cfg,
            index_sha,
            threads,
            tok.pad_id,
        )
    )
    staged = beam.pvalue.AsSingleton(
        shard_files | "StagedPaths" >> beam.Map(lambda e: e["path"]) | "AllStaged" >> beam.combiners.ToList()
    )
    _ = manifest | "Commit" >> beam.Map(
        lambda manifest, staged, *after: commit_stage(
            manifest, staging, cfg.output, shards_dir(cfg), clock, staged, cfg.max_rejected_fraction
        ),
        staged,
        beam.pvalue.AsList(rejected_files),
    )
    if dry_run:
        return describe(pipeline)
    manifest = run_stage(pipeline, clock, shards_dir(cfg), ShardsManifest, detach)
    if isinstance(manifest, ShardsManifest):
        log.info(
            "committed %s (%d sequences in %d shards, %s)",
            shards_dir(cfg),
            manifest.num_sequences,
            len(manifest.shards),
            manifest.neighbour_summary(),
        )
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
            cause = (
                f"after dropping repeated tokens fewer than k of the {cfg.neighbour_candidates} "
                "candidates were left (raise neighbour_candidates)"
            )
        else:
            cause = (
                "the chunk database holds fewer than k chunks outside a sequence's own "
                "documents for these chunks (a database of few, long documents)"
            )
        warnings.append(
            f"only {fill:.1%} of neighbour slots are filled ({empty:,} empty): {cause}; "
            "a RETRO model sees these slots as padding"
        )
    recall, depth, target = manifest.neighbour_recall, manifest.search_depth, cfg.index.target_recall
    if recall is not None and recall.value < target:
        if depth is not None and depth.recall_below_target == "warn":
            cause = f"recall_below_target: warn kept the index's search depth {depth.depth} ('deepen' tunes it)"
        elif depth is not None and depth.plateau:
            cause = (
                f"two doublings of the search depth beyond {depth.depth} gained less than {PLATEAU_GAIN} (the index's "
                "codes limit recall, not the depth: a larger index.memory_budget or another index.type)"
            )
        elif depth is not None and depth.curve and depth.curve[-1]["recall"] >= target:
            cause = (
                f"the search depth {depth.depth} reached {depth.curve[-1]['recall']:.3f} on the tuning sample, "
                "which this check's sample misses (a larger neighbour_recall_sample tunes on more chunks)"
            )
        else:
            cause = "the index misses near neighbours even at its deepest search (raise index.memory_budget)"
        warnings.append(f"neighbour recall {recall.value:.3f} against exact search is below {target}: {cause}")
    return warnings
