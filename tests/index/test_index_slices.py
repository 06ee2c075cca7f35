"""Index slices by groups of inverted lists, seen as the one index they are cut from: a slice's
size, the tie order of merged hits, and a small SQ8 index written as slices and read back from
their files, searched routed (`routing.search_routed`) and merged plainly (as build-index tunes
on): what the one index answers, at several depths and with excluded ranges. The routing's own
rules (list owners, deepening, assembly order) are in test_routing.py."""

import functools
import types

import faiss
import numpy as np
import pytest

from pipeline.index.build_slices import AssembledSlices, AssemblePiece, merged_pieces
from pipeline.index.exact import exact_nearest_other
from pipeline.index.factory import IndexBuildError, estimated_bytes
from pipeline.index.files import load_index, write_index
from pipeline.index.recall import one_recall_at_k
from pipeline.index.routing import (
    assemble_list_slice,
    list_blocks,
    list_owners,
    list_sizes,
    search_routed,
    slice_by_lists,
    slice_count,
    write_blocks,
)
from pipeline.index.search import search_depth_range, search_excluding, set_search_depth
from pipeline.index.slices import merge_slice_results, vectors_per_slice
from pipeline.index.train import merge_part, train_index
from pipeline.index.tuning import tune_depth, tune_search_depth

pytestmark = pytest.mark.unit

N, D, FACTORY = 20_000, 32, "IVF128,SQ8"


def _owner(index, slices: int) -> np.ndarray:
    ivf = faiss.extract_index_ivf(index)
    return list_owners(ivf.quantizer.reconstruct_n(0, ivf.nlist), list_sizes(index), slices)


# --- a slice's size -------------------------------------------------------------------------


def test_a_slice_smaller_than_the_trained_index_is_an_error():
    factory, dim = "IVF2048,PQ128x8np", 384
    with pytest.raises(IndexBuildError, match="alone .* more than the slice size.*larger slice size"):
        vectors_per_slice(factory, dim, estimated_bytes(factory, 0, dim) - 1)
    assert vectors_per_slice(factory, dim, estimated_bytes(factory, 1000, dim)) == 1000


# --- exact ties: the single index's order ---------------------------------------------------


