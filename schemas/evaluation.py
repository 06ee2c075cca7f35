"""The scores `ratrain-eval` writes as JSON and `report --eval` reads back (trainer/evaluate.py).

Every group counts next-token targets that are not pad: position p of a sequence predicts its
token p + 1. Groups: all targets; *copyable* ones (the target occurs among the neighbour tokens
the position attends to through chunked cross-attention) and the rest; and by the r(C) overlap
bucket of the chunk that contains the target token (pipeline/shards/rows.py, OVERLAP_BUCKETS),
plus `NO_CHUNK` for the last target of each sequence (token n, after the sequence's last
chunk). The loss to report for a model is `low_overlap`'s: chunks with r(C) at most
`low_overlap_threshold`, whose text the neighbours do not hold (RETRO's leakage evaluation).
Shards of a blend are also scored per training source (`sources`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from pydantic import TypeAdapter

#: The bucket of targets that lie in no chunk of their sequence (its last target, token n).
NO_CHUNK = "none"


@dataclass(frozen=True)
class GroupScore:
    tokens: int  # non-pad targets in the group
    mean_loss: float | None  # cross-entropy in nats per target; None when the group is empty
    accuracy: float | None  # share whose argmax prediction is the target; None when empty


@dataclass(frozen=True)
class BucketScore:
    bucket: str  # an OVERLAP_BUCKETS threshold as pipeline/shards/rows.py overlap_bucket names it, or NO_CHUNK
    r_range: str  # the r(C) range it holds, e.g. "(0.0, 0.125]" (pipeline/shards/rows.py overlap_ranges)
    score: GroupScore


@dataclass(frozen=True)
class VariantScores:
    """One pass over the shards: with their neighbours, or with every neighbour blanked."""

    all: GroupScore
    copyable: GroupScore
    not_copyable: GroupScore
    low_overlap: GroupScore  # targets in chunks with r(C) <= Evaluation.low_overlap_threshold
    overlap_buckets: list[BucketScore]  # each threshold of OVERLAP_BUCKETS in order, then NO_CHUNK


@dataclass(frozen=True)
class RetrievalGain:
    """Mean loss blanked minus with neighbours, per group (nats per target; positive: retrieval helps)."""

    all: float | None
    copyable: float | None
    not_copyable: float | None
    low_overlap: float | None


@dataclass(frozen=True, kw_only=True)
class SourceScore:
    """The targets of one training source of a blend (the shards' source column)."""

    name: str
    sequences: int
    with_neighbours: VariantScores
    blanked: VariantScores | None  # None for a model without retrieval


@dataclass(frozen=True, kw_only=True)
class Evaluation:
    checkpoint: str
    step: int | None  # the optimizer step the checkpoint was written at
    shards: str
    sequences: int  # sequences scored
    retrieval: bool  # whether the model reads neighbours (False: trained with --no-retrieval)
    chunk_tokens: int
    neighbours: int
    low_overlap_threshold: float
    with_neighbours: VariantScores
    blanked: VariantScores | None  # None for a model without retrieval: `blanked_note` says why
    retrieval_gain: RetrievalGain | None
    blanked_note: str
    sources: list[SourceScore] = field(default_factory=list)  # a blend's sources, in its order (else none)


@dataclass(frozen=True)
class ScoreRow:
    """One group of targets as the summary and the report show it."""

    label: str
    with_neighbours: GroupScore
    blanked: GroupScore | None
    reported: bool = False  # the group a model's loss is reported by (low overlap)

    @property
    def blanked_loss(self) -> float | None:
        return None if self.blanked is None else self.blanked.mean_loss

    @property
    def blanked_accuracy(self) -> float | None:
        return None if self.blanked is None else self.blanked.accuracy

    @property
    def gain(self) -> float | None:
        blanked, with_neighbours = self.blanked_loss, self.with_neighbours.mean_loss
        return None if blanked is None or with_neighbours is None else blanked - with_neighbours


def score_rows(evaluation: Evaluation) -> list[ScoreRow]:
    """All, copyable, not copyable, low overlap, then each r(C) bucket (and the targets in no
    chunk), then a blend's sources: all their targets and the low-overlap ones."""
    with_, blanked = evaluation.with_neighbours, evaluation.blanked
    rows = [
        ScoreRow("all targets", with_.all, None if blanked is None else blanked.all),
        ScoreRow("copyable", with_.copyable, None if blanked is None else blanked.copyable),
        ScoreRow("not copyable", with_.not_copyable, None if blanked is None else blanked.not_copyable),
        ScoreRow(
            f"low overlap: r ≤ {evaluation.low_overlap_threshold}",
            with_.low_overlap,
            None if blanked is None else blanked.low_overlap,
            reported=True,
        ),
    ]
    for i, bucket in enumerate(with_.overlap_buckets):
        label = "in no chunk (the last target)" if bucket.bucket == NO_CHUNK else f"chunk r(C): {bucket.r_range}"
        rows.append(ScoreRow(label, bucket.score, None if blanked is None else blanked.overlap_buckets[i].score))
    for source in evaluation.sources:  # a blend's, each on its own
        mine, blank = source.with_neighbours, source.blanked
        rows.append(ScoreRow(f"source {source.name}: all", mine.all, None if blank is None else blank.all))
        low = None if blank is None else blank.low_overlap
        rows.append(ScoreRow(f"source {source.name}: low overlap", mine.low_overlap, low))
    return rows


def evaluation_json(evaluation: Evaluation) -> str:
    return json.dumps(asdict(evaluation), indent=2, ensure_ascii=False) + "\n"


def read_evaluation(text: str | bytes) -> Evaluation:
    """An Evaluation from its JSON; a pydantic ValidationError names any field that does not fit."""
    return TypeAdapter(Evaluation).validate_json(text)
