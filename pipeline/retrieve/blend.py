"""A blend of training sources (docs/design.md §7, "Blends"): how many sequences each source
gives, which ones, and where each lands among the blend's, without Beam.

Each source packs its own sequences (ids 0 … S-1, dense). Once their counts are known,
`BlendPlan.of` sizes the blend: the largest that holds every source at its weight with no
source taken more than `repeat` times over (nor beyond `max_tokens`), each source's draws
worked out from its tokens per sequence. A source's draws are its sequences in the order of a
seeded permutation, again and again: draw q is sequence π⁻¹(q mod S), so a source repeated
1.5 times holds every sequence once and half of them twice, and a subsampled one keeps the
first draws of that order. The blend's draws, source after source, are then placed by a
second permutation, which interleaves the sources evenly. Every decision is a function of a
sequence's id and the plan (a few numbers per source): any runner, any worker count, the
same shards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pipeline.common.sampling import Permutation
from pipeline.retrieve.search import QueryBlock
from pipeline.shards.rows import Sequence

# salts of the two permutations: a source's order (plus its number) and the interleaving
_SOURCE_ORDER, _INTERLEAVE = 1 << 20, 0


@dataclass(frozen=True, kw_only=True)
class SourceSize:
    """What a source's packed sequences hold."""

    sequences: int
    tokens: int  # input tokens that are not padding, over all its sequences


@dataclass(frozen=True, kw_only=True)
class SourceDraws:
    """One source's part of a plan."""

    name: str
    share: float  # the share of the blend's tokens asked (weights normalised)
    sequences: int  # S: sequences it packed
    tokens: int  # their tokens (not padding)
    draws: int  # its rows in the shards
    first_draw: int  # where its draws start in the blend's, before interleaving
    first_chunk: int  # where its chunks start in the ids they are embedded under

    @property
    def distinct(self) -> int:
        """Sequences drawn at least once."""
        return min(self.draws, self.sequences)

    @property
    def repeats(self) -> int:
        """Draws of a sequence drawn already."""
        return self.draws - self.distinct

    @property
    def left_out(self) -> int:
        """Sequences never drawn."""
        return self.sequences - self.distinct


@dataclass(frozen=True)
class BlendPlan:
    sources: tuple[SourceDraws, ...]
    seed: int
    chunks_per_seq: int

    @classmethod
    def of(cls, sources, sizes: list[SourceSize], *, seed: int, chunks_per_seq: int) -> BlendPlan:
        """The plan for `sources` (TrainingSource: name, weight, repeat, max_tokens) of these
        sizes. ValueError names a source with no sequence, or whose share rounds to none."""
        total_weight = sum(source.weight for source in sources)
        for source, size in zip(sources, sizes):
            if size.sequences == 0 or size.tokens == 0:
                raise ValueError(
                    f"training source {source.name!r} holds no full sequence of {chunks_per_seq} chunks: "
                    "it cannot be in the blend (too little text, or every document rejected)"
                )
        # the blend's tokens: the most at which every source is within its repeat and max_tokens
        capacity = [
            min(source.repeat * size.tokens, source.max_tokens or math.inf) for source, size in zip(sources, sizes)
        ]
        blend_tokens = min(cap * total_weight / source.weight for cap, source in zip(capacity, sources))
        plans, first_draw, first_chunk = [], 0, 0
        for source, size in zip(sources, sizes):
            share = source.weight / total_weight
            draws = min(round(share * blend_tokens * size.sequences / size.tokens), int(source.repeat * size.sequences))
            if draws == 0:
                raise ValueError(
                    f"training source {source.name!r}: its share {share:.4g} of the blend's "
                    f"{blend_tokens:,.0f} tokens is under half a sequence (raise its weight)"
                )
            plans.append(
                SourceDraws(
                    name=source.name,
                    share=share,
                    sequences=size.sequences,
                    tokens=size.tokens,
                    draws=draws,
                    first_draw=first_draw,
                    first_chunk=first_chunk,
                )
            )
            first_draw += draws
            first_chunk += size.sequences * chunks_per_seq
        return cls(tuple(plans), seed, chunks_per_seq)

    @property
    def draws(self) -> int:
        return sum(source.draws for source in self.sources)

    def _order(self, source: int) -> Permutation:
        return Permutation(self.sources[source].sequences, self.seed ^ (_SOURCE_ORDER + source))

    def _interleave(self) -> Permutation:
        return Permutation(self.draws, self.seed ^ _INTERLEAVE)

    def copies(self, source: int, seq_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each draw of these sequences of `source` (their ids within it): (which of `seq_ids`,
        the draw's position among the blend's rows), ordered by sequence, then draw."""
        plan = self.sources[source]
        first = self._order(source)(seq_ids)  # each sequence's first draw
        passes = -(-plan.draws // plan.sequences)
        draws = first[:, None] + plan.sequences * np.arange(passes)[None, :]
        which, made = np.nonzero(draws < plan.draws)
        return which, self._interleave()(plan.first_draw + draws[which, made])

    def drawn(self, source: int, seq_ids: np.ndarray) -> np.ndarray:
        """Whether each of these sequences of `source` is drawn at least once."""
        plan = self.sources[source]
        return self._order(source)(seq_ids) < plan.draws

    def blended(self, source: int, sequences: list[Sequence]) -> list[Sequence]:
        """A source's packed sequences -> each of their draws, its seq id its position in the blend."""
        which, positions = self.copies(source, np.array([s.seq_id for s in sequences], np.int64))
        return [
            Sequence(int(p), sequences[w].tokens, sequences[w].doc_ids, source)
            for w, p in zip(which.tolist(), positions.tolist())
        ]

    def embedded_ids(self, source: int, chunk_ids: np.ndarray) -> np.ndarray:
        """A source's chunk ids -> the ids they are embedded under (each source's after the
        one before's), -1 where their sequence is not drawn (or is none: the source's tail)."""
        plan, L = self.sources[source], self.chunks_per_seq
        seq_ids = chunk_ids // L
        packed = np.flatnonzero(seq_ids < plan.sequences)
        ids = np.full(len(chunk_ids), -1, np.int64)
        kept = packed[self.drawn(source, seq_ids[packed])]
        ids[kept] = plan.first_chunk + chunk_ids[kept]
        return ids

    def queries(self, block: QueryBlock) -> QueryBlock:
        """Query embeddings under the ids they were embedded under (`embedded_ids`) -> under
        each draw's chunk ids in the blend (position · L + chunk), a row per draw."""
        L = self.chunks_per_seq
        firsts = np.array([source.first_chunk for source in self.sources], np.int64)
        sources = np.searchsorted(firsts, block.chunk_ids, side="right") - 1
        ids, rows = [], []
        for source in np.unique(sources).tolist():
            at = np.flatnonzero(sources == source)
            local = block.chunk_ids[at] - firsts[source]
            which, positions = self.copies(source, local // L)
            ids.append(positions * L + local[which] % L)
            rows.append(at[which])
        if not ids:
            return block
        return QueryBlock(np.concatenate(ids), block.vectors[np.concatenate(rows)])
