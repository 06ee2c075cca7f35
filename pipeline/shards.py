"""Pack training sequences, retrieve their neighbours, join neighbour tokens, write shards.

Everything moves through Beam shuffles keyed by ids: sequences meet their query embeddings by
search batch; search hits, and later the kept neighbours, are shuffled by the chunk file that
holds their chunk id and look up their document (or tokens) in one read of that file; and
neighbours meet their sequence by sequence id. No process holds the chunk database, and
nothing shuffles it: only the hits and picks move, so the work grows with the training
sequences, not with the database.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import apache_beam as beam
import numpy as np
from apache_beam.metrics import Metrics
from apache_beam.utils import shared

from pipeline.chunkdb import ChunkFileRanges
from pipeline.chunking import Chunk
from pipeline.corpus import METRICS_NAMESPACE
from pipeline.index import load_index
from pipeline.writers import WriteGroupedFiles, arrow_ipc_bytes
from schemas.arrow import shard_table

SENT = "sent"  # tagged output: (seq_id, elements it sent through the next shuffle)
SEQUENCES_PER_SEARCH = 64  # fixed search batches: faiss scores depend on batch shape


@dataclass(frozen=True)
class Sequence:
    seq_id: int
    tokens: np.ndarray      # int32 [n + 1]: n input tokens and the next-token target
    doc_ids: tuple          # sorted ids of every document whose tokens it holds


# Search hits travel in numpy blocks, one per (search batch, chunk file), not one tuple each.
# doc_id and token_key are filled from the hit's chunk file (token_key only when deduplicating).
CANDIDATE = np.dtype([("seq_id", "<i8"), ("j", "<i4"), ("rank", "<i4"), ("chunk_id", "<i8"),
                      ("score", "<f4"), ("doc_id", "<i8"), ("token_key", "<i8")])


@dataclass(frozen=True)
class ShardRow:
    seq_id: int
    tokens: np.ndarray           # [n + 1]
    neighbours: np.ndarray       # [n/m, k, 2m]
    neighbour_ids: np.ndarray    # [n/m, k]
    neighbour_scores: np.ndarray  # [n/m, k]
    doc_ids: tuple


# --- pure functions -------------------------------------------------------------------------

def pack_sequence(seq_id: int, chunks: list[Chunk], next_token: int | None,
                  next_doc: int | None, pad_id: int) -> Sequence:
    """L consecutive chunks (sorted by id) + the first token of the chunk after them."""
    target = pad_id if next_token is None else next_token
    tokens = np.concatenate([c.tokens for c in chunks] + [np.array([target], np.int32)])
    docs = {c.doc_id for c in chunks} | ({next_doc} if next_doc is not None else set())
    return Sequence(seq_id, tokens.astype(np.int32), tuple(sorted(docs)))


def select_neighbours(candidates: np.ndarray, exclude_docs, k: int,
                      dedupe: bool = False) -> tuple[list[tuple], dict[str, int]]:
    """Per chunk j, the k best-ranked CANDIDATE rows from documents outside `exclude_docs`
    (and, with `dedupe`, whose tokens differ from those already kept for j):
    ([(j, slot, chunk_id, score)], candidates dropped by reason)."""
    c = candidates[np.lexsort((candidates["rank"], candidates["j"]))]
    own = np.isin(c["doc_id"], np.asarray(list(exclude_docs), np.int64))
    picks, kept = [], {}
    dropped = {"own_document": 0, "duplicate_tokens": 0}
    for j, chunk_id, score, key, excluded in zip(c["j"].tolist(), c["chunk_id"].tolist(), c["score"].tolist(),
                                                 c["token_key"].tolist(), own.tolist()):
        keys = kept.setdefault(j, [])
        if len(keys) >= k:
            continue
        if excluded:
            dropped["own_document"] += 1
            continue
        if dedupe and key in keys:
            dropped["duplicate_tokens"] += 1
            continue
        picks.append((j, len(keys), chunk_id, score))
        keys.append(key)
    return picks, dropped


def token_key(tokens: np.ndarray) -> int:
    """A 63-bit hash of a chunk's tokens, equal for equal tokens."""
    return int.from_bytes(hashlib.blake2b(np.ascontiguousarray(tokens, np.int32).tobytes(),
                                          digest_size=8).digest(), "little") >> 1


OVERLAP_BUCKETS = (0.0, 0.125, 0.25, 0.5, 0.75, 1.0)  # RETRO's r(C) thresholds


