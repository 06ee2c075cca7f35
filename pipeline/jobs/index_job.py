"""build-index: read, chunk, embed and index the retrieval corpus in one Beam job that commits
itself.
"""

from __future__ import annotations

import apache_beam as beam
import numpy as np

from pipeline.chunks.beam import ChunkDocuments
from pipeline.chunks.chunk_files import CHUNK_ROW_GROUP_ROWS
from pipeline.chunks.chunking import Chunk
from pipeline.common import fileio
from pipeline.common.models import (
    fingerprint_path,
    resolve_model,
)
from pipeline.common.progress import ReportProgress
from pipeline.common.tally import Tally, counted
from pipeline.common.writers import WriteGroupedFiles, WriteRejected, chunks_table, embeddings_table, parquet_bytes
from pipeline.decontaminate.beam import ReadCorpusKeptClean
from pipeline.index.build import BuildIndex
from pipeline.index.build_info import BuildInfo
from pipeline.jobs.commit import REJECTED_STAGING
from pipeline.jobs.index_files import (
    _documents_read_tally,
    _index_counters,
    _index_entries,
    _index_staged,
    _log_index,
    _rejected_tally,
    check_index_type,
)
from pipeline.jobs.job import (
    Job,
    Submitted,
    Tokenization,
    _sorted_entries,
    index_dir,
)
from pipeline.jobs.options import encoder_threads
from pipeline.jobs.reuse import committed, index_action
from pipeline.jobs.vector_index_job import _rebuild_faiss
from schemas.config import PipelineConfig
from schemas.manifest import (
    CREATED_BY,
    Fingerprint,
    IndexManifest,
)


def tokens_in_chunk(chunk: Chunk, pad_id: int) -> int:
    """The document tokens a chunk holds: all m but in a document's last chunk (its
    continuation is padding), which ends at its last non-pad token."""
    if (chunk.continuation != pad_id).any():
        return len(chunk.tokens)
    held = np.flatnonzero(chunk.tokens != pad_id)
    return int(held[-1]) + 1 if len(held) else 0


def _index_manifest(
    entries, info: BuildInfo, tallies, precision, cfg: PipelineConfig, tok: Tokenization, threads
) -> IndexManifest:
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
        num_chunks=sum(e.rows for e in files if e.path.startswith("chunks/")),
        chunk_tokens=cfg.chunk_tokens,
        pad_id=tok.pad_id,
        files=files,
        counters=dict(sorted({**tallies, **_index_counters(info)}.items())),
        created_by=CREATED_BY,
        **info.vector_index(),
    )


def build_index(
    cfg: PipelineConfig, beam_args: list[str], force: bool = False, dry_run: bool = False, detach: bool = False
) -> IndexManifest | Submitted | dict:
    """Stages 1-3: retrieval corpus -> chunks, embeddings, faiss index, committed manifest.

    When the committed chunks and embeddings match the config (only `index.*` changed), only
    the faiss index is rebuilt from them. dry_run: build the graph, touch no input or output,
    run nothing; return `describe(pipeline)`. detach: submit and return.
    """
    check_index_type(cfg)
    previous = None if force or dry_run else committed(index_dir(cfg), IndexManifest)
    if previous is not None and index_action(cfg, previous) != "build":  # asked to build: at least the faiss files
        return _rebuild_faiss(cfg, previous, beam_args, detach)
    tok = Tokenization.of(cfg)
    job = Job(
        "build-index",
        "chunks",
        cfg.output,
        index_dir(cfg),
        IndexManifest,
        beam_args,
        staging="index",
        dry_run=dry_run,
        detach=detach,
        max_rejected_fraction=cfg.max_rejected_fraction,
    )
    pipeline, staging = job.pipeline, job.staging
    m, pad = cfg.chunk_tokens, tok.pad_id
    threads = encoder_threads(cfg.embedding.cpu_threads, cfg.embedding.device, pipeline.options)
    corpus = pipeline | "ReadRetrievalCorpus" >> ReadCorpusKeptClean(cfg, "retrieval", match=not dry_run)
    documents, rejected = corpus.documents, corpus.rejected
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
        to_bytes=lambda rows: parquet_bytes(chunks_table(rows, m), CHUNK_ROW_GROUP_ROWS),
    )
    from pipeline.embed.beam import EmbedChunks

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
        | "EmbeddingPaths" >> beam.Map(lambda entry: fileio.join(staging, entry.path))
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
        *_documents_read_tally(corpus.documents, all_rejected, "Index"),
        corpus.tallies,
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
    job.commit(manifest, staged=entries, staged_of=_index_staged, after=(rejected_files,))
    manifest = job.run()
    if isinstance(manifest, IndexManifest):
        _log_index(index_dir(cfg), manifest)
    return manifest
