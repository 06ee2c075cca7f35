"""Index slices by chunk-id range (`pipeline.index.slices`): the plan, and 300,000 clustered
384-d vectors under a 64 MiB budget's factory cut into 12 MiB slices that, searched together,
answer what the one merged index answers."""

import faiss
import numpy as np
import pytest

from benchmarks.synthetic import LowRankClusters
from pipeline.index.exact import exact_nearest_other
from pipeline.index.factory import IndexBuildError, choose_index_factory, estimated_bytes, training_size
from pipeline.index.files import load_index, write_index
from pipeline.index.recall import one_recall_at_k
from pipeline.index.sampling import TRAIN_SALT, in_sample
from pipeline.index.search import search_excluding, set_search_depth
from pipeline.index.slices import assemble_slice, plan_slices, recall_of_slices, search_slices, tune_slices_depth
from pipeline.index.train import merge_part, train_index
from pipeline.index.tuning import tune_search_depth

N, D, BUDGET, SLICE_BYTES, PART_ROWS = 300_000, 384, 64 * 2**20, 12 * 2**20, 32_768
FACTORY = "IVF2048,PQ128x8np"  # choose_index_factory(N, D, BUDGET), checked below


# --- the plan -------------------------------------------------------------------------------


@pytest.mark.unit
def test_everything_that_fits_is_one_slice():
    assert plan_slices([PART_ROWS] * 4, FACTORY, D, 10**9) == [range(0, 4)]
    assert plan_slices([], FACTORY, D, SLICE_BYTES) == []


@pytest.mark.unit
def test_slices_are_the_fewest_consecutive_groups_that_fit():
    rng = np.random.default_rng(0)
    for _ in range(20):
        rows = rng.integers(0, 40_000, rng.integers(1, 30)).tolist()
        slices = plan_slices(rows, FACTORY, D, SLICE_BYTES)
        assert [p for s in slices for p in s] == list(range(len(rows)))
        sizes = [sum(rows[p] for p in s) for s in slices]
        assert all(estimated_bytes(FACTORY, n, D) <= SLICE_BYTES for n in sizes)
        # greedy: each slice is full, the next slice's first part would not have fitted
        assert all(estimated_bytes(FACTORY, n + rows[s.stop], D) > SLICE_BYTES for n, s in zip(sizes, slices[:-1]))


@pytest.mark.unit
def test_a_part_larger_than_a_slice_is_an_error():
    with pytest.raises(
        IndexBuildError,
        match=r"file 1 holds 70,000 vectors.*at most 66,499: lower "
        r"chunk_file_rows",
    ):
        plan_slices([PART_ROWS, 70_000], FACTORY, D, SLICE_BYTES)


@pytest.mark.unit
def test_a_slice_smaller_than_the_trained_index_is_an_error():
    with pytest.raises(IndexBuildError, match="alone .* more than the slice size.*larger slice size"):
        plan_slices([10], FACTORY, D, estimated_bytes(FACTORY, 0, D) - 1)


# --- exact ties: the single index's order ---------------------------------------------------