def chunk_overlap(chunks: np.ndarray, neighbours: np.ndarray, pad_id: int) -> np.ndarray:
    """RETRO's leakage measure r(C) per chunk: the longest run of tokens the chunk shares
    with any of its neighbours (chunk + continuation), divided by m. Padding never matches.
    chunks [L, m], neighbours [L, k, 2m] -> float64 [L] in [0, 1]."""
    m = chunks.shape[1]
    equal = ((chunks[:, None, :, None] == neighbours[:, :, None, :])
             & (chunks != pad_id)[:, None, :, None])                     # [L, k, m, 2m]
    run = np.zeros(neighbours.shape, np.int32)     # [L, k, 2m]: run ending at (i, col)
    longest = np.zeros(len(chunks), np.int32)
    for i in range(m):
        extended = np.zeros_like(run)
        extended[..., 1:] = run[..., :-1] + 1     # diagonal step (i-1, col-1) -> (i, col)
        extended[..., 0] = 1
        run = np.where(equal[:, :, i, :], extended, 0)
        longest = np.maximum(longest, run.max(axis=(1, 2), initial=0))
    return longest / m


def overlap_bucket(ratio: float) -> str:
    """The histogram key of r(C): the smallest threshold at or above it."""
    return str(next(t for t in OVERLAP_BUCKETS if ratio <= t))


OVERLAP_COUNTER = "overlap_r_le_"


def overlap_histogram(counters: dict[str, int]) -> dict[str, int]:
    """Take the overlap counters out of a job's counters: {threshold: chunks}, every threshold
    present (chunks whose r(C) is ≤ it and above the one before)."""
    return {str(t): counters.pop(f"{OVERLAP_COUNTER}{t}", 0) for t in OVERLAP_BUCKETS}


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
        Metrics.counter(METRICS_NAMESPACE, "chunks_not_in_a_sequence").inc(len(chunks))
        return
    next_token, next_doc = following[0] if following else (None, None)
    Metrics.counter(METRICS_NAMESPACE, "sequences").inc()
    yield pack_sequence(seq_id, chunks, next_token, next_doc, pad_id)


class PackSequences(beam.PTransform):
    """Chunk rows -> Sequences of `chunks_per_seq` consecutive chunks (ids seq·L … seq·L+L-1)."""

    def __init__(self, chunks_per_seq: int, pad_id: int):
        super().__init__()
        self.chunks_per_seq, self.pad_id = chunks_per_seq, pad_id

    def expand(self, chunks):
        return (chunks
                | "KeyBySequence" >> beam.FlatMap(_sequence_parts, self.chunks_per_seq)
                | "GroupBySequence" >> beam.GroupByKey()
                | "Assemble" >> beam.FlatMap(_assemble, self.chunks_per_seq, self.pad_id))


class _Search(beam.DoFn):
    """A search batch of sequences -> its hits as CANDIDATE blocks keyed by the chunk file
    holding them (index loaded once per process through Beam `Shared`)."""

    _shared_index = shared.Shared()

    def __init__(self, index_path: str, nprobe, chunk_files: ChunkFileRanges, chunks_per_seq: int,
                 candidates: int):
        self.index_path, self.nprobe, self.chunk_files = index_path, nprobe, chunk_files
        self.chunks_per_seq, self.candidates = chunks_per_seq, candidates

    def setup(self):
        path, nprobe = self.index_path, self.nprobe

        class _Holder:  # Shared needs a weak-referenceable object
            def __init__(self):
                self.index = load_index(path, nprobe)

        self.index = self._shared_index.acquire(_Holder, tag=f"{path}:{nprobe}").index

    def process(self, keyed):
        _, grouped = keyed
        sequences = sorted(grouped["sequences"], key=lambda s: s.seq_id)
        if not sequences:  # only the embeddings of chunks left over after the last sequence
            return
        vectors = dict(grouped["embeddings"])
        L, C = self.chunks_per_seq, self.candidates
        queries = np.stack([vectors[s.seq_id * L + j] for s in sequences for j in range(L)])
        scores, found = self.index.search(queries.astype(np.float32), C)   # [Q, C], Q = S·L
        Metrics.counter(METRICS_NAMESPACE, "queries").inc(len(queries))
        hits = np.zeros(found.size, CANDIDATE)
        hits["seq_id"] = np.repeat([s.seq_id for s in sequences], L * C)
        hits["j"] = np.tile(np.repeat(np.arange(L), C), len(sequences))
        hits["rank"] = np.tile(np.arange(C), len(queries))
        hits["chunk_id"], hits["score"] = found.ravel(), scores.ravel()
        hits = hits[hits["chunk_id"] >= 0]  # -1: fewer than C vectors reachable
        unknown = hits["chunk_id"][hits["chunk_id"] >= self.chunk_files.num_chunks]
        if len(unknown):
            raise ValueError(f"the index returned chunk id {unknown[0]}, which is not in the chunk "
                             f"database ({self.chunk_files.num_chunks} chunks): index and chunks disagree")
        seq_ids, counts = np.unique(hits["seq_id"], return_counts=True)
        sent = dict(zip(seq_ids.tolist(), counts.tolist()))
        for s in sequences:  # what each sequence must receive back, checked in _select
            yield beam.pvalue.TaggedOutput(SENT, (s.seq_id, sent.get(s.seq_id, 0)))
        files = self.chunk_files.files_of(hits["chunk_id"])
        for number in np.unique(files):
            yield int(number), hits[files == number]


