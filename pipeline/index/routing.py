"""Index slices by groups of nearby inverted lists, and a search routed to them, without Beam.

Slices by chunk-id range would each hold a share of every list, so every query would go to
every slice, and each would repeat the coarse assignment and the per-query tables: the
search's cost would multiply with the slices. Here a slice owns whole lists, and the lists a
slice owns are neighbours in the embedding space (a k-means of the centroids), so a query's
probed lists fall in few slices. The coarse assignment runs once per query (`assign_lists`,
on the trained index without lists: the quantizer file); each query goes only to the slices
owning at least one of its probed lists, with those lists; each slice scans only them (faiss
`search_preassigned`, the other lists masked as -1); the slices' hits merge as one index lists
them (`slices.merge_hits`). A query whose merged top k is short after the exclusion is
searched again at twice the depth, on the merged result, as one index decides it. Exact score
ties between vectors of different lists, which live in different slices, keep the lowest ids,
where one index keeps the one in the list it probes first.

A slice's lists are sorted by chunk id, so a slice is the same whatever order its parts
arrive in; appending documents adds vectors to lists, which a later generation of slices
holds (the owner of a list never changes: it is fixed with the trained quantizer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import faiss
import numpy as np

from pipeline.index.factory import IndexBuildError
from pipeline.index.files import read_range, write_consecutive
from pipeline.index.search import exclusion_selector, quantizer_graph
from pipeline.index.slices import merge_hits


def slice_count(list_sizes: np.ndarray, fits: int) -> int:
    """Slices needed so that none holds more than `fits` vectors: `list_owners` cuts the lists
    into runs each starting within an equal share of the vectors, so a run holds at most one
    share plus its last list."""
    largest, total = int(list_sizes.max(initial=0)), int(list_sizes.sum())
    if largest >= fits:
        raise IndexBuildError(
            f"an inverted list holds {largest:,} vectors, and a slice at most {fits:,}: a slice owns whole "
            "lists, so use a larger index.slice_bytes (or more lists)"
        )
    if total <= fits:
        return 1
    return max(1, min(math.ceil(total / (fits - largest)), len(list_sizes)))


def list_owners(centroids: np.ndarray, list_sizes: np.ndarray, slices: int, seed: int = 0) -> np.ndarray:
    """The slice of each inverted list [nlist]: the lists ordered by a spherical k-means of their
    centroids into `slices` groups (nearby lists together), then cut into `slices` consecutive
    runs of about equal vectors (`list_sizes`), so slices are balanced and mostly one group each."""
    nlist = len(centroids)
    slices = max(1, min(slices, nlist))
    if slices == 1:
        return np.zeros(nlist, np.int32)
    kmeans = faiss.Kmeans(centroids.shape[1], slices, niter=20, seed=seed, spherical=True, min_points_per_centroid=1)
    kmeans.train(np.ascontiguousarray(centroids, dtype=np.float32))
    _, group = kmeans.index.search(np.ascontiguousarray(centroids, dtype=np.float32), 1)
    order = np.lexsort((np.arange(nlist), group.ravel()))
    before = np.cumsum(list_sizes[order]) - list_sizes[order]  # vectors ahead of each list in that order
    run = np.minimum(before * slices // max(int(list_sizes.sum()), 1), slices - 1)
    owner = np.empty(nlist, np.int32)
    owner[order] = run
    return owner


def list_sizes(index) -> np.ndarray:
    """Vectors in each inverted list of an IVF index [nlist]."""
    ivf = faiss.extract_index_ivf(index)
    invlists = _lists_of(ivf)
    return np.array([invlists.list_size(number) for number in range(ivf.nlist)], np.int64)


@dataclass(frozen=True)
class ListBlock:
    """What one filled part holds in the lists one slice owns: it travels to the worker
    assembling a piece of that slice (only codes and ids: the trained tables are in every
    slice already)."""

    index_slice: int
    lists: np.ndarray  # [b] list numbers
    sizes: np.ndarray  # [b] vectors in each
    ids: np.ndarray  # [sum(sizes)] chunk ids, list by list
    codes: np.ndarray  # [sum(sizes), code_size] uint8


@dataclass(frozen=True, kw_only=True)
class BlockRef:
    """Where one ListBlock lies in a blocks file (`write_blocks`): what travels through the
    shuffle to the worker assembling a piece, in place of the block's codes, which that worker
    reads by their byte range (`read_block`)."""

    path: str
    offset: int
    index_slice: int
    lists: int  # b
    vectors: int  # sum(sizes)
    code_size: int

    @property
    def nbytes(self) -> int:
        return 16 * self.lists + (8 + self.code_size) * self.vectors


def write_blocks(blocks: list[ListBlock], path: str) -> list[BlockRef]:
    """`blocks` one after another in one file (each: lists, sizes, ids as int64, then codes), so
    that each is read alone by its range: a part's blocks are read once, each by the worker
    assembling its slice's piece."""
    offsets = write_consecutive(
        path,
        (
            [*(np.asarray(a, np.int64) for a in (b.lists, b.sizes, b.ids)), np.asarray(b.codes, np.uint8)]
            for b in blocks
        ),
    )
    return [
        BlockRef(
            path=path,
            offset=offset,
            index_slice=b.index_slice,
            lists=len(b.lists),
            vectors=len(b.ids),
            code_size=b.codes.shape[1] if b.codes.ndim == 2 else 0,
        )
        for b, offset in zip(blocks, offsets)
    ]


