"""The memory model's rows for training an IVF index (`pipeline/jobs/memory_model.py`, §6): one
worker with the whole sample (`clustering: flat`), or the steps of two-level training, none of
which holds the sample.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipeline.index.factory import encoder_size, estimated_bytes, ivf_lists, resolve_clustering, training_size
from pipeline.index.kmeans import first_level_clusters, first_level_size
from pipeline.index.two_level import FOLD_BYTES, LIST_BLOCK, SUBSET_FILE_BYTES


def training_steps(
    factory: str, *, C: int, dim: int, clustering: str, accelerator: bool, auto: bool, file_rows: int
) -> list[tuple]:
    """The index training steps: one worker with the whole sample ('flat'), or the two-level
    steps, none of which holds the sample. With index.type auto every term follows the corpus
    (through the lists); the terms of one sample file always do (its share of the sample)."""
    if resolve_clustering(clustering, factory, accelerator) != "two_level":
        sample, centroids = training_size(C, factory), (ivf_lists(factory) or 1) * dim * 4
        steps = [
            (f"index: train {factory}", {f"{sample:,} training vectors": sample * dim * 4 * 2, "centroids": centroids})
        ]
        return [(name, terms, list(range(len(terms))) if auto else []) for name, terms in steps]
    return [
        (
            step.name,
            step.terms,
            [i for i, t in enumerate(step.terms) if t in step.per_file or (auto and t not in step.fixed)],
        )
        for step in two_level_steps(factory, C, dim, file_rows)
    ]


@dataclass(frozen=True)
class TrainingStep:
    """One step of two-level training: {term: bytes} one process holds at once; `per_file`:
    terms of one sample file (its share of the sample follows the corpus); `fixed`: terms of
    a size fixed however many lists (one block of lists, one subset file)."""

    name: str
    terms: dict[str, int]
    per_file: frozenset[str] = frozenset()
    fixed: frozenset[str] = frozenset()


def two_level_steps(factory: str, C: int, dim: int, file_rows: int) -> list[TrainingStep]:
    """Every step of two-level training (`TrainIndex`), from the shapes: one process's largest
    holding in each, on top of the SDK process. Checked against measured peaks by
    benchmarks/index_training.py."""
    sample, nlist = training_size(C, factory), ivf_lists(factory) or 1
    vector, row = dim * 4, dim * 4 + 8  # a vector; a vector and its chunk id
    file_sample = math.ceil(file_rows * sample / C)  # one embeddings file's share of the sample
    subset, encoder = first_level_size(sample, nlist), encoder_size(factory)
    cluster = 2 * math.ceil(sample / first_level_clusters(nlist))  # a first-level cluster: twice its share
    block, centroids = min(LIST_BLOCK, nlist), nlist * vector
    gathered = 3  # the gathered parts, their concatenation, the copy in chunk-id order
    one_file = f"one sample file (~{file_sample:,} vectors)"
    folded = "its bundle's sums folded per block until written, and one block's as its lists join"
    return [
        TrainingStep(
            "index: first-level and encoder subsets of one sample file",
            {f"{one_file} and its chosen rows": int(file_sample * row * (1 + min(1, max(subset, encoder) / sample)))},
            per_file=frozenset({f"{one_file} and its chosen rows"}),
        ),
        TrainingStep(
            "index: write one subset file",
            {"its sample files' chosen rows, gathered and in chunk-id order": SUBSET_FILE_BYTES * 3},
            fixed=frozenset({"its sample files' chosen rows, gathered and in chunk-id order"}),
        ),
        TrainingStep(
            "index: train first level", {f"{subset:,} training vectors, gathered and stacked": subset * row * gathered}
        ),
        TrainingStep(
            "index: assign one sample file to the first level",
            {f"{one_file} and its rows by cluster": file_sample * row * 2},
            per_file=frozenset({f"{one_file} and its rows by cluster"}),
        ),
        TrainingStep(
            "index: train one first-level cluster",
            {f"~{cluster:,} training vectors, gathered and stacked": cluster * row * gathered},
        ),
        TrainingStep(
            "index: write one block of centroids",
            {f"{block:,} lists' centroids, in pieces and joined": block * vector * 2},
            fixed=frozenset({f"{block:,} lists' centroids, in pieces and joined"}),
        ),
        TrainingStep(
            "index: Lloyd step over one sample file",
            {
                f"{nlist:,} centroids, read from their blocks": centroids,
                "their assigner (a copy, in growable lists)": centroids * 2,
                f"{one_file}, its fixed-point copy and sums": file_sample * dim * 20,
                folded: min(FOLD_BYTES, nlist * dim * 8) + block * dim * 8,
            },
            per_file=frozenset({f"{one_file}, its fixed-point copy and sums"}),
            fixed=frozenset({folded}),
        ),
        TrainingStep(
            "index: Lloyd step: combine one block's sums",
            {f"int64 sums of {block:,} lists: the fold, one part, the result": block * dim * 8 * 3},
            fixed=frozenset({f"int64 sums of {block:,} lists: the fold, one part, the result"}),
        ),
        TrainingStep(
            "index: Lloyd step: move one block",
            {
                f"{block:,} lists' centroids (read, copied, moved) and sums (int64, float64, normalised)": block
                * (vector + dim * 8)
                * 3
            },
            fixed=frozenset(
                {f"{block:,} lists' centroids (read, copied, moved) and sums (int64, float64, normalised)"}
            ),
        ),
        TrainingStep(
            f"index: assemble trained {factory}",
            {
                f"{nlist:,} centroids": centroids,
                "the trained index (quantizer)": estimated_bytes(factory, 0, dim),
                f"{encoder:,} encoder training vectors, gathered and stacked": encoder * row * gathered,
            },
        ),
    ]
