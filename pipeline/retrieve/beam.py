"""Pack training sequences, retrieve their neighbours, join neighbour tokens, write shards.

Everything moves through Beam shuffles keyed by ids, in numpy blocks rather than an element per
chunk or hit: chunk rows are packed into sequences by search batch (64 sequences); a sequence's
documents meet their chunk-id ranges by document id; sequences meet those ranges, and their
query embeddings, by search batch (where the training chunks are the database's, they meet
instead by the embedding file holding the batch, and each group reads its file where it
searches: no query embedding is shuffled to its batch); the search (`search_beam`) leaves out
hits in those ranges, so the k best hits are the neighbours (with `dedupe_neighbours`, the
candidates first fetch their tokens from the chunk file holding them); the kept neighbours are
shuffled by the chunk file that holds them and read their tokens in one read of that file; and
they meet their sequences by shard, where the shard's rows are assembled and then written without a
shuffle. No process holds the chunk database, and nothing shuffles it: what moves grows with
the training sequences (plus one (doc id, range) per database document), not with the chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import apache_beam as beam
import numpy as np

from pipeline.chunks.beam import ReadParquetFiles
from pipeline.chunks.chunk_files import ChunkFileRanges
from pipeline.chunks.committed import CommittedChunkFiles, CommittedFiles
from pipeline.chunks.deleted import DeletedFiles
from pipeline.common.arrays import positions_of, widest_span
from pipeline.index.exact import truth_depth
from pipeline.retrieve.depth import tune_retrieval_depth
from pipeline.retrieve.file_queries import file_batches, with_file_queries
from pipeline.retrieve.file_tokens import FileTokens
from pipeline.retrieve.recall import ExactTruth, SmallestProbes
from pipeline.retrieve.search import (
    CANDIDATE,
    LOST_DATA,
    PICK,
    SEQUENCES_PER_SEARCH,
    NeighbourBlock,
    QueryBlock,
    Records,
    Retrieval,
    SentCounts,
    batch_documents,
    batch_probes,
    excluded_ranges,
    received_by,
    search_batch_of,
    select_distinct,
)
from pipeline.retrieve.search_beam import SENT, TALLY, ProbeQueries, SearchIndex, by_chunk_file
from pipeline.retrieve.sequences import batch_parts, document_spans, pack_batch, with_tokens
from pipeline.shards.rows import RowBatch, SequenceBatch, ShardRow, sequences_neighbour_arrays


def _pack(keyed, chunks_per_seq: int, pad_id: int):
    batch, parts = keyed
    sequences = list(pack_batch(batch, list(parts), chunks_per_seq, SEQUENCES_PER_SEARCH, pad_id))
    if sequences:  # none: the database's tail, too short for a sequence
        yield SequenceBatch(sequences)


class PackSequences(beam.PTransform):
    """Training chunks (`TrainingChunks` blocks) -> a SequenceBatch per search batch: its sequences, each
    of `chunks_per_seq` consecutive chunks (ids seq·L … seq·L+L-1), travel as one element."""

    def __init__(self, chunks_per_seq: int, pad_id: int):
        super().__init__()
        self.chunks_per_seq, self.pad_id = chunks_per_seq, pad_id

    def expand(self, chunks):
        return (
            chunks
            | "KeyBySearchBatch" >> beam.FlatMap(batch_parts, self.chunks_per_seq, SEQUENCES_PER_SEARCH)
            | "GroupBySearchBatch" >> beam.GroupByKey()
            | "Pack" >> beam.FlatMap(_pack, self.chunks_per_seq, self.pad_id)
        )


class DocumentSpans(beam.PTransform):
    """Chunk files (a glob, or those a committed manifest lists) -> (doc_id, (first chunk id,
    last + 1)) per database document: a document's chunks are one contiguous id range, so
    excluding it is excluding a range. The `deleted` documents' chunks are left out: a replaced
    document's id then spans its new chunks only, not its old ones too."""

    def __init__(self, files: str | CommittedFiles, validate: bool = True, deleted: DeletedFiles | None = None):
        super().__init__()
        self.files, self.validate, self.deleted = files, validate, deleted

    def expand(self, pbegin):
        deleted = self.deleted
        return (
            pbegin
            | "ReadDocumentIds" >> ReadParquetFiles(self.files, columns=["chunk_id", "doc_id"], validate=self.validate)
            | "SpansInBatch" >> beam.FlatMap(_live_document_spans, deleted)
            | "WidestSpan" >> beam.CombinePerKey(widest_span)
        )