def read_block(ref: BlockRef) -> ListBlock:
    data = read_range(ref.path, ref.offset, ref.nbytes)
    b, n = ref.lists, ref.vectors
    numbers = np.frombuffer(data, np.int64, 2 * b + n)
    codes = np.frombuffer(data, np.uint8, n * ref.code_size, offset=8 * (2 * b + n)).reshape(n, ref.code_size)
    return ListBlock(ref.index_slice, numbers[:b], numbers[b : 2 * b], numbers[2 * b :], codes)


def list_blocks(part, owner: np.ndarray) -> list[ListBlock]:
    """A filled IVF part cut by `owner` into one ListBlock per slice it has vectors for."""
    invlists = _lists_of(faiss.extract_index_ivf(part))
    sizes = list_sizes(part)
    blocks = []
    for number in np.unique(owner[sizes > 0]):
        lists = np.flatnonzero((owner == number) & (sizes > 0))
        contents = [_list_contents(invlists, int(listed)) for listed in lists]
        blocks.append(
            ListBlock(
                int(number),
                lists,
                sizes[lists],
                np.concatenate([ids for ids, _ in contents]),
                np.concatenate([codes for _, codes in contents]),
            )
        )
    return blocks


def _lists_of(ivf):
    if ivf.invlists is None:
        raise IndexBuildError("an IVF index without inverted lists cannot be sliced")
    return ivf.invlists


def _list_contents(invlists, number: int) -> tuple[np.ndarray, np.ndarray]:
    size = invlists.list_size(number)
    ids, codes = np.empty(size, np.int64), np.empty((size, invlists.code_size), np.uint8)
    if size:
        faiss.memcpy(faiss.swig_ptr(ids), invlists.get_ids(number), ids.nbytes)
        faiss.memcpy(faiss.swig_ptr(codes), invlists.get_codes(number), codes.nbytes)
    return ids, codes


def assemble_list_slice(trained, blocks):
    """A copy of the trained index holding the vectors of `blocks` (an iterable, read one at a
    time), each list then sorted by chunk id (the order one index merged from parts in
    chunk-id order scans them in, whatever order the blocks came in)."""
    index_slice = faiss.clone_index(trained)
    if faiss.extract_index_ivf(index_slice).ntotal:
        raise IndexBuildError("an index slice is assembled from the trained index without vectors")
    add_list_blocks(index_slice, blocks)
    return index_slice


