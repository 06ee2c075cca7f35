"""Word n-gram shingles, MinHash signatures (datasketch's), LSH bands and Jaccard, without Beam.

A document's shingles are the 64-bit hashes of its word n-grams (NFKC, lower case, words as
runs of letters and digits: punctuation and spacing do not count); a document shorter than n
words is one shingle of all its words, so that a short copy still matches. Jaccard between two
documents is computed exactly on these sets; MinHash estimates it from signatures of
`num_perm` values, and LSH bands make candidate pairs of documents whose signatures agree on a
whole band.
"""

from __future__ import annotations

import math
import re
import unicodedata
from dataclasses import dataclass

import numpy as np
import xxhash

WORD = re.compile(r"\w+")
SHINGLE_BLOCK = 4096  # shingles permuted at once: a block holds [SHINGLE_BLOCK, num_perm] uint64
_NGRAM_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)  # odd: a word's place in the n-gram changes its hash


def words(text: str) -> list[str]:
    """The text's words after NFKC normalisation and lower-casing."""
    return WORD.findall(unicodedata.normalize("NFKC", text).lower())


def shingles(text: str, n: int) -> np.ndarray:
    """Sorted distinct uint64 hashes of the text's word n-grams (one of all its words when it
    has fewer than n; none when it has no word)."""
    found = words(text)
    if not found:
        return np.zeros(0, np.uint64)
    distinct, at = np.unique(np.array(found, dtype=object), return_inverse=True)
    hashed = np.array([xxhash.xxh3_64_intdigest(w.encode()) for w in distinct], np.uint64)[at]
    width = min(n, len(hashed))
    grams = np.zeros(len(hashed) - width + 1, np.uint64)
    with np.errstate(over="ignore"):  # the hash is modulo 2^64
        for k in range(width):
            grams = grams * _NGRAM_MULTIPLIER + hashed[k : k + len(grams)]
    return np.unique(grams)


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Exact Jaccard of two shingle sets (sorted distinct arrays); 0 when both are empty."""
    union = len(a) + len(b)
    if union == 0:
        return 0.0
    common = len(np.intersect1d(a, b, assume_unique=True))
    return common / (union - common)


@dataclass(frozen=True)
class LshBands:
    """A signature of `bands * rows` values cut into `bands` bands of `rows` values: two
    documents become a candidate pair when one band is equal."""

    bands: int
    rows: int

    @classmethod
    def for_threshold(cls, threshold: float, num_perm: int, min_recall: float) -> LshBands:
        """The most rows per band (fewest chance pairs) whose bands still make a pair at
        Jaccard `threshold` a candidate with probability >= `min_recall`."""
        best = cls(num_perm, 1)
        for rows in range(1, num_perm + 1):
            bands = num_perm // rows
            if cls(bands, rows).candidate_probability(threshold) >= min_recall:
                best = cls(bands, rows)
        return best

    def candidate_probability(self, similarity: float) -> float:
        """P(some band equal) for a pair at this Jaccard: 1 - (1 - s^rows)^bands."""
        return 1.0 - (1.0 - similarity**self.rows) ** self.bands

    def keys(self, signature: np.ndarray) -> list[int]:
        """One 63-bit key per band: the band's number and its values, hashed."""
        used = signature[: self.bands * self.rows].astype("<u8").reshape(self.bands, self.rows)
        return [xxhash.xxh3_64_intdigest(band.tobytes(), seed=number) >> 1 for number, band in enumerate(used)]


class Signer:
    """MinHash signatures from datasketch (its 64-bit affine permutations after a MurmurHash3
    finalizer, seeded, so equal in every process), fed a block of shingles at a time."""

    def __init__(self, num_perm: int, seed: int):
        self.num_perm, self.seed = num_perm, seed
        from datasketch import MinHash  # here: it imports scipy, which no job without decontamination needs

        self.minhash = MinHash
        self.permutations = MinHash(num_perm=num_perm, seed=seed, scheme="affine64").permutations

    def signature(self, shingle_hashes: np.ndarray) -> np.ndarray:
        """uint64 [num_perm]: the MinHash of the shingles (all values the maximum when none)."""
        minhash = self.minhash(
            num_perm=self.num_perm,
            seed=self.seed,
            scheme="affine64",
            hashfunc=int,
            permutations=self.permutations,
        )
        for start in range(0, len(shingle_hashes), SHINGLE_BLOCK):
            minhash.update_batch(shingle_hashes[start : start + SHINGLE_BLOCK].tolist())
        return np.asarray(minhash.hashvalues, np.uint64)


def estimated_jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Jaccard estimated from two signatures: the share of equal values."""
    return float(np.mean(a == b))


def standard_error(similarity: float, num_perm: int) -> float:
    """The MinHash estimate's standard error at this Jaccard."""
    return math.sqrt(similarity * (1 - similarity) / num_perm)
