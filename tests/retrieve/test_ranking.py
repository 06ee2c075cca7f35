"""The one candidate order, and stored neighbours refreshed from the new vectors alone against
a full search of the changed database (real faiss, exact index)."""

import faiss
import numpy as np
import pytest

from benchmarks.synthetic import LowRankClusters
from pipeline.index.search import search_each_excluding
from pipeline.index.ties import ranked
from pipeline.retrieve.ranking import refreshed

pytestmark = pytest.mark.unit

D, K = 32, 4


def test_ties_go_by_chunk_id_and_empty_slots_last():
    scores = np.array([[0.5, 0.9, 0.5, -3.4e38, 0.9]], np.float32)
    ids = np.array([[7, 12, 3, -1, 5]], np.int64)
    s, i = ranked(scores, ids)
    assert i.tolist() == [[5, 12, 3, 7, -1]] and s[0, :4].tolist() == pytest.approx([0.9, 0.9, 0.5, 0.5])


class Database:
    """Chunk ids 0 … n-1 in documents of 1-6 consecutive chunks, some deleted."""

    def __init__(self, vectors: np.ndarray, doc_of: np.ndarray):
        self.vectors, self.doc_of = vectors, doc_of
        self.deleted_docs: set[int] = set()

    def grown(self, vectors: np.ndarray, rng) -> tuple["Database", np.ndarray]:
        first = len(self.vectors)
        docs = self.doc_of[-1] + 1 + np.cumsum(rng.random(len(vectors)) < 0.3)
        grown = Database(np.concatenate([self.vectors, vectors]), np.concatenate([self.doc_of, docs]))
        grown.deleted_docs = set(self.deleted_docs)
        return grown, np.arange(first, first + len(vectors))

    def live(self) -> np.ndarray:
        return np.flatnonzero(~np.isin(self.doc_of, sorted(self.deleted_docs)))

    def own_ranges(self, queries: np.ndarray) -> list[list[tuple[int, int]]]:
        ranges = []
        for q in queries.tolist():
            ids = np.flatnonzero(self.doc_of == self.doc_of[q])
            ranges.append([(int(ids[0]), int(ids[-1]) + 1)])
        return ranges

    def search(self, queries: np.ndarray, ids: np.ndarray, width: int = K) -> tuple[np.ndarray, np.ndarray]:
        """The queries' best `width` among `ids`, their own documents excluded, in the one order."""
        index = faiss.IndexIDMap(faiss.IndexFlatIP(D))
        if len(ids):
            index.add_with_ids(self.vectors[ids], ids.astype(np.int64))
        found = search_each_excluding(index, self.vectors[queries], width, self.own_ranges(queries))
        return ranked(found.scores, found.ids)


def refresh(db: Database, queries, stored, new_ids):
    """What build-shards over a changed index does, Beam apart: the new vectors searched, merged
    with what was stored; the queries that lost a neighbour searched in the whole index."""
    deleted = ~np.isin(stored[1], db.live()) & (stored[1] >= 0)
    new = db.search(queries, np.intersect1d(new_ids, db.live()))
    out = refreshed(*stored, deleted, *new)
    scores, ids = out.scores.copy(), out.ids.copy()
    again = np.flatnonzero(out.search_again)
    if len(again):
        scores[again], ids[again] = db.search(queries[again], db.live())
    return (scores, ids), out


def built(seed: int, chunks: int, appended: int, queries: int):
    """A database of `chunks` vectors, sampled queries' neighbours stored as a build stores
    them, and `appended` vectors more to change it with."""
    rng = np.random.default_rng(seed)
    vectors = LowRankClusters(D).sample(chunks + appended, rng)
    db = Database(vectors[:chunks], np.cumsum(rng.random(chunks) < 0.3))
    sampled = np.sort(rng.choice(chunks, queries, replace=False))
    return rng, db, vectors[chunks:], sampled, db.search(sampled, db.live())


def still_made(db: Database, queries, stored):
    """The queries whose documents the change kept (a deleted document's make no sequence), and their stored rows."""
    alive = np.isin(queries, db.live())
    return queries[alive], (stored[0][alive], stored[1][alive])


def test_a_refresh_from_the_new_vectors_gives_the_full_searchs_neighbours():
    rng, db, appended, queries, stored = built(5, 5_000, 1_000, 1_500)
    db, new_ids = db.grown(appended, rng)  # a 20% append
    db.deleted_docs = set(rng.choice(np.unique(db.doc_of[:5_000]), 40, replace=False).tolist())
    queries, stored = still_made(db, queries, stored)

    (scores, ids), out = refresh(db, queries, stored, new_ids)
    full_scores, full_ids = db.search(queries, db.live())
    assert np.array_equal(ids, full_ids)
    assert np.allclose(scores, full_scores, atol=1e-6)
    # the change matters: new vectors entered, deleted ones left, and only those rows were searched again
    assert np.isin(ids, new_ids).any() and not np.array_equal(ids, stored[1])
    lost = (~np.isin(stored[1], db.live()) & (stored[1] >= 0)).any(axis=1)
    assert lost.any() and np.array_equal(out.search_again, lost)
    # without searching them again, those rows would be wrong: the rule is needed
    assert not np.array_equal(out.ids[lost], full_ids[lost])


def test_two_refreshes_in_turn_equal_one_over_both_changes():
    rng, db, appended, queries, stored = built(11, 4_000, 1_000, 1_000)
    first, first_new = db.grown(appended[:500], rng)
    first.deleted_docs = set(rng.choice(np.unique(db.doc_of), 15, replace=False).tolist())
    second, second_new = first.grown(appended[500:], rng)
    second.deleted_docs = first.deleted_docs | set(rng.choice(np.unique(first.doc_of), 15, replace=False).tolist())
    queries, stored = still_made(second, queries, stored)

    in_turn, _ = refresh(second, queries, refresh(first, queries, stored, first_new)[0], second_new)
    at_once, _ = refresh(second, queries, stored, np.concatenate([first_new, second_new]))
    assert np.array_equal(in_turn[1], at_once[1]) and np.allclose(in_turn[0], at_once[0], atol=1e-6)
    assert np.array_equal(at_once[1], second.search(queries, second.live())[1])


def test_a_row_the_build_left_short_is_filled_from_the_new_vectors_without_a_search_again():
    stored_scores = np.array([[0.9, 0.8, -3.4e38, -3.4e38]], np.float32)
    stored_ids = np.array([[4, 2, -1, -1]], np.int64)
    out = refreshed(
        stored_scores,
        stored_ids,
        np.zeros((1, K), bool),
        np.array([[0.85, 0.1, -3.4e38, -3.4e38]], np.float32),
        np.array([[30, 31, -1, -1]], np.int64),
    )
    assert out.ids.tolist() == [[4, 30, 2, 31]] and not out.search_again.any()