class _CandidateDocs(beam.DoFn):
    """(chunk file, hit blocks in it) -> one CANDIDATE block per sequence, each hit with its
    chunk's document (and token hash when deduplicating), from one read of that file."""

    def __init__(self, chunk_files: ChunkFileRanges, dedupe: bool):
        self.chunk_files, self.dedupe = chunk_files, dedupe

    def process(self, keyed):
        number, blocks = keyed
        rows = self.chunk_files.read(number, ["doc_id", "tokens"] if self.dedupe else ["doc_id"])
        hits = np.concatenate(list(blocks))
        local = hits["chunk_id"] - self.chunk_files.starts[number]
        hits["doc_id"] = rows["doc_id"][local]
        if self.dedupe:  # a chunk is hit by many queries: hash each once
            unique, inverse = np.unique(local, return_inverse=True)
            hits["token_key"] = np.array([token_key(rows["tokens"][r]) for r in unique], np.int64)[inverse]
        hits = hits[np.argsort(hits["seq_id"], kind="stable")]
        seq_ids, starts = np.unique(hits["seq_id"], return_index=True)
        for seq_id, block in zip(seq_ids.tolist(), np.split(hits, starts[1:])):
            yield seq_id, block


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


def _arrived(seq_id: int, what: str, received: int, sent: list[int]) -> None:
    """Each sequence counts what it sent through a shuffle; fail loudly if any went missing
    rather than write a shard with silently padded neighbours."""
    if len(sent) != 1 or received != sent[0]:
        raise RuntimeError(f"sequence {seq_id}: {received} {what} arrived, {sent or 'no count'} were "
                           "sent: the runner lost data; nothing is committed, run the stage again")


def _select(keyed, k: int, dedupe: bool):
    seq_id, grouped = keyed
    (sequence,) = grouped["sequence"]
    blocks = list(grouped["candidates"])  # none when the index reached no chunk for it
    candidates = np.concatenate(blocks) if blocks else np.zeros(0, CANDIDATE)
    _arrived(seq_id, "search hits", len(candidates), list(grouped["sent"]))
    picks, dropped = select_neighbours(candidates, sequence.doc_ids, k, dedupe)
    for reason, count in dropped.items():
        Metrics.counter(METRICS_NAMESPACE, f"candidates_dropped_{reason}").inc(count)
    yield beam.pvalue.TaggedOutput(SENT, (seq_id, len(picks)))
    for j, slot, chunk_id, score in picks:
        yield chunk_id, (seq_id, j, slot, score)


def _to_row(keyed, chunks_per_seq: int, k: int, m: int, pad_id: int):
    _, grouped = keyed
    (sequence,) = grouped["sequence"]
    picks = [(j, slot, chunk_id, score, np.frombuffer(value, np.int32))
             for j, slot, chunk_id, score, value in grouped["picks"]]
    _arrived(sequence.seq_id, "neighbours", len(picks), list(grouped["sent"]))
    neighbours, ids, scores = neighbour_arrays(picks, chunks_per_seq, k, m, pad_id)
    Metrics.counter(METRICS_NAMESPACE, "neighbour_slots_padded").inc(chunks_per_seq * k - len(picks))
    chunks = sequence.tokens[:chunks_per_seq * m].reshape(chunks_per_seq, m)
    for ratio in chunk_overlap(chunks, neighbours, pad_id):
        Metrics.counter(METRICS_NAMESPACE, OVERLAP_COUNTER + overlap_bucket(ratio)).inc()
    yield ShardRow(sequence.seq_id, sequence.tokens, neighbours, ids, scores, sequence.doc_ids)


