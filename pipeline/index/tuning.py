"""Tuning the search depth to a target recall: the query sample, its exact truth, and both
recall curves (the deeper of the two depths is kept).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from pipeline.index.exact import merge_nearest
from pipeline.index.recall import NEIGHBOUR_MEASURE, PLATEAU_GAIN, one_recall_at_k
from pipeline.index.search import search_depth_range, set_search_depth
from schemas.measures import DepthRecall, OwnDocumentRecall
from schemas.stage_config import IndexConfig


@dataclass(frozen=True)
class QuerySample:
    """The held-out queries the depth is tuned on: indexed vectors chosen by a hash of their ids."""

    ids: np.ndarray  # [q] chunk ids, ascending
    vectors: np.ndarray  # [q, d]
    documents: list | None  # per query, its document's chunk-id range ((start, end),); None: unknown


@dataclass(frozen=True)
class Truth:
    """The exact neighbours of the query sample, (scores, ids) [q, depth] each, merged over parts."""

    nearest_other: tuple  # every vector but the query itself
    outside_document: tuple | None  # every vector outside the query's document (None: unknown)

    def merge(self, other: Truth) -> Truth:
        outside = None
        if self.outside_document is not None:
            outside = merge_nearest(self.outside_document, other.outside_document)
        return Truth(merge_nearest(self.nearest_other, other.nearest_other), outside)


class Tuned(NamedTuple):
    """A tuned search depth (None: an exact index) and the recall measured at it."""

    depth: int | None
    recall: float
    plateau: bool  # deeper gained less than PLATEAU_GAIN over two doublings: the codes limit recall


def _recorded(curve: list[DepthRecall], recall_at, depth: int) -> float:
    """The recall at `depth` from the curve, measured (and appended) if it is not there."""
    for point in curve:
        if point.depth == depth:
            return point.recall
    curve.append(DepthRecall(depth=depth, recall=recall_at(depth)))
    return curve[-1].recall


def tune_index_depth(
    depths, plain_at, own_at, cfg: IndexConfig, neighbours: int
) -> tuple[Tuned, list[DepthRecall] | None, OwnDocumentRecall | None]:
    """The depth an index is searched at, from two measures on the query sample: plain_at(depth),
    RECALL_MEASURE (the query itself excluded), and own_at(depth) (None: documents unknown),
    NEIGHBOUR_MEASURE at k = neighbours with the query's whole document excluded, as
    build-shards searches. Each is tuned to cfg.target_recall (`tune_depth`) and the deeper
    depth is kept: on long documents a chunk's nearest lists are its own document's, and the
    depth that finds its nearest other vector misses its nearest chunks of other documents.
    depths: those to try (None: an exact index). -> ((depth, recall, plateau), curve, own)."""
    own = None
    if depths is None:
        if own_at is not None:
            own = OwnDocumentRecall(measure=NEIGHBOUR_MEASURE, k=neighbours, value=own_at(None), depth=None, curve=None)
        return Tuned(None, plain_at(None), False), None, own
    curve: list[DepthRecall] = []
    if cfg.nprobe is not None:
        depth, recall, plateau = cfg.nprobe, _recorded(curve, plain_at, cfg.nprobe), False
    else:
        depth, recall, plateau = tune_depth(depths, plain_at, cfg.target_recall, curve)
    if own_at is not None:
        own_curve: list[DepthRecall] = []
        if cfg.nprobe is not None:
            own_depth, own_plateau = cfg.nprobe, False
        else:
            own_depth, _, own_plateau = tune_depth(depths, own_at, cfg.target_recall, own_curve)
        if own_depth > depth:
            depth = own_depth
            recall = _recorded(curve, plain_at, depth)
            plateau = plateau and recall < cfg.target_recall
        own = OwnDocumentRecall(
            measure=NEIGHBOUR_MEASURE,
            k=neighbours,
            value=_recorded(own_curve, own_at, depth),
            depth=own_depth,
            plateau=own_plateau,
            curve=own_curve,
        )
    return Tuned(depth, recall, plateau), curve, own


def tune_depth(
    depths: list[int], recall_at, target: float, curve: list[DepthRecall] | None = None
) -> tuple[int, float, bool]:
    """Over `depths` (smallest first), `recall_at(depth)` until one reaches `target`, or until
    two doublings of the depth in a row gain less than PLATEAU_GAIN together (then the depth
    before that plateau: deeper would cost time for nothing, the codes, not the depth, limit
    recall). One flat doubling is not a plateau: with a query's own document excluded, the
    first lists probed can all be its document's, and the gain comes after them.
    -> (depth, recall, plateaued). Each measurement is appended to `curve`."""
    measured: list[tuple[int, float]] = []
    for depth in depths:
        recall = recall_at(depth)
        if curve is not None:
            curve.append(DepthRecall(depth=depth, recall=recall))
        if recall >= target:
            return depth, recall, False
        if len(measured) >= 2 and recall - measured[-2][1] < PLATEAU_GAIN:
            return measured[-2][0], measured[-2][1], True
        measured.append((depth, recall))
    return depth, recall, False


def tune_search_depth(
    index, query_ids, queries, truth, *, target: float, curve: list[DepthRecall] | None = None
) -> Tuned:
    """Smallest search depth of `index` reaching `target` (`tune_depth`, which fills `curve`),
    set on it: (depth, recall, plateaued); depth None for an index without a depth knob."""
    depths = search_depth_range(index)
    if depths is None:
        return Tuned(None, one_recall_at_k(index, query_ids, queries, truth), False)

    def recall_at(depth):
        set_search_depth(index, depth)
        return one_recall_at_k(index, query_ids, queries, truth)

    depth, recall, plateau = tune_depth(depths, recall_at, target, curve)
    set_search_depth(index, depth)
    return Tuned(depth, recall, plateau)
