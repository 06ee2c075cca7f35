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

import hashlib
from dataclasses import dataclass

import apache_beam as beam
import numpy as np
from apache_beam.io.parquetio import ReadFromParquetBatched
from apache_beam.utils import shared

from pipeline.chunkdb import ChunkFileRanges
from pipeline.chunking import Chunk
from pipeline.faiss_index import (
    load_index,
    recall_of,
    sample_keys,
    search_depth_range,
    search_each_excluding,
    search_excluding,
    set_search_depth,
    truth_depth,
    tune_depth,
)
from pipeline.index_shards import merge_shard_results
from pipeline.neighbour_recall import ExactTruth, Probe, SmallestProbes
from pipeline.retro_rows import Sequence, ShardRow
from pipeline.writers import WriteGroupedFiles
from schemas.arrow import shard_ipc_bytes, shard_table

FILLED = "neighbour_slots_filled"  # per shard in the manifest: slots holding a neighbour
SENT = "sent"  # tagged output: (seq_id, elements it sent through the next shuffle)
SEQUENCES_PER_SEARCH = 64  # fixed search batches: faiss scores depend on batch shape


# With dedupe_neighbours, search hits travel in numpy blocks, one per (search batch, chunk
# file), not one tuple each; token_key is filled from the hit's chunk file.
CANDIDATE = np.dtype(
    [("seq_id", "<i8"), ("j", "<i4"), ("rank", "<i4"), ("chunk_id", "<i8"), ("score", "<f4"), ("token_key", "<i8")]
)
TALLY = "tally"  # tagged output: (name, count) pairs, counted as data (pipeline.tally)
PROBE_SALT = 3


# --- pure functions -------------------------------------------------------------------------


def pack_sequence(
    seq_id: int, chunks: list[Chunk], next_token: int | None, next_doc: int | None, pad_id: int
) -> Sequence:
    """L consecutive chunks (sorted by id) + the first token of the chunk after them."""
    target = pad_id if next_token is None else next_token
    tokens = np.concatenate([c.tokens for c in chunks] + [np.array([target], np.int32)])
    docs = {c.doc_id for c in chunks} | ({next_doc} if next_doc is not None else set())
    return Sequence(seq_id, tokens.astype(np.int32), tuple(sorted(docs)))


def document_spans(chunk_ids: np.ndarray, doc_ids: np.ndarray) -> list[tuple[int, tuple[int, int]]]:
    """(doc_id, (first chunk id, last + 1)) of each document among these chunk rows; a document
    cut by the rows' edges gives a partial span, which `widest_span` merges."""
    order = np.argsort(chunk_ids, kind="stable")
    ids, docs = chunk_ids[order], doc_ids[order]
    starts = np.flatnonzero(np.r_[True, docs[1:] != docs[:-1]])
    ends = np.r_[starts[1:], len(ids)]
    return [(int(docs[a]), (int(ids[a]), int(ids[b - 1]) + 1)) for a, b in zip(starts, ends)]


def widest_span(spans) -> tuple[int, int]:
    """Merge partial spans of one document (associative, so Beam can combine it anywhere)."""
    spans = list(spans)
    return min(a for a, _ in spans), max(b for _, b in spans)


def merge_ranges(ranges) -> list[tuple[int, int]]:
    """Sorted [start, end) ranges with overlapping and adjacent ones joined."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def select_distinct(candidates: np.ndarray, k: int) -> tuple[list[tuple], int]:
    """Per chunk j, the k best-ranked CANDIDATE rows whose tokens differ from those already
    kept for j: ([(j, slot, chunk_id, score)], candidates dropped as duplicates)."""
    c = candidates[np.lexsort((candidates["rank"], candidates["j"]))]
    picks, kept, dropped = [], {}, 0
    for j, chunk_id, score, key in zip(
        c["j"].tolist(), c["chunk_id"].tolist(), c["score"].tolist(), c["token_key"].tolist()
    ):
        keys = kept.setdefault(j, [])
        if len(keys) >= k:
            continue
        if key in keys:
            dropped += 1
            continue
        picks.append((j, len(keys), chunk_id, score))
        keys.append(key)
    return picks, dropped


def token_key(tokens: np.ndarray) -> int:
    """A 63-bit hash of a chunk's tokens, equal for equal tokens."""
    return (
        int.from_bytes(
            hashlib.blake2b(np.ascontiguousarray(tokens, np.int32).tobytes(), digest_size=8).digest(), "little"
        )
        >> 1
    )


