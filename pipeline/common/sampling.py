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
