"""Which rows of each shard an epoch reads when a `ShardDataset` selects or weights the
training sources of a blend (docs/trainer.md, "Sources").

`sources` is a list of names (those sources' rows, each once) or a mapping of names to weights
(each source's share of the epoch's rows: its rows repeated or subsampled, the epoch as long as
the selected rows). Each shard's manifest entry counts its rows per source (`source_rows`), so
how many rows of each source each shard gives is fixed before any shard is read: source s's
epoch rows are spread over the shards in proportion to their rows of s, the remainder to the
shards with the largest fractions (ties to the lower shard), so the totals are exact. Which rows
a shard repeats or leaves out is drawn when the shard is opened, from the epoch's generator
(without shuffling: its first rows of each source). Holds two counts per shard and source.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from pipeline.shards.rows import rows_per_source
from schemas.arrow import shard_sources
from schemas.file_table import entry_columns


class SourceMixError(ValueError):
    """A selection the shards cannot give: an unknown source, a weight below zero, nothing selected."""


def _weights(names: tuple[str, ...], wanted: Sequence[str] | Mapping[str, float]) -> np.ndarray:
    # a name listed is selected as it is (nan); a mapping gives weights; a source not named: 0
    chosen: dict[str, float] = dict(wanted) if isinstance(wanted, Mapping) else dict.fromkeys(wanted, np.nan)
    unknown = sorted(set(chosen) - set(names))
    if unknown:
        raise SourceMixError(f"no source {', '.join(map(repr, unknown))} in the shards (they hold {', '.join(names)})")
    weights = np.array([float(chosen.get(n, 0)) for n in names])
    given = weights[[n in chosen for n in names]]
    if isinstance(wanted, Mapping) and not np.isfinite(given).all():
        raise SourceMixError(f"source weights must be finite numbers: {dict(chosen)}")
    if (weights < 0).any() or not (np.isnan(weights) | (weights > 0)).any():
        raise SourceMixError(f"source weights must be at least 0, one above it: {dict(chosen)}")
    return weights  # nan: selected as it is


class SourceMix:
    """Per-shard rows of each source an epoch reads (`draws` [shards, sources])."""

    @classmethod
    def of_manifest(cls, manifest, directory: str, wanted: Sequence[str] | Mapping[str, float], open_file) -> SourceMix:
        """The mix for a shards manifest (its entries' `source_rows`, from its file table
        through `open_file` when it has one)."""
        names = tuple(source.name for source in manifest.sources)
        if not names:
            raise SourceMixError(f"not a blend of sources (training_corpus: {manifest.training_corpus})")
        counts = entry_columns(manifest, directory, ["source_rows"], open_file=open_file, error=SourceMixError)
        column = counts.column("source_rows")
        if column.null_count:
            raise SourceMixError("its manifest does not count each shard's rows per source")
        return cls(names, wanted, np.array(column.to_pylist(), np.int64).reshape(len(column), len(names)))

    def __init__(self, names: tuple[str, ...], wanted: Sequence[str] | Mapping[str, float], source_rows: np.ndarray):
        self.names, self.source_rows = names, source_rows
        weights = _weights(names, wanted)
        available = source_rows.sum(axis=0)  # [sources]
        if isinstance(wanted, Mapping):
            total = available[weights > 0].sum()
            targets = np.rint(weights / weights.sum() * total).astype(np.int64)
        else:
            targets = np.where(np.isnan(weights), available, 0).astype(np.int64)
        self.draws = np.zeros_like(source_rows)
        for s, target in enumerate(targets.tolist()):
            if not weights[s] == 0 and not available[s]:  # nan (selected) or a weight
                raise SourceMixError(f"source {names[s]!r} has no rows in the shards")
            if target:
                exact = source_rows[:, s] * (target / available[s])
                self.draws[:, s] = np.floor(exact)
                short = target - int(self.draws[:, s].sum())
                order = np.lexsort((np.arange(len(exact)), -(exact - np.floor(exact))))
                self.draws[order[:short], s] += 1
        self.wanted = {n: (None if np.isnan(w) else w) for n, w in zip(names, weights.tolist()) if not w == 0}

    @property
    def shard_rows(self) -> np.ndarray:
        return self.draws.sum(axis=1)

    def rows_of(self, shard: int, sources: np.ndarray, rng: np.random.Generator | None) -> np.ndarray:
        """The rows (indices in the shard, repeated where drawn again) shard `shard` gives in an
        epoch, from its rows' sources: in the order `rng` permutes them (None: ascending)."""
        picked = []
        for s, draws in enumerate(self.draws[shard].tolist()):
            rows = np.flatnonzero(sources == s)
            if draws == 0:
                continue
            if len(rows) == 0:
                raise SourceMixError(f"shard {shard} holds no row of source {self.names[s]!r}, its manifest entry some")
            whole, part = divmod(draws, len(rows))
            extra = rows if rng is None else rng.permutation(rows)
            picked += [np.tile(rows, whole), np.sort(extra[:part])]
        chosen = np.concatenate(picked) if picked else np.zeros(0, np.int64)
        return rng.permutation(chosen) if rng is not None else np.sort(chosen, kind="stable")


def checked_sources(names: tuple[str, ...], batches, counted: np.ndarray | None) -> list[np.ndarray]:
    """Each record batch's rows' source numbers; for a blend's shard (`names`: the manifest's),
    SourceMixError where its names are others, or its rows per source not `counted` (its
    entry's, where sources are selected)."""
    found = [shard_sources(batch) for batch in batches]
    wrong = next((got for got, _ in found if names and got != names), None)
    if wrong is not None:
        raise SourceMixError(f"source names {list(wrong)}, the manifest's {list(names)}")
    sources = [numbers for _, numbers in found]
    if counted is not None:
        rows = rows_per_source(np.concatenate(sources), len(names))
        if rows != counted.tolist():
            raise SourceMixError(f"{rows} rows per source, the manifest says {counted.tolist()}")
    return sources