def _live_document_spans(table, deleted: DeletedFiles | None):
    chunk_ids, doc_ids = table["chunk_id"].to_numpy(), table["doc_id"].to_numpy()
    if deleted:
        live = ~deleted.ranges().contains(chunk_ids)
        chunk_ids, doc_ids = chunk_ids[live], doc_ids[live]
    return document_spans(chunk_ids, doc_ids)


class ReadQueryBlocks(beam.PTransform):
    """Embedding files (a glob, or those a committed manifest lists) -> a `QueryBlock` per
    record batch, the `deleted` documents' chunks left out."""

    def __init__(self, files: str | CommittedFiles, deleted: DeletedFiles | None = None, validate: bool = True):
        super().__init__()
        self.files, self.deleted, self.validate = files, deleted, validate

    def expand(self, pbegin):
        deleted = self.deleted
        return (
            pbegin
            | "Read" >> ReadParquetFiles(self.files, validate=self.validate)
            | "QueryBlocks" >> beam.Map(lambda table: QueryBlock.of_table(table, deleted.ranges() if deleted else None))
        )


class SpansOfTrainingChunks(beam.PTransform):
    """`TrainingChunks` blocks -> (doc_id, (first chunk id, last + 1)) per document they hold:
    `DocumentSpans` without reading the chunk files again, where the training chunks are the
    database's (`training_corpus: same`; a deleted document is in no sequence, so it needs no
    span)."""

    def expand(self, blocks):
        return (
            blocks
            | "SpansInBlock" >> beam.FlatMap(lambda b: document_spans(b.chunk_id, b.doc_id))
            | "WidestSpan" >> beam.CombinePerKey(widest_span)
        )


def _by_search_batch(sequences: SequenceBatch):
    return search_batch_of(sequences.sequences[0].seq_id), sequences


def _by_first_file(keyed, chunk_files, chunks_per_seq: int):
    """(search batch, what it holds) -> (the number of the file holding the batch's first
    chunk, (search batch, what it holds))."""
    return chunk_files.file_of(keyed[0] * SEQUENCES_PER_SEARCH * chunks_per_seq), keyed


class _CandidateTokens(beam.DoFn):
    """(chunk file, candidate blocks in it) -> (search batch, its block with each hit's token
    hash), from one read of that file's tokens. A block is one search batch's hits in the
    file, handled and sent on before the next is read, so this holds the file's tokens, a key
    per row and one block: not every candidate of the file (a runner that streams a large
    group, as Beam's state-backed iterables do, never holds them all either)."""

    def __init__(self, chunk_files: ChunkFileRanges | CommittedChunkFiles):
        self.chunk_files = chunk_files

    def process(self, keyed):
        number, blocks = keyed
        file = FileTokens(self.chunk_files, number, continuation=False)
        for block in blocks:
            yield search_batch_of(int(block.rows["seq_id"][0])), Records(file.with_token_keys(block.rows))


class _NeighbourTokens(beam.DoFn):
    """(chunk file, blocks of kept neighbours in it) -> (search batch, NeighbourBlock) per
    block, each neighbour with its chunk + continuation [2m], from one read of that file."""

    def __init__(self, chunk_files: ChunkFileRanges | CommittedChunkFiles):
        self.chunk_files = chunk_files

    def process(self, keyed):
        number, blocks = keyed
        file = FileTokens(self.chunk_files, number, continuation=True)
        for block in blocks:
            picks = block.rows
            yield search_batch_of(int(picks["seq_id"][0])), NeighbourBlock(picks, file.values(picks["chunk_id"]))


