"""The tokens a chunk file gives the search: a neighbour slot's value (tokens + continuation)
and the token hash that `dedupe_neighbours` compares, from one read of the file.
"""

from __future__ import annotations

import hashlib

import numpy as np


def token_key(tokens: np.ndarray) -> int:
    """A 63-bit hash of a chunk's tokens, equal for equal tokens."""
    return (
        int.from_bytes(
            hashlib.blake2b(np.ascontiguousarray(tokens, np.int32).tobytes(), digest_size=8).digest(), "little"
        )
        >> 1
    )


class FileTokens:
    """One chunk file's token columns, read once, and what its rows give the search: the token
    hash deduplication compares (each row hashed once) and a neighbour slot's value."""

    def __init__(self, chunk_files, number: int, continuation: bool):
        columns = chunk_files.read(number, ["tokens", "continuation"] if continuation else ["tokens"])
        self.start = chunk_files.start(number)
        self.tokens, self.continuation = columns["tokens"], columns.get("continuation")
        self._keys = np.full(len(self.tokens), -1, np.int64)  # token_key is never negative

    def with_token_keys(self, hits: np.ndarray) -> np.ndarray:
        """A copy of CANDIDATE `hits` (all in this file) with each chunk's token_key."""
        hits = hits.copy()
        local = hits["chunk_id"] - self.start
        new = np.unique(local[self._keys[local] < 0])  # a chunk is hit by many queries
        self._keys[new] = [token_key(self.tokens[r]) for r in new]
        hits["token_key"] = self._keys[local]
        return hits

    def values(self, chunk_ids: np.ndarray) -> np.ndarray:
        """What a neighbour slot holds for each of `chunk_ids` (all in this file): the chunk's
        tokens + its continuation, int32 [len(chunk_ids), 2m]."""
        assert self.continuation is not None, "read with continuation=True"
        local = np.asarray(chunk_ids, np.int64) - self.start
        return np.concatenate([self.tokens[local], self.continuation[local]], axis=1).astype(np.int32)