def neighbour_arrays(picks: list[tuple], chunks_per_seq: int, k: int, m: int, pad_id: int):
    """(j, slot, chunk_id, score, value [2m]) picks -> neighbours [L, k, 2m], ids [L, k]
    (-1 = absent), scores [L, k]; absent slots hold pad_id and score 0."""
    tokens = np.full((chunks_per_seq, k, 2 * m), pad_id, dtype=np.int32)
    ids = np.full((chunks_per_seq, k), -1, dtype=np.int64)
    scores = np.zeros((chunks_per_seq, k), dtype=np.float32)
    for j, slot, chunk_id, score, value in picks:
        tokens[j, slot], ids[j, slot], scores[j, slot] = value, chunk_id, score
    return tokens, ids, scores


# --- Beam transforms ------------------------------------------------------------------------


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


@dataclass(frozen=True)
class Retrieval:
    """What `RetrieveNeighbours` needs (small and picklable: it travels with the transforms)."""

    index_paths: tuple  # index.faiss, or its shards in chunk-id order
    depth: int | None  # search depth the index was tuned to (nprobe, efSearch)
    chunk_files: ChunkFileRanges  # the chunk database
    chunks_per_seq: int  # L
    chunk_tokens: int  # m
    neighbours: int  # k
    candidates: int  # hits searched per chunk when deduplicating
    pad_id: int
    dedupe: bool = False
    probes: int = 0  # training chunks sampled for the neighbour-recall check and the depth tuning
    embeddings: str = ""  # the embedding files (a glob): the probes' exact search
    target_recall: float = 0.95  # index.target_recall: what the depth is tuned to
    recall_below_target: str = "deepen"  # deepen | warn | fail (PipelineConfig.recall_below_target)


def _excluded_ranges(keyed):
    """(doc_id, its span and the sequences holding it) -> (seq_id, span) per sequence; a
    document not in the database (a separate training corpus) excludes nothing."""
    _, grouped = keyed
    spans = list(grouped["span"])
    if spans:
        for seq_id in grouped["seq"]:
            yield seq_id, spans[0]


def _loaded_index(holder: shared.Shared, path: str, depth: int | None):
    """The faiss file at `path`, loaded once per process through Beam `Shared` (which keeps the
    last one acquired alive: a process searching shards in turn holds one at a time)."""

    class _Holder:  # Shared needs a weak-referenceable object
        def __init__(self):
            self.index = load_index(path, depth)

    return holder.acquire(_Holder, tag=f"{path}:{depth}")


def batch_queries(grouped, L: int):
    """A joined search batch -> per sequence (seq id order): (sequence, its queries [L, d], its
    documents' chunk-id ranges, merged)."""
    vectors = dict(grouped["embeddings"])
    excluded: dict[int, list] = {}
    for seq_id, span in grouped["excluded"]:
        excluded.setdefault(seq_id, []).append(span)
    for s in sorted(grouped["sequences"], key=lambda s: s.seq_id):
        queries = np.stack([vectors[s.seq_id * L + j] for j in range(L)])  # [L, d]
        yield s, queries, merge_ranges(excluded.get(s.seq_id, []))


def batch_probes(keyed, spec: Retrieval) -> list[Probe]:
    """A joined search batch -> its training chunks in the probe sample's running: the
    `spec.probes` smallest by (key, seq_id, j), keys a hash of the chunk's position."""
    _, grouped = keyed
    L, probes = spec.chunks_per_seq, []
    for s, queries, ranges in batch_queries(grouped, L):
        keys = sample_keys(s.seq_id * L + np.arange(L), PROBE_SALT)
        probes += [Probe(int(key), s.seq_id, j, queries[j], tuple(ranges)) for j, key in enumerate(keys)]
    return sorted(probes, key=lambda p: p[:3])[: spec.probes]