def _arrived(seq_id: int, what: str, received: int, sent: list[int]) -> None:
    """Each sequence counts what it sent through a shuffle; fail loudly if any went missing
    rather than write a shard with silently padded neighbours."""
    if len(sent) != 1 or received != sent[0]:
        raise RuntimeError(
            f"sequence {seq_id}: {received} {what} arrived, {sent or 'no count'} were "
            f"sent: {LOST_DATA}; nothing is committed"
        )


def _all_arrived(what: str, seq_ids: np.ndarray, rows: np.ndarray, sent: list[SentCounts]) -> None:
    """`_arrived` for each of a batch's sequences (sorted seq ids): the rows it received
    against the counts sent for it (one, unless a shuffle lost or repeated a count)."""
    counts: dict[int, list[int]] = {}
    for sent_counts in sent:
        for seq_id, count in zip(sent_counts.seq_ids.tolist(), sent_counts.counts.tolist()):
            counts.setdefault(seq_id, []).append(count)
    for seq_id, received in zip(seq_ids.tolist(), received_by(seq_ids, rows).tolist()):
        _arrived(seq_id, what, received, counts.get(seq_id, []))


def _select_distinct(keyed, spec: Retrieval):
    """(search batch, its candidate blocks with token hashes and its SentCounts) -> the k
    distinct neighbours per query as PICK blocks keyed by chunk file, with their SentCounts."""
    batch, grouped = keyed
    blocks, sent = [block.rows for block in grouped["candidates"]], list(grouped["sent"])
    candidates = np.concatenate(blocks) if blocks else np.zeros(0, CANDIDATE)
    seq_ids = np.union1d(np.concatenate([s.seq_ids for s in sent] or [[]]), candidates["seq_id"]).astype(np.int64)
    _all_arrived("search hits", seq_ids, candidates, sent)
    picks, dropped = select_distinct(candidates, spec.neighbours)
    yield beam.pvalue.TaggedOutput(TALLY, ("candidates_dropped_duplicate_tokens", dropped))
    yield beam.pvalue.TaggedOutput(SENT, (batch, SentCounts.of(seq_ids.tolist(), picks)))
    yield from by_chunk_file(spec, picks)


def _in_shards(keyed, shard_rows: int):
    """(search batch, its SequenceBatch, a NeighbourBlock or its SentCounts) -> (shard, the
    part its sequences there own) per shard it touches: the last join meets by shard, so a
    shard's rows are assembled where they are written, and never shuffled."""
    _, value = keyed
    yield from value.in_shards(shard_rows)


def _to_rows(keyed, spec: Retrieval):
    """(shard, its sequences, neighbour blocks and SentCounts) -> its RowBatch."""
    _, grouped = keyed
    chunks_per_seq, k, m, pad_id = spec.chunks_per_seq, spec.neighbours, spec.chunk_tokens, spec.pad_id
    sequences = SequenceBatch.merged(grouped["sequences"])
    blocks = list(grouped["picks"])
    picks = np.concatenate([b.picks for b in blocks]) if blocks else np.zeros(0, PICK)
    values = np.concatenate([b.values for b in blocks]) if blocks else np.zeros((0, 2 * m), np.int32)
    seq_ids = np.array([s.seq_id for s in sequences], np.int64)
    _all_arrived("neighbours", seq_ids, picks, list(grouped["sent"]))
    if spec.tokens_from_chunk_files and sequences:
        sequences = with_tokens(sequences, spec.chunk_files, chunks_per_seq)
    row, owned = positions_of(seq_ids, picks["seq_id"])
    neighbours, ids, scores = sequences_neighbour_arrays(
        row[owned], len(sequences), picks[owned], values[owned], chunks_per_seq=chunks_per_seq, k=k, m=m, pad_id=pad_id
    )
    rows = [
        ShardRow(
            seq_id=s.seq_id,
            tokens=s.tokens,
            neighbours=neighbours[i],
            neighbour_ids=ids[i],
            neighbour_scores=scores[i],
            doc_ids=s.doc_ids,
            source=s.source,
        )
        for i, s in enumerate(sequences)
    ]
    if rows:
        yield RowBatch(rows)


