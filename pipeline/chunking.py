"""Tokenise documents and cut them into chunks of m tokens with dense, stable chunk ids.

Chunk ids are dense (0 … N-1) and stable: documents are ordered by doc id and each takes the
next `ceil(tokens / m)` ids. They are assigned without any table of all documents: doc ids
are uniform 63-bit hashes, so their top bits split them into 2^16 buckets that are contiguous,
ordered doc-id ranges; a prefix sum over the buckets' chunk counts (a side input of at most
2^16 entries) gives each bucket its first id, and each bucket, grouped on one worker, numbers
its own documents in doc-id order. A chunk row carries its continuation — the next chunk of the
same document, or pad where the document ends — so a neighbour never runs into another
document (docs/design.md §5). (Training sequences are packed in `shards.py`.)
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import apache_beam as beam
import numpy as np
from apache_beam.metrics import Metrics
from tokenizers import Tokenizer

from pipeline.corpus import METRICS_NAMESPACE, Document, Rejected

TOKENIZE_BATCH = 256
BUCKET_BITS = 16  # doc-id buckets of the chunk-id prefix sum: 65,536 offsets at most


@dataclass(frozen=True)
class Chunk:
    chunk_id: int
    doc_id: int
    position: int  # index of the chunk within its document
    tokens: np.ndarray  # int32 [m]
    continuation: np.ndarray  # int32 [m]: next chunk of the same document, or pad


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


def chunk_document(doc_id: int, tokens: np.ndarray, first_chunk_id: int, m: int, pad_id: int) -> Iterator[Chunk]:
    """The chunks of one document, ids from `first_chunk_id`, each with its continuation."""
    chunks = chunk_tokens(tokens, m, pad_id)
    padding = np.full(m, pad_id, dtype=np.int32)
    for i, row in enumerate(chunks):
        continuation = chunks[i + 1] if i + 1 < len(chunks) else padding
        yield Chunk(first_chunk_id + i, doc_id, i, row, continuation)


def chunk_offsets(chunk_counts: Iterable[tuple[int, int]]) -> dict[int, int]:
    """{key: first chunk id}: keys (doc ids, or buckets of them) in order, ids dense from 0."""
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
                    "rejected", Rejected(doc.source, doc.position, "no_tokens", doc.text[:200])
                )
                continue
            self.tokens.inc(len(tokens))
            yield doc.doc_id, tokens


def bucket_of(doc_id: int, bits: int = BUCKET_BITS) -> int:
    """The doc-id bucket: the top `bits` of the 63-bit doc id, so buckets are contiguous doc-id
    ranges in doc-id order."""
    return doc_id >> (63 - bits)


def _cut_bucket(keyed, offsets: dict[int, int], m: int, pad_id: int):
    """One bucket's documents, numbered in doc-id order from the bucket's first chunk id."""
    bucket, docs = keyed
    next_id = offsets[bucket]
    for doc_id, tokens in sorted(docs, key=lambda d: d[0]):
        Metrics.counter(METRICS_NAMESPACE, "documents_chunked").inc()
        yield from chunk_document(doc_id, tokens, next_id, m, pad_id)
        next_id += num_chunks(len(tokens), m)


class ChunkDocuments(beam.PTransform):
    """Documents -> (Chunk rows with dense stable ids, rejected documents)."""

    def __init__(self, tokenizer_path: str, chunk_tokens: int, pad_id: int, bucket_bits: int = BUCKET_BITS):
        super().__init__()
        self.tokenizer_path, self.m, self.pad_id = tokenizer_path, chunk_tokens, pad_id
        self.bucket_bits = bucket_bits

    def expand(self, documents):
        tokenized = (
            documents
            | "BatchDocuments" >> beam.BatchElements(min_batch_size=1, max_batch_size=TOKENIZE_BATCH)
            | "Tokenize" >> beam.ParDo(_Tokenize(self.tokenizer_path)).with_outputs("rejected", main="tokens")
        )
        m, bits = self.m, self.bucket_bits
        by_bucket = tokenized.tokens | "KeyByBucket" >> beam.Map(lambda d: (bucket_of(d[0], bits), d))
        offsets = (
            by_bucket
            | "CountChunks" >> beam.Map(lambda b: (b[0], num_chunks(len(b[1][1]), m)))
            | "ChunksPerBucket" >> beam.CombinePerKey(sum)
            | "CollectBuckets" >> beam.combiners.ToList()
            | "BucketOffsets" >> beam.Map(chunk_offsets)
        )
        chunks = (
            by_bucket
            | "GroupBuckets" >> beam.GroupByKey()
            | "CutChunks"
            >> beam.FlatMap(_cut_bucket, offsets=beam.pvalue.AsSingleton(offsets), m=m, pad_id=self.pad_id)
        )
        return chunks, tokenized.rejected