@pytest.mark.parametrize("factory", ["IVF16,Flat", "IVF16,PQ4x8np"])
@pytest.mark.unit
def test_exact_ties_come_back_as_the_single_index_gives_them(factory):
    rng = np.random.default_rng(3)
    vectors = rng.normal(size=(3000, 16)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    copies = [5, 17, 1040, 1041, 2077]  # one vector five times, in three parts
    vectors[copies] = vectors[0]
    ids = np.arange(len(vectors), dtype=np.int64)
    trained = train_index(factory, vectors)
    parts = []
    for start in range(0, len(ids), 1000):
        parts.append(faiss.clone_index(trained))
        parts[-1].add_with_ids(vectors[start : start + 1000], ids[start : start + 1000])
    single = assemble_slice(trained, [faiss.clone_index(p) for p in parts])
    slices = [assemble_slice(trained, [p]) for p in parts]
    for index in [single, *slices]:
        set_search_depth(index, 4)
    for k in (2, 3, 4, 6, 8):
        expected = single.search(vectors[:1], k)
        scores, found, _ = search_slices(slices, vectors[:1], k)
        assert found.tolist() == expected[1].tolist() and np.array_equal(scores, expected[0])
    assert search_slices(slices, vectors[:1], 3)[1][0].tolist() == [17, 5, 0]  # lowest kept, highest first


@pytest.mark.unit
def test_slices_must_share_one_depth():
    vectors = np.random.default_rng(4).normal(size=(2000, 16)).astype(np.float32)
    trained = train_index("IVF16,Flat", vectors)
    slices = [faiss.clone_index(trained), faiss.clone_index(trained)]
    set_search_depth(slices[1], 2)
    with pytest.raises(ValueError, match="one nprobe"):
        search_slices(slices, vectors[:2], 3)
    assert search_slices(slices, vectors[:2], 3, depth=2)[1].shape == (2, 3)  # an explicit depth is one depth


# --- 300,000 vectors, 12 MiB slices ---------------------------------------------------------
# A run at corpus scale (minutes): e2e and slow, though no Beam runs, so that `-m unit` stays quick.


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Trained once; each part filled once; the single index merged from copies of the parts,
    the slices assembled from the parts and read back from their files, one by one."""
    assert choose_index_factory(N, D, BUDGET) == FACTORY
    model = LowRankClusters(D)
    vectors = model.sample(N, np.random.default_rng(1))
    ids = np.arange(N, dtype=np.int64) * 2 + 1_000_000  # not positions: ids must survive as-is
    trained = train_index(FACTORY, vectors[in_sample(ids, training_size(N, FACTORY), N, TRAIN_SALT)])
    parts = []
    for start in range(0, N, PART_ROWS):
        parts.append(faiss.clone_index(trained))
        parts[-1].add_with_ids(vectors[start : start + PART_ROWS], ids[start : start + PART_ROWS])
    single = faiss.clone_index(trained)
    for part in parts:
        merge_part(single, faiss.clone_index(part))
    plan = plan_slices([p.ntotal for p in parts], FACTORY, D, SLICE_BYTES)
    root = tmp_path_factory.mktemp("index_slices")
    paths = []
    for number, group in enumerate(plan):
        paths.append(root / f"slice-{number:05d}.faiss")
        faiss.write_index(assemble_slice(trained, [parts[p] for p in group]), str(paths[-1]))
    slices = [load_index(str(path)) for path in paths]  # each file alone
    queries = model.sample(1000, np.random.default_rng(2))  # held out: in no part, no sample
    query_ids = np.arange(len(queries), dtype=np.int64) + 10**9
    truth = exact_nearest_other(query_ids, queries, ids, vectors)
    depth, _, _ = tune_search_depth(single, query_ids, queries, truth, 0.95)
    for index_slice in slices:
        set_search_depth(index_slice, depth)
    return {
        "ids": ids,
        "vectors": vectors,
        "single": single,
        "slices": slices,
        "paths": paths,
        "plan": plan,
        "queries": queries,
        "query_ids": query_ids,
        "truth": truth,
        "depth": depth,
    }


@pytest.mark.slow  # the module's `built` fixture: ~2.5 min, paid by the first test that uses it
@pytest.mark.e2e
def test_slices_fit_their_size_and_hold_their_id_range(built):
    plan, slices, ids = built["plan"], built["slices"], built["ids"]
    assert len(plan) >= 4
    assert all(path.stat().st_size <= SLICE_BYTES for path in built["paths"])
    assert sum(s.ntotal for s in slices) == N
    for group, index_slice in zip(plan, slices):
        own = ids[group.start * PART_ROWS : group.stop * PART_ROWS]
        _, found = index_slice.search(built["queries"][:200], 10)
        assert index_slice.ntotal == len(own) and np.isin(found[found >= 0], own).all()


@pytest.mark.parametrize("depth", [None, 16])  # the depth tuned on the single index, and a deeper one
@pytest.mark.slow  # uses `built`
@pytest.mark.e2e
def test_slices_answer_what_the_single_index_answers(built, depth):
    single, slices, queries = built["single"], built["slices"], built["queries"]
    nprobe = depth or built["depth"]
    set_search_depth(single, nprobe)
    expected_scores, expected = single.search(queries, 10)
    scores, found, deeper = search_slices(slices, queries, 10, depth=depth)
    assert deeper == 0 and np.mean(found == expected) >= 0.995
    assert np.allclose(scores[found == expected], expected_scores[found == expected], rtol=0, atol=1e-6)
    args = built["query_ids"], queries, built["truth"]
    single_recall, sliced_recall = one_recall_at_k(single, *args), recall_of_slices(slices, *args, depth=depth)
    assert single_recall >= 0.95 and abs(sliced_recall - single_recall) <= 0.01


@pytest.mark.slow  # uses `built`
@pytest.mark.e2e
def test_tuning_over_slices_finds_the_single_index_depth(built):
    slices, args = built["slices"], (built["query_ids"], built["queries"], built["truth"])
    depth, recall, _ = tune_slices_depth(slices, *args, 0.95)
    assert depth == built["depth"] and recall >= 0.95
    assert all(faiss.extract_index_ivf(s).nprobe == depth for s in slices)


def _outside(found, excluded):
    return all(not ((found >= start) & (found < end)).any() for start, end in excluded)


@pytest.mark.slow  # uses `built`
@pytest.mark.e2e
def test_excluded_ranges_as_one_index_excludes_them(built):
    """Sequences of 32 indexed chunks, each with its own chunk-id span excluded (as the
    retrieval stage searches)."""
    single, slices, ids, vectors = built["single"], built["slices"], built["ids"], built["vectors"]
    set_search_depth(single, built["depth"])
    same = total = 0
    for start in np.random.default_rng(5).choice(N - 32, 60, replace=False):
        excluded = [(int(ids[start]) - 100, int(ids[start + 31]) + 101)]
        expected = search_excluding(single, vectors[start : start + 32], 10, excluded)
        scores, found, deeper = search_slices(slices, vectors[start : start + 32], 10, excluded)
        assert _outside(found, excluded) and (found >= 0).all() and deeper == expected[2]
        same, total = same + (found == expected[1]).sum(), total + found.size
    assert same / total >= 0.995


@pytest.mark.slow  # uses `built`
@pytest.mark.e2e
def test_exclusion_deepens_as_one_index_does(built):
    """All but 150 vectors of each slice excluded: at the tuned depth the probed lists hold
    fewer than k, so the search deepens; decided on the merged result, as one index decides."""
    single, slices, ids, plan = built["single"], built["slices"], built["ids"], built["plan"]
    starts = [int(ids[group.start * PART_ROWS]) for group in plan]
    kept = [(s, s + 2 * 150) for s in starts]  # ids step by 2
    excluded = [(0, kept[0][0])] + [(a[1], b[0]) for a, b in zip(kept, kept[1:])] + [(kept[-1][1], 2**62)]
    set_search_depth(single, built["depth"])
    queries = built["queries"][:300]
    expected_scores, expected, expected_deeper = search_excluding(single, queries, 10, excluded)
    scores, found, deeper = search_slices(slices, queries, 10, excluded)
    assert expected_deeper > 0 and deeper == expected_deeper
    assert _outside(found, excluded) and (found >= 0).all()
    assert np.mean(found == expected) >= 0.995


@pytest.mark.unit
def test_a_part_is_written_without_the_coarse_quantizer_and_merges_as_a_whole_one(tmp_path):
    from pipeline.index.files import read_index
    from pipeline.index.train import write_part

    rng = np.random.default_rng(3)
    vectors = rng.standard_normal((4000, 32)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    trained = train_index("IVF256,Flat", vectors)
    whole, part = faiss.clone_index(trained), faiss.clone_index(trained)
    whole.add_with_ids(vectors, np.arange(4000))
    part.add_with_ids(vectors, np.arange(4000))
    stripped, _ = write_part(part, str(tmp_path / "part.faiss"))
    full, _ = write_index(part, str(tmp_path / "full.faiss"))
    assert full - stripped >= 256 * 32 * 4  # the quantizer's centroids stayed behind
    merged = faiss.clone_index(trained)
    merge_part(merged, read_index(str(tmp_path / "part.faiss")))
    for index in (merged, whole):
        set_search_depth(index, 8)
    assert np.array_equal(merged.search(vectors[:100], 10)[1], whole.search(vectors[:100], 10)[1])
