"""Index slices by groups of nearby lists, searched with one coarse assignment per query and
each query sent only to the slices owning its probed lists: the same neighbours as one index."""

import faiss
import faiss.contrib.inspect_tools
import numpy as np
import pytest

from pipeline.index.factory import IndexBuildError
from pipeline.index.routing import (
    assemble_list_slice,
    list_blocks,
    list_owners,
    list_sizes,
    read_block,
    search_routed,
    slice_by_lists,
    slice_count,
    write_blocks,
)
from pipeline.index.search import search_excluding, set_search_depth

pytestmark = pytest.mark.unit

DIM, K = 32, 10


def _index(factory: str, vectors: int = 20_000, nprobe: int = 8):
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(64, DIM)).astype(np.float32)
    data = centres[rng.integers(0, 64, vectors)] + 0.6 * rng.normal(size=(vectors, DIM)).astype(np.float32)
    faiss.normalize_L2(data)
    index = faiss.index_factory(DIM, factory, faiss.METRIC_INNER_PRODUCT)
    index.train(data)
    index.add(data)
    set_search_depth(index, nprobe)
    queries = data[rng.integers(0, vectors, 300)] + 0.05 * rng.normal(size=(300, DIM)).astype(np.float32)
    return index, data, np.ascontiguousarray(queries / np.linalg.norm(queries, axis=1, keepdims=True))


def _slices(index, count: int):
    ivf = faiss.extract_index_ivf(index)
    sizes = list_sizes(index)
    owner = list_owners(ivf.quantizer.reconstruct_n(0, ivf.nlist), sizes, count)
    return slice_by_lists(index, owner), owner, sizes


def _same_slots(ids, scores, want_ids, want_scores) -> float:
    """Share of slots holding the same id, or a score tied within 1e-6 with the one index's."""
    return float(((ids == want_ids) | (np.abs(scores - want_scores) <= 1e-6)).mean())


@pytest.mark.parametrize("count", [1, 4, 16])
def test_routed_slices_return_one_indexs_neighbours(count):
    index, _, queries = _index("IVF256,Flat")
    want_scores, want_ids = index.search(queries, K)
    slices, owner, _ = _slices(index, count)
    scores, ids, deeper, sent = search_routed(index, slices, owner, queries, k=K)
    assert _same_slots(ids, scores, want_ids, want_scores) >= 0.999
    assert deeper == 0
    if count > 1:  # a query's 8 probed lists are neighbours, so it reaches few of the slices
        assert sent < 0.6 * len(queries) * min(count, 8)


def test_lists_are_shared_out_by_vectors():
    index, _, _ = _index("IVF256,Flat")
    _, owner, sizes = _slices(index, 16)
    per_slice = np.bincount(owner, weights=sizes, minlength=16)
    assert sorted(set(owner.tolist())) == list(range(16))
    assert per_slice.max() <= 1.5 * per_slice.mean()


@pytest.mark.parametrize("factory", ["IVF256,Flat", "IVF256_HNSW32,Flat"])
def test_deepening_is_decided_on_the_merged_result(factory):
    """Every id but three excluded: one index deepens until it finds them; so do the slices
    (each alone would see most of its lists empty and never know the query is short)."""
    index, data, queries = _index(factory, vectors=6_000)
    excluded = [(0, 1_000), (1_001, 3_000), (3_001, 5_999)]
    want_scores, want_ids, _ = search_excluding(index, queries[:20], 3, excluded)
    slices, owner, _ = _slices(index, 8)
    scores, ids, deeper, _ = search_routed(index, slices, owner, queries[:20], k=3, excluded_each=[excluded] * 20)
    assert deeper > 0
    assert (np.sort(ids, axis=1) == [1_000, 3_000, 5_999]).all()
    assert _same_slots(ids, scores, want_ids, want_scores) == 1.0


