"""The deterministic samples of the embed and index stages: a chunk id is in the training or query
sample by a salted hash, so every worker agrees without coordination.
"""

from __future__ import annotations

import numpy as np


def sample_keys(ids: np.ndarray, salt: int) -> np.ndarray:
    """A deterministic pseudo-random 32-bit key per id (splitmix64 finaliser): samples do not
    depend on input order or on the number of workers."""
    with np.errstate(over="ignore"):
        x = ids.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(salt)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return (x ^ (x >> np.uint64(31))) >> np.uint64(32)


def in_sample(ids, size: int, population: int, salt: int):
    """True for about `size` of `population` ids, chosen by `sample_keys`."""
    keys = sample_keys(np.asarray(ids, dtype=np.int64), salt)
    return (
        keys < np.uint64(min(size, population) * (1 << 32) // max(population, 1))
        if size < population
        else np.ones(keys.shape, dtype=bool)
    )


TRAIN_SALT, QUERY_SALT = 1, 2


FEISTEL_ROUNDS = 4


class Permutation:
    """A seeded bijection of [0, size), computed per id without a table: a balanced Feistel
    network over the smallest even number of bits that holds `size` (its rounds keyed by
    `sample_keys`), with cycle walking back into range. Any worker computes the same position
    for an id, whatever else it holds."""

    def __init__(self, size: int, seed: int):
        if size < 1:
            raise ValueError(f"a permutation of {size} ids")
        self.size = size
        self.half = max(1, ((size - 1).bit_length() + 1) // 2)  # 4**half >= size
        self.keys = [int(key) for key in sample_keys(np.arange(FEISTEL_ROUNDS), salt=seed)]

    def _round_trip(self, x: np.ndarray) -> np.ndarray:
        mask = np.uint64((1 << self.half) - 1)
        left, right = x >> np.uint64(self.half), x & mask
        for key in self.keys:
            left, right = right, left ^ (sample_keys(right.astype(np.int64), key) & mask)
        return (left << np.uint64(self.half)) | right

    def __call__(self, ids) -> np.ndarray:
        """The position of each id (int64, each in [0, size))."""
        ids = np.asarray(ids, np.int64)
        if len(ids) and (ids.min() < 0 or ids.max() >= self.size):
            raise ValueError(f"ids outside [0, {self.size})")
        x = self._round_trip(ids.astype(np.uint64))
        outside = np.flatnonzero(x >= np.uint64(self.size))
        while len(outside):  # each walk stays on the id's cycle, which holds an id in range
            x[outside] = self._round_trip(x[outside])
            outside = outside[x[outside] >= np.uint64(self.size)]
        return x.astype(np.int64)
