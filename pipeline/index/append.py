"""Changing a committed index: the new vectors added to the trained, filled index (no
retraining: the lists stay as trained), deleted documents' vectors removed, and how well its
tuned depth still finds the new vectors' neighbours, which tells when retraining is due
(docs/design.md §8, "Appending and deleting").

The index is one file (Flat, HNSW or IVF; HNSW cannot remove vectors), or IVF slices by
inverted lists, changed one slice per worker: each new embedding file is encoded on the trained
index and cut into the blocks of the slices owning its lists (`new_blocks`); a list empty at the
build has no owner, and the slice owning the nearest owned list takes it (`adopting_owners`).
A slice's blocks from a run of new files make a piece (`train.write_piece`); each slice then
takes its pieces and loses its deleted vectors (`change_slice`); one grown past
the slice size is cut in pieces as the build cuts an index, and `renumbered` numbers the new
pieces after the last slice, in slice order, once every slice is done.
"""

from __future__ import annotations

from dataclasses import dataclass

import faiss
import numpy as np

from pipeline.chunks.deleted import DeletedRanges
from pipeline.common.sampling import QUERY_SALT, in_sample
from pipeline.index.exact import exact_nearest_other, merge_nearest
from pipeline.index.files import read_embeddings
from pipeline.index.recall import RECALL_K
from pipeline.index.routing import (
    ListBlock,
    add_list_blocks,
    assign_lists,
    list_blocks,
    list_owners,
    list_sizes,
    slice_count,
)
from pipeline.index.slices import merge_slice_results
from pipeline.index.train import merge_pieces

SEARCHED = RECALL_K + 1  # hits kept per query: the query itself is among them


@dataclass(frozen=True)
class NewVectorRecall:
    """RECALL_MEASURE of sampled new vectors at the index's depth, against exact search over
    every vector: as the index build measures it, so the two compare."""

    value: float
    sample_size: int


def add_in_file_order(index, embedding_paths: list[str]) -> int:
    """Add every vector of these embedding files (given in chunk-id order), their chunk ids as
    faiss ids; the vectors added."""
    added = 0
    for path in embedding_paths:
        for ids, vectors in read_embeddings(path):
            index.add_with_ids(vectors, ids)
            added += len(ids)
    return added


@dataclass(frozen=True)
class NewQueries:
    """About `sample` of an append's new vectors, chosen by a hash of their ids (the index
    build's query sample rule), ids ascending: the queries of its recall measure."""

    ids: np.ndarray  # [q]
    vectors: np.ndarray  # [q, d]

    @classmethod
    def of_file(cls, path: str, sample: int, population: int) -> NewQueries:
        """This embedding file's share of the sample, `population` vectors being new in all."""
        ids, vectors = [], []
        for batch_ids, batch_vectors in read_embeddings(path):
            keep = in_sample(batch_ids, sample, population, QUERY_SALT)
            ids.append(batch_ids[keep])
            vectors.append(batch_vectors[keep])
        return cls.joined([cls(i, v) for i, v in zip(ids, vectors)])

    @classmethod
    def joined(cls, parts: list[NewQueries]) -> NewQueries:
        parts = [p for p in parts if len(p.ids)]
        if not parts:
            return cls(np.zeros(0, np.int64), np.zeros((0, 0), np.float32))
        ids = np.concatenate([p.ids for p in parts])
        order = np.argsort(ids, kind="stable")
        return cls(ids[order], np.ascontiguousarray(np.concatenate([p.vectors for p in parts])[order]))


def truth_in_file(path: str, queries: NewQueries, deleted: DeletedRanges):
    """The queries' exact nearest other vectors among this embedding file's vectors not
    deleted ((scores, ids) [q, depth]; merge files with `merge_nearest`); None: none there."""
    truth = None
    for ids, vectors in read_embeddings(path):
        kept = ~deleted.contains(ids)
        if kept.any():
            found = exact_nearest_other(queries.ids, queries.vectors, ids[kept], vectors[kept])
            truth = found if truth is None else merge_nearest(truth, found)
    return truth


def remove_deleted(index, deleted: DeletedRanges) -> int:
    """Remove the deleted documents' vectors from the index; the vectors removed."""
    if not len(deleted):
        return 0
    return int(index.remove_ids(faiss.IDSelectorBatch(deleted.chunk_ids())))


def centroids_of(trained) -> np.ndarray:
    ivf = faiss.extract_index_ivf(trained)
    return ivf.quantizer.reconstruct_n(0, ivf.nlist)


