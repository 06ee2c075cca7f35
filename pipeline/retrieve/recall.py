"""Neighbour recall inside build-shards: on a deterministic sample of training chunks (probes),
an exact search over the stored embeddings that applies the same exclusion as the real search
(the chunk-id ranges of the sequence's own documents). It is computed once, before the search,
and serves twice: to tune the search depth on the workload it serves (`pipeline.retrieve`), and
to check the neighbours written against it.

Recall counts distance ties the way ann-benchmarks does: a neighbour is right when its exact
similarity to the query is within `TIE_TOLERANCE` of the exact k-th best, so near-duplicate
chunks are interchangeable; an empty slot is a miss unless the database has fewer than k
chunks outside the sequence's documents. The exact side is one scan over the database's
embeddings (a matrix product per block against the probes), merged like a top-k. It keeps the
`truth_depth` best per probe, so a neighbour's exact similarity is read from that list; one
beyond it is below the k-th best (a miss).
"""

from __future__ import annotations

import functools
import heapq
from typing import NamedTuple

import apache_beam as beam
import numpy as np

from pipeline.common.combining import MergedBy
from pipeline.index.exact import exact_nearest_outside, exact_scores_of, merge_top
from pipeline.index.recall import NEIGHBOUR_MEASURE, recall_with_ties
from schemas.measures import TIE_TOLERANCE


class Probe(NamedTuple):
    """A sampled training chunk: ordered by (key, seq_id, j), so the sample depends on neither
    bundling nor workers."""

    key: int  # sample_keys of its chunk position
    seq_id: int
    j: int  # the chunk's place in its sequence
    query: np.ndarray | None  # its embedding [d]; None while the sample is chosen (by key alone)
    excluded: tuple  # its sequence's documents' chunk-id ranges ((start, end), ...)


def queries_of(probes: list[Probe]) -> np.ndarray:
    """The probes' queries [n, d], once read (`ProbeQueries`)."""
    queries = [p.query for p in probes]
    if any(q is None for q in queries):
        raise ValueError("a probe's query was not read: the sample goes through ProbeQueries first")
    return np.stack(queries)  # type: ignore[arg-type]  # checked above


def scan_batch(ids: np.ndarray, vectors: np.ndarray, probes: list[Probe], depth: int):
    """One (non-empty) block of embeddings against the probes: its exact top `depth`
    (scores, ids) per probe, each probe's ranges excluded."""
    return exact_nearest_outside(queries_of(probes), [p.excluded for p in probes], ids, vectors, depth)


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


def _scan(block, probes, depth: int):
    if probes and len(block.chunk_ids):
        yield scan_batch(block.chunk_ids, block.vectors, probes, depth)


class ExactTruth(beam.PTransform):
    """(probe sample (one sorted list), the database's embeddings (`QueryBlock`s: every chunk
    not deleted, each once)) -> one (scores, ids) [n, depth] in sample order: the exact best
    chunks outside each probe's ranges; None when nothing was sampled."""

    def __init__(self, depth: int):
        super().__init__()
        self.depth = depth

    def expand(self, inputs):
        sample, database = inputs
        return (
            database
            | "ExactScan" >> beam.FlatMap(_scan, beam.pvalue.AsSingleton(sample), self.depth)
            | "MergeScans" >> beam.CombineGlobally(MergedBy(functools.partial(merge_top, k=self.depth)))
        )


def _our_neighbours(block, wanted: set):
    for seq_id, ids in zip(block.seq_ids.tolist(), block.ids):
        for j in range(len(ids)):
            if (seq_id, j) in wanted:
                yield (seq_id, j), ids[j]


def neighbour_recall(probes: list[Probe], truth, ours: list, k: int) -> dict | None:
    """The check's result for the manifest: the written neighbours `ours` ([((seq_id, j),
    ids [k])]) of the sampled probes against their truth; None when nothing was sampled."""
    if truth is None or not probes:
        return None
    found = dict(ours)
    ids = np.stack([found.get((p.seq_id, p.j), np.full(k, -1, np.int64)) for p in probes])
    right, slots = recall_with_ties(truth[0], exact_scores_of(truth, ids))
    return {
        "measure": NEIGHBOUR_MEASURE,
        "value": right / slots if slots else 1.0,
        "sample_size": len(probes),
        "slots": slots,
        "tolerance": TIE_TOLERANCE,
    }


class MeasureNeighbourRecall(beam.PTransform):
    """(probe sample, its exact truth, `NeighbourIds` of every row) -> one dict: the recall of
    the neighbours written for the sampled training chunks (`neighbour_recall`), or None."""

    def __init__(self, k: int):
        super().__init__()
        self.k = k

    def expand(self, inputs):
        sample, truth, rows = inputs
        wanted = sample | "SampledChunks" >> beam.Map(lambda ps: {(p.seq_id, p.j) for p in ps})
        ours = rows | "OurNeighbours" >> beam.FlatMap(_our_neighbours, beam.pvalue.AsSingleton(wanted))
        return sample | "Recall" >> beam.Map(
            neighbour_recall, beam.pvalue.AsSingleton(truth), beam.pvalue.AsList(ours), self.k
        )
