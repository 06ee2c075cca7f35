"""`ChunkDocuments`: documents into chunks with dense chunk ids, in Beam.

Ids are assigned per doc-id bucket (`chunking.bucket_of`): a prefix sum over the buckets'
chunk counts gives each bucket its first id, and within a bucket documents take ids in doc-id
order, so no step holds a table of all documents.
"""

from __future__ import annotations

import apache_beam as beam
from apache_beam.io.parquetio import ReadAllFromParquetBatched, ReadFromParquetBatched
from apache_beam.metrics import Metrics

from pipeline.chunks.chunking import (
    BUCKET_BITS,
    TOKENIZE_BATCH_CHARS,
    bucket_of,
    chunk_document,
    chunk_offsets,
    load_tokenizer,
    num_chunks,
    tokenize_batch,
)
from pipeline.chunks.committed import CommittedFiles
from pipeline.common.rejected import Rejected, excerpt
from pipeline.corpus.records import METRICS_NAMESPACE, Document


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
                    "rejected", Rejected(doc.source, doc.position, "no_tokens", excerpt(doc.text))
                )
                continue
            self.tokens.inc(len(tokens))
            yield doc.doc_id, tokens


def _cut_bucket(keyed, offsets: dict[int, int], m: int, pad_id: int):
    """One bucket's documents, numbered in doc-id order from the bucket's first chunk id."""
    bucket, docs = keyed
    next_id = offsets[bucket]
    for doc_id, tokens in sorted(docs, key=lambda d: d[0]):
        Metrics.counter(METRICS_NAMESPACE, "documents_chunked").inc()
        yield from chunk_document(doc_id, tokens, next_id, m, pad_id)
        next_id += num_chunks(len(tokens), m)


class ChunkDocuments(beam.PTransform):
    """Documents -> (Chunk rows with dense stable ids from `first_chunk_id`, rejected documents).
    An append numbers its chunks after the database's last (`first_chunk_id` = its chunk count)."""

    def __init__(
        self,
        tokenizer_path: str,
        chunk_tokens: int,
        pad_id: int,
        bucket_bits: int = BUCKET_BITS,
        first_chunk_id: int = 0,
    ):
        super().__init__()
        self.tokenizer_path, self.m, self.pad_id = tokenizer_path, chunk_tokens, pad_id
        self.bucket_bits, self.first_chunk_id = bucket_bits, first_chunk_id

    def expand(self, documents):
        tokenized = (
            documents
            | "BatchDocuments"
            >> beam.BatchElements(
                min_batch_size=1, max_batch_size=TOKENIZE_BATCH_CHARS, element_size_fn=lambda d: len(d.text)
            )
            | "Tokenize" >> beam.ParDo(_Tokenize(self.tokenizer_path)).with_outputs("rejected", main="tokens")
        )
        m, bits, first = self.m, self.bucket_bits, self.first_chunk_id
        by_bucket = tokenized.tokens | "KeyByBucket" >> beam.Map(lambda d: (bucket_of(d[0], bits), d))
        offsets = (
            by_bucket
            | "CountChunks" >> beam.Map(lambda b: (b[0], num_chunks(len(b[1][1]), m)))
            | "ChunksPerBucket" >> beam.CombinePerKey(sum)
            | "CollectBuckets" >> beam.combiners.ToList()
            | "BucketOffsets" >> beam.Map(chunk_offsets, first)
        )
        chunks = (
            by_bucket
            | "GroupBuckets" >> beam.GroupByKey()
            | "CutChunks"
            >> beam.FlatMap(_cut_bucket, offsets=beam.pvalue.AsSingleton(offsets), m=m, pad_id=self.pad_id)
        )
        return chunks, tokenized.rejected


class ListedPaths(beam.PTransform):
    """The files a committed manifest lists (`CommittedFiles`), listed on a worker (the graph
    does not grow with them) and spread over the workers."""

    def __init__(self, files: CommittedFiles):
        super().__init__()
        self.files = files

    def expand(self, pbegin):
        return (
            pbegin
            | "Listed" >> beam.Create([self.files])
            | "ListedPaths" >> beam.FlatMap(lambda files: files.paths())
            | "SpreadPaths" >> beam.Reshuffle()
        )


class ReadParquetFiles(beam.PTransform):
    """Parquet files -> Arrow record batches of `columns` (None: all): a glob (files given
    directly), or the files a committed manifest lists (`CommittedFiles`), listed on a worker."""

    def __init__(self, files: str | CommittedFiles, columns: list[str] | None = None, validate: bool = True):
        super().__init__()
        self.files, self.columns, self.validate = files, columns, validate

    def expand(self, pbegin):
        if isinstance(self.files, str):
            return pbegin | "ReadGlob" >> ReadFromParquetBatched(
                self.files, columns=self.columns, validate=self.validate
            )
        return (
            pbegin
            | "Listed" >> ListedPaths(self.files)
            | "ReadListed" >> ReadAllFromParquetBatched(columns=self.columns)
        )