class RetrieveNeighbours(beam.PTransform):
    """(sequences, query embeddings) -> ShardRows with k neighbours per chunk from the chunk
    database `chunk_files`, none from a document the sequence holds.

    Candidates travel as small tuples: they meet their chunk's document in its chunk file,
    are filtered per sequence, and only the k kept per chunk fetch their tokens.
    """

    def __init__(self, index_path: str, nprobe, chunk_files: ChunkFileRanges, chunks_per_seq: int,
                 chunk_tokens: int, neighbours: int, candidates: int, pad_id: int,
                 dedupe: bool = False, min_ram: str | None = None):
        super().__init__()
        if min_ram:  # every worker holds the index
            self.with_resource_hints(min_ram=min_ram)
        self.index_path, self.nprobe, self.chunk_files = index_path, nprobe, chunk_files
        self.L, self.m, self.k = chunks_per_seq, chunk_tokens, neighbours
        self.candidates, self.pad_id, self.dedupe = candidates, pad_id, dedupe

    def expand(self, inputs):
        sequences, embeddings = inputs
        L, batch, files = self.L, SEQUENCES_PER_SEARCH, self.chunk_files
        by_seq = sequences | "SeqById" >> beam.Map(lambda s: (s.seq_id, s))
        hits = (
            {"sequences": sequences | "SeqBySearchBatch" >> beam.Map(
                lambda s: (s.seq_id // batch, s)),
             "embeddings": embeddings | "QueryBySearchBatch" >> beam.Map(
                lambda e: (e[0] // L // batch, e))}
            | "JoinQueries" >> beam.CoGroupByKey()
            | "Search" >> beam.ParDo(_Search(self.index_path, self.nprobe, files, L, self.candidates))
            .with_outputs(SENT, main="hits"))
        candidates = (
            hits.hits
            | "GroupHitsByChunkFile" >> beam.GroupByKey()
            | "CandidateDocs" >> beam.ParDo(_CandidateDocs(files, self.dedupe)))
        picks = (
            {"sequence": by_seq, "candidates": candidates, "sent": hits[SENT]}
            | "JoinCandidates" >> beam.CoGroupByKey()
            | "DropOwnDocuments" >> beam.FlatMap(_select, self.k, self.dedupe).with_outputs(SENT, main="picks"))
        neighbours = (
            picks.picks
            | "PicksByChunkFile" >> beam.Map(lambda pick: (files.file_of(pick[0]), pick))
            | "GroupPicksByChunkFile" >> beam.GroupByKey()
            | "NeighbourTokens" >> beam.ParDo(_NeighbourTokens(files)))
        return (
            {"sequence": by_seq, "picks": neighbours, "sent": picks[SENT]}
            | "JoinNeighbours" >> beam.CoGroupByKey()
            | "AssembleRows" >> beam.FlatMap(_to_row, L, self.k, self.m, self.pad_id))


def rows_to_ipc(rows: list[ShardRow], pad_id: int) -> bytes:
    table = shard_table(
        np.array([r.seq_id for r in rows], dtype=np.int64),
        np.stack([r.tokens for r in rows]),
        np.stack([r.neighbours for r in rows]),
        np.stack([r.neighbour_ids for r in rows]),
        np.stack([r.neighbour_scores for r in rows]),
        [r.doc_ids for r in rows], pad_id=pad_id)
    return arrow_ipc_bytes(table)


class WriteShards(beam.PTransform):
    """ShardRows -> `shard-NNNNN.arrow`, shard NNNNN holding seq ids NNNNN·rows … (sorted)."""

    def __init__(self, directory: str, shard_rows: int, pad_id: int):
        super().__init__()
        self.directory, self.shard_rows, self.pad_id = directory, shard_rows, pad_id

    def expand(self, rows):
        pad_id = self.pad_id
        return rows | "WriteShardFiles" >> WriteGroupedFiles(
            self.directory, self.directory, "shard", "arrow", key=lambda r: r.seq_id,
            rows_per_file=self.shard_rows, to_bytes=lambda rs: rows_to_ipc(rs, pad_id))
