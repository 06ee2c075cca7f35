"""build-index: read, chunk, embed and index the retrieval corpus in one Beam job that commits
itself.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import apache_beam as beam
import numpy as np

from pipeline.chunks.beam import ChunkDocuments
from pipeline.chunks.chunk_files import CHUNK_ROW_GROUP_ROWS, EMBEDDINGS_DIR
from pipeline.chunks.chunking import Chunk
from pipeline.common import fileio
from pipeline.common.models import (
    fingerprint_path,
    resolve_model,
)
from pipeline.common.progress import ReportProgress
from pipeline.common.tally import Tally, counted
from pipeline.common.writers import WriteGroupedFiles, WriteRejected, chunks_table, embeddings_table, parquet_bytes
from pipeline.decontaminate.beam import CorpusRead, ReadCorpusKeptClean
from pipeline.index.build import BuildIndex
from pipeline.index.build_info import BuildInfo
from pipeline.index.sources import SOURCES_DIR, bucket_of_source, sources_prefix, sources_table
from pipeline.jobs.commit import REJECTED_STAGING, StageError
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
from pipeline.jobs.reuse import committed_index, corpus_changes, index_action, listed_corpus_files
from pipeline.jobs.vector_index_job import _rebuild_faiss
from schemas.config import PipelineConfig
from schemas.manifest import (
    CREATED_BY,
    Fingerprint,
    Generation,
    IndexManifest,
)

log = logging.getLogger("ratrain")


def tokens_in_chunk(chunk: Chunk, pad_id: int) -> int:
    """The document tokens a chunk holds: all m but in a document's last chunk (its
    continuation is padding), which ends at its last non-pad token."""
    if (chunk.continuation != pad_id).any():
        return len(chunk.tokens)
    held = np.flatnonzero(chunk.tokens != pad_id)
    return int(held[-1]) + 1 if len(held) else 0


def _index_manifest(
    entries, info: BuildInfo, tallies, precision, files_read, cfg: PipelineConfig, tok: Tokenization, threads
) -> IndexManifest:
    files = _sorted_entries(list(entries) + _index_entries(info))
    num_chunks = sum(e.rows for e in files if e.path.startswith("chunks/"))
    num_documents = tallies.get("documents_chunked", 0)
    return IndexManifest(
        config_hash=cfg.index_hash(),
        embed_config_hash=cfg.embed_hash(),
        encoding_config_hash=cfg.encoding_hash(),
        generations=[
            Generation(
                number=0,
                inputs=sorted(files_read, key=lambda f: f.path),
                first_chunk_id=0,
                num_chunks=num_chunks,
                num_documents=num_documents,
            )
        ],
        tokenizer=Fingerprint(name=tok.name, fingerprint=fingerprint_path(tok.path)),
        embedding_model=Fingerprint(
            name=cfg.embedding.model, fingerprint=fingerprint_path(resolve_model(cfg.embedding.model))
        ),
        encoder_threads=threads,
        embedding_precision=precision,
        num_documents=num_documents,
        num_chunks=num_chunks,
        chunk_tokens=cfg.chunk_tokens,
        pad_id=tok.pad_id,
        files=files,
        counters=dict(sorted({**tallies, **_index_counters(info)}.items())),
        created_by=CREATED_BY,
        **info.vector_index(),
    )


@dataclass
class ChunksWritten:
    """What `chunk_and_embed` gives."""

    chunks: beam.PCollection  # Chunk rows
    unusable: beam.PCollection  # Rejected: documents with no tokens
    chunk_files: beam.PCollection  # FileEntry of each chunks-NNNNN.parquet written
    embeddings: beam.PCollection  # EmbeddedChunks, a group of chunks each
    embedding_files: beam.PCollection  # FileEntry of each embeddings-NNNNN.parquet written
    precision: beam.PCollection  # the one PrecisionCheck


def chunk_and_embed(
    documents,
    cfg: PipelineConfig,
    tok: Tokenization,
    staging: str,
    threads,
    first_chunk_id: int = 0,
    first_file: int = 0,
) -> ChunksWritten:
    """Documents -> chunks with ids from `first_chunk_id`, embedded, both written to files
    numbered from `first_file` (file first_file + i holds the chunk ids first_chunk_id + i·R …)."""
    m, pad = cfg.chunk_tokens, tok.pad_id
    shift = first_file * cfg.chunk_file_rows - first_chunk_id  # chunk id -> its key in the file numbering
    chunks, unusable = (
        documents
        | "DocumentProgress" >> ReportProgress("read", "documents")
        | "ChunkDocuments" >> ChunkDocuments(tok.path, m, pad, first_chunk_id=first_chunk_id)
    )
    chunk_files = chunks | "WriteChunks" >> WriteGroupedFiles(
        fileio.join(staging, "chunks"),
        staging,
        "chunks",
        "parquet",
        key=lambda c: c.chunk_id + shift,
        rows_per_file=cfg.chunk_file_rows,
        to_bytes=lambda rows: parquet_bytes(chunks_table(rows, m), CHUNK_ROW_GROUP_ROWS),
    )
    from pipeline.embed.beam import EmbedChunks

    embeddings, precision = chunks | "EmbedChunks" >> EmbedChunks(cfg.embedding, tok.path, threads)
    embeddings = embeddings | "EmbedProgress" >> ReportProgress("embed", "chunks", len)
    embedding_files = embeddings | "WriteEmbeddings" >> WriteGroupedFiles(
        fileio.join(staging, EMBEDDINGS_DIR),
        staging,
        EMBEDDINGS_DIR,
        "parquet",
        key=lambda row: row[0] + shift,  # (chunk id, vector)
        rows_per_file=cfg.chunk_file_rows,
        to_bytes=lambda rows: parquet_bytes(embeddings_table(rows)),
        rows_of=lambda group: group.rows,
    )
    return ChunksWritten(chunks, unusable, chunk_files, embeddings, embedding_files, precision)


def write_sources(staging: str, generation: int) -> beam.PTransform:
    """Documents -> the generation's sources files (which corpus file each came from)."""
    return beam.Map(lambda d: (d.doc_id, d.source)) | WriteGroupedFiles(
        fileio.join(staging, SOURCES_DIR),
        staging,
        sources_prefix(generation),
        "parquet",
        key=bucket_of_source,
        rows_per_file=1,
        to_bytes=lambda rows: parquet_bytes(sources_table(rows)),
    )


