"""Ties in an exact index: a pair scores the same whatever else its search call holds, and copies
of a vector tie exactly, so the chunk id decides (real faiss)."""

import faiss
import numpy as np
import pytest

from pipeline.index.search import search_each_excluding, search_excluding
from pipeline.index.ties import TIE_SLACK, exact_search, is_exact

pytestmark = pytest.mark.unit

D, N = 384, 5000
# one vector stored under these ids: more than k + TIE_SLACK hits hold, fewer than k + 16
COPIES = [0, 10, 20, 30, 100, 200, 300, 400, 600, 700, 800, 900, 1500, 2500, 4000, 4999]


def _index():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, D)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    x[COPIES] = x[0]
    index = faiss.IndexIDMap2(faiss.IndexFlatIP(D))
    index.add_with_ids(x, np.arange(N))
    others = rng.standard_normal((2047, D)).astype(np.float32)
    return index, x[0] * np.float32(0.9), others / np.linalg.norm(others, axis=1, keepdims=True)


def test_a_pair_scores_alike_alone_and_among_many_queries_and_copies_keep_the_lowest_ids():
    index, query, others = _index()
    # faiss alone rounds this pair differently in calls of other shapes (0.8999999 against 0.9)
    # 4 + 8 hits searched (the tie slack) hold 12 of the 16 copies: searched again, wider; 4 + 16 (the
    # range's margin) hold all
    assert TIE_SLACK == 8
    for excluded, lowest, wider in (((), [0, 10, 20, 30], True), (((0, 16),), [20, 30, 100, 200], False)):
        alone = search_each_excluding(index, query[None], 4, [excluded])
        among = search_each_excluding(index, np.vstack([others, query[None]]), 4, [excluded] * 2048)
        assert alone.ids[0].tolist() == among.ids[-1].tolist() == lowest
        assert np.array_equal(alone.scores[0], among.scores[-1])
        assert alone.searched_alone[0] == among.searched_alone[-1] == wider
    scores, ids, deeper = search_excluding(index, query[None], 3, [(0, 25)])
    assert ids[0].tolist() == [30, 100, 200] and deeper == 0 and len(set(scores[0].tolist())) == 1


def test_an_exact_search_widens_only_while_ties_reach_its_last_hit():
    index, query, others = _index()
    scores, ids = exact_search(index, np.vstack([query[None], others[:3]]), 2)
    assert ids[0].tolist() == [0, 10] and scores[0, 0] == scores[0, 1]
    assert np.array_equal(ids[1:], index.search(others[:3], 2)[1])  # no tie: faiss's own hits
    assert is_exact(index) and is_exact(faiss.IndexFlatIP(D))
    assert not is_exact(faiss.IndexFlatL2(D)) and not is_exact(faiss.index_factory(D, "IVF4,Flat"))
