"""Packing documents into training sequences of n tokens, and the chunk-id spans of the
documents a sequence holds (what its search excludes).
"""

from __future__ import annotations

import numpy as np

from pipeline.chunks.chunking import Chunk
from pipeline.shards.rows import Sequence


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
