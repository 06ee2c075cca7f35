"""The steps of every job that grows an index (build-index and an appended generation): documents
chunked with ids from a given one, embedded, both written to numbered files
(`chunk_and_embed`); the sources files; the counters of reading, chunking and embedding.
"""

from __future__ import annotations

from dataclasses import dataclass

import apache_beam as beam
import numpy as np

from pipeline.build_index.files import documents_read_tally, rejected_tally
from pipeline.chunks.beam import ChunkDocuments
from pipeline.chunks.chunk_files import CHUNK_ROW_GROUP_ROWS, EMBEDDINGS_DIR, chunks_table
from pipeline.chunks.chunking import Chunk
from pipeline.common import fileio
from pipeline.common.progress import ReportProgress
from pipeline.common.tally import Tally, counted
from pipeline.common.writers import WriteGroupedFiles, embeddings_table, parquet_bytes
from pipeline.decontaminate.beam import CorpusRead
from pipeline.index.sources import SOURCES_DIR, bucket_of_source, sources_prefix, sources_table
from pipeline.jobs.job import Tokenization
from schemas.config import PipelineConfig


def tokens_in_chunk(chunk: Chunk, pad_id: int) -> int:
    """The document tokens a chunk holds: all m but in a document's last chunk (its
    continuation is padding), which ends at its last non-pad token."""
    if (chunk.continuation != pad_id).any():
        return len(chunk.tokens)
    held = np.flatnonzero(chunk.tokens != pad_id)
    return int(held[-1]) + 1 if len(held) else 0


@dataclass(kw_only=True)
class ChunksWritten:
    """What `chunk_and_embed` gives."""

    chunks: beam.PCollection  # Chunk rows
    unusable: beam.PCollection  # Rejected: documents with no tokens
    chunk_files: beam.PCollection  # FileEntry of each chunks-NNNNN.parquet written
    embeddings: beam.PCollection  # EmbeddedChunks, a chunk file's each
    embedding_files: beam.PCollection  # FileEntry of each embeddings-NNNNN.parquet written
    precision: beam.PCollection  # the one PrecisionCheck


def chunk_and_embed(
    documents,
    cfg: PipelineConfig,
    tok: Tokenization,
    *,
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
    # grouped once by chunk file: each file is written, encoded and its embeddings written where
    # it is grouped, so neither the chunks nor the embeddings are shuffled again
    files = (
        chunks
        | "KeyByChunkFile" >> beam.Map(lambda c: ((c.chunk_id + shift) // cfg.chunk_file_rows, c))
        | "GroupByChunkFile" >> beam.GroupByKey()
    )
    chunk_files = files | "WriteChunks" >> WriteGroupedFiles(
        fileio.join(staging, "chunks"),
        relative_to=staging,
        prefix="chunks",
        extension="parquet",
        key=lambda c: c.chunk_id + shift,
        rows_per_file=cfg.chunk_file_rows,
        to_bytes=lambda rows: parquet_bytes(chunks_table(rows, m), CHUNK_ROW_GROUP_ROWS),
        rows_of=lambda file: file[1],
        grouped=True,
    )
    from pipeline.embed.beam import EmbedChunkFiles

    embeddings, precision = files | "EmbedChunks" >> EmbedChunkFiles(cfg.embedding, tok.path, threads)
    embeddings = embeddings | "EmbedProgress" >> ReportProgress("embed", "chunks", len)
    embedding_files = embeddings | "WriteEmbeddings" >> WriteGroupedFiles(
        fileio.join(staging, EMBEDDINGS_DIR),
        relative_to=staging,
        prefix=EMBEDDINGS_DIR,
        extension="parquet",
        key=lambda row: row[0] + shift,  # (chunk id, vector)
        rows_per_file=cfg.chunk_file_rows,
        to_bytes=lambda rows: parquet_bytes(embeddings_table(rows)),
        rows_of=lambda group: group.rows,
        grouped=True,
    )
    return ChunksWritten(
        chunks=chunks,
        unusable=unusable,
        chunk_files=chunk_files,
        embeddings=embeddings,
        embedding_files=embedding_files,
        precision=precision,
    )


def write_sources(staging: str, generation: int) -> beam.PTransform:
    """Documents -> the generation's sources files (which corpus file each came from)."""
    return beam.Map(lambda d: (d.doc_id, d.source)) | WriteGroupedFiles(
        fileio.join(staging, SOURCES_DIR),
        relative_to=staging,
        prefix=sources_prefix(generation),
        extension="parquet",
        key=bucket_of_source,
        rows_per_file=1,
        to_bytes=lambda rows: parquet_bytes(sources_table(rows)),
    )


def stage_tallies(corpus: CorpusRead, all_rejected, written: ChunksWritten, pad: int):
    """The counters of a job that reads, chunks and embeds: (name, count) summed."""
    chunks = written.chunks
    return (
        *documents_read_tally(corpus.documents, all_rejected, "Index"),
        corpus.tallies,
        rejected_tally(all_rejected, "TallyRejected"),
        chunks
        | "TallyDocumentsChunked" >> beam.FlatMap(lambda c: [("documents_chunked", 1)] if c.position == 0 else []),
        counted("chunks", chunks),
        counted("tokens", chunks, lambda c: tokens_in_chunk(c, pad)),
        counted("chunks_embedded", written.embeddings, len),
    ) | "Tallies" >> Tally()
