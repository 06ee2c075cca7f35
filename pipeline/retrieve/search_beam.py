"""The search step of `RetrieveNeighbours` (`SearchIndex`): each joined search batch's queries
searched, in one index file where the batch is, or over an index in slices by inverted lists
(each query routed to the slices owning its lists, a slice loaded once per group of batches,
the slices' hits merged per batch, queries still short routed again at twice the depth), and
what a searched batch sends on (hits in blocks by chunk file, each sequence's count, tallies).

Apart from `beam`, which joins what the search reads and what it finds with the sequences:
this module holds only the search and the index files it loads; it imports nothing from
`beam`, which imports it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import apache_beam as beam
import faiss
import numpy as np
from apache_beam.utils import shared

from pipeline.common.arrays import groups, positions_of
from pipeline.index.files import read_owners
from pipeline.retrieve.depth import index_version, load_searched, stored_path
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
    LOST_DATA,
    Records,
    Retrieval,
    Routing,
    SentCounts,
    check_in_database,
    picks_of,
    search_batch,
)
from schemas.measures import SearchDepth


def _probe_chunk_ids(sample, chunks_per_seq: int) -> np.ndarray:
    return np.array([p.seq_id * chunks_per_seq + p.j for p in sample], np.int64)


def _queries_of_probes(block, sample, chunks_per_seq: int):
    """A block of training chunks' queries -> (chunk id, query) for each sampled chunk in it."""
    order = np.argsort(block.chunk_ids, kind="stable")
    wanted = _probe_chunk_ids(sample, chunks_per_seq)
    at, present = positions_of(block.chunk_ids[order], wanted)
    for chunk_id, row in zip(wanted[present].tolist(), order[at[present]]):
        yield chunk_id, block.vectors[row]


def _with_queries(sample, found, chunks_per_seq: int):
    """The sample with each probe's query from `found` ((chunk id, query) pairs); a query that
    did not arrive fails the job: nothing is committed."""
    queries, chunk_ids = dict(found), _probe_chunk_ids(sample, chunks_per_seq).tolist()
    for probe, chunk_id in zip(sample, chunk_ids):
        if chunk_id not in queries:
            raise RuntimeError(
                f"sequence {probe.seq_id}: the query of its sampled chunk {probe.j} did not arrive: "
                f"{LOST_DATA}; nothing is committed"
            )
    return [p._replace(query=queries[i]) for p, i in zip(sample, chunk_ids)]


def _read_probe_queries(sample, chunk_files, chunks_per_seq: int):
    ids = _probe_chunk_ids(sample, chunks_per_seq)
    return [p._replace(query=q) for p, q in zip(sample, chunk_files.read_embedding_rows(ids))]


class ProbeQueries(beam.PTransform):
    """(the probe sample, chosen by key: `batch_probes`) -> the sample with each probe's query:
    read from the database's embedding files (`queries`: its chunk files; only the row groups
    holding them), or picked out of the training chunks' `QueryBlock`s (`queries`: a PCollection)."""

    def __init__(self, chunks_per_seq: int, queries):
        super().__init__()
        self.chunks_per_seq, self.queries = chunks_per_seq, queries

    def expand(self, sample):
        L, queries = self.chunks_per_seq, self.queries
        if not isinstance(queries, beam.PCollection):
            return sample | "ReadProbeQueries" >> beam.Map(_read_probe_queries, queries, L)
        found = queries | "QueriesOfProbes" >> beam.FlatMap(
            lambda block, probes: _queries_of_probes(block, probes, L) if probes else (),
            beam.pvalue.AsSingleton(sample),
        )
        return sample | "WithQueries" >> beam.Map(_with_queries, beam.pvalue.AsList(found), L)


SENT = "sent"  # tagged output: (search batch, SentCounts: what each sequence sent through the next shuffle)
TALLY = "tally"  # tagged output: (name, count) pairs, counted as data (pipeline.common.tally)


def emit_hits(
    spec: Retrieval, batch: int, *, seq_ids: list[int], queries: int, hits: np.ndarray, deeper: int, searched_alone: int
):
    """What a searched batch sends on: tallies, the count each of its sequences will receive
    (one `SentCounts`, keyed by the batch), and the hits in blocks keyed by the chunk file
    holding them: the k neighbours as PICK rows, or (deduplicating) the CANDIDATE rows.
    `queries`: the query rows searched (all L of each sequence, unless a refresh narrowed them);
    `deeper`: those of them searched deeper than the tuned depth. `searched_alone`: queries the
    batched search left short (0 for a routed search, which excludes inside each slice's search)."""
    check_in_database(hits, spec.chunk_files.num_chunks)
    yield beam.pvalue.TaggedOutput(TALLY, ("queries", queries))
    yield beam.pvalue.TaggedOutput(TALLY, ("queries_searched_deeper", deeper))
    yield beam.pvalue.TaggedOutput(TALLY, ("queries_searched_alone", searched_alone))
    yield beam.pvalue.TaggedOutput(SENT, (batch, SentCounts.of(seq_ids, hits)))
    yield from by_chunk_file(spec, hits if spec.dedupe else picks_of(hits))


def by_chunk_file(spec: Retrieval, rows: np.ndarray):
    """CANDIDATE or PICK rows -> (chunk file number, `Records`: the block of them it holds) per file."""
    for number, at in groups(spec.chunk_files.files_of(rows["chunk_id"])):
        yield number, Records(rows[at])


