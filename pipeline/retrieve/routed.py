"""The search of build-shards over an index in slices by inverted lists, without Beam: a search
batch's queries assigned to their lists once, sent only to the slices owning them, each
slice's hits merged as one index ranks them, and the queries still short after the exclusion
routed again at twice the depth (`pipeline.index.routing` has the argument).

Only what a slice needs travels to it (`SliceQueries`: query vectors, their probed lists and
list scores, their excluded chunk-id ranges); the sequences' tokens never leave the step that
packed them, and the hits rejoin their sequences by id.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from pipeline.index.routing import assign_lists, merge_hits, route, search_assigned, selector_groups
from pipeline.retrieve.search import LOST_DATA, batch_queries, candidate_rows, searched_rows


@dataclass(frozen=True)
class BatchQueries:
    """A search batch's queries without the sequences' tokens: what the merge keeps for the
    deeper rounds."""

    batch: int
    seq_ids: np.ndarray  # [s] the batch's sequences, in seq id order
    queries: np.ndarray  # [s·L, d] float32; row r is chunk r % L of sequence r // L
    excluded: list[tuple]  # [s] each sequence's excluded chunk-id ranges (merged)
    rows: np.ndarray  # the rows searched (`searched_rows`: all, unless a refresh narrows them)


def batch_of(keyed, chunks_per_seq: int) -> BatchQueries:
    """A joined search batch (sequences, embeddings, excluded ranges) -> its BatchQueries."""
    batch, _ = keyed
    seq_ids, queries, excluded = [], [], []
    for sequence, vectors, ranges in batch_queries(keyed[1], chunks_per_seq):
        seq_ids.append(sequence.seq_id)
        queries.append(vectors)
        excluded.append(tuple(ranges))
    dim = queries[0].shape[1] if queries else 0
    stacked = np.concatenate(queries).astype(np.float32) if queries else np.zeros((0, dim), np.float32)
    ids = np.array(seq_ids, np.int64)
    return BatchQueries(batch, ids, stacked, excluded, searched_rows(keyed[1], ids, chunks_per_seq))


@dataclass(frozen=True, kw_only=True)
class SliceQueries:
    """The rows of one search batch that one round sends to one slice."""

    batch: int
    index_slice: int
    rows: np.ndarray  # [r] query rows of the batch
    queries: np.ndarray  # [r, d]
    lists: np.ndarray  # [r, w] probed lists; -1 where another slice owns the list
    list_scores: np.ndarray  # [r, w] the coarse scores of those lists
    excluded: list[tuple]  # [r] each row's excluded chunk-id ranges


@dataclass(frozen=True)
class SliceFound:
    """One slice's hits of the rows a round sent it."""

    batch: int
    index_slice: int
    rows: np.ndarray  # [r] query rows of the batch
    scores: np.ndarray  # [r, width]
    ids: np.ndarray  # [r, width], -1 = none


@dataclass(frozen=True, kw_only=True)
class RoutedBatch:
    """A search batch between rounds: its queries, the best hits so far, and what the round
    in flight sent where."""

    queries: BatchQueries
    depth: int  # the depth of the round in flight
    rows: np.ndarray  # the rows it searches (all, then the short ones)
    sent: tuple[int, ...]  # the slices it sent rows to: each answers once
    scores: np.ndarray  # [n, width]
    ids: np.ndarray  # [n, width]
    deeper: frozenset[int] = field(default_factory=frozenset)  # query rows searched deeper


def route_rows(
    state: RoutedBatch, quantized, owner: np.ndarray, chunks_per_seq: int
) -> tuple[RoutedBatch, list[SliceQueries]]:
    """`state.rows` assigned at `state.depth` (one coarse assignment each) and cut by slice:
    (the state with what was sent, one SliceQueries per slice owning a probed list)."""
    batch = state.queries
    queries = batch.queries[state.rows]
    list_scores, lists = assign_lists(quantized, queries, state.depth)
    sent = []
    for number, (reached, mine) in sorted(route(lists, owner).items()):
        rows = state.rows[reached]
        excluded = [batch.excluded[row // chunks_per_seq] for row in rows.tolist()]
        sent.append(
            SliceQueries(
                batch=batch.batch,
                index_slice=number,
                rows=rows,
                queries=queries[reached],
                lists=mine,
                list_scores=list_scores[reached],
                excluded=excluded,
            )
        )
    return replace(state, sent=tuple(s.index_slice for s in sent)), sent


def first_round(batch: BatchQueries, *, depth: int, width: int, quantized, owner, chunks_per_seq: int):
    """Every query of a batch it searches routed at the tuned depth: (RoutedBatch, [SliceQueries])."""
    n = len(batch.queries)
    state = RoutedBatch(
        queries=batch,
        depth=depth,
        rows=batch.rows,
        sent=(),
        scores=np.full((n, width), np.finfo(np.float32).min, np.float32),
        ids=np.full((n, width), -1, np.int64),
    )
    return route_rows(state, quantized, owner, chunks_per_seq)


def search_slice(index_slice, sent: SliceQueries, width: int) -> SliceFound:
    """One slice scanning only the lists each row was sent with, each row's excluded ranges
    skipped inside faiss (rows sharing ranges, a sequence's chunks, in one call)."""
    scores = np.empty((len(sent.rows), width), np.float32)
    ids = np.empty((len(sent.rows), width), np.int64)
    for group, selector, _keep in selector_groups(np.arange(len(sent.rows)), sent.excluded):
        scores[group], ids[group] = search_assigned(
            index_slice,
            sent.queries[group],
            k=width,
            lists=sent.lists[group],
            list_scores=sent.list_scores[group],
            selector=selector,
        )
    return SliceFound(sent.batch, sent.index_slice, sent.rows, scores, ids)


def merge_round(state: RoutedBatch, found: list[SliceFound], width: int, nlist: int, chunks_per_seq: int):
    """A round's hits from every slice it sent to -> (the state with them merged in, whether
    rows are short and can go deeper). A slice's answer that did not arrive fails the job
    (its hits would be missing without a trace): nothing is committed."""
    arrived = sorted(f.index_slice for f in found)
    if arrived != sorted(state.sent):
        raise RuntimeError(
            f"search batch {state.queries.batch}: index slices {arrived} of {sorted(state.sent)} answered at depth "
            f"{state.depth}: {LOST_DATA}; nothing is committed"
        )
    rows = [np.searchsorted(state.rows, f.rows) for f in found]  # state.rows ascend: positions in them
    scores, ids = merge_hits(rows, [(f.scores, f.ids) for f in found], len(state.rows), width)
    best_scores, best_ids = state.scores.copy(), state.ids.copy()  # a runner's input stays as it came
    best_scores[state.rows], best_ids[state.rows] = scores, ids
    state = replace(state, scores=best_scores, ids=best_ids)
    short = state.rows[(ids < 0).any(axis=1)]
    if not len(short) or state.depth >= nlist:
        return state, False
    deeper = state.deeper | set(short.tolist())
    return replace(state, depth=min(2 * state.depth, nlist), rows=short, sent=(), deeper=frozenset(deeper)), True


def hits_of(state: RoutedBatch, chunks_per_seq: int) -> np.ndarray:
    """A finished batch's hits as CANDIDATE records (the best `width` per query, rank = slot)."""
    return candidate_rows(state.queries.seq_ids, state.scores, state.ids, chunks_per_seq)