@pytest.mark.parametrize("factory", ["IVF16,Flat", "IVF16,PQ4x8np"])
def test_exact_ties_come_back_as_the_single_index_gives_them(factory):
    """One vector five times, in three parts (embeddings files): the slices assembled from the
    parts' blocks, last part first, keep the lowest ids of the copies and list them highest
    first, as the one index filled in chunk-id order does; routed or merged plainly."""
    rng = np.random.default_rng(3)
    vectors = rng.normal(size=(3000, 16)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    vectors[[5, 17, 1040, 1041, 2077]] = vectors[0]
    ids = np.arange(len(vectors), dtype=np.int64)
    trained = train_index(factory, vectors)
    single, parts = faiss.clone_index(trained), []
    single.add_with_ids(vectors, ids)
    for start in range(0, len(ids), 1000):
        parts.append(faiss.clone_index(trained))
        parts[-1].add_with_ids(vectors[start : start + 1000], ids[start : start + 1000])
    owner = _owner(single, 4)
    blocks = [block for part in reversed(parts) for block in list_blocks(part, owner)]
    slices = [assemble_list_slice(trained, [b for b in blocks if b.index_slice == n]) for n in range(4)]
    for index in [single, *slices]:
        set_search_depth(index, 4)
    for k in (2, 3, 4, 6, 8):
        expected_scores, expected = single.search(vectors[:1], k)
        scores, found, _, _ = search_routed(single, slices, owner, vectors[:1], k=k)
        plain_scores, plain = merge_slice_results([s.search(vectors[:1], k) for s in slices], k)
        assert found.tolist() == plain.tolist() == expected.tolist()
        assert np.array_equal(scores, expected_scores) and np.array_equal(plain_scores, expected_scores)
        # build-index merges the slices' results as they come, in whatever order: the same
        each = [
            AssembledSlices(({"path": f"slice-{n:05d}.faiss"},), {4: (*s.search(vectors[:1], k), 1.0)}, {})
            for n, s in enumerate(slices)
        ]
        for order in (each, each[::-1], [each[1], each[3], each[0], each[2]]):
            merged = functools.reduce(AssembledSlices.merged, order)
            assert merged.results[4][1].tolist() == expected.tolist() and merged.results[4][2] == 4.0
            assert [f["path"] for f in merged.files] == [f"slice-{n:05d}.faiss" for n in range(4)]
    assert search_routed(single, slices, owner, vectors[:1], k=3)[1][0].tolist() == [17, 5, 0]


def test_a_slice_merged_from_pieces_is_the_slice_assembled_from_all_its_blocks(tmp_path):
    """Each part's blocks of a slice assembled into a piece (`AssemblePiece`, which reads them
    from the part's blocks file by their ranges), the pieces arriving in any order: merged, the
    same index file as the slice assembled from every block at once (lists sorted by chunk id)."""
    rng = np.random.default_rng(4)
    vectors = rng.normal(size=(3000, 16)).astype(np.float32)
    trained = train_index("IVF16,PQ4x4", vectors)
    trained_path = str(tmp_path / "trained.faiss")
    write_index(trained, trained_path)
    parts = []
    for start in range(0, len(vectors), 1000):
        parts.append(faiss.clone_index(trained))
        parts[-1].add_with_ids(vectors[start : start + 1000], np.arange(start, start + 1000, dtype=np.int64))
    single = faiss.clone_index(trained)
    single.add_with_ids(vectors, np.arange(len(vectors), dtype=np.int64))
    owner = _owner(single, 2)
    blocks_of = [list_blocks(part, owner) for part in parts]
    refs_of = [write_blocks(blocks, str(tmp_path / f"part-{p}.blocks")) for p, blocks in enumerate(blocks_of)]
    assembling = AssemblePiece(str(tmp_path))
    for n in range(2):
        blocks = [[b for b in part if b.index_slice == n] for part in blocks_of]
        refs = [[r for r in part if r.index_slice == n] for part in refs_of]
        whole = assemble_list_slice(trained, [b for part in blocks[::-1] for b in part])
        pieces = [next(assembling.process(((n, p), part), trained_path))[1] for p, part in enumerate(refs)]
        merged = merged_pieces(trained_path, pieces[::-1])
        assert faiss.serialize_index(merged).tobytes() == faiss.serialize_index(whole).tobytes()


# --- a small SQ8 index in slices, read back from their files --------------------------------


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The one index; its lists shared out by `slice_count` for a slice size of a quarter of
    the vectors; the slices written and loaded back (memory-mapped), set to nprobe 1 so that
    only the depth a search is given counts; held-out queries and their exact neighbours."""
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(64, D)).astype(np.float32)
    vectors = centres[rng.integers(0, 64, N + 300)] + 0.6 * rng.normal(size=(N + 300, D)).astype(np.float32)
    faiss.normalize_L2(vectors)
    vectors, queries = vectors[:N], vectors[N:]
    ids = np.arange(N, dtype=np.int64) * 2 + 1_000_000  # not positions: ids must survive as-is
    single = train_index(FACTORY, vectors)
    single.add_with_ids(vectors, ids)
    slice_bytes = estimated_bytes(FACTORY, N // 4, D)
    sizes = list_sizes(single)
    owner = _owner(single, slice_count(sizes, vectors_per_slice(FACTORY, D, slice_bytes)))
    root = tmp_path_factory.mktemp("index_slices")
    paths = [root / f"slice-{n:05d}.faiss" for n in range(int(owner.max()) + 1)]
    for path, index_slice in zip(paths, slice_by_lists(single, owner)):
        write_index(index_slice, str(path))
    slices = [load_index(str(path), depth=1, sha256=None) for path in paths]
    query_ids = np.arange(len(queries), dtype=np.int64) + 10**9
    truth = exact_nearest_other(query_ids, queries, ids, vectors)
    return types.SimpleNamespace(
        single=single,
        slices=slices,
        paths=paths,
        owner=owner,
        sizes=sizes,
        slice_bytes=slice_bytes,
        ids=ids,
        vectors=vectors,
        queries=queries,
        query_ids=query_ids,
        truth=truth,
    )


def test_slices_fit_their_size_and_hold_only_their_lists(built):
    assert len(built.slices) >= 4
    assert all(path.stat().st_size <= built.slice_bytes for path in built.paths)
    assert sum(s.ntotal for s in built.slices) == N
    for number, index_slice in enumerate(built.slices):
        assert (list_sizes(index_slice) == np.where(built.owner == number, built.sizes, 0)).all()


def _routed_at(built, depth):
    """The slices as one index's `search`, routed at `depth`."""
    return types.SimpleNamespace(
        search=lambda q, k: search_routed(built.single, built.slices, built.owner, q, k=k, depth=depth)[:2]
    )


@pytest.mark.parametrize("depth", [4, 16, 128])  # 128: every list
def test_slices_answer_what_the_single_index_answers(built, depth):
    set_search_depth(built.single, depth)
    expected_scores, expected = built.single.search(built.queries, 10)
    scores, found, deeper, _ = search_routed(built.single, built.slices, built.owner, built.queries, k=10, depth=depth)
    assert deeper == 0 and np.mean(found == expected) >= 0.995
    assert np.allclose(scores[found == expected], expected_scores[found == expected], rtol=0, atol=1e-6)
    # build-index tunes on each slice searched plainly at the depth, merged
    params = faiss.SearchParametersIVF(nprobe=depth)  # type: ignore[call-arg]
    plain = merge_slice_results([s.search(built.queries, 10, params=params) for s in built.slices], 10)
    assert np.array_equal(plain[1], found) and np.array_equal(plain[0], scores)
    args = built.query_ids, built.queries, built.truth
    assert one_recall_at_k(_routed_at(built, depth), *args) == one_recall_at_k(built.single, *args)


def test_tuning_over_slices_finds_the_single_index_depth(built):
    args = built.query_ids, built.queries, built.truth
    expected = tune_search_depth(built.single, *args, target=0.9)
    depths = search_depth_range(built.slices[0])
    depth, recall, _ = tune_depth(depths, lambda d: one_recall_at_k(_routed_at(built, d), *args), 0.9)
    assert (depth, recall) == (expected[0], expected[1]) and depth > 1


def test_excluded_ranges_as_one_index_excludes_them(built):
    """Sequences of 32 indexed chunks, each with its own chunk-id span excluded (as the
    retrieval stage searches), all in one routed search."""
    set_search_depth(built.single, 8)
    starts = np.random.default_rng(5).choice(N - 32, 20, replace=False)
    excluded_each, expected, rows = [], [], []
    for start in starts:
        excluded = [(int(built.ids[start]) - 100, int(built.ids[start + 31]) + 101)]
        expected.append(search_excluding(built.single, built.vectors[start : start + 32], 10, excluded)[1])
        excluded_each += [excluded] * 32
        rows.append(np.arange(start, start + 32))
    queries = built.vectors[np.concatenate(rows)]
    _, found, _, _ = search_routed(built.single, built.slices, built.owner, queries, k=10, excluded_each=excluded_each)
    assert (found >= 0).all()
    for ranges, row in zip(excluded_each, found):
        assert not any(((row >= start) & (row < end)).any() for start, end in ranges)
    assert np.mean(found == np.concatenate(expected)) >= 0.995


# --- parts ----------------------------------------------------------------------------------


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
    merge_part(merged, read_index(str(tmp_path / "part.faiss"), sha256=None))
    for index in (merged, whole):
        set_search_depth(index, 8)
    assert np.array_equal(merged.search(vectors[:100], 10)[1], whole.search(vectors[:100], 10)[1])


def test_files_without_a_number_are_spread_over_pieces():
    """`index` over hand-given files: unnumbered names would all be one piece (one group through
    the shuffle); a hash of the path spreads them, the numbered ones keep their runs."""
    from pipeline.index.build_slices import piece_of

    assert [piece_of(f"emb/embeddings-{n:05d}.parquet", 100, 800) for n in (0, 99, 100, 799)] == [0, 0, 1, 7]
    names = [f"hand/given/part_{letter}.parquet" for letter in "abcdefghijklmnopqrstuvwx"]
    unnumbered = [piece_of(name, 100, 800) for name in names]
    assert all(-8 <= piece < 0 for piece in unnumbered) and len(set(unnumbered)) >= 4
    assert unnumbered == [piece_of(name, 100, 800) for name in names]  # the same on every run