def _loaded_index(holder: shared.Shared, path: str, depth: int | None, chunk_files):
    """The faiss file at `path`, loaded once per process through Beam `Shared` (which keeps the
    last one acquired alive: a process searching slices in turn holds one at a time), checked
    to be the one the job's index manifest describes (`load_searched`)."""

    class _Holder:  # Shared needs a weak-referenceable object
        def __init__(self):
            self.index = load_searched(chunk_files, path, depth)

    # a change rewrites an index file under its name: the tag names the manifest too
    return holder.acquire(_Holder, tag=f"{path}:{depth}:{index_version(chunk_files)}")


class _Search(beam.DoFn):
    """A search batch of sequences -> per sequence, its queries searched with the chunk-id
    ranges of its own documents skipped inside faiss (the one index file, loaded once per
    process, at the tuned depth: a side input). Emits `emit_hits`."""

    _shared_index = shared.Shared()

    def __init__(self, spec: Retrieval):
        self.spec = spec

    def process(self, keyed, tuned: SearchDepth):
        _, grouped = keyed
        assert self.spec.index_path is not None  # one index file (__post_init__ allows nothing else here)
        index = _loaded_index(self._shared_index, self.spec.index_path, tuned.depth, self.spec.chunk_files).index
        sequences, queries, hits, deeper, alone = search_batch(index, grouped, self.spec)
        if sequences:  # none: only the embeddings of chunks left over after the last sequence
            yield from emit_hits(
                self.spec,
                keyed[0],
                seq_ids=[s.seq_id for s in sequences],
                queries=queries,
                hits=hits,
                deeper=deeper,
                searched_alone=alone,
            )


BATCHES_PER_SEARCH_GROUP = 256  # search batches a (slice, group) key holds: the slice is loaded once per group
STATE = "state"  # tagged output: (batch, RoutedBatch) between rounds of a routed search
NEXT = "next"  # tagged output: ((slice, group), SliceQueries) for the next, deeper round


def _search_key(sent: SliceQueries):
    """Queries go to (slice, group of consecutive batches): groups grow in number with the
    training sequences, so a large job spreads over as many workers as the runner gives it."""
    return (sent.index_slice, sent.batch // BATCHES_PER_SEARCH_GROUP), sent


@functools.lru_cache(maxsize=1)
def _owners(path: str, _version: str) -> np.ndarray:
    return read_owners(path)


#: The quantizer of a sliced index, held once per process by every step that routes queries
#: (the first round's and each later round's: one Shared each would hold it twice).
_QUANTIZER = shared.Shared()


def _router(spec: Retrieval, routing: Routing):
    """(quantizer index, list owners) of a sliced index, loaded once per process."""
    return _loaded_index(_QUANTIZER, routing.quantizer, None, spec.chunk_files).index, _owners(
        stored_path(spec.chunk_files, routing.owners), index_version(spec.chunk_files)
    )


class _RouteQueries(beam.DoFn):
    """A joined search batch -> its queries (tokens left behind) assigned to their lists at the
    tuned depth: the batch's RoutedBatch (tagged STATE) and one SliceQueries per slice owning
    a probed list, keyed for the search (the quantizer loaded once per process)."""

    def __init__(self, spec: Retrieval, routing: Routing):
        self.spec, self.routing = spec, routing  # routing: spec.routing, known to be set

    def process(self, keyed, tuned: SearchDepth):
        batch = batch_of(keyed, self.spec.chunks_per_seq)
        if not len(batch.seq_ids):  # only the embeddings of chunks left over after the last sequence
            return
        quantized, owner = _router(self.spec, self.routing)
        depth = tuned.depth or faiss.extract_index_ivf(quantized).nprobe
        state, sent = first_round(
            batch,
            depth=depth,
            width=_width(self.spec),
            quantized=quantized,
            owner=owner,
            chunks_per_seq=self.spec.chunks_per_seq,
        )
        yield beam.pvalue.TaggedOutput(STATE, (batch.batch, state))
        yield from map(_search_key, sent)


class SearchRouted(beam.DoFn):
    """((slice, group), SliceQueries) -> (batch, SliceFound): each process loads the slice of
    the group it is given and searches every batch's rows sent to it, only their lists."""

    _shared_index = shared.Shared()

    def __init__(self, spec: Retrieval, routing: Routing):
        self.spec, self.routing, self.width = spec, routing, _width(spec)

    def process(self, keyed):
        (index_slice, _), sent = keyed
        path = self.routing.slice_path(index_slice)
        index = _loaded_index(self._shared_index, path, None, self.spec.chunk_files).index
        for rows in sent:
            yield rows.batch, search_slice(index, rows, self.width)


class _MergeRound(beam.DoFn):
    """(batch, its RoutedBatch and the round's SliceFound) -> the hits merged as one index
    ranks them; a batch with rows still short routes them again at twice the depth (tagged
    STATE and NEXT), a finished one sends its hits on as one index's search would."""

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
            yield from emit_hits(
                self.spec,
                batch,
                seq_ids=state.queries.seq_ids.tolist(),
                queries=len(state.queries.rows),
                hits=hits_of(state, L),
                deeper=len(state.deeper),
                searched_alone=0,
            )
            return
        state, sent = route_rows(state, *_router(self.spec, self.routing), L)
        yield beam.pvalue.TaggedOutput(STATE, (batch, state))
        for keyed_rows in map(_search_key, sent):
            yield beam.pvalue.TaggedOutput(NEXT, keyed_rows)


def _width(spec: Retrieval) -> int:
    return spec.candidates if spec.dedupe else spec.neighbours


@dataclass
class Searched:
    """What the search sends on: hits ("found"), each sequence's count (SENT), tallies."""

    found: beam.PCollection
    sent: beam.PCollection
    tallies: beam.PCollection


class SearchIndex(beam.PTransform):
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
                        | f"SearchSlices{number}" >> beam.ParDo(SearchRouted(spec, routing))
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