def adopting_owners(trained, owner: np.ndarray) -> np.ndarray:
    """`owner` with every list that has none (empty at the build) given the owner of the
    owned list whose centroid is nearest its own: where new vectors of that list go."""
    orphans = np.flatnonzero(owner < 0)
    if not len(orphans):
        return owner
    centroids = centroids_of(trained)
    owned = np.flatnonzero(owner >= 0)
    nearest = faiss.IndexFlatL2(centroids.shape[1])
    nearest.add(np.ascontiguousarray(centroids[owned]))
    _, found = nearest.search(np.ascontiguousarray(centroids[orphans]), 1)
    adopting = owner.copy()
    adopting[orphans] = owner[owned[found.ravel()]]
    return adopting


def new_blocks(emptied, path: str, adopting: np.ndarray) -> list[ListBlock]:
    """One new embedding file's vectors encoded on `emptied` (the trained index, no vectors)
    and cut into a block per slice owning their lists (`adopting_owners`)."""
    add_in_file_order(emptied, [path])
    return list_blocks(emptied, adopting)


def probed_slices(trained, queries: np.ndarray, depth: int, adopting: np.ndarray) -> frozenset[int]:
    """The slices owning a list that some query probes at `depth` (the routed search's rule):
    the only ones whose hits can reach the queries' top k."""
    if not len(queries):
        return frozenset()
    _, lists = assign_lists(trained, queries, depth)
    listed = lists[lists >= 0]
    return frozenset(int(s) for s in np.unique(adopting[listed]) if s >= 0)


def cut_in_pieces(index_slice, trained, fits: int) -> list[tuple[np.ndarray, faiss.Index]]:
    """A slice holding more than `fits` vectors cut into as many as its lists need
    (`slice_count`, `list_owners` over its lists, as the build cuts an index): [(the lists a
    piece holds, the piece)], the piece that keeps the slice's number first."""
    sizes = list_sizes(index_slice)
    held = np.flatnonzero(sizes)
    count = slice_count(sizes[held], fits)
    _, cut = np.unique(list_owners(centroids_of(trained)[held], sizes[held], count), return_inverse=True)
    local = np.full(len(sizes), -1, np.int64)
    local[held] = cut
    pieces = []
    for block in sorted(list_blocks(index_slice, local), key=lambda b: b.index_slice):
        piece = faiss.clone_index(trained)
        add_list_blocks(piece, [block])
        pieces.append((block.lists, piece))
    return pieces


def change_slice(index_slice, *, pieces, deleted: DeletedRanges, fits: int | None, trained_of, owner: np.ndarray):
    """One slice changed: this generation's deleted vectors removed, its new vectors merged from
    their pieces ((piece, path), `train.write_piece`: no worker holds all of a slice's new codes
    at once) in piece order, every list in chunk-id order again, cut when past `fits`
    (`trained_of()` reads the trained index only then). -> (pieces [(lists held, index)], or []
    when the slice is unchanged, or [(None, slice)] when changed and not cut; vectors removed;
    the lists without `owner` it took new vectors into)."""
    removed = remove_deleted(index_slice, deleted)
    if not removed and not pieces:
        return [], 0, np.zeros(0, np.int64)
    merge_pieces(index_slice, pieces)
    adopted = np.flatnonzero((list_sizes(index_slice) > 0) & (owner < 0))
    if fits is not None and index_slice.ntotal > fits:
        return cut_in_pieces(index_slice, trained_of(), fits), removed, adopted
    return [(None, index_slice)], removed, adopted


def renumbered(cuts: dict[int, int], first_new: int) -> dict[tuple[int, int], int]:
    """{slice: pieces it was cut in} -> {(slice, piece): number}: the first piece keeps its
    slice's number, the others are numbered from `first_new` on, in slice order (deterministic,
    however the slices were spread over workers)."""
    numbers, after = {}, first_new
    for number in sorted(cuts):
        numbers[(number, 0)] = number
        for piece in range(1, cuts[number]):
            numbers[(number, piece)] = after
            after += 1
    return numbers


def owners_after(
    owner: np.ndarray, adopted: dict[int, np.ndarray], pieces: dict[tuple[int, int], np.ndarray], numbers
) -> np.ndarray:
    """The list owners after a change: lists without owner that a slice took new vectors into
    (`adopted`: slice -> lists) given it, then the lists of every piece of a cut slice
    (`pieces`: (slice, piece) -> lists) given the piece's number (`renumbered`)."""
    owner = owner.copy()
    for number, lists in adopted.items():
        owner[lists] = number
    for key, lists in pieces.items():
        owner[lists] = numbers[key]
    return owner


def merged_hits(a, b):
    """Two searches' (scores, ids) [q, SEARCHED] of the same queries in different slices ->
    their best as one index ranks them (associative; None: nothing searched yet)."""
    if a is None or b is None:
        return a if b is None else b
    return merge_slice_results([a, b], SEARCHED)
