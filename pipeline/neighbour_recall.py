"""The neighbour-quality check inside build-shards: on a deterministic sample of training
chunks, the shards' neighbours against an exact search over the stored embeddings that applies
the same exclusion (the chunk-id ranges of the sequence's own documents).

Recall counts distance ties the way ann-benchmarks does: a neighbour is right when its exact
similarity to the query is within `TIE_TOLERANCE` of the exact k-th best, so near-duplicate
chunks are interchangeable; an empty slot is a miss unless the database has fewer than k
chunks outside the sequence's documents. The exact side is one scan over the embedding files
(a matrix product per record batch against the sampled queries), merged like a top-k.
"""

from __future__ import annotations

import heapq

import apache_beam as beam
import numpy as np
from apache_beam.io.parquetio import ReadFromParquetBatched

from pipeline.faiss_index import TIE_TOLERANCE, exact_top, merge_top
from schemas.arrow import tensor_column_to_numpy

MEASURE = f"recall@k with ties within {TIE_TOLERANCE:g} (empty slot = miss)"

# A probe: (sample key, seq_id, j, query vector [d], excluded chunk-id ranges ((start, end), ...))


# --- pure functions -------------------------------------------------------------------------


def recall_with_ties(exact_scores: np.ndarray, ours_exact: np.ndarray) -> tuple[int, int]:
    """(right neighbours, slots that exact search fills) over the sampled queries.

    exact_scores [n, k]: exact search's best scores (-inf where fewer than k exist);
    ours_exact [n, k]: the exact score of each of our neighbours (nan for an empty slot)."""
    slots = np.isfinite(exact_scores).sum(axis=1)  # [n]
    kth = np.where(slots > 0, exact_scores[np.arange(len(slots)), np.maximum(slots - 1, 0)], np.inf)
    with np.errstate(invalid="ignore"):
        right = (ours_exact >= kth[:, None] - TIE_TOLERANCE).sum(axis=1)  # nan compares False
    return int(np.minimum(right, slots).sum()), int(slots.sum())


def scan_batch(ids: np.ndarray, vectors: np.ndarray, probes: list, ours: np.ndarray, k: int):
    """One (non-empty) record batch of embeddings against the probes: (exact top-k (scores, ids) of the
    batch with each probe's ranges excluded, exact scores of our neighbours in the batch
    [n, k], nan for those elsewhere)."""
    order = np.argsort(ids, kind="stable")
    ids, vectors = ids[order], np.asarray(vectors, np.float32)[order]
    queries = np.stack([p[3] for p in probes]).astype(np.float32)
    scores = queries @ vectors.T  # [n, r]
    position = np.minimum(np.searchsorted(ids, ours), len(ids) - 1)
    here = (ours >= 0) & (ids[position] == ours)
    ours_exact = np.where(here, np.take_along_axis(scores, position, axis=1), np.nan)
    for row, probe in enumerate(probes):
        for start, end in probe[4]:
            scores[row, np.searchsorted(ids, start) : np.searchsorted(ids, end)] = -np.inf
    return exact_top(scores, ids, k), ours_exact


def merge_scans(a, b, k: int):
    (top_a, ours_a), (top_b, ours_b) = a, b
    return merge_top(top_a, top_b, k), np.where(np.isnan(ours_a), ours_b, ours_a)


# --- Beam -----------------------------------------------------------------------------------


class SmallestProbes(beam.CombineFn):
    """The `size` probes with the smallest (key, seq_id, j): a sample that depends on neither
    bundling nor workers. Inputs are lists of probes (one per search batch)."""

    def __init__(self, size: int):
        self.size = size

    def create_accumulator(self):
        return []

    def add_input(self, acc, probes):
        return heapq.nsmallest(self.size, acc + list(probes), key=lambda p: p[:3])

    def merge_accumulators(self, accs):
        return heapq.nsmallest(self.size, [p for acc in accs for p in acc], key=lambda p: p[:3])

    def extract_output(self, acc):
        return sorted(acc, key=lambda p: p[:3])


class _MergeScans(beam.CombineFn):
    def __init__(self, k: int):
        self.k = k

    def create_accumulator(self):
        return None

    def add_input(self, acc, scan):
        return scan if acc is None else merge_scans(acc, scan, self.k)

    def merge_accumulators(self, accs):
        result = None
        for acc in accs:
            if acc is not None:
                result = acc if result is None else merge_scans(result, acc, self.k)
        return result

    def extract_output(self, acc):
        return acc


def _our_neighbours(row, wanted: set):
    for j in range(len(row.neighbour_ids)):
        if (row.seq_id, j) in wanted:
            yield (row.seq_id, j), row.neighbour_ids[j]


def _ours_in_probe_order(probes: list, ours: list, k: int) -> np.ndarray:
    found = dict(ours)
    return (
        np.stack([found.get((p[1], p[2]), np.full(k, -1, np.int64)) for p in probes])
        if probes
        else np.zeros((0, k), np.int64)
    )


def _scan(table, probes, ours, k: int):
    if probes and table.num_rows:
        yield scan_batch(
            table["chunk_id"].to_numpy(),
            tensor_column_to_numpy(table["embedding"]),
            probes,
            _ours_in_probe_order(probes, ours, k),
            k,
        )


def _result(scan, probes) -> dict | None:
    if scan is None or not probes:
        return None
    (exact_scores, _), ours_exact = scan
    right, slots = recall_with_ties(exact_scores, ours_exact)
    return {
        "measure": MEASURE,
        "value": right / slots if slots else 1.0,
        "sample_size": len(probes),
        "slots": slots,
        "tolerance": TIE_TOLERANCE,
    }


class MeasureNeighbourRecall(beam.PTransform):
    """(probes from the search, shard rows) -> one dict: the neighbour recall of `size` sampled
    training chunks against exact search over the embedding files `embeddings` (a glob),
    or None when nothing was sampled."""

    def __init__(self, embeddings: str, k: int, size: int, validate: bool = True):
        super().__init__()
        self.embeddings, self.k, self.size, self.validate = embeddings, k, size, validate

    def expand(self, inputs):
        probes, rows = inputs
        k = self.k
        sample = probes | "SampleProbes" >> beam.CombineGlobally(SmallestProbes(self.size))
        wanted = sample | "SampledChunks" >> beam.Map(lambda ps: {(p[1], p[2]) for p in ps})
        ours = (
            rows
            | "OurNeighbours" >> beam.FlatMap(_our_neighbours, beam.pvalue.AsSingleton(wanted))
            | "GatherOurs" >> beam.combiners.ToList()
        )
        scan = (
            rows.pipeline
            | "ReadEmbeddings" >> ReadFromParquetBatched(self.embeddings, validate=self.validate)
            | "ExactScan" >> beam.FlatMap(_scan, beam.pvalue.AsSingleton(sample), beam.pvalue.AsSingleton(ours), k)
            | "MergeScans" >> beam.CombineGlobally(_MergeScans(k))
        )
        return scan | "Recall" >> beam.Map(_result, beam.pvalue.AsSingleton(sample))