def add_list_blocks(index_slice, blocks) -> None:
    """Add the vectors of `blocks` to a slice's lists, then sort every list by chunk id (also
    after `remove_ids`, which moves a list's last vectors into the gaps)."""
    ivf = faiss.extract_index_ivf(index_slice)
    invlists = _lists_of(ivf)
    ptr = faiss.swig_ptr
    for block in blocks:
        ends = np.cumsum(block.sizes)
        for listed, end, size in zip(block.lists.tolist(), ends.tolist(), block.sizes.tolist()):
            ids = np.ascontiguousarray(block.ids[end - size : end])
            codes = np.ascontiguousarray(block.codes[end - size : end])
            invlists.add_entries(listed, size, ptr(ids), ptr(codes))
        ivf.ntotal += int(ends[-1]) if len(ends) else 0
    for listed in np.flatnonzero(list_sizes(index_slice)).tolist():
        ids, codes = _list_contents(invlists, listed)
        order = np.argsort(ids, kind="stable")
        if (order != np.arange(len(order))).any():
            ids, codes = np.ascontiguousarray(ids[order]), np.ascontiguousarray(codes[order])
            invlists.update_entries(listed, 0, len(ids), ptr(ids), ptr(codes))
    index_slice.ntotal = ivf.ntotal  # a pre-transform wrapper counts too


def slice_by_lists(index, owner: np.ndarray) -> list:
    """A filled IVF index split into slices that each hold only the lists `owner` gives them
    (the trained quantizer and codebooks in every slice), as the index stage assembles them."""
    trained = faiss.clone_index(index)
    trained.reset()
    blocks = {block.index_slice: block for block in list_blocks(index, owner)}
    return [assemble_list_slice(trained, [blocks[n]] if n in blocks else []) for n in range(int(owner.max()) + 1)]


def assign_lists(quantized, queries: np.ndarray, depth: int) -> tuple[np.ndarray, np.ndarray]:
    """The coarse assignment, once per query: (centroid scores, list numbers) [q, depth] of the
    `depth` lists each query probes in the IVF index `quantized` (an HNSW quantizer walking at
    least that deep, as `search._search_params` sets it for a whole search)."""
    quantizer = faiss.extract_index_ivf(quantized).quantizer
    graph = quantizer_graph(quantized)
    params = None
    if graph is not None:
        params = faiss.SearchParametersHNSW(efSearch=max(graph.efSearch, depth))  # type: ignore[attr-defined]
    return quantizer.search(np.ascontiguousarray(queries, dtype=np.float32), depth, params=params)


def search_assigned(index_slice, queries: np.ndarray, *, k: int, lists: np.ndarray, list_scores: np.ndarray, selector):
    """One slice scanning only `lists` [q, w] (-1: not this slice's) of each query, with the
    ids `selector` rejects skipped: (scores, ids) [q, k]. (faiss's Python wrapper of
    search_preassigned takes no search parameters, so the C function is called.)"""
    ivf = faiss.extract_index_ivf(index_slice)
    n, width = lists.shape
    queries = np.ascontiguousarray(queries, dtype=np.float32)
    lists = np.ascontiguousarray(lists, dtype=np.int64)
    list_scores = np.ascontiguousarray(list_scores, dtype=np.float32)
    scores, ids = np.empty((n, k), np.float32), np.empty((n, k), np.int64)
    params = faiss.SearchParametersIVF(sel=selector, nprobe=width)  # type: ignore[call-arg]
    ptr = faiss.swig_ptr
    ivf.search_preassigned_c(  # type: ignore[attr-defined]  # the stubs list only the wrapper
        n, ptr(queries), k, ptr(lists), ptr(list_scores), ptr(scores), ptr(ids), False, params
    )
    return scores, ids


