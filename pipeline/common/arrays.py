"""Numpy idioms the block-wise steps share: rows grouped by a key, ids looked up in a sorted
id array, and runs of consecutive integers laid end to end; [start, end) ranges merged
(`widest_span`, one document's partial chunk-id spans; `merge_ranges`); and token ids sent
through a shuffle in 2 bytes each where they fit (`narrow_tokens`, `widened_tokens`)."""

from __future__ import annotations

import numpy as np


def groups(keys: np.ndarray):
    """(key, the positions holding it, ascending) for each distinct key, smallest key first."""
    keys = np.asarray(keys)
    order = np.argsort(keys, kind="stable")
    distinct, starts = np.unique(keys[order], return_index=True)
    yield from zip(distinct.tolist(), np.split(order, starts[1:]))


def positions_of(sorted_ids: np.ndarray, wanted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where each of `wanted` sits in `sorted_ids`, and whether it is there at all (a missing
    id's position is any valid one)."""
    wanted = np.asarray(wanted)
    if not len(sorted_ids):
        return np.zeros(len(wanted), np.int64), np.zeros(len(wanted), bool)
    at = np.minimum(np.searchsorted(sorted_ids, wanted), len(sorted_ids) - 1)
    return at, sorted_ids[at] == wanted


def ranges_of(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The integers starts[r] ... starts[r] + counts[r] - 1 of every r, concatenated."""
    counts = np.asarray(counts, np.int64)
    within = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(np.asarray(starts, np.int64), counts) + within


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


def narrow_tokens(tokens: np.ndarray) -> tuple[str, bytes]:
    """Token ids as (dtype, raw bytes): uint16 when every id fits (vocabularies under 65,536,
    as the default encoder's 30,522), else int32. Neighbour tokens are most of what
    build-shards shuffles: 2 bytes an id halves them."""
    tokens = np.asarray(tokens)
    fits = tokens.size == 0 or (int(tokens.min()) >= 0 and int(tokens.max()) <= np.iinfo(np.uint16).max)
    dtype = "<u2" if fits else "<i4"
    return dtype, np.ascontiguousarray(tokens, dtype).tobytes()


def widened_tokens(dtype: str, data: bytes) -> np.ndarray:
    """`narrow_tokens`' bytes -> int32 token ids (flat), writable."""
    return np.frombuffer(data, dtype).astype(np.int32)
