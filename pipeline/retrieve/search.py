"""The search of build-shards without Beam: what it is given (`Retrieval`, `Routing`), query
batches, the search with each sequence's own documents excluded inside faiss, the blocks its
hits travel in, and picking distinct neighbours. The index files loaded, slices searched in
turn and the search depth tuned on sampled training chunks are in `depth`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeline.chunks.chunk_files import ChunkFileRanges
from pipeline.chunks.committed import CommittedChunkFiles, CommittedFiles
from pipeline.chunks.deleted import DeletedFiles, DeletedRanges
from pipeline.common import fileio
from pipeline.common.arrays import groups, merge_ranges, narrow_tokens, positions_of, widened_tokens
from pipeline.common.names import file_name
from pipeline.common.sampling import sample_keys
from pipeline.index.files import LIST_OWNERS_FILE, QUANTIZER_FILE
from pipeline.index.search import search_each_excluding
from pipeline.index.ties import ranked
from pipeline.retrieve.recall import Probe
from pipeline.shards.rows import SequenceBatch
from schemas.arrow import tensor_column_to_numpy

SEQUENCES_PER_SEARCH = 64  # fixed search batches: faiss scores depend on batch shape
# With dedupe_neighbours, search hits travel in numpy blocks, one per (search batch, chunk
# file), not one tuple each; token_key is filled from the hit's chunk file.
CANDIDATE = np.dtype(
    [("seq_id", "<i8"), ("j", "<i4"), ("rank", "<i4"), ("chunk_id", "<i8"), ("score", "<f4"), ("token_key", "<i8")]
)
# The neighbours kept, in numpy blocks: slot of chunk j of sequence seq_id.
PICK = np.dtype([("seq_id", "<i8"), ("j", "<i4"), ("slot", "<i4"), ("chunk_id", "<i8"), ("score", "<f4")])

PROBE_SALT = 3


def search_batch_of(seq_id):
    """The search batch a sequence (or an array of them) belongs to: its queries are searched
    with those of the batch (its row is assembled with those of its shard)."""
    return seq_id // SEQUENCES_PER_SEARCH


def picks_of(hits: np.ndarray) -> np.ndarray:
    """CANDIDATE hits that are the neighbours themselves (no deduplication: rank = slot) -> PICK rows."""
    picks = np.zeros(len(hits), PICK)
    for field in ("seq_id", "j", "chunk_id", "score"):
        picks[field] = hits[field]
    picks["slot"] = hits["rank"]
    return picks


def select_distinct(candidates: np.ndarray, k: int) -> tuple[np.ndarray, int]:
    """Per chunk (seq_id, j), the k best-ranked CANDIDATE rows whose tokens differ from those
    already kept for it: (PICK rows, candidates dropped as duplicates)."""
    c = candidates[np.lexsort((candidates["rank"], candidates["j"], candidates["seq_id"]))]
    kept: dict[tuple[int, int], list[int]] = {}
    rows: list[int] = []
    slots: list[int] = []
    dropped = 0
    for row, (seq_id, j, key) in enumerate(zip(c["seq_id"].tolist(), c["j"].tolist(), c["token_key"].tolist())):
        keys = kept.setdefault((seq_id, j), [])
        if len(keys) >= k:
            continue
        if key in keys:
            dropped += 1
            continue
        rows.append(row)
        slots.append(len(keys))
        keys.append(key)
    picks = picks_of(c[rows])
    picks["slot"] = slots
    return picks, dropped


@dataclass(frozen=True)
class SentCounts:
    """What a search batch sent through a shuffle, per sequence (its seq ids, in order): the
    elements each must receive, checked when they arrive."""

    seq_ids: np.ndarray  # int64
    counts: np.ndarray  # int64

    @classmethod
    def of(cls, seq_ids: list[int], rows: np.ndarray) -> SentCounts:
        """For these sequences, how many of `rows` (CANDIDATE or PICK) each one owns."""
        ids = np.asarray(seq_ids, np.int64)
        return cls(ids, received_by(ids, rows))

    def in_shards(self, shard_rows: int):
        """-> (shard, the counts of its sequences) per shard these fall in."""
        for shard, at in groups(self.seq_ids // shard_rows):
            yield shard, SentCounts(self.seq_ids[at], self.counts[at])


def received_by(seq_ids: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """How many of `rows` (CANDIDATE or PICK) belong to each of `seq_ids` (sorted)."""
    at, owned = positions_of(seq_ids, rows["seq_id"])
    return np.bincount(at[owned], minlength=len(seq_ids)).astype(np.int64)


# A block of hits pickles as its record type's name and its raw bytes: numpy pickles a record
# array's dtype description with it (~330 B), and blocks per (search batch, chunk file) hold a
# hit or two once there are many chunk files (measured: benchmarks/scale_rehearsal.py).
RECORD_TYPES = {"candidate": CANDIDATE, "pick": PICK}


@dataclass(frozen=True)
class Records:
    """CANDIDATE or PICK rows as one shuffled element."""

    rows: np.ndarray

    def __reduce__(self):
        name = next(name for name, dtype in RECORD_TYPES.items() if dtype == self.rows.dtype)
        return _records, (name, self.rows.tobytes())


def _records(name: str, data: bytes) -> Records:
    return Records(np.frombuffer(data, RECORD_TYPES[name]).copy())


@dataclass(frozen=True)
class NeighbourBlock:
    """Kept neighbours with what their slots hold."""

    picks: np.ndarray  # PICK [n]
    values: np.ndarray  # int32 [n, 2m]: each chunk's tokens + its continuation

    def in_shards(self, shard_rows: int):
        """-> (shard, the block of its sequences' neighbours) per shard these fall in."""
        for shard, at in groups(self.picks["seq_id"] // shard_rows):
            yield shard, NeighbourBlock(self.picks[at], self.values[at])

    def __reduce__(self):  # raw bytes, as Records; the tokens in 2 bytes each where they fit
        return _neighbour_block, (self.picks.tobytes(), *narrow_tokens(self.values), self.values.shape[1])


def _neighbour_block(picks: bytes, dtype: str, values: bytes, width: int) -> NeighbourBlock:
    return NeighbourBlock(np.frombuffer(picks, PICK).copy(), widened_tokens(dtype, values).reshape(-1, width))


@dataclass(frozen=True)
class Routing:
    """An index in slices by inverted lists (slice-NNNNN.faiss, 0 … slices-1, beside the files
    that route each query to the slices owning its probed lists); named by its directory, so
    what travels with the steps does not grow with the slices."""

    directory: str  # the faiss directory
    slices: int
    nlist: int  # inverted lists: the deepest a query is searched

    @property
    def quantizer(self) -> str:
        return fileio.join(self.directory, QUANTIZER_FILE)

    @property
    def owners(self) -> str:
        return fileio.join(self.directory, LIST_OWNERS_FILE)

    def slice_path(self, number: int) -> str:
        return fileio.join(self.directory, file_name("slice", number, "faiss"))


@dataclass(frozen=True, kw_only=True)
class Retrieval:
    """What `RetrieveNeighbours` needs (small and picklable: it travels with the transforms)."""

    index_path: str | None  # index.faiss; None for an index in slices (`routing`)
    depth: int | None  # search depth the index was tuned to (nprobe, efSearch)
    chunk_files: ChunkFileRanges | CommittedChunkFiles  # the chunk database
    chunks_per_seq: int  # L
    chunk_tokens: int  # m
    neighbours: int  # k
    candidates: int  # hits searched per chunk when deduplicating
    pad_id: int
    dedupe: bool = False
    probes: int = 0  # training chunks sampled for the neighbour-recall check and the depth tuning
    embeddings: str | CommittedFiles = ""  # the embedding files (a glob, or as listed): the probes' exact search
    target_recall: float = 0.95  # index.target_recall: what the depth is tuned to
    recall_below_target: str = "deepen"  # deepen | warn | fail (PipelineConfig.recall_below_target)
    routing: Routing | None = None  # an index in slices by inverted lists: how queries reach them
    deleted: DeletedFiles | None = None  # documents deleted from the index: not in the probes' exact search
    # the training chunks are the database's (training_corpus: same): sequences carry each
    # chunk's first token only (`TrainingChunks.heads`), the rows' assembly reads the rest
    tokens_from_chunk_files: bool = False

    def __post_init__(self):
        if (self.index_path is None) == (self.routing is None):
            raise ValueError("Retrieval searches one index file (index_path) or slices by lists (routing), one of them")


LOST_DATA = "the runner lost data"  # build_shards retries a stage that failed with this, once


def batch_documents(keyed):
    """(search batch, its sequences) -> (doc_id, batch) for each document they hold."""
    batch, sequences = keyed
    for doc_id in sorted({d for s in sequences.sequences for d in s.doc_ids}):
        yield doc_id, batch


def excluded_ranges(keyed):
    """(doc_id, its span and the search batches holding it) -> (batch, (doc_id, span)) per
    batch, span None for a document not in the database (a separate training corpus: it
    excludes nothing), so every sequence can check that each of its documents answered."""
    doc_id, grouped = keyed
    spans = list(grouped["span"])
    for batch in set(grouped["batch"]):  # a batch's sequences may come in more than one element
        yield batch, (doc_id, spans[0] if spans else None)


@dataclass(frozen=True)
class QueryBlock:
    """Query embeddings of training chunks, any ids in any order: what the search reads, in
    blocks (a file's rows, or a group the embed stage encoded) rather than an element per chunk."""

    chunk_ids: np.ndarray  # int64 [n]
    vectors: np.ndarray  # [n, d]

    @classmethod
    def of_table(cls, table, deleted: DeletedRanges | None = None) -> QueryBlock:
        """A record batch of the embedding files, the `deleted` documents' chunks left out."""
        block = cls(table["chunk_id"].to_numpy(), tensor_column_to_numpy(table["embedding"]))
        if deleted is None or not len(deleted):
            return block
        kept = ~deleted.contains(block.chunk_ids)
        return cls(block.chunk_ids[kept], block.vectors[kept])

    def by_search_batch(self, chunks_per_seq: int):
        """-> (search batch, the block of its rows) for each batch these rows' sequences fall in."""
        for batch, rows in groups(search_batch_of(self.chunk_ids // chunks_per_seq)):
            yield batch, QueryBlock(self.chunk_ids[rows], self.vectors[rows])


@dataclass(frozen=True)
class SearchedChunks:
    """Which chunks of some sequences their search batch searches (a refresh's: the chunks that
    lost a stored neighbour); a sequence without one has all its chunks searched."""

    seq_ids: np.ndarray  # int64 [s], ascending
    chunks: np.ndarray  # bool [s, L]

    def in_shards(self, shard_rows: int):
        """-> (shard, the entries of its sequences) per shard these fall in."""
        for shard, at in groups(self.seq_ids // shard_rows):
            yield shard, SearchedChunks(self.seq_ids[at], self.chunks[at])


def searched_rows(grouped, seq_ids: np.ndarray, L: int) -> np.ndarray:
    """The query rows a joined search batch searches (row r: chunk r % L of sequence
    `seq_ids[r // L]`, ascending): all of them, but where its "searched_chunks"
    (SearchedChunks) narrow a sequence to some of its chunks."""
    searched = np.ones((len(seq_ids), L), bool)
    for part in grouped.get("searched_chunks", ()):
        at, present = positions_of(seq_ids, part.seq_ids)
        searched[at[present]] = part.chunks[present]
    return np.flatnonzero(searched.ravel())


def batch_ranges(grouped):
    """A joined search batch -> per sequence (seq id order): (sequence, its documents' chunk-id
    ranges, merged). A sequence whose documents did not all answer (a lost range would let its
    own chunks through as neighbours) fails the job: nothing is committed."""
    spans: dict[int, list] = {}
    for doc_id, span in grouped["excluded"]:
        spans.setdefault(doc_id, []).append(span)
    for s in SequenceBatch.merged(grouped["sequences"]):
        answered = [spans[d][0] for d in s.doc_ids if len(spans.get(d, ())) == 1]
        if len(answered) != len(s.doc_ids):
            raise RuntimeError(
                f"sequence {s.seq_id}: {len(answered)} of its {len(s.doc_ids)} documents' chunk-id ranges "
                f"arrived: {LOST_DATA}; nothing is committed"
            )
        yield s, merge_ranges([span for span in answered if span is not None])


def batch_queries(grouped, L: int):
    """A joined search batch -> per sequence (seq id order): (sequence, its queries [L, d], its
    documents' chunk-id ranges, merged: `batch_ranges`). A sequence whose chunks' embeddings did
    not all arrive fails the job: nothing is committed."""
    blocks = list(grouped["embeddings"])
    ids = np.concatenate([b.chunk_ids for b in blocks]) if blocks else np.zeros(0, np.int64)
    order = np.argsort(ids, kind="stable")
    ids = ids[order]
    vectors = None
    for s, ranges in batch_ranges(grouped):
        wanted = s.seq_id * L + np.arange(L)
        at, present = positions_of(ids, wanted)
        if not present.all():
            raise RuntimeError(
                f"sequence {s.seq_id}: the embeddings of its chunks {wanted[0]}..{wanted[-1]} did not all arrive: "
                f"{LOST_DATA}; nothing is committed"
            )
        if vectors is None:  # the batch's vectors in id order, once it has a sequence to search
            vectors = np.concatenate([b.vectors for b in blocks])[order]
        yield s, vectors[at], ranges


def batch_probes(keyed, spec: Retrieval) -> list[Probe]:
    """A search batch joined with its documents' ranges -> its training chunks in the probe
    sample's running: the `spec.probes` smallest by (key, seq_id, j), keys a hash of the chunk's
    position. Chosen by key alone: their queries are read once the sample is known
    (`recall.ProbeQueries`), not every query of the batch."""
    _, grouped = keyed
    L, probes = spec.chunks_per_seq, []
    for s, ranges in batch_ranges(grouped):
        keys = sample_keys(s.seq_id * L + np.arange(L), PROBE_SALT)
        probes += [Probe(int(key), s.seq_id, j, None, tuple(ranges)) for j, key in enumerate(keys)]
    return sorted(probes, key=lambda p: p[:3])[: spec.probes]


def search_batch(index, grouped, spec: Retrieval):
    """One search batch (sequences, their query embeddings, their excluded chunk-id ranges) ->
    (sequences, queries searched, CANDIDATE hits with the best `width` per query outside the
    ranges, queries whose search went deeper, queries searched again alone): one batched search
    for the queries it searches (`searched_rows`; `search_each_excluding`)."""
    L = spec.chunks_per_seq
    width = spec.candidates if spec.dedupe else spec.neighbours
    batch = list(batch_queries(grouped, L))
    if not batch:
        return [], 0, np.zeros(0, CANDIDATE), 0, 0
    sequences = [s for s, _, _ in batch]
    seq_ids = np.array([s.seq_id for s in sequences], np.int64)
    queries = np.concatenate([queries for _, queries, _ in batch])  # rows: sequence after sequence, L each
    excluded = [r for _, _, r in batch for _ in range(L)]
    rows = searched_rows(grouped, seq_ids, L)
    found = search_each_excluding(index, queries[rows], width, [excluded[r] for r in rows.tolist()])
    scores = np.full((len(queries), width), -np.inf, np.float32)
    ids = np.full((len(queries), width), -1, np.int64)  # a row not searched has no hits
    scores[rows], ids[rows] = found.scores, found.ids
    hits = candidate_rows(seq_ids, scores, ids, L)
    return sequences, len(rows), hits, int(found.deeper.sum()), int(found.searched_alone.sum())


def candidate_rows(seq_ids: np.ndarray, scores: np.ndarray, ids: np.ndarray, chunks_per_seq: int) -> np.ndarray:
    """Search results [r, width] of query rows r (row r is chunk r % L of the sequence
    `seq_ids[r // L]`) -> CANDIDATE records in the one order (`ranked`), empty slots left out."""
    scores, ids = ranked(scores, ids)
    rows, width = ids.shape
    block = np.zeros(ids.size, CANDIDATE)
    row = np.repeat(np.arange(rows), width)
    block["seq_id"], block["j"] = seq_ids[row // chunks_per_seq], row % chunks_per_seq
    block["rank"] = np.tile(np.arange(width), rows)
    block["chunk_id"], block["score"] = ids.ravel(), scores.ravel()
    return block[block["chunk_id"] >= 0]  # -1: fewer than `width` reachable


def check_in_database(hits: np.ndarray, num_chunks: int) -> None:
    """CANDIDATE hits whose chunk ids the chunk database holds, or an error naming one that is not."""
    unknown = hits["chunk_id"][hits["chunk_id"] >= num_chunks]
    if len(unknown):
        raise ValueError(
            f"the index returned chunk id {unknown[0]}, which is not in the chunk "
            f"database ({num_chunks} chunks): index and chunks disagree"
        )