def route(lists: np.ndarray, owner: np.ndarray) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Probed lists [q, w] -> {slice: (the query rows it is sent, their lists [r, w] with -1
    where another slice owns the list)}, for each slice owning at least one probed list. One
    sort of the (row, slot) pairs by owner, so the work does not multiply with the slices."""
    width = lists.shape[1]
    owners = np.where(lists >= 0, owner[np.maximum(lists, 0)], -1).ravel()  # -1: a slot left empty
    order = np.argsort(owners, kind="stable")  # by slice, then row, then slot
    numbers, starts = np.unique(owners[order], return_index=True)
    routed = {}
    for number, start, end in zip(numbers.tolist(), starts.tolist(), [*starts[1:].tolist(), len(order)]):
        if number < 0:
            continue
        slots = order[start:end]
        rows, position = np.unique(slots // width, return_inverse=True)
        mine = np.full((len(rows), width), -1, np.int64)
        mine[position, slots % width] = lists.ravel()[slots]
        routed[number] = (rows, mine)
    return routed


def selector_groups(rows: np.ndarray, excluded_each):
    """The query `rows` grouped by their excluded chunk-id ranges (`excluded_each[row]`: one
    [(start, end)] per query; None: nothing excluded) -> (rows, faiss selector, what keeps it
    alive) per group, so queries sharing ranges (a sequence's chunks) are searched together."""
    if excluded_each is None:
        yield rows, None, []
        return
    groups: dict[tuple, list[int]] = {}
    for row in rows.tolist():
        groups.setdefault(tuple(excluded_each[row]), []).append(row)
    for ranges, members in groups.items():
        selector, keep = exclusion_selector(list(ranges))
        yield np.array(members, np.int64), selector, keep


def search_routed(
    quantized, slices, owner: np.ndarray, queries: np.ndarray, *, k: int, excluded_each=None, depth: int | None = None
):
    """The slices searched as one index: one coarse assignment per query at `depth` (default:
    `quantized`'s nprobe) on `quantized` (the trained index, or any slice), each query sent to
    the slices owning its probed lists, the hits merged. With `excluded_each` (per query, its
    [start, end) chunk-id ranges) those ids are skipped inside faiss, and the queries whose
    merged top k is short are searched again at twice the depth, up to every list, as one index
    deepens. `slices[n]` is slice n (a sequence that may load it on access; each round takes
    the slices in number order). -> (scores [q, k], ids [q, k] (-1 = none), deeper searches
    made, (query, slice) pairs sent)."""
    queries = np.ascontiguousarray(queries, dtype=np.float32)
    ivf = faiss.extract_index_ivf(quantized)
    sent = 0

    def search_at(rows: np.ndarray, at: int):
        nonlocal sent
        list_scores, lists = assign_lists(quantized, queries[rows], at)
        reached_rows: list[np.ndarray] = []
        found = []
        for number, (reached, mine) in sorted(route(lists, owner).items()):
            sent += len(reached)
            for positions, selector, _keep in selector_groups(
                np.arange(len(reached)), _subset(excluded_each, rows[reached])
            ):
                sent_rows = reached[positions]
                found.append(
                    search_assigned(
                        slices[number],
                        queries[rows[sent_rows]],
                        k=k,
                        lists=mine[positions],
                        list_scores=list_scores[sent_rows],
                        selector=selector,
                    )
                )
                reached_rows.append(sent_rows)
        return merge_hits(reached_rows, found, len(rows), k)

    depth = depth or ivf.nprobe
    everything = np.arange(len(queries))
    scores, ids = search_at(everything, depth)
    deeper = 0
    while excluded_each is not None and depth < ivf.nlist and (ids < 0).any():
        depth, deeper = min(2 * depth, ivf.nlist), deeper + 1
        short = np.flatnonzero((ids < 0).any(axis=1))
        scores[short], ids[short] = search_at(short, depth)
    return scores, ids, deeper, sent


def _subset(excluded_each, rows: np.ndarray):
    return None if excluded_each is None else [excluded_each[row] for row in rows.tolist()]
