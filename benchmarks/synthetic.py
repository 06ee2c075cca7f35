"""Synthetic embeddings shaped like sentence embeddings, for the index tests and benchmarks.

Isotropic Gaussian clusters in 384 dimensions make every point of a cluster nearly equidistant
from every other, so no compressed index can rank their neighbours (measured: PQ48 reached
0.456 1-recall@10 at 1M probing every list). Real sentence embeddings have a low intrinsic
dimension; here each cluster spreads along its own `rank`-dim subspace, plus a little
isotropic noise.
"""

from __future__ import annotations

import numpy as np

BLOCK = 8192  # vectors generated at a time: bounds the [block, rank, d] temporaries


class LowRankClusters:
    """Unit vectors around `clusters` random centres; cluster c spreads as
    `spread · z · bases[c]` (z ~ N(0, I_rank)) plus `noise` · N(0, I_d). With `topics`, the
    centres themselves gather around that many topic centres (`topic_spread` apart from
    theirs), as texts on one subject do; without, no two clusters are nearer than any other."""

    def __init__(
        self,
        dim: int,
        clusters: int = 1000,
        rank: int = 8,
        spread: float = 0.5,
        noise: float = 0.1,
        seed: int = 0,
        topics: int | None = None,
        topic_spread: float = 0.5,
    ):
        model = np.random.default_rng([seed, 0])
        self.centres = model.normal(size=(clusters, dim)).astype(np.float32)
        if topics:
            topic = model.normal(size=(topics, dim)).astype(np.float32)
            self.centres = topic[model.integers(0, topics, clusters)] + topic_spread * self.centres
        self.bases = model.normal(size=(clusters, rank, dim)).astype(np.float32)
        self.spread, self.noise = spread, noise

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """float32 [n, d], L2-normalised."""
        clusters, rank, dim = self.bases.shape
        out = np.empty((n, dim), np.float32)
        for start in range(0, n, BLOCK):
            size = min(BLOCK, n - start)
            label = rng.integers(0, clusters, size)
            z = rng.normal(size=(size, rank)).astype(np.float32)
            out[start : start + size] = (
                self.centres[label]
                + self.spread * np.einsum("nr,nrd->nd", z, self.bases[label])
                + self.noise * rng.normal(size=(size, dim)).astype(np.float32)
            )
        out /= np.linalg.norm(out, axis=1, keepdims=True)
        return out


def long_documents(documents: int, chunks_per_document: int, dim: int = 32, seed: int = 0):
    """Embeddings of long documents, chunk ids contiguous per document: each document a topic
    (a random unit centre) with 4 sections around it, each chunk near its section. A chunk's
    nearest chunks are its own document's, and one document spans several IVF lists, so the
    search depth that finds a chunk's nearest other vector misses its nearest chunks of other
    documents (IVF64 over 32 × 100: 1-recall@10 0.99 at nprobe 1, where recall@2 outside the
    own document is 0.62; it needs nprobe 16).
    -> (vectors float32 [documents · chunks_per_document, dim], document spans [(start, end)])."""
    rng = np.random.default_rng(seed)
    vectors, spans = [], []
    for _ in range(documents):
        centre = rng.normal(size=dim)
        sections = centre / np.linalg.norm(centre) + 0.6 * rng.normal(size=(4, dim)) / np.sqrt(dim)
        start = len(vectors) * chunks_per_document
        chunks = np.repeat(sections, -(-chunks_per_document // 4), axis=0)[:chunks_per_document]
        chunks = chunks + 0.5 * rng.normal(size=chunks.shape) / np.sqrt(dim)
        vectors.append(chunks / np.linalg.norm(chunks, axis=1, keepdims=True))
        spans.append((start, start + chunks_per_document))
    return np.concatenate(vectors).astype(np.float32), spans


def words_replaced(text: str, share: float, seed: int) -> str:
    """The text (split on whitespace) with `share` of its words, chosen by `seed`, replaced by
    words it does not hold: a planted near-copy for decontamination."""
    words = text.split()
    rng = np.random.default_rng(seed)
    for i in rng.choice(len(words), int(len(words) * share), replace=False):
        words[i] = f"planted{seed}x{i}"
    return " ".join(words)