def stage_tallies(corpus: CorpusRead, all_rejected, written: ChunksWritten, pad: int):
    """The counters of a job that reads, chunks and embeds: (name, count) summed."""
    chunks = written.chunks
    return (
        *_documents_read_tally(corpus.documents, all_rejected, "Index"),
        corpus.tallies,
        _rejected_tally(all_rejected, "TallyRejected"),
        chunks
        | "TallyDocumentsChunked" >> beam.FlatMap(lambda c: [("documents_chunked", 1)] if c.position == 0 else []),
        counted("chunks", chunks),
        counted("tokens", chunks, lambda c: tokens_in_chunk(c, pad)),
        counted("chunks_embedded", written.embeddings, len),
    ) | "Tallies" >> Tally()


def build_index(
    cfg: PipelineConfig,
    beam_args: list[str],
    force: bool = False,
    dry_run: bool = False,
    detach: bool = False,
    delete: tuple[str, ...] = (),
) -> IndexManifest | Submitted | dict:
    """Stages 1-3: retrieval corpus -> chunks, embeddings, faiss index, committed manifest.

    When the committed chunks and embeddings match the config (only `index.*` changed), only
    the faiss index is rebuilt from them; when the corpus only gained files, they are appended
    (`change_index`). `delete`: identities of documents to delete from the committed index (as
    the corpus's id field gives them), any new files appended in the same generation.
    dry_run: build the graph, touch no input or output, run nothing; return
    `describe(pipeline)`. detach: submit and return.
    """
    check_index_type(cfg)
    previous, previous_sha = (None, None) if force or dry_run else committed_index(index_dir(cfg))
    if delete and (previous is None or not previous.generations):
        raise StageError(
            f"{index_dir(cfg)}: no committed index to delete documents from"
            + (" that records its generations (rebuild it once with --force)" if previous is not None else "")
            + ("; --force builds from scratch, without them" if force else "")
        )
    if previous is not None:
        listed = listed_corpus_files(cfg)
        action = index_action(cfg, previous, listed)
        if action == "append" or (delete and action == "reuse"):
            from pipeline.jobs.append_job import change_index

            assert previous_sha is not None  # read with the manifest
            changes = corpus_changes(previous, listed)
            return change_index(cfg, previous, previous_sha, changes, beam_args, delete, detach)
        needs = "faiss rebuild" if action == "rebuild_faiss" else "build"
        if delete:
            raise StageError(
                f"{index_dir(cfg)}: documents can be deleted only from an index that matches the config "
                f"(this config needs a {needs}); run build-index first"
            )
        if action == "reuse" and previous.deleted_documents:  # a faiss rebuild would bring them back
            log.info("build-index: %s matches the config and its corpus files; nothing to build", index_dir(cfg))
            return previous
        if previous.deleted_documents:  # the corpus files still hold them
            raise StageError(
                f"{index_dir(cfg)}: this config needs a {needs}, "
                f"which would bring back the {previous.deleted_documents:,} documents deleted from the index: "
                "remove them from the corpus files, then run build-index --force"
            )
        if action != "build":  # asked to build: at least the faiss files
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
    threads = encoder_threads(cfg.embedding.cpu_threads, cfg.embedding.device, pipeline.options)
    corpus = pipeline | "ReadRetrievalCorpus" >> ReadCorpusKeptClean(cfg, "retrieval", match=not dry_run)
    written = chunk_and_embed(corpus.documents, cfg, tok, staging, threads)
    chunks = written.chunks
    info = (
        written.embedding_files
        | "EmbeddingPaths" >> beam.Map(lambda entry: fileio.join(staging, entry.path))
        | "BuildIndex"
        >> BuildIndex(
            cfg.index,
            fileio.join(staging, "faiss"),
            chunks | "DocumentOfChunk" >> beam.Map(lambda c: (c.chunk_id, c.doc_id)),
            cfg.neighbours,
        )
    )
    all_rejected = (corpus.rejected, written.unusable) | "MergeRejected" >> beam.Flatten()
    rejected_files = all_rejected | "WriteRejected" >> WriteRejected(
        fileio.join(staging, REJECTED_STAGING), "build-index"
    )
    tallies = stage_tallies(corpus, all_rejected, written, tok.pad_id)
    sources = corpus.documents | "WriteSources" >> write_sources(staging, 0)
    entries = (written.chunk_files, written.embedding_files, sources) | "FileEntries" >> beam.Flatten()
    manifest = (
        entries
        | "GatherEntries" >> beam.combiners.ToList()
        | "IndexManifest"
        >> beam.Map(
            _index_manifest,
            beam.pvalue.AsSingleton(info),
            beam.pvalue.AsDict(tallies),
            beam.pvalue.AsSingleton(written.precision),
            beam.pvalue.AsList(corpus.files),
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
