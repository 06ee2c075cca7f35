"""Packing documents into training sequences of n tokens, and the chunk-id spans of the
documents a sequence holds (what its search excludes).
"""

from __future__ import annotations

import numpy as np

from pipeline.chunks.chunk_files import TrainingChunks
from pipeline.common.arrays import groups, positions_of
from pipeline.shards.rows import Sequence


def pack_sequence(
    seq_id: int, tokens: np.ndarray, doc_ids: np.ndarray, *, next_token: int | None, next_doc: int | None, pad_id: int
) -> Sequence:
    """The tokens [L, m] and documents [L] of L consecutive chunks + the first token of the
    chunk after them (and its document)."""
    target = pad_id if next_token is None else next_token
    flat = np.concatenate([np.asarray(tokens).ravel(), np.array([target], np.int32)])
    docs = set(np.asarray(doc_ids).tolist()) | ({next_doc} if next_doc is not None else set())
    return Sequence(seq_id, flat.astype(np.int32), tuple(sorted(docs)))


def batch_parts(rows: TrainingChunks, chunks_per_seq: int, sequences_per_batch: int):
    """Training chunk rows -> (batch, its rows) for each batch of `sequences_per_batch` sequences they
    fall in; a batch's first chunk also goes to the batch before, whose last sequence takes
    its first token as its target."""
    per_batch = chunks_per_seq * sequences_per_batch
    for batch, at in groups(rows.chunk_id // per_batch):
        yield batch, rows.take(at)
    opening = np.flatnonzero((rows.chunk_id % per_batch == 0) & (rows.chunk_id > 0))
    for row in opening.tolist():
        yield int(rows.chunk_id[row]) // per_batch - 1, rows.take(np.array([row]))


def pack_batch(batch: int, parts: list[TrainingChunks], chunks_per_seq: int, sequences_per_batch: int, pad_id: int):
    """A batch's chunk rows (`batch_parts`) -> its Sequences, in seq id order: each of L
    consecutive chunks, with the first token of the chunk after it as its target. A sequence
    short of chunks is the chunk database's tail, too short for one: none is made."""
    rows = TrainingChunks.concatenate(parts)
    rows = rows.take(np.argsort(rows.chunk_id, kind="stable"))
    ids, L = rows.chunk_id, chunks_per_seq
    for seq_id in range(batch * sequences_per_batch, (batch + 1) * sequences_per_batch):
        at, present = positions_of(ids, seq_id * L + np.arange(L + 1))  # its chunks and the next one
        if not present[:L].all():
            continue
        next_token, next_doc = (int(rows.tokens[at[L], 0]), int(rows.doc_id[at[L]])) if present[L] else (None, None)
        yield pack_sequence(
            seq_id, rows.tokens[at[:L]], rows.doc_id[at[:L]], next_token=next_token, next_doc=next_doc, pad_id=pad_id
        )


def with_tokens(sequences: list[Sequence], chunk_files, chunks_per_seq: int) -> list[Sequence]:
    """Sequences packed from `TrainingChunks.heads` (tokens [L + 1]: each chunk's first token and
    the target) -> the same with their chunks' tokens read from the chunk files (one read of the
    rows they span, in seq id order), each checked to begin with the token packed for it."""
    L = chunks_per_seq
    first, end = sequences[0].seq_id * L, sequences[-1].seq_id * L + L
    tokens = chunk_files.read_tokens(first, end)
    starts = np.array([s.seq_id * L - first for s in sequences], np.int64)
    own = tokens[starts[:, None] + np.arange(L)]  # [sequences, L, m], one gather for the shard
    packed = np.stack([s.tokens for s in sequences])  # [sequences, L + 1]
    changed = np.flatnonzero((own[:, :, 0] != packed[:, :L]).any(axis=1))
    if len(changed):
        seq_id = sequences[changed[0]].seq_id
        raise ValueError(f"sequence {seq_id}: its chunks' tokens changed in the chunk files since it was packed")
    filled = np.concatenate([own.reshape(len(sequences), -1), packed[:, L:]], axis=1).astype(np.int32)
    return [Sequence(s.seq_id, row, s.doc_ids, s.source) for s, row in zip(sequences, filled)]


def document_spans(chunk_ids: np.ndarray, doc_ids: np.ndarray) -> list[tuple[int, tuple[int, int]]]:
    """(doc_id, (first chunk id, last + 1)) of each document among these chunk rows; a document
    cut by the rows' edges gives a partial span, which `widest_span` merges. No rows (a block
    whose documents were all deleted): no spans."""
    if not len(chunk_ids):
        return []
    order = np.argsort(chunk_ids, kind="stable")
    ids, docs = chunk_ids[order], doc_ids[order]
    starts = np.flatnonzero(np.r_[True, docs[1:] != docs[:-1]])
    ends = np.r_[starts[1:], len(ids)]
    return [(int(docs[a]), (int(ids[a]), int(ids[b - 1]) + 1)) for a, b in zip(starts, ends)]
