"""Pack training sequences, retrieve their neighbours, join neighbour tokens, write shards.

Everything moves through Beam shuffles keyed by ids: a sequence's documents meet their chunk-id
ranges by document id; sequences meet their query embeddings and those ranges by search batch;
the search skips the ranges inside faiss, so the k best hits are already the neighbours (with
`dedupe_neighbours`, the candidates first fetch their tokens from the chunk file holding
them); the kept neighbours are shuffled by the chunk file that holds them and read their
tokens in one read of that file; and neighbours meet their sequence by sequence id. No
process holds the chunk database, and nothing shuffles it: what moves grows with the
training sequences (plus one (doc id, range) per database document), not with the chunks.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import apache_beam as beam
import faiss
import numpy as np
from apache_beam.io.parquetio import ReadFromParquetBatched
from apache_beam.utils import shared

from pipeline.chunks.chunk_files import ChunkFileRanges, CommittedChunkFiles
from pipeline.chunks.chunking import Chunk
from pipeline.index.exact import truth_depth
from pipeline.index.files import load_index, read_owners
from pipeline.retrieve.recall import ExactTruth, SmallestProbes
from pipeline.retrieve.routed import (
    SliceQueries,
    batch_of,
    first_round,
    hits_of,
    merge_round,
    route_rows,
    search_slice,
)
from pipeline.retrieve.search import (
    CANDIDATE,
    LOST_DATA,
    SEQUENCES_PER_SEARCH,
    Retrieval,
    Routing,
    _excluded_ranges,
    batch_probes,
    check_in_database,
    neighbour_values,
    search_batch,
    select_distinct,
    token_key,
    tune_retrieval_depth,
)
from pipeline.retrieve.sequences import document_spans, pack_sequence, widest_span
from pipeline.shards.rows import ShardRow, neighbour_arrays
from schemas.manifest import SearchDepth

SENT = "sent"  # tagged output: (seq_id, elements it sent through the next shuffle)
TALLY = "tally"  # tagged output: (name, count) pairs, counted as data (pipeline.common.tally)


def _sequence_parts(chunk: Chunk, chunks_per_seq: int):
    seq_id, offset = divmod(chunk.chunk_id, chunks_per_seq)
    yield seq_id, ("chunk", chunk)
    if offset == 0 and seq_id > 0:  # the first token of a sequence is the previous one's target
        yield seq_id - 1, ("next", (int(chunk.tokens[0]), chunk.doc_id))


def _assemble(keyed, chunks_per_seq: int, pad_id: int):
    seq_id, parts = keyed
    chunks = sorted((p for kind, p in parts if kind == "chunk"), key=lambda c: c.chunk_id)
    following = [p for kind, p in parts if kind == "next"]
    if len(chunks) < chunks_per_seq:  # the chunk database's tail: too short for a sequence
        return
    next_token, next_doc = following[0] if following else (None, None)
    yield pack_sequence(seq_id, chunks, next_token, next_doc, pad_id)


class PackSequences(beam.PTransform):
    """Chunk rows -> Sequences of `chunks_per_seq` consecutive chunks (ids seq·L … seq·L+L-1)."""

    def __init__(self, chunks_per_seq: int, pad_id: int):
        super().__init__()
        self.chunks_per_seq, self.pad_id = chunks_per_seq, pad_id

    def expand(self, chunks):
        return (
            chunks
            | "KeyBySequence" >> beam.FlatMap(_sequence_parts, self.chunks_per_seq)
            | "GroupBySequence" >> beam.GroupByKey()
            | "Assemble" >> beam.FlatMap(_assemble, self.chunks_per_seq, self.pad_id)
        )


class DocumentSpans(beam.PTransform):
    """Chunk files (a glob) -> (doc_id, (first chunk id, last + 1)) per database document: a
    document's chunks are one contiguous id range, so excluding it is excluding a range."""

    def __init__(self, pattern: str, validate: bool = True):
        super().__init__()
        self.pattern, self.validate = pattern, validate

    def expand(self, pbegin):
        return (
            pbegin
            | "ReadDocumentIds"
            >> ReadFromParquetBatched(self.pattern, columns=["chunk_id", "doc_id"], validate=self.validate)
            | "SpansInBatch" >> beam.FlatMap(lambda t: document_spans(t["chunk_id"].to_numpy(), t["doc_id"].to_numpy()))
            | "WidestSpan" >> beam.CombinePerKey(widest_span)
        )