@dataclass
class Retrieved:
    """What `RetrieveNeighbours` gives: PCollections of the rows and of what checks them."""

    rows: beam.PCollection  # a RowBatch per shard (`shard_rows` sequences)
    probes: beam.PCollection  # one sorted list of Probes: the training chunks sampled
    truth: beam.PCollection  # one (scores, ids) [probes, truth_depth]: their exact neighbours, or None
    search_depth: beam.PCollection  # one SearchDepth: `tune_retrieval_depth`'s result
    tallies: beam.PCollection  # (name, count) pairs


class RetrieveNeighbours(beam.PTransform):
    """(sequences (`PackSequences`' SequenceBatches), query embeddings (`QueryBlock`s; left out
    where the training chunks are the database's: each search then reads its queries from the
    database's embedding files, grouped by file, so no query embedding is shuffled to its
    batch), database
    document spans) -> `Retrieved`: ShardRows, in a RowBatch per shard of `shard_rows` sequences, with
    the k nearest chunks of the database outside each sequence's documents, and the probe
    sample with its exact truth and the search depth tuned on it.

    The exclusion happens inside the search (faiss skips the sequences' documents' chunk-id
    ranges), so long documents, whose nearest chunks are mostly their own, cannot starve the
    k slots. The depth is tuned on the same search, before it runs (`tune_retrieval_depth`): on
    long documents the nearest chunks outside a chunk's own document sit in lists that the
    index's own depth, tuned without that exclusion, does not probe. Only the kept neighbours
    (or, deduplicating, the candidates) travel on.
    """

    def __init__(self, spec: Retrieval, shard_rows: int, min_ram: str | None = None, validate: bool = True):
        super().__init__()
        if min_ram:  # every worker holds the index
            self.with_resource_hints(min_ram=min_ram)
        if spec.probes and not spec.embeddings:
            raise ValueError("Retrieval.probes needs Retrieval.embeddings: the files their exact search reads")
        self.spec, self.validate, self.shard_rows = spec, validate, shard_rows

    def expand(self, inputs):
        # (sequences, spans): the training chunks are the database's, their embeddings in its files;
        # a refresh's dict adds "probed": sequences not searched, only offered to the probe sample,
        # and "searched_chunks": SearchedChunks per search batch, narrowing some sequences' search
        if isinstance(inputs, dict):
            sequences, embeddings, doc_spans, probed = inputs["sequences"], None, inputs["spans"], inputs["probed"]
            narrowed = inputs["searched_chunks"]
        else:
            sequences, embeddings, doc_spans = inputs if len(inputs) == 3 else (inputs[0], None, inputs[1])
            probed = narrowed = None
        spec = self.spec
        L, files = spec.chunks_per_seq, spec.chunk_files
        by_batch = sequences | "BySearchBatch" >> beam.Map(_by_search_batch)
        sampled = by_batch  # the probes are sampled from every sequence the shards hold
        if probed is not None:
            sampled = (by_batch, probed | "ProbedBySearchBatch" >> beam.Map(_by_search_batch)) | beam.Flatten()
        excluded = (
            {"span": doc_spans, "batch": sampled | "BatchDocuments" >> beam.FlatMap(batch_documents)}
            | "JoinDocumentSpans" >> beam.CoGroupByKey()
            | "ExcludedRanges" >> beam.FlatMap(excluded_ranges)
        )
        if embeddings is None:  # the training chunks are the database's: their rows are in its embedding files

            def by_file(batches, prefix: str = "", narrowed=None):
                joined = {
                    "sequences": batches | f"{prefix}SequencesByFile" >> beam.Map(_by_first_file, files, L),
                    "excluded": excluded | f"{prefix}RangesByFile" >> beam.Map(_by_first_file, files, L),
                }
                if narrowed is not None:
                    keyed = narrowed | "NarrowedBySearchBatch" >> beam.Map(lambda c: (search_batch_of(c.seq_ids[0]), c))
                    joined["searched_chunks"] = keyed | "NarrowedByFile" >> beam.Map(_by_first_file, files, L)
                return joined | f"{prefix}JoinByEmbeddingFile" >> beam.CoGroupByKey()

            searched_by_file = by_file(by_batch, narrowed=narrowed)
            sampled_by_file = searched_by_file if probed is None else by_file(sampled, "Probed")
            # each file read where its batches are searched: no query is shuffled
            searched_joins = searched_by_file | "SearchQueries" >> beam.FlatMap(with_file_queries, files, L)
            sampled_joins = sampled_by_file | "ProbedBatches" >> beam.FlatMap(file_batches)
        else:
            searched_joins = sampled_joins = {
                "sequences": by_batch,
                "embeddings": embeddings | "QueriesBySearchBatch" >> beam.FlatMap(lambda b: b.by_search_batch(L)),
                "excluded": excluded,
            } | "JoinQueries" >> beam.CoGroupByKey()
        if spec.probes:
            # chosen by key, then only the chosen chunks' queries read, not every query once more
            probes = (
                sampled_joins
                | "BatchProbes" >> beam.Map(batch_probes, spec)
                | "SampleProbes" >> beam.CombineGlobally(SmallestProbes(spec.probes))
                | "ProbeQueries" >> ProbeQueries(L, files if embeddings is None else embeddings)
            )
            # read again even when the queries are the database: scanning those would keep every
            # query embedding until the sample exists (a side input from the same read)
            database = by_batch.pipeline | "ReadDatabaseEmbeddings" >> ReadQueryBlocks(
                spec.embeddings, spec.deleted, self.validate
            )
            truth = (probes, database) | "ExactTruth" >> ExactTruth(truth_depth(spec.neighbours))
        else:
            probes = by_batch.pipeline | "NoProbes" >> beam.Create([[]])
            truth = probes | "NoTruth" >> beam.Map(lambda _: None)
        depth = probes | "TuneSearchDepth" >> beam.Map(
            lambda sample, truth: tune_retrieval_depth(spec, sample, truth), beam.pvalue.AsSingleton(truth)
        )
        searched = searched_joins | "Search" >> SearchIndex(spec, depth)
        tallies = [searched.tallies]
        if spec.dedupe:
            picked = (
                {
                    "candidates": (
                        searched.found
                        | "GroupHitsByChunkFile" >> beam.GroupByKey()
                        | "CandidateTokens" >> beam.ParDo(_CandidateTokens(files))
                    ),
                    "sent": searched.sent,
                }
                | "JoinCandidates" >> beam.CoGroupByKey()
                | "DropDuplicateTokens" >> beam.FlatMap(_select_distinct, spec).with_outputs(SENT, TALLY, main="picks")
            )
            picks, sent = picked.picks, picked[SENT]
            tallies.append(picked[TALLY])
        else:
            picks, sent = searched.found, searched.sent
        neighbours = (
            picks
            | "GroupPicksByChunkFile" >> beam.GroupByKey()
            | "NeighbourTokens" >> beam.ParDo(_NeighbourTokens(files))
        )
        rows = (
            {
                "sequences": by_batch | "SequencesByShard" >> beam.FlatMap(_in_shards, self.shard_rows),
                "picks": neighbours | "NeighboursByShard" >> beam.FlatMap(_in_shards, self.shard_rows),
                "sent": sent | "CountsByShard" >> beam.FlatMap(_in_shards, self.shard_rows),
            }
            | "JoinNeighbours" >> beam.CoGroupByKey()
            | "AssembleRows" >> beam.FlatMap(_to_rows, spec)
        )
        return Retrieved(rows, probes, truth, depth, tallies | "RetrievalTallies" >> beam.Flatten())