def search_batch(index, grouped, spec: Retrieval):
    """One search batch (sequences, their query embeddings, their excluded chunk-id ranges) ->
    (sequences, CANDIDATE hits with the best `width` per query outside the ranges, seq ids
    whose search went deeper)."""
    L = spec.chunks_per_seq
    width = spec.candidates if spec.dedupe else spec.neighbours
    blocks, sequences, deeper_seqs = [np.zeros(0, CANDIDATE)], [], set()
    for s, queries, ranges in batch_queries(grouped, L):
        sequences.append(s)
        scores, found, deeper = search_excluding(index, queries, width, ranges)  # [L, width]
        if deeper:
            deeper_seqs.add(s.seq_id)
        block = np.zeros(found.size, CANDIDATE)
        block["seq_id"], block["j"] = s.seq_id, np.repeat(np.arange(L), width)
        block["rank"] = np.tile(np.arange(width), L)
        block["chunk_id"], block["score"] = found.ravel(), scores.ravel()
        blocks.append(block[block["chunk_id"] >= 0])  # -1: fewer than `width` reachable
    return sequences, np.concatenate(blocks), deeper_seqs


# --- the search depth, tuned on the probes ----------------------------------------------------


class NeighbourRecallTooLow(RuntimeError):
    """recall_below_target: fail, and the index's search depth misses the target."""


def search_probes(indexes, probes: list[Probe], k: int, depth: int | None) -> np.ndarray:
    """The probes' k neighbour ids [n, k] as the search finds them at `depth`: each probe with
    its own ranges excluded, in every index of `indexes` (an iterable that loads them in turn,
    so one is held at a time), deepening per index as the search does, merged by score."""
    queries, excluded = np.stack([p.query for p in probes]), [p.excluded for p in probes]
    results = []
    for index in indexes:
        if depth is not None:
            set_search_depth(index, depth)
        results.append(search_each_excluding(index, queries, k, excluded))
    return merge_shard_results(results, k)[1]


def tune_retrieval_depth(spec: Retrieval, probes: list[Probe], truth) -> dict:
    """The depth build-shards searches at, from the recall of the probes' neighbours against
    their exact truth, own documents excluded (what the shards will hold): the index's depth,
    then (recall_below_target: deepen or fail) twice that and so on until `target_recall` is
    met or two doublings gain less than PLATEAU_GAIN (`tune_depth`). fail raises when the index's
    depth misses the target, naming the depth that meets it. -> the manifest's search_depth."""
    result = {
        "index_depth": spec.depth,
        "depth": spec.depth,
        "target": spec.target_recall,
        "recall_below_target": spec.recall_below_target,
        "curve": [],
        "plateau": False,
    }
    if truth is None or not probes:
        return result

    first = load_index(spec.index_paths[0])

    def indexes():  # one file is loaded once; shards one at a time, at each depth measured
        yield first
        for path in spec.index_paths[1:]:
            yield load_index(path)

    def recall_at(depth):
        return recall_of(truth, search_probes(indexes(), probes, spec.neighbours, depth))

    depths = search_depth_range(first)
    if depths is None or spec.recall_below_target == "warn":  # exhaustive, or kept as it is
        result["curve"].append({"depth": spec.depth, "recall": recall_at(spec.depth)})
        return result
    start = spec.depth if spec.depth is not None else depths[0]
    curve = result["curve"]
    depth, recall, plateau = tune_depth(
        [start] + [d for d in depths if d > start], recall_at, spec.target_recall, curve
    )
    result.update(depth=depth, plateau=plateau)
    at_index = curve[0]["recall"]
    if spec.recall_below_target == "fail" and at_index < spec.target_recall:
        reached = f"depth {depth} reaches {recall:.3f}" if recall >= spec.target_recall else "no depth reaches it"
        raise NeighbourRecallTooLow(
            f"neighbour recall {at_index:.3f} at the index's search depth {start} is below index.target_recall "
            f"{spec.target_recall} on {len(probes)} sampled training chunks with their own documents excluded; "
            f"{reached} (recall_below_target: fail; 'deepen' searches deeper)"
        )
    return result


def merge_shard_hits(blocks: list[np.ndarray], width: int) -> np.ndarray:
    """The shards' hits of the same queries -> the best `width` per query (seq_id, j) by score,
    ranked as one index ranks them: of exact ties the lowest chunk ids are kept (the first an
    index scans) and listed highest id first (faiss's top-k heap pops them so)."""
    hits = np.concatenate(blocks)
    hits = hits[np.lexsort((hits["chunk_id"], -hits["score"], hits["j"], hits["seq_id"]))]
    query = np.stack([hits["seq_id"], hits["j"]], axis=1)
    first = np.ones(len(hits), bool)
    first[1:] = (query[1:] != query[:-1]).any(axis=1)
    starts = np.flatnonzero(first)
    place = np.arange(len(hits)) - np.repeat(starts, np.diff(np.append(starts, len(hits))))
    hits = hits[place < width]
    hits = hits[np.lexsort((-hits["chunk_id"], -hits["score"], hits["j"], hits["seq_id"]))]
    hits["rank"] = place[place < width]
    return hits


