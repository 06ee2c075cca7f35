"""The rows of the build-shards stage and RETRO's chunk-overlap audit, without Beam.

`Sequence` (a packed training sequence) and `ShardRow` (a sequence with its neighbours: one
row of a shard) are what the retrieve and shards transforms pass on; the audit measures r(C) for each
chunk of a row (docs/design.md §4, `overlap`). `inspect`, `report` and the tests' shard
fixtures need these without a Beam job, so this module imports numpy and the shard spec only
(no Beam, faiss or torch).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from schemas.arrow import shard_column, shard_sources
from schemas.shard_columns import ShardDims, array_columns


@dataclass(frozen=True)
class Sequence:
    seq_id: int
    # int32 [n + 1]: n input tokens and the next-token target; packed from `TrainingChunks.heads`,
    # [L + 1] (each chunk's first token and the target) until the rows' assembly reads the rest
    tokens: np.ndarray
    doc_ids: tuple  # sorted ids of every document whose tokens it holds
    source: int = 0  # its training source: the number of its name in `PipelineConfig.source_names`


@dataclass(frozen=True, kw_only=True)
class ShardRow:
    """A sequence with its neighbours: what a shard row's columns are taken from
    (`schemas/shard_columns.py`)."""

    seq_id: int
    tokens: np.ndarray  # [n + 1]
    neighbours: np.ndarray  # [n/m, k, 2m]
    neighbour_ids: np.ndarray  # [n/m, k]
    neighbour_scores: np.ndarray  # [n/m, k]
    doc_ids: tuple
    source: int = 0  # as Sequence's

    @property
    def dims(self) -> ShardDims:
        """n, m and k as this row's arrays hold them."""
        _, k, width = self.neighbours.shape
        return ShardDims(n=len(self.tokens) - 1, m=width // 2, k=k)


def rows_of_table(table) -> list[ShardRow]:
    """A shard's table (`schemas.arrow.read_shard_table`) -> its rows, in file order: what a
    refresh starts from."""
    arrays = {column.name: shard_column(table, column.name) for column in array_columns()}
    doc_ids = table.column("doc_ids").to_pylist()
    seq_ids = arrays.pop("seq_id").tolist()
    sources = shard_sources(table)[1].tolist()
    return [
        ShardRow(
            seq_id=seq_id,
            **{name: values[i] for name, values in arrays.items()},
            doc_ids=tuple(doc_ids[i]),
            source=sources[i],
        )
        for i, seq_id in enumerate(seq_ids)
    ]


@dataclass(frozen=True)
class SequenceBatch:
    """One search batch's sequences, in seq id order, as one element: Beam's default coder
    pickles a list item by item, this in one call."""

    sequences: list[Sequence]

    def __reduce__(self):
        # Beam pickles every element that crosses a stage: one array per field, not a small
        # array per sequence, pickles in half the time (64 sequences of 513 tokens)
        return _by_column(SequenceBatch, Sequence, self.sequences)

    @staticmethod
    def merged(batches) -> list[Sequence]:
        """The sequences of these SequenceBatches (a shuffle's group of them), in seq id order."""
        return sorted((s for batch in batches for s in batch.sequences), key=lambda s: s.seq_id)

    def in_shards(self, shard_rows: int):
        """-> (shard, the SequenceBatch of its sequences here) per shard these fall in
        (shard s holds seq ids s·shard_rows …)."""
        shards: dict[int, list[Sequence]] = {}
        for s in self.sequences:
            shards.setdefault(s.seq_id // shard_rows, []).append(s)
        for shard, sequences in shards.items():
            yield shard, SequenceBatch(sequences)


@dataclass(frozen=True)
class RowBatch:
    """Shard rows in seq id order, as one element (see SequenceBatch): one shard's rows, as
    `RetrieveNeighbours` assembles them."""

    rows: list[ShardRow]

    def __reduce__(self):  # as SequenceBatch's
        return _by_column(RowBatch, ShardRow, self.rows)


@dataclass(frozen=True)
class NeighbourIds:
    """The neighbour ids of some shard rows, without their tokens: what the recall check reads
    of every row (a refresh's unchanged shards send these on, not their rows)."""

    seq_ids: np.ndarray  # int64 [n]
    ids: np.ndarray  # int64 [n, L, k]

    @classmethod
    def of(cls, batch: RowBatch) -> NeighbourIds:
        seq_ids = np.array([row.seq_id for row in batch.rows], np.int64)
        return cls(seq_ids, np.stack([row.neighbour_ids for row in batch.rows]))


def _by_column(batch_type, record_type, records: list):
    """A batch's pickle as columns: the seq ids and sources as one array each, every other
    field but doc_ids stacked (equal shapes within a batch), the doc ids listed;
    `_from_columns` rebuilds it."""
    if not records:
        return batch_type, ([],)
    arrays = [field.name for field in fields(record_type) if field.name not in _LISTED]
    stacked = [np.stack([getattr(record, name) for record in records]) for name in arrays]
    listed = [[getattr(record, name) for record in records] for name in _LISTED]
    return _from_columns, (batch_type, record_type, arrays, *stacked, *listed)


_LISTED = ("seq_id", "doc_ids", "source")  # Python ints and tuples, rebuilt as they were


def _from_columns(batch_type, record_type, arrays: list[str], *columns):
    names = [*arrays, *_LISTED]
    return batch_type([record_type(**dict(zip(names, values))) for values in zip(*columns)])


def neighbour_arrays(picks: np.ndarray, values: np.ndarray, *, chunks_per_seq: int, k: int, m: int, pad_id: int):
    """One sequence's kept neighbours (records with j, slot, chunk_id, score) and their values
    [n, 2m] -> neighbours [L, k, 2m], ids [L, k] (-1 = absent), scores [L, k]; absent slots
    hold pad_id and score 0."""
    row = np.zeros(len(picks), np.int64)
    tokens, ids, scores = sequences_neighbour_arrays(
        row, 1, picks, values, chunks_per_seq=chunks_per_seq, k=k, m=m, pad_id=pad_id
    )
    return tokens[0], ids[0], scores[0]


def sequences_neighbour_arrays(
    row: np.ndarray,
    sequences: int,
    picks: np.ndarray,
    values: np.ndarray,
    *,
    chunks_per_seq: int,
    k: int,
    m: int,
    pad_id: int,
):
    """`neighbour_arrays` of many sequences at once, pick i in sequence `row[i]` (0 ...
    `sequences` - 1) -> neighbours [S, L, k, 2m], ids [S, L, k], scores [S, L, k]."""
    tokens = np.full((sequences, chunks_per_seq, k, 2 * m), pad_id, dtype=np.int32)
    ids = np.full((sequences, chunks_per_seq, k), -1, dtype=np.int64)
    scores = np.zeros((sequences, chunks_per_seq, k), dtype=np.float32)
    at = (row, picks["j"], picks["slot"])
    tokens[at], ids[at], scores[at] = values, picks["chunk_id"], picks["score"]
    return tokens, ids, scores


OVERLAP_BUCKETS = (0.0, 0.125, 0.25, 0.5, 0.75, 1.0)  # RETRO's r(C) thresholds


def chunk_overlap(chunks: np.ndarray, neighbours: np.ndarray, pad_id: int) -> np.ndarray:
    """RETRO's leakage measure r(C) per chunk: the longest run of tokens the chunk shares
    with any of its neighbours (chunk + continuation), divided by m. Padding never matches.
    chunks [C, m], neighbours [C, k, 2m] (C: the chunks of one row, or of many rows at once:
    numpy's per-call cost is paid per position i, so many rows together cost little more than
    one) -> float64 [C] in [0, 1]."""
    m = chunks.shape[1]
    counts = np.uint8 if m < 2**8 else np.uint16 if m < 2**16 else np.uint32  # a run is at most m
    own = np.where(chunks == pad_id, -1, chunks)[:, None, :]  # [C, 1, m]: padding matches nothing
    run = np.zeros((*neighbours.shape[:2], neighbours.shape[2] + 1), counts)  # [C, k, 1 + 2m]: run ending at col
    step = np.empty(neighbours.shape, counts)
    longest = np.zeros(neighbours.shape, counts)
    for i in range(m):
        np.add(run[..., :-1], 1, out=step)  # the diagonal step (i-1, col-1) -> (i, col)
        step *= neighbours == own[..., i, None]
        run[..., 1:] = step
        np.maximum(longest, step, out=longest)
    return longest.reshape(len(chunks), -1).max(axis=1, initial=0) / m


def overlap_bucket(ratio: float) -> str:
    """The histogram key of r(C): the smallest threshold at or above it."""
    return str(next(t for t in OVERLAP_BUCKETS if ratio <= t))


def overlap_ranges(thresholds: list[str]) -> list[str]:
    """The r(C) range each bucket of ascending `thresholds` holds: `r ≤ t` for the first, then
    `(previous, t]` (a bucket counts what is at most its threshold and above the one before)."""
    return [f"r ≤ {t}" if i == 0 else f"({thresholds[i - 1]}, {t}]" for i, t in enumerate(thresholds)]


OVERLAP_COUNTER = "overlap_r_le_"


def overlap_tally(batch: RowBatch, m: int, pad_id: int):
    """(overlap counter of a bucket, the chunks in it) for the chunks of a batch of shard rows:
    the audit, counted as data."""
    rows = batch.rows
    chunks = np.concatenate([row.tokens[: len(row.neighbours) * m].reshape(-1, m) for row in rows])
    ratios = chunk_overlap(chunks, np.concatenate([row.neighbours for row in rows]), pad_id)
    bucket_of = np.searchsorted(OVERLAP_BUCKETS, ratios, side="left")
    buckets, counts = np.unique(bucket_of, return_counts=True)
    for bucket, count in zip(buckets.tolist(), counts.tolist()):  # the smallest threshold at or above r
        yield OVERLAP_COUNTER + str(OVERLAP_BUCKETS[bucket]), count


def row_tally(batch: RowBatch, m: int, pad_id: int):
    """A batch of shard rows' counters: its sequences, its empty neighbour slots and the
    overlap audit's buckets."""
    yield "sequences", len(batch.rows)
    yield "neighbour_slots_padded", int(sum((row.neighbour_ids < 0).sum() for row in batch.rows))
    yield from overlap_tally(batch, m, pad_id)


def input_tokens(tokens: np.ndarray, pad_id: int) -> np.ndarray:
    """Per sequence (tokens [..., n + 1]: the last is the target), its input tokens that are not
    padding: what a blend's shares are counted in."""
    return (tokens[..., :-1] != pad_id).sum(axis=-1)


def rows_per_source(sources: np.ndarray, count: int) -> list[int]:
    """Rows of each of `count` sources, from each row's source number."""
    return np.bincount(sources.astype(np.int64), minlength=count).tolist()


def source_tally(batch: RowBatch, pad_id: int):
    """A batch of shard rows' counters per training source: `source/<number>/rows` and `/tokens`."""
    sources = np.array([row.source for row in batch.rows])
    tokens = input_tokens(np.stack([row.tokens for row in batch.rows]), pad_id)
    for source in np.unique(sources).tolist():
        yield f"source/{source}/rows", int((sources == source).sum())
        yield f"source/{source}/tokens", int(tokens[sources == source].sum())


def overlap_histogram(counters: dict[str, int]) -> dict[str, int]:
    """Take the overlap counters out of a job's counters: {threshold: chunks}, every threshold
    present (chunks whose r(C) is ≤ it and above the one before)."""
    return {str(t): counters.pop(f"{OVERLAP_COUNTER}{t}", 0) for t in OVERLAP_BUCKETS}
