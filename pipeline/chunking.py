"""Tokenise documents, cut them into chunks, pack training sequences.

Chunk ids are dense (0 … N-1) and stable: documents are ordered by doc id and each takes the
next `ceil(tokens / m)` ids. A chunk row carries its continuation — the next chunk of the
same document, or pad where the document ends — so a neighbour never runs into another
document (DESIGN §5).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterable, Iterator

import apache_beam as beam
import numpy as np
from apache_beam.metrics import Metrics
from tokenizers import Tokenizer

from pipeline.corpus import METRICS_NAMESPACE, Document, Rejected

TOKENIZE_BATCH = 256


@dataclass(frozen=True)
class Chunk:
    chunk_id: int
    doc_id: int
    position: int               # index of the chunk within its document
    tokens: np.ndarray          # int32 [m]
    continuation: np.ndarray    # int32 [m]: next chunk of the same document, or pad


@functools.lru_cache(maxsize=4)
def load_tokenizer(path: str) -> Tokenizer:
    """A whole-document tokenizer: truncation and padding off (the bundled file truncates at 128)."""
    tokenizer = Tokenizer.from_file(path)
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def pad_id_of(tokenizer: Tokenizer) -> int:
    for token in ("[PAD]", "<pad>", "<|pad|>", "<|endoftext|>"):
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return token_id
    return 0


def tokenize_batch(tokenizer: Tokenizer, texts: list[str]) -> list[np.ndarray]:
    """Token ids of each text, without special tokens (one batched call)."""
    encodings = tokenizer.encode_batch(texts, add_special_tokens=False)
    return [np.asarray(e.ids, dtype=np.int32) for e in encodings]


def num_chunks(num_tokens: int, m: int) -> int:
    return -(-num_tokens // m)


def chunk_tokens(tokens: np.ndarray, m: int, pad_id: int) -> np.ndarray:
    """[ceil(len/m), m] chunks, the last one padded."""
    rows = num_chunks(len(tokens), m)
    chunks = np.full((rows, m), pad_id, dtype=np.int32)
    chunks.reshape(-1)[: len(tokens)] = tokens
    return chunks


def chunk_document(doc_id: int, tokens: np.ndarray, first_chunk_id: int, m: int,
                   pad_id: int) -> Iterator[Chunk]:
    """The chunks of one document, ids from `first_chunk_id`, each with its continuation."""
    chunks = chunk_tokens(tokens, m, pad_id)
    padding = np.full(m, pad_id, dtype=np.int32)
    for i, row in enumerate(chunks):
        continuation = chunks[i + 1] if i + 1 < len(chunks) else padding
        yield Chunk(first_chunk_id + i, doc_id, i, row, continuation)


def chunk_offsets(chunk_counts: Iterable[tuple[int, int]]) -> dict[int, int]:
    """{doc_id: first chunk id}: documents in doc-id order, ids dense from 0."""
    offsets, next_id = {}, 0
    for doc_id, count in sorted(chunk_counts):
        offsets[doc_id] = next_id
        next_id += count
    return offsets


class _Tokenize(beam.DoFn):
    """Batches of documents -> (doc_id, tokens); a document with no tokens is rejected."""

    def __init__(self, tokenizer_path: str):
        self.tokenizer_path = tokenizer_path
        self.tokens = Metrics.counter(METRICS_NAMESPACE, "tokens")

    def setup(self):
        self.tokenizer = load_tokenizer(self.tokenizer_path)

    def process(self, docs: list[Document]):
        for doc, tokens in zip(docs, tokenize_batch(self.tokenizer, [d.text for d in docs])):
            if len(tokens) == 0:
                Metrics.counter(METRICS_NAMESPACE, "rejected_no_tokens").inc()
                yield beam.pvalue.TaggedOutput(
                    "rejected", Rejected(doc.source, doc.position, "no_tokens", doc.text[:200]))
                continue
            self.tokens.inc(len(tokens))
            yield doc.doc_id, tokens


def _emit_chunks(doc, offsets, m, pad_id):
    doc_id, tokens = doc
    Metrics.counter(METRICS_NAMESPACE, "documents_chunked").inc()
    for chunk in chunk_document(doc_id, tokens, offsets[doc_id], m, pad_id):
        Metrics.counter(METRICS_NAMESPACE, "chunks").inc()
        yield chunk


class ChunkDocuments(beam.PTransform):
    """Documents -> (Chunk rows with dense stable ids, rejected documents)."""

    def __init__(self, tokenizer_path: str, chunk_tokens: int, pad_id: int):
        super().__init__()
        self.tokenizer_path, self.m, self.pad_id = tokenizer_path, chunk_tokens, pad_id

    def expand(self, documents):
        tokenized = (documents
                     | "BatchDocuments" >> beam.BatchElements(min_batch_size=1,
                                                              max_batch_size=TOKENIZE_BATCH)
                     | "Tokenize" >> beam.ParDo(_Tokenize(self.tokenizer_path)).with_outputs(
                         "rejected", main="tokens"))
        m = self.m
        offsets = (tokenized.tokens
                   | "CountChunks" >> beam.Map(lambda d: (d[0], num_chunks(len(d[1]), m)))
                   | "CollectCounts" >> beam.combiners.ToList()
                   | "AssignChunkIds" >> beam.Map(chunk_offsets))
        chunks = tokenized.tokens | "CutChunks" >> beam.FlatMap(
            _emit_chunks, offsets=beam.pvalue.AsSingleton(offsets), m=m, pad_id=self.pad_id)
        return chunks, tokenized.rejected