def emit_hits(spec: Retrieval, seq_ids: list[int], hits: np.ndarray, deeper_seqs):
    """What a searched batch sends on: tallies, the count each sequence will receive,
    and the hits (the k neighbours keyed by chunk id, or candidate blocks by chunk file)."""
    unknown = hits["chunk_id"][hits["chunk_id"] >= spec.chunk_files.num_chunks]
    if len(unknown):
        raise ValueError(
            f"the index returned chunk id {unknown[0]}, which is not in the chunk "
            f"database ({spec.chunk_files.num_chunks} chunks): index and chunks disagree"
        )
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


class _Search(beam.DoFn):
    """A search batch of sequences -> per sequence, its queries searched with the chunk-id
    ranges of its own documents skipped inside faiss (the one index file, loaded once per
    process, at the tuned depth: a side input). Emits the k neighbours as picks keyed by chunk
    id, or (deduplicating) the candidates as CANDIDATE blocks keyed by the chunk file holding
    them."""

    _shared_index = shared.Shared()

    def __init__(self, spec: Retrieval):
        self.spec = spec

    def process(self, keyed, tuned: dict):
        _, grouped = keyed
        index = _loaded_index(self._shared_index, self.spec.index_paths[0], tuned["depth"]).index
        sequences, hits, deeper = search_batch(index, grouped, self.spec)
        if sequences:  # none: only the embeddings of chunks left over after the last sequence
            yield from emit_hits(self.spec, [s.seq_id for s in sequences], hits, deeper)


class _SearchShard(beam.DoFn):
    """((shard, group), search batches) -> (batch, (shard, seq ids, its hits, deeper seq ids)):
    each process loads the shard of the group it is given (at the tuned depth), and searches
    every batch of the group with it."""

    _shared_index = shared.Shared()

    def __init__(self, spec: Retrieval):
        self.spec = spec

    def process(self, keyed, tuned: dict):
        (shard, _), batches = keyed
        index = _loaded_index(self._shared_index, self.spec.index_paths[shard], tuned["depth"]).index
        for batch, grouped in batches:
            sequences, hits, deeper = search_batch(index, grouped, self.spec)
            if sequences:
                yield batch, (shard, [s.seq_id for s in sequences], hits, deeper)


def _merge_shards(keyed, spec: Retrieval):
    """(batch, every shard's search of it) -> what one index's search would send on."""
    _, results = keyed
    results = sorted(results, key=lambda r: r[0])
    width = spec.candidates if spec.dedupe else spec.neighbours
    hits = merge_shard_hits([r[2] for r in results], width)
    deeper = set().union(*(r[3] for r in results))
    yield from emit_hits(spec, results[0][1], hits, deeper)


SEARCH_GROUPS_PER_SHARD = 64  # search batches of a shard split over this many groups (parallelism)


class _CandidateTokens(beam.DoFn):
    """(chunk file, candidate blocks in it) -> one CANDIDATE block per sequence, each hit with
    its chunk's token hash, from one read of that file's tokens."""

    def __init__(self, chunk_files: ChunkFileRanges):
        self.chunk_files = chunk_files

    def process(self, keyed):
        number, blocks = keyed
        tokens = self.chunk_files.read(number, ["tokens"])["tokens"]
        hits = np.concatenate(list(blocks))
        local = hits["chunk_id"] - self.chunk_files.starts[number]
        unique, inverse = np.unique(local, return_inverse=True)  # a chunk is hit by many queries
        hits["token_key"] = np.array([token_key(tokens[r]) for r in unique], np.int64)[inverse]
        hits = hits[np.argsort(hits["seq_id"], kind="stable")]
        seq_ids, starts = np.unique(hits["seq_id"], return_index=True)
        yield from zip(seq_ids.tolist(), np.split(hits, starts[1:]))


class _NeighbourTokens(beam.DoFn):
    """(chunk file, kept neighbours in it) -> neighbours keyed by sequence, each with its
    chunk + continuation [2m] as raw int32 bytes (compact through the next shuffle)."""

    def __init__(self, chunk_files: ChunkFileRanges):
        self.chunk_files = chunk_files

    def process(self, keyed):
        number, picks = keyed
        rows = self.chunk_files.read(number, ["tokens", "continuation"])
        values = np.concatenate([rows["tokens"], rows["continuation"]], axis=1).astype(np.int32)
        start = self.chunk_files.starts[number]
        for chunk_id, (seq_id, j, slot, score) in picks:
            yield seq_id, (j, slot, chunk_id, score, values[chunk_id - start].tobytes())


