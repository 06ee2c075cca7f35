"""Shard rows brought up to date after the chunk database changed, without Beam: what a refresh
of build-shards does to one shard (`refresh_shard`), with the vectors the change added
(`NewVectors`).

A shard's sequences are packed again from the changed chunk files, exactly as a full build
packs them. A stored row whose sequence packs the same (same chunks' first tokens, target and
documents) keeps its tokens; its neighbours are the stored ones less the deleted, merged with
its best hits among the new vectors (`ranking.refreshed`). A sequence that is new or packs
differently (its next chunk deleted or appended) is searched in the whole changed index, as a
full build searches it; of a sequence that lost a stored neighbour, only the chunks that lost
one are (`SearchedChunks`). A stored row whose sequence is no
longer made (one of its chunks deleted) is dropped. A shard none of whose rows changed keeps
its file.

The new vectors are searched exactly (an IVF index's: in its trained lists, at the shards'
depth) and without exclusions: a new chunk is a new document's
or a replaced one's, and a sequence that held a replaced document held its deleted chunks (or,
as its next chunk, its first), so it is dropped or searched again.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

import faiss
import numpy as np

from pipeline.chunks.deleted import DeletedRanges
from pipeline.index.ties import exact_search
from pipeline.retrieve.depth import load_searched
from pipeline.retrieve.ranking import refreshed
from pipeline.retrieve.search import SearchedChunks
from pipeline.shards.rows import Sequence, ShardRow
from schemas.stage_config import IndexConfig, parse_size

QUERY_BLOCK = 1024  # queries searched among the new vectors at once
TIES_WIDTH = 16  # × k hits searched among the new vectors at first: a corpus's verbatim copies tie at once


@dataclass(frozen=True)
class NewVectors:
    """The chunks the generations since the shards' added, less any deleted since: sorted ids,
    embeddings and what a neighbour slot holds for each (tokens + continuation). Held whole by
    each process that refreshes: it grows with the change, not with the database."""

    ids: np.ndarray  # int64 [n], ascending
    vectors: np.ndarray  # float32 [n, d]
    values: np.ndarray  # int32 [n, 2m]
    # an IVF index's trained lists holding the new vectors, searched at its depth (None: exact)
    lists: object = None

    @classmethod
    def read(
        cls,
        chunk_files,
        ranges: tuple[tuple[int, int], ...],
        deleted: DeletedRanges,
        *,
        trained: str | None = None,
        depth: int | None = None,
    ) -> NewVectors:
        """From the chunk and embedding files holding the chunk-id `ranges` ([start, end) each).
        `trained`: the faiss file of an IVF index (its one file, or the quantizer of its slices),
        whose trained lists take the new vectors, searched at `depth` as the index is: a
        search among them then costs what the index's does, not a scan of every new vector."""
        ids, vectors, values = [], [], []
        for start, end in ranges:
            for number in range(chunk_files.file_of(start), chunk_files.file_of(end - 1) + 1):
                first = chunk_files.start(number)
                columns = chunk_files.read(number, ["tokens", "continuation"])
                rows = np.arange(max(start, first), min(end, first + len(columns["tokens"]))) - first
                rows = rows[~deleted.contains(rows + first)]
                ids.append(rows + first)
                vectors.append(chunk_files.read_embeddings(number)[rows])
                values.append(np.concatenate([columns["tokens"][rows], columns["continuation"][rows]], 1))
        if not ids:
            raise ValueError("NewVectors.read: no chunk-id range given")
        new = cls(
            np.concatenate(ids).astype(np.int64),
            np.concatenate(vectors).astype(np.float32),
            np.concatenate(values).astype(np.int32),
        )
        if trained is None:
            return new
        return replace(new, lists=in_trained_lists(load_searched(chunk_files, trained, depth), new))

    @functools.cached_property
    def _exact(self):
        index = faiss.IndexFlatIP(self.vectors.shape[1])
        index.add(self.vectors)
        return index

    def best(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Each query's k best new vectors by inner product, exactly (faiss's flat search) or
        in the trained lists (`lists`), a query they leave short searched exactly, as a full
        build deepens a short one to every list: (scores, ids) [q, k], (-inf, -1) past the new
        vectors; QUERY_BLOCK queries at a time."""
        scores, ids = np.full((len(queries), k), -np.inf, np.float32), np.full((len(queries), k), -1, np.int64)
        for start in range(0, len(queries), QUERY_BLOCK):
            block = np.ascontiguousarray(queries[start : start + QUERY_BLOCK], np.float32)
            if self.lists is not None:
                found_scores, found = self.lists.search(block, k)  # type: ignore[attr-defined]
                short = np.flatnonzero((found >= 0).sum(axis=1) < min(k, len(self.ids)))
                if len(short):
                    found_scores[short], found[short] = self._exactly(block[short], k)
            else:
                found_scores, found = self._exactly(block, k)
            kept = found >= 0
            scores[start : start + len(found)][kept] = found_scores[kept]
            ids[start : start + len(found)][kept] = found[kept]
        return scores, ids

    def _exactly(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        # ties scored again as a full build's exact search scores them (`index.ties`); the
        # positions ascend as the chunk ids do, so the tie rule orders them alike
        found_scores, at = exact_search(self._exact, queries, k, width=TIES_WIDTH * k)
        return found_scores, np.where(at >= 0, self.ids[np.maximum(at, 0)], -1)

    @staticmethod
    def held_bytes(vectors: int, dim: int, chunk_tokens: int, lists: int | None = None) -> int:
        """What a process holds for this many new vectors; with an IVF index of `lists` lists,
        its trained lists too (their centroids, and the new vectors' codes at most as large as
        the vectors)."""
        held = vectors * (8 + dim * 4 + 2 * chunk_tokens * 4)
        return held + (lists * dim * 4 + vectors * (8 + dim * 4) if lists else 0)

    def values_of(self, chunk_ids: np.ndarray) -> np.ndarray:
        """What the slots of these new chunks hold, int32 [len(chunk_ids), 2m]."""
        return self.values[np.searchsorted(self.ids, chunk_ids)]


def refresh_budget(index: IndexConfig) -> int:
    """The most a refreshing process may hold for the new vectors: the workers' memory where the
    config says it (`index.min_ram`: the workers that search the index refresh it), else a slice
    (`index.slice_bytes`, what a search worker holds) where the index is in slices, else the
    whole index's budget (`index.memory_budget`: one process holds the one file). A larger
    change is built whole."""
    if index.min_ram is not None:
        return parse_size(index.min_ram)
    return index.slice_bytes or index.memory_budget


def in_trained_lists(index, new: NewVectors):
    """The trained IVF `index` (memory-mapped, its lists read-only) with its lists replaced by
    empty ones in memory, and the new vectors added: no code of the index is read."""
    ivf = faiss.extract_index_ivf(index)
    lists = faiss.ArrayInvertedLists(ivf.nlist, ivf.code_size)
    ivf.replace_invlists(lists, True)
    lists.this.disown()  # type: ignore[attr-defined]  # the index owns them now
    ivf.ntotal = index.ntotal = 0
    index.add_with_ids(new.vectors, new.ids)
    return index


@dataclass
class ShardRefresh:
    """One shard after a refresh: the stored rows kept, their neighbours brought up to date
    (those in `narrowed` only in part), the sequences to search in the whole index (heads, as
    packing gives them), which of their chunks where not all (`narrowed`: the chunks that lost
    a stored neighbour), whether the shard's file must be written again, and what happened to
    its sequences, counted."""

    rows: list[ShardRow]
    searched: list[Sequence]
    narrowed: SearchedChunks | None
    changed: bool
    counts: dict[str, int] = field(default_factory=dict)


def heads_of(row: ShardRow, m: int) -> Sequence:
    """A stored row's sequence as packing gives it: each chunk's first token and the target,
    and its documents."""
    return Sequence(
        row.seq_id,
        np.concatenate([row.tokens[:-1:m], row.tokens[-1:]]),
        tuple(int(d) for d in row.doc_ids),
        row.source,
    )


def _same_sequence(row: ShardRow, sequence: Sequence, m: int) -> bool:
    stored = heads_of(row, m)
    return stored.doc_ids == tuple(sequence.doc_ids) and np.array_equal(stored.tokens, sequence.tokens)


def refresh_shard(
    stored: list[ShardRow],
    packed: list[Sequence],
    *,
    new: NewVectors | None,
    deleted: DeletedRanges,
    queries,
    m: int,
    pad_id: int,
) -> ShardRefresh:
    """One shard: its `stored` rows, the sequences `packed` from the changed chunk files for
    its seq ids (heads), the vectors the change added (None: it only deleted), the documents
    deleted since the rows were made, and `queries(chunk_ids)` -> their embeddings [n, d]
    (read only where there are new vectors)."""
    by_id = {row.seq_id: row for row in stored}
    same = [(by_id[s.seq_id], s) for s in packed if s.seq_id in by_id and _same_sequence(by_id[s.seq_id], s, m)]
    kept_ids = {s.seq_id for _, s in same}
    whole = [s for s in packed if s.seq_id not in kept_ids]
    rows, lost, changed_rows = _refreshed_rows(
        [row for row, _ in same], new=new, deleted=deleted, queries=queries, pad_id=pad_id
    )
    again = lost.any(axis=1)
    partial = [s for (_, s), searched in zip(same, again) if searched]
    narrowed = None
    if partial:
        narrowed = SearchedChunks(np.array([s.seq_id for s in partial], np.int64), lost[again])
    counts = {
        "sequences_dropped": len(stored) - len(same) - sum(s.seq_id in by_id for s in whole),
        "sequences_new": sum(s.seq_id not in by_id for s in whole),
        "sequences_packed_again": sum(s.seq_id in by_id for s in whole),
        "sequences_searched_again": len(partial),
        "chunks_searched_again": int(lost.sum()),
        "sequences_neighbours_refreshed": changed_rows,
    }
    changed = bool(whole) or changed_rows > 0 or len(same) != len(stored)
    return ShardRefresh(rows, sorted(whole + partial, key=lambda s: s.seq_id), narrowed, changed, counts)


def _refreshed_rows(rows: list[ShardRow], *, new: NewVectors | None, deleted: DeletedRanges, queries, pad_id: int):
    """Rows whose sequences stay -> (the rows with their neighbours up to date, which of their
    chunks lost a stored neighbour (bool [r, L]: to search again), how many rows changed)."""
    if not rows:
        return [], np.zeros((0, 0), bool), 0
    ids = np.stack([row.neighbour_ids for row in rows])  # [r, L, k]
    scores = np.stack([row.neighbour_scores for row in rows])
    r, L, k = ids.shape
    gone = deleted.contains(ids.ravel()).reshape(ids.shape) & (ids >= 0)
    if new is None:
        new_scores, new_ids = np.zeros((r * L, 0), np.float32), np.zeros((r * L, 0), np.int64)
    else:
        chunk_ids = (np.array([row.seq_id for row in rows], np.int64)[:, None] * L + np.arange(L)).ravel()
        new_scores, new_ids = new.best(queries(chunk_ids), k)
    result = refreshed(scores.reshape(-1, k), ids.reshape(-1, k), gone.reshape(-1, k), new_scores, new_ids)
    fresh_ids = result.ids.reshape(r, L, k)
    fresh_scores = np.where(fresh_ids >= 0, result.scores.reshape(r, L, k), 0).astype(np.float32)
    changed = np.flatnonzero((fresh_ids != ids).any(axis=(1, 2)))
    out = list(rows)
    if len(changed):  # the changed rows' slots at once: from a stored slot holding the id, else the new vectors
        neighbours = _slot_values(
            ids[changed], np.stack([rows[i].neighbours for i in changed]), fresh_ids[changed], new, pad_id
        )
        for at, i in enumerate(changed.tolist()):
            out[i] = replace(
                rows[i], neighbours=neighbours[at], neighbour_ids=fresh_ids[i], neighbour_scores=fresh_scores[i]
            )
    return out, result.search_again.reshape(r, L), len(changed)


def _slot_values(stored_ids, stored_values, ids, new: NewVectors | None, pad_id: int) -> np.ndarray:
    """What slots holding `ids` [r, L, k] (-1: none) hold: the stored slot's value [r, L, k, 2m]
    where one holds the id, else the new vector's; pad for none."""
    match = (ids[..., None] == stored_ids[..., None, :]) & (ids[..., None] >= 0)  # [r, L, k, k]
    stored = match.any(axis=-1)
    values = np.full(stored_values.shape, pad_id, np.int32)
    values[stored] = np.take_along_axis(stored_values, match.argmax(axis=-1)[..., None], axis=2)[stored]
    added = (ids >= 0) & ~stored
    if added.any():
        assert new is not None, "a neighbour neither stored nor new"
        values[added] = new.values_of(ids[added])
    return values


def with_searched(kept: ShardRow, searched: ShardRow, chunks: np.ndarray) -> ShardRow:
    """A kept row whose `chunks` (bool [L]) were searched in the whole index again: those
    chunks' neighbours from the search (`searched`, the same sequence's row), the rest kept."""
    at = chunks[:, None]
    return replace(
        kept,
        neighbours=np.where(at[:, :, None], searched.neighbours, kept.neighbours),
        neighbour_ids=np.where(at, searched.neighbour_ids, kept.neighbour_ids),
        neighbour_scores=np.where(at, searched.neighbour_scores, kept.neighbour_scores),
    )