def emit_hits(spec: Retrieval, seq_ids: list[int], hits: np.ndarray, deeper_seqs):
    """What a searched batch sends on: tallies, the count each sequence will receive,
    and the hits (the k neighbours keyed by chunk id, or candidate blocks by chunk file)."""
    check_in_database(hits, spec.chunk_files.num_chunks)
    L = spec.chunks_per_seq
    yield beam.pvalue.TaggedOutput(TALLY, ("queries", len(seq_ids) * L))
    yield beam.pvalue.TaggedOutput(TALLY, ("queries_searched_deeper", len(deeper_seqs) * L))
    hit_seqs, counts = np.unique(hits["seq_id"], return_counts=True)
    sent = dict(zip(hit_seqs.tolist(), counts.tolist()))
    for seq_id in seq_ids:  # what each sequence must receive back, checked when it arrives
        yield beam.pvalue.TaggedOutput(SENT, (seq_id, sent.get(seq_id, 0)))
    if not spec.dedupe:  # the k hits are the neighbours (rank = slot)
        for seq_id, j, slot, chunk_id, score in zip(
            hits["seq_id"].tolist(),
            hits["j"].tolist(),
            hits["rank"].tolist(),
            hits["chunk_id"].tolist(),
            hits["score"].tolist(),
        ):
            yield chunk_id, (seq_id, j, slot, score)
        return
    files = spec.chunk_files.files_of(hits["chunk_id"])
    for number in np.unique(files):
        yield int(number), hits[files == number]


def _loaded_index(holder: shared.Shared, path: str, depth: int | None):
    """The faiss file at `path`, loaded once per process through Beam `Shared` (which keeps the
    last one acquired alive: a process searching slices in turn holds one at a time)."""

    class _Holder:  # Shared needs a weak-referenceable object
        def __init__(self):
            self.index = load_index(path, depth)

    return holder.acquire(_Holder, tag=f"{path}:{depth}")


class _Search(beam.DoFn):
    """A search batch of sequences -> per sequence, its queries searched with the chunk-id
    ranges of its own documents skipped inside faiss (the one index file, loaded once per
    process, at the tuned depth: a side input). Emits the k neighbours as picks keyed by chunk
    id, or (deduplicating) the candidates as CANDIDATE blocks keyed by the chunk file holding
    them."""

    _shared_index = shared.Shared()

    def __init__(self, spec: Retrieval):
        self.spec = spec

    def process(self, keyed, tuned: SearchDepth):
        _, grouped = keyed
        assert self.spec.index_path is not None  # one index file (__post_init__ allows nothing else here)
        index = _loaded_index(self._shared_index, self.spec.index_path, tuned.depth).index
        sequences, hits, deeper = search_batch(index, grouped, self.spec)
        if sequences:  # none: only the embeddings of chunks left over after the last sequence
            yield from emit_hits(self.spec, [s.seq_id for s in sequences], hits, deeper)


BATCHES_PER_SEARCH_GROUP = 256  # search batches a (slice, group) key holds: the slice is loaded once per group
STATE = "state"  # tagged output: (batch, RoutedBatch) between rounds of a routed search
NEXT = "next"  # tagged output: ((slice, group), SliceQueries) for the next, deeper round