LOST_DATA = "the runner lost data"  # build_shards retries a stage that failed with this, once


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


class _SearchIndex(beam.PTransform):
    """Joined search batches -> the search's outputs (found, SENT, TALLY), at the depth in
    `tuned` (a singleton side input: `tune_retrieval_depth`'s result). One index
    file: each batch searched where it is. Shards: each batch goes to every shard, the batches
    of a shard grouped so a process loads one shard per group, and each batch's hits from all
    shards merged by score (a query's candidates are those one index would find, up to ties
    and the depth each shard deepens to alone)."""

    def __init__(self, spec: Retrieval, tuned):
        super().__init__()
        self.spec, self.tuned = spec, tuned

    def expand(self, batches):
        spec, tuned = self.spec, beam.pvalue.AsSingleton(self.tuned)
        outputs = (SENT, TALLY)
        if len(spec.index_paths) == 1:
            return batches | "SearchBatches" >> beam.ParDo(_Search(spec), tuned).with_outputs(*outputs, main="found")
        shards = len(spec.index_paths)
        return (
            batches
            | "ToEveryShard"
            >> beam.FlatMap(lambda b: [((shard, b[0] % SEARCH_GROUPS_PER_SHARD), b) for shard in range(shards)])
            | "GroupByShard" >> beam.GroupByKey()
            | "SearchShards" >> beam.ParDo(_SearchShard(spec), tuned)
            | "GroupShardHits" >> beam.GroupByKey()
            | "MergeShards" >> beam.FlatMap(_merge_shards, spec).with_outputs(*outputs, main="found")
        )


@dataclass
class Retrieved:
    """What `RetrieveNeighbours` gives: PCollections of the rows and of what checks them."""

    rows: beam.PCollection  # ShardRows
    probes: beam.PCollection  # one sorted list of Probes: the training chunks sampled
    truth: beam.PCollection  # one (scores, ids) [probes, truth_depth]: their exact neighbours, or None
    search_depth: beam.PCollection  # one dict: `tune_retrieval_depth`'s result
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
        tallies = [searched[TALLY]]
        if spec.dedupe:
            picked = (
                {
                    "candidates": (
                        searched.found
                        | "GroupHitsByChunkFile" >> beam.GroupByKey()
                        | "CandidateTokens" >> beam.ParDo(_CandidateTokens(files))
                    ),
                    "sent": searched[SENT],
                }
                | "JoinCandidates" >> beam.CoGroupByKey()
                | "DropDuplicateTokens"
                >> beam.FlatMap(_select_distinct, spec.neighbours).with_outputs(SENT, TALLY, main="picks")
            )
            picks, sent = picked.picks, picked[SENT]
            tallies.append(picked[TALLY])
        else:
            picks, sent = searched.found, searched[SENT]
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


def rows_to_ipc(rows: list[ShardRow], pad_id: int) -> bytes:
    table = shard_table(
        np.array([r.seq_id for r in rows], dtype=np.int64),
        np.stack([r.tokens for r in rows]),
        np.stack([r.neighbours for r in rows]),
        np.stack([r.neighbour_ids for r in rows]),
        np.stack([r.neighbour_scores for r in rows]),
        [r.doc_ids for r in rows],
        pad_id=pad_id,
    )
    return shard_ipc_bytes(table)


class WriteShards(beam.PTransform):
    """ShardRows -> `shard-NNNNN.arrow`, shard NNNNN holding seq ids NNNNN·rows … (sorted)."""

    def __init__(self, directory: str, shard_rows: int, pad_id: int):
        super().__init__()
        self.directory, self.shard_rows, self.pad_id = directory, shard_rows, pad_id

    def expand(self, rows):
        pad_id = self.pad_id
        return rows | "WriteShardFiles" >> WriteGroupedFiles(
            self.directory,
            self.directory,
            "shard",
            "arrow",
            key=lambda r: r.seq_id,
            rows_per_file=self.shard_rows,
            to_bytes=lambda rs: rows_to_ipc(rs, pad_id),
            facts=lambda rs: {FILLED: sum(int((r.neighbour_ids >= 0).sum()) for r in rs)},
        )
