"""What a report samples from the data files themselves: neighbour scores by rank over a sample
of the shards (`gather_scores`, `score_table`), and rejected records by reason with a few
examples (`gather_rejected`).
"""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass

import numpy as np

from pipeline.check.report_sources import Sources
from pipeline.check.sample import sampled
from pipeline.common import fileio
from schemas.arrow import read_shard, shard_column
from schemas.manifest import ShardsManifest

SCORE_SAMPLE_SEQUENCES = 20_000  # shards are sampled (by name hash) down to about this many sequences
SCORE_EDGES = np.linspace(-1.0, 1.0, 401)  # cosine of unit vectors, in bins 0.005 wide
EXAMPLES_PER_REASON = 3
EXCERPT_CHARS = 160


@dataclass(frozen=True, kw_only=True)
class ScoreSample:
    """Histograms of the filled slots' scores by neighbour rank, over a sample of the shards."""

    edges: np.ndarray  # [bins + 1]
    counts: np.ndarray  # [k, bins]
    sums: np.ndarray  # [k]: for exact means
    shards_read: int
    shards_total: int
    sequences: int

    def quantile(self, rank: int, q: float) -> float:
        """The q-quantile of rank's scores, to a bin's width (its bin's upper edge)."""
        cumulative = np.cumsum(self.counts[rank])
        return float(self.edges[1:][np.searchsorted(cumulative, q * cumulative[-1])])


def gather_scores(directory: str, manifest: ShardsManifest, max_sequences: int = SCORE_SAMPLE_SEQUENCES) -> ScoreSample:
    """Read the neighbour_ids and neighbour_scores columns (only those) of a sample of the
    shards, record batch by record batch: memory holds the histograms and one batch."""
    fraction = min(1.0, max_sequences / manifest.num_sequences) if manifest.num_sequences else 1.0
    paths = fileio.entry_paths_and_rows(manifest, directory)[0]
    chosen = sampled(paths, fraction, path_of=str)
    k = manifest.neighbours
    counts, sums, sequences = np.zeros((k, len(SCORE_EDGES) - 1), np.int64), np.zeros(k), 0
    for path in chosen:
        with fileio.open_read(fileio.join(directory, path)) as f:
            _, batches = read_shard(f, columns=["neighbour_ids", "neighbour_scores"])
            for batch in batches:
                ids = shard_column(batch, "neighbour_ids").reshape(-1, k)
                scores = shard_column(batch, "neighbour_scores").reshape(-1, k)
                sequences += batch.num_rows
                for rank in range(k):
                    present = np.clip(scores[ids[:, rank] >= 0, rank], SCORE_EDGES[0], SCORE_EDGES[-1])
                    counts[rank] += np.histogram(present, SCORE_EDGES)[0]
                    sums[rank] += float(present.sum(dtype=np.float64))
    return ScoreSample(
        edges=SCORE_EDGES,
        counts=counts,
        sums=sums,
        shards_read=len(chosen),
        shards_total=len(paths),
        sequences=sequences,
    )


def score_table(sample: ScoreSample) -> list[tuple[str, ...]]:
    """(rank, filled slots, mean, 10th percentile, median, 90th percentile) per rank."""
    rows: list[tuple[str, ...]] = []
    for rank, counts in enumerate(sample.counts):
        filled = int(counts.sum())
        if not filled:
            rows.append((str(rank), "0", "—", "—", "—", "—"))
            continue
        rows.append(
            (
                str(rank),
                f"{filled:,}",
                f"{sample.sums[rank] / filled:.3f}",
                *(f"{sample.quantile(rank, q):.3f}" for q in (0.1, 0.5, 0.9)),
            )
        )
    return rows


@dataclass(frozen=True)
class RejectedReason:
    reason: str
    count: int
    examples: tuple[dict, ...]


def gather_rejected(
    sources: Sources, counters: dict[str, int], examples: int = EXAMPLES_PER_REASON
) -> list[RejectedReason]:
    """Rejected records by reason: counts from the manifests' `rejected_<reason>` counters, a
    few examples from the rejected files of the stages covered (read only until each reason
    has its examples)."""
    counts = {
        name[len("rejected_") :]: value
        for name, value in sorted(counters.items())
        if name.startswith("rejected_") and value
    }
    found: dict[str, list[dict]] = {reason: [] for reason in counts}
    files = [
        p
        for p in fileio.list_files(sources.rejected)
        if posixpath.basename(p).startswith(tuple(f"{stage}-" for stage in sources.rejected_stages))
    ]

    def enough() -> bool:
        return all(len(kept) >= examples for kept in found.values())

    for path in files:
        with fileio.open_read(path) as f:
            for line in f:
                if enough():
                    break
                record = json.loads(line)
                kept = found.get(record["reason"])
                if kept is not None and len(kept) < examples:
                    kept.append(record)
    return [RejectedReason(reason, count, tuple(found[reason])) for reason, count in counts.items()]