def _search_key(sent: SliceQueries):
    """Queries go to (slice, group of consecutive batches): groups grow in number with the
    training sequences, so a large job spreads over as many workers as the runner gives it."""
    return (sent.index_slice, sent.batch // BATCHES_PER_SEARCH_GROUP), sent


@functools.lru_cache(maxsize=1)
def _owners(path: str) -> np.ndarray:
    return read_owners(path)


def _router(holder: shared.Shared, routing: Routing):
    """(quantizer index, list owners) of a sliced index, loaded once per process."""
    return _loaded_index(holder, routing.quantizer, None).index, _owners(routing.owners)


class _RouteQueries(beam.DoFn):
    """A joined search batch -> its queries (tokens left behind) assigned to their lists at the
    tuned depth: the batch's RoutedBatch (tagged STATE) and one SliceQueries per slice owning
    a probed list, keyed for the search (the quantizer loaded once per process)."""

    _shared_quantizer = shared.Shared()

    def __init__(self, spec: Retrieval, routing: Routing):
        self.spec, self.routing = spec, routing  # routing: spec.routing, known to be set

    def process(self, keyed, tuned: SearchDepth):
        batch = batch_of(keyed, self.spec.chunks_per_seq)
        if not len(batch.seq_ids):  # only the embeddings of chunks left over after the last sequence
            return
        quantized, owner = _router(self._shared_quantizer, self.routing)
        depth = tuned.depth or faiss.extract_index_ivf(quantized).nprobe
        state, sent = first_round(batch, depth, _width(self.spec), quantized, owner, self.spec.chunks_per_seq)
        yield beam.pvalue.TaggedOutput(STATE, (batch.batch, state))
        yield from map(_search_key, sent)


class _SearchRouted(beam.DoFn):
    """((slice, group), SliceQueries) -> (batch, SliceFound): each process loads the slice of
    the group it is given and searches every batch's rows sent to it, only their lists."""

    _shared_index = shared.Shared()

    def __init__(self, routing: Routing, width: int):
        self.routing, self.width = routing, width

    def process(self, keyed):
        (index_slice, _), sent = keyed
        index = _loaded_index(self._shared_index, self.routing.slice_path(index_slice), None).index
        for rows in sent:
            yield rows.batch, search_slice(index, rows, self.width)


class _MergeRound(beam.DoFn):
    """(batch, its RoutedBatch and the round's SliceFound) -> the hits merged as one index
    ranks them; a batch with rows still short routes them again at twice the depth (tagged
    STATE and NEXT), a finished one sends its hits on as one index's search would."""

    _shared_quantizer = shared.Shared()

    def __init__(self, spec: Retrieval, routing: Routing):
        self.spec, self.routing = spec, routing  # routing: spec.routing, known to be set

    def process(self, keyed):
        batch, grouped = keyed
        states = list(grouped["state"])
        if len(states) != 1:
            raise RuntimeError(f"search batch {batch}: {len(states)} states of its routed search arrived: {LOST_DATA}")
        L = self.spec.chunks_per_seq
        state, deeper = merge_round(states[0], list(grouped["found"]), _width(self.spec), self.routing.nlist, L)
        if not deeper:
            yield from emit_hits(self.spec, state.queries.seq_ids.tolist(), hits_of(state, L), state.deeper)
            return
        state, sent = route_rows(state, *_router(self._shared_quantizer, self.routing), L)
        yield beam.pvalue.TaggedOutput(STATE, (batch, state))
        for keyed_rows in map(_search_key, sent):
            yield beam.pvalue.TaggedOutput(NEXT, keyed_rows)


def _width(spec: Retrieval) -> int:
    return spec.candidates if spec.dedupe else spec.neighbours


class _CandidateTokens(beam.DoFn):
    """(chunk file, candidate blocks in it) -> one CANDIDATE block per sequence, each hit with
    its chunk's token hash, from one read of that file's tokens. A block is one search batch's
    hits in the file, handled and sent on before the next is read, so this holds the file's
    tokens, a key per row and one block: not every candidate of the file (a runner that streams
    a large group, as Beam's state-backed iterables do, never holds them all either)."""

    def __init__(self, chunk_files: ChunkFileRanges | CommittedChunkFiles):
        self.chunk_files = chunk_files

    def process(self, keyed):
        number, blocks = keyed
        tokens = self.chunk_files.read(number, ["tokens"])["tokens"]
        keys = np.full(len(tokens), -1, np.int64)  # each row's token_key (never negative), hashed once
        start = self.chunk_files.starts[number]
        for block in blocks:
            hits = block[np.argsort(block["seq_id"], kind="stable")]  # a copy: the input stays as it came
            local = hits["chunk_id"] - start
            new = np.unique(local[keys[local] < 0])  # a chunk is hit by many queries
            keys[new] = [token_key(tokens[r]) for r in new]
            hits["token_key"] = keys[local]
            seq_ids, starts = np.unique(hits["seq_id"], return_index=True)
            yield from zip(seq_ids.tolist(), np.split(hits, starts[1:]))


class _NeighbourTokens(beam.DoFn):
    """(chunk file, kept neighbours in it) -> neighbours keyed by sequence, each with its
    chunk + continuation [2m] as raw int32 bytes (compact through the next shuffle)."""

    def __init__(self, chunk_files: ChunkFileRanges | CommittedChunkFiles):
        self.chunk_files = chunk_files

    def process(self, keyed):
        number, picks = keyed
        picks = list(picks)
        values = neighbour_values(self.chunk_files, number, np.array([chunk_id for chunk_id, _ in picks], np.int64))
        for (chunk_id, (seq_id, j, slot, score)), value in zip(picks, values):
            yield seq_id, (j, slot, chunk_id, score, value.tobytes())


def _arrived(seq_id: int, what: str, received: int, sent: list[int]) -> None:
    """Each sequence counts what it sent through a shuffle; fail loudly if any went missing
    rather than write a shard with silently padded neighbours."""
    if len(sent) != 1 or received != sent[0]:
        raise RuntimeError(
            f"sequence {seq_id}: {received} {what} arrived, {sent or 'no count'} were "
            f"sent: {LOST_DATA}; nothing is committed"
        )


def _select_distinct(keyed, k: int):
    seq_id, grouped = keyed
    blocks = list(grouped["candidates"])  # none when the index reached no chunk for it
    candidates = np.concatenate(blocks) if blocks else np.zeros(0, CANDIDATE)
    _arrived(seq_id, "search hits", len(candidates), list(grouped["sent"]))
    picks, dropped = select_distinct(candidates, k)
    yield beam.pvalue.TaggedOutput(TALLY, ("candidates_dropped_duplicate_tokens", dropped))
    yield beam.pvalue.TaggedOutput(SENT, (seq_id, len(picks)))
    for j, slot, chunk_id, score in picks:
        yield chunk_id, (seq_id, j, slot, score)


def _to_row(keyed, chunks_per_seq: int, k: int, m: int, pad_id: int):
    _, grouped = keyed
    (sequence,) = grouped["sequence"]
    picks = [
        (j, slot, chunk_id, score, np.frombuffer(value, np.int32))
        for j, slot, chunk_id, score, value in grouped["picks"]
    ]
    _arrived(sequence.seq_id, "neighbours", len(picks), list(grouped["sent"]))
    neighbours, ids, scores = neighbour_arrays(picks, chunks_per_seq, k, m, pad_id)
    yield ShardRow(sequence.seq_id, sequence.tokens, neighbours, ids, scores, sequence.doc_ids)


@dataclass
class Searched:
    """What the search sends on: hits ("found"), each sequence's count (SENT), tallies."""

    found: beam.PCollection
    sent: beam.PCollection
    tallies: beam.PCollection


class _SearchIndex(beam.PTransform):
    """Joined search batches -> `Searched`, at the depth in `tuned` (a singleton side input:
    `tune_retrieval_depth`'s result). One index file: each batch searched where it is. Slices
    by inverted lists (`spec.routing`): each query assigned to its lists once, sent only to
    the slices owning them (vectors, lists, excluded ranges: no tokens), the slices' hits
    merged per batch; queries still short go round again at twice the depth, in as many
    rounds as doubling takes from one list to all of them (a round nothing needs is empty)."""

    def __init__(self, spec: Retrieval, tuned):
        super().__init__()
        self.spec, self.tuned = spec, tuned

    def expand(self, batches):
        spec, tuned = self.spec, beam.pvalue.AsSingleton(self.tuned)
        if spec.routing is None:
            out = batches | "SearchBatches" >> beam.ParDo(_Search(spec), tuned).with_outputs(SENT, TALLY, main="found")
            return Searched(out.found, out[SENT], out[TALLY])
        routing = spec.routing
        first = batches | "RouteQueries" >> beam.ParDo(_RouteQueries(spec, routing), tuned).with_outputs(
            STATE, main="sent"
        )
        sent, states, rounds = first.sent, first[STATE], []
        for number in range(math.ceil(math.log2(routing.nlist)) + 1):  # depth 1, 2, 4, … nlist at most
            merged = (
                {
                    "state": states,
                    "found": (
                        sent
                        | f"GroupBySlice{number}" >> beam.GroupByKey()
                        | f"SearchSlices{number}" >> beam.ParDo(_SearchRouted(routing, _width(spec)))
                    ),
                }
                | f"JoinSliceHits{number}" >> beam.CoGroupByKey()
                | f"MergeSliceHits{number}"
                >> beam.ParDo(_MergeRound(spec, routing)).with_outputs(SENT, TALLY, STATE, NEXT, main="found")
            )
            rounds.append(merged)
            sent, states = merged[NEXT], merged[STATE]
        _ = (sent, states) | "DeepestRoundEnds" >> beam.Flatten() | beam.Map(_nothing_left)
        return Searched(
            [r.found for r in rounds] | "RoundHits" >> beam.Flatten(),
            [r[SENT] for r in rounds] | "RoundCounts" >> beam.Flatten(),
            [r[TALLY] for r in rounds] | "RoundTallies" >> beam.Flatten(),
        )


def _nothing_left(element):
    raise RuntimeError(f"a routed search went deeper than every list: {element!r:.200}")


@dataclass
class Retrieved:
    """What `RetrieveNeighbours` gives: PCollections of the rows and of what checks them."""

    rows: beam.PCollection  # ShardRows
    probes: beam.PCollection  # one sorted list of Probes: the training chunks sampled
    truth: beam.PCollection  # one (scores, ids) [probes, truth_depth]: their exact neighbours, or None
    search_depth: beam.PCollection  # one SearchDepth: `tune_retrieval_depth`'s result
    tallies: beam.PCollection  # (name, count) pairs


class RetrieveNeighbours(beam.PTransform):
    """(sequences, query embeddings, database document spans) -> `Retrieved`: ShardRows with
    the k nearest chunks of the database outside each sequence's documents, and the probe
    sample with its exact truth and the search depth tuned on it.

    The exclusion happens inside the search (faiss skips the sequences' documents' chunk-id
    ranges), so long documents, whose nearest chunks are mostly their own, cannot starve the
    k slots. The depth is tuned on the same search, before it runs (`tune_retrieval_depth`): on
    long documents the nearest chunks outside a chunk's own document sit in lists that the
    index's own depth, tuned without that exclusion, does not probe. Only the kept neighbours
    (or, deduplicating, the candidates) travel on.
    """

    def __init__(self, spec: Retrieval, min_ram: str | None = None, validate: bool = True):
        super().__init__()
        if min_ram:  # every worker holds the index
            self.with_resource_hints(min_ram=min_ram)
        if spec.probes and not spec.embeddings:
            raise ValueError("Retrieval.probes needs Retrieval.embeddings: the files their exact search reads")
        self.spec, self.validate = spec, validate

    def expand(self, inputs):
        sequences, embeddings, doc_spans = inputs
        spec, batch = self.spec, SEQUENCES_PER_SEARCH
        L, files = spec.chunks_per_seq, spec.chunk_files
        by_seq = sequences | "SeqById" >> beam.Map(lambda s: (s.seq_id, s))
        excluded = (
            {
                "span": doc_spans,
                "seq": sequences | "SeqDocuments" >> beam.FlatMap(lambda s: [(d, s.seq_id) for d in s.doc_ids]),
            }
            | "JoinDocumentSpans" >> beam.CoGroupByKey()
            | "ExcludedRanges" >> beam.FlatMap(_excluded_ranges)
        )
        joined = {
            "sequences": sequences | "SeqBySearchBatch" >> beam.Map(lambda s: (s.seq_id // batch, s)),
            "embeddings": embeddings | "QueryBySearchBatch" >> beam.Map(lambda e: (e[0] // L // batch, e)),
            "excluded": excluded | "ExcludedBySearchBatch" >> beam.Map(lambda e: (e[0] // batch, e)),
        } | "JoinQueries" >> beam.CoGroupByKey()
        if spec.probes:
            probes = (
                joined
                | "BatchProbes" >> beam.Map(batch_probes, spec)
                | "SampleProbes" >> beam.CombineGlobally(SmallestProbes(spec.probes))
            )
        else:
            probes = joined.pipeline | "NoProbes" >> beam.Create([[]])
        if spec.probes:
            truth = probes | "ExactTruth" >> ExactTruth(spec.embeddings, truth_depth(spec.neighbours), self.validate)
        else:
            truth = probes | "NoTruth" >> beam.Map(lambda _: None)
        depth = probes | "TuneSearchDepth" >> beam.Map(
            lambda sample, truth: tune_retrieval_depth(spec, sample, truth), beam.pvalue.AsSingleton(truth)
        )
        searched = joined | "Search" >> _SearchIndex(spec, depth)
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
                | "DropDuplicateTokens"
                >> beam.FlatMap(_select_distinct, spec.neighbours).with_outputs(SENT, TALLY, main="picks")
            )
            picks, sent = picked.picks, picked[SENT]
            tallies.append(picked[TALLY])
        else:
            picks, sent = searched.found, searched.sent
        neighbours = (
            picks
            | "PicksByChunkFile" >> beam.Map(lambda pick: (files.file_of(pick[0]), pick))
            | "GroupPicksByChunkFile" >> beam.GroupByKey()
            | "NeighbourTokens" >> beam.ParDo(_NeighbourTokens(files))
        )
        rows = (
            {"sequence": by_seq, "picks": neighbours, "sent": sent}
            | "JoinNeighbours" >> beam.CoGroupByKey()
            | "AssembleRows" >> beam.FlatMap(_to_row, L, spec.neighbours, spec.chunk_tokens, spec.pad_id)
        )
        return Retrieved(rows, probes, truth, depth, tallies | "RetrievalTallies" >> beam.Flatten())