def test_a_slice_is_the_same_whatever_order_its_parts_arrive_in():
    """Parts filled from different files, their blocks assembled in either order: the same
    lists, sorted by chunk id, as one index filled in chunk-id order holds them."""
    index, data, _ = _index("IVF64,PQ8x8np", vectors=4_000)
    trained = faiss.clone_index(index)
    trained.reset()
    parts = []
    for start in (0, 2_000):
        part = faiss.clone_index(trained)
        part.add_with_ids(data[start : start + 2_000], np.arange(start, start + 2_000))
        parts.append(part)
    owner = list_owners(faiss.extract_index_ivf(index).quantizer.reconstruct_n(0, 64), list_sizes(index), 3)
    blocks = [b for part in parts for b in list_blocks(part, owner) if b.index_slice == 1]
    forward, backward = assemble_list_slice(trained, blocks), assemble_list_slice(trained, blocks[::-1])
    want = slice_by_lists(index, owner)[1]
    for one in (forward, backward):
        assert one.ntotal == want.ntotal == int(list_sizes(index)[owner == 1].sum())
        for listed in np.flatnonzero(owner == 1).tolist():
            got = faiss.contrib.inspect_tools.get_invlist(faiss.extract_index_ivf(one).invlists, listed)
            expected = faiss.contrib.inspect_tools.get_invlist(faiss.extract_index_ivf(want).invlists, listed)
            assert (got[0] == expected[0]).all() and (np.diff(got[0]) > 0).all()
            assert (got[1] == expected[1]).all()


def test_a_parts_blocks_written_one_after_another_are_each_read_back_alone_by_their_range(tmp_path):
    """What a piece's worker receives is where a block lies, not the block: read by its range
    from the part's blocks file, each block is the one written, and a slice assembled from the
    blocks read back is the slice assembled from the blocks themselves."""
    index, _, _ = _index("IVF64,PQ8x8np", vectors=4_000)
    owner = list_owners(faiss.extract_index_ivf(index).quantizer.reconstruct_n(0, 64), list_sizes(index), 3)
    blocks = list_blocks(index, owner)
    refs = write_blocks(blocks, str(tmp_path / "part-00000.blocks"))
    assert [r.index_slice for r in refs] == [b.index_slice for b in blocks] == [0, 1, 2]
    assert (tmp_path / "part-00000.blocks").stat().st_size == sum(r.nbytes for r in refs)
    trained = faiss.clone_index(index)
    trained.reset()
    for ref, block in reversed(list(zip(refs, blocks))):  # any order: each alone
        read = read_block(ref)
        for field in ("lists", "sizes", "ids", "codes"):
            assert np.array_equal(getattr(read, field), getattr(block, field)), field
        assembled, want = assemble_list_slice(trained, [read]), assemble_list_slice(trained, [block])
        assert faiss.serialize_index(assembled).tobytes() == faiss.serialize_index(want).tobytes()


def test_slice_count_bounds_every_slice():
    sizes = np.random.default_rng(0).integers(0, 500, 1_000)
    count = slice_count(sizes, 20_000)
    owner = list_owners(np.random.default_rng(1).normal(size=(1_000, 8)).astype(np.float32), sizes, count)
    assert np.bincount(owner, weights=sizes).max() <= 20_000
    with pytest.raises(IndexBuildError, match="larger index.slice_bytes"):
        slice_count(sizes, 499)


def test_an_exact_tie_across_slices_keeps_the_lowest_id_where_one_index_keeps_the_first_list_probed():
    """The one place routed slices differ from one index (docs/scale.md, "Index slices"): two vectors
    of exactly the same score in different lists owned by different slices."""
    quantizer = faiss.IndexFlatIP(2)
    quantizer.add(np.array([[0.65, 0.76], [0.6, -0.8]], np.float32))  # the query's nearer list first
    index = faiss.IndexIVFFlat(quantizer, 2, 2, faiss.METRIC_INNER_PRODUCT)
    index.is_trained = True
    index.add_with_ids(np.array([[0.6, 0.8], [0.6, -0.8]], np.float32), np.array([5, 3]))
    index.nprobe = 2
    query = np.array([[1.0, 0.0]], np.float32)
    _, one = index.search(query, 1)
    owner = np.array([0, 1], np.int32)
    _, routed, _, _ = search_routed(index, slice_by_lists(index, owner), owner, query, k=1)
    assert one.tolist() == [[5]] and routed.tolist() == [[3]]


