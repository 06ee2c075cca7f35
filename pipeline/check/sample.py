"""Which files a sampled `validate` reads: the ceil(fraction x n) (at least one) whose file names
hash lowest, the same ones on every run whatever else the directory holds. Chosen by a threshold
on the hash found in two passes over the names, so no process holds a hash per file: a count per
16-bit prefix of the hash, then the hashes in the one prefix the threshold falls in (n / 65,536
of them on average). Imports no Beam.
"""

from __future__ import annotations

import hashlib
import math
import posixpath
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

PREFIXES = 1 << 16  # counts kept in the first pass


def name_hash(path: str) -> bytes:
    return hashlib.sha256(posixpath.basename(path).encode()).digest()


def _prefix(digest: bytes) -> int:
    return int.from_bytes(digest[:2], "big")


def sample_count(fraction: float, total: int) -> int:
    """How many of `total` files a sample of `fraction` reads: ceil(fraction x total), at least one."""
    if fraction >= 1 or total == 0:
        return total
    return max(1, math.ceil(fraction * total - 1e-9))  # 0.07 x 100 is 7.000000000000001


@dataclass(frozen=True)
class Sample:
    """`count` of `total` files chosen: those whose name hash is at most `threshold` (None: all).
    Names hash by their last segment, so two files of one name in different folders are chosen
    together (one more than `count` where they meet the threshold)."""

    count: int
    total: int
    threshold: bytes | None = None

    @property
    def complete(self) -> bool:
        return self.threshold is None

    def chooses(self, path: str) -> bool:
        return self.threshold is None or name_hash(path) <= self.threshold

    @classmethod
    def of(cls, fraction: float, total: int, names: Callable[[], Iterable[Iterable[str]]]) -> Sample:
        """The sample of the `total` names `names()` gives in batches (not called for a sample
        of all of them, else twice)."""
        count = sample_count(fraction, total)
        if count == total:
            return cls(total, total)
        counts = np.zeros(PREFIXES, np.int64)
        for batch in names():
            prefixes = [_prefix(name_hash(name)) for name in batch]
            counts += np.bincount(np.array(prefixes, np.int64), minlength=PREFIXES)
        if int(counts.sum()) != total:
            raise ValueError(f"{int(counts.sum())} names given for a sample of {total}")
        cumulative = np.cumsum(counts)
        prefix = int(np.searchsorted(cumulative, count))  # the first prefix whose files reach `count`
        before = int(cumulative[prefix] - counts[prefix])
        inside = sorted(h for batch in names() for h in map(name_hash, batch) if _prefix(h) == prefix)
        return cls(count, total, inside[count - before - 1])


def sampled(entries: list, fraction: float, path_of=lambda entry: entry.path) -> list:
    """The entries of a list a `Sample` of `fraction` chooses by their file names
    (`path_of(entry)`), in their own order."""
    sample = Sample.of(fraction, len(entries), lambda: [[path_of(entry) for entry in entries]])
    return [entry for entry in entries if sample.chooses(path_of(entry))]