def test_a_grown_slice_is_cut_and_a_list_empty_at_the_build_gets_the_owner_of_its_nearest(tmp_path):
    """Appending to slices: new vectors land in their lists' slices, a list nobody owned (empty
    at the build) goes to the slice of the nearest owned list, and a slice past the size limit
    is cut in lists; the routed search then answers as one index holding every vector."""
    from pipeline.chunks.deleted import DeletedRanges
    from pipeline.index.append import adopting_owners, change_slice, new_blocks, owners_after, renumbered
    from pipeline.index.train import write_piece
    from tests.helpers import write_embedding_files

    index, data, queries = _index("IVF64,Flat", vectors=8_000)
    trained = faiss.clone_index(index)
    trained.reset()
    _, lists = faiss.extract_index_ivf(trained).quantizer.search(data, 1)
    emptied = int(np.bincount(lists[:6_000].ravel()).argmax())  # the build saw no vector of this list
    old = np.flatnonzero(lists[:6_000].ravel() != emptied)
    base = faiss.clone_index(trained)
    base.add_with_ids(data[old], old)
    sizes = list_sizes(base)
    owner = list_owners(faiss.extract_index_ivf(trained).quantizer.reconstruct_n(0, 64), sizes, 4)
    owner[sizes == 0] = -1
    slices = slice_by_lists(base, owner)
    ids = np.arange(6_000, 8_000)
    paths = write_embedding_files(tmp_path, ids, data[6_000:], 2)  # two new files, encoded apart
    everything = faiss.clone_index(trained)  # one index holding every vector
    everything.add_with_ids(data[np.concatenate([old, ids])], np.concatenate([old, ids]))
    set_search_depth(everything, 8)

    adopting = adopting_owners(trained, owner)
    assert owner[emptied] == -1 and adopting[emptied] >= 0
    assert (np.delete(adopting, emptied) == np.delete(owner, emptied)).all()
    pieces: dict[int, list] = {}  # a piece of each slice per new file, as the append writes them
    for at, path in enumerate(paths):
        for block in new_blocks(faiss.clone_index(trained), path, adopting):
            piece = str(tmp_path / f"piece-{block.index_slice}-{at}.faiss")
            write_piece(faiss.clone_index(trained), [block], piece)
            pieces.setdefault(block.index_slice, []).append((at, piece))
    fits = int(max(s.ntotal for s in slices) * 1.1)
    changed, adopted = {}, {}
    for number in range(len(slices)):  # each slice alone, as its own worker takes it
        changed[number], _, lists = change_slice(
            slices[number],
            pieces=pieces.get(number, [])[::-1],  # merged in piece order whatever order they come in
            deleted=DeletedRanges.none(),
            fits=fits,
            trained_of=lambda: trained,
            owner=owner,
        )
        if len(lists):
            adopted[number] = lists
    assert sum(s.ntotal for p in changed.values() for _, s in p) + sum(
        slices[n].ntotal for n, p in changed.items() if not p
    ) == 8_000 - (6_000 - len(old))
    assert {n: lists.tolist() for n, lists in adopted.items()} == {int(adopting[emptied]): [emptied]}
    cut = {n: len(p) for n, p in changed.items() if p}
    numbers = renumbered(cut, len(slices))
    assert any(count > 1 for count in cut.values())
    pieces = {(n, at): lists for n, p in changed.items() for at, (lists, _) in enumerate(p) if lists is not None}
    owner = owners_after(owner, adopted, pieces, numbers)
    grown = sorted(((numbers[(n, at)], piece) for n, p in changed.items() for at, (_, piece) in enumerate(p) if at))
    for n, p in changed.items():
        if p:
            slices[n] = p[0][1]
    assert [number for number, _ in grown] == list(range(len(slices), len(slices) + len(grown)))
    slices += [piece for _, piece in grown]
    assert grown and all(s.ntotal <= fits for s in slices)
    for number, index_slice in enumerate(slices):  # every slice holds only lists it owns
        held = np.flatnonzero(list_sizes(index_slice))
        assert (owner[held] == number).all()
    want_scores, want_ids = everything.search(queries, K)
    scores, found, _, _ = search_routed(everything, slices, owner, queries, k=K)
    assert _same_slots(found, scores, want_ids, want_scores) >= 0.999
