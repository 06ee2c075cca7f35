"""Changing a committed index: the new vectors added to the trained, filled index (no
retraining: the lists stay as trained), deleted documents' vectors removed, and how well its
tuned depth still finds the new vectors' neighbours, which tells when retraining is due
(docs/design.md §8, "Appending and deleting").

The index is one file (Flat, HNSW or IVF; HNSW cannot remove vectors), or IVF slices by
inverted lists: the new vectors are encoded once on the trained index and each slice takes
those of its lists. A list empty at the build has no owner: the slice owning the nearest
owned list takes it. A slice grown past the slice size is cut in two or more (its lists
shared out as the build shares them), the new ones numbered after the last.
"""

from __future__ import annotations

from dataclasses import dataclass

import faiss
import numpy as np

from pipeline.chunks.deleted import DeletedRanges
from pipeline.common.sampling import QUERY_SALT, in_sample
from pipeline.index.exact import exact_nearest_other, merge_nearest
from pipeline.index.files import read_embeddings
from pipeline.index.recall import RECALL_K, one_recall_at_k
from pipeline.index.routing import ListBlock, add_list_blocks, list_blocks, list_owners, list_sizes, slice_count
from pipeline.index.slices import merge_slice_results


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


def sampled_vectors(embedding_paths: list[str], size: int, population: int) -> tuple[np.ndarray, np.ndarray]:
    """About `size` of the `population` vectors in these files, chosen by a hash of their ids
    (the index build's query sample rule): (ids [q], vectors [q, d])."""
    ids, vectors = [], []
    for path in embedding_paths:
        for batch_ids, batch_vectors in read_embeddings(path):
            keep = in_sample(batch_ids, size, population, QUERY_SALT)
            ids.append(batch_ids[keep])
            vectors.append(batch_vectors[keep])
    if not ids:
        return np.zeros(0, np.int64), np.zeros((0, 0), np.float32)
    return np.concatenate(ids), np.concatenate(vectors)


def remove_deleted(index, deleted: DeletedRanges) -> int:
    """Remove the deleted documents' vectors from the index; the vectors removed."""
    if not len(deleted):
        return 0
    return int(index.remove_ids(faiss.IDSelectorBatch(deleted.chunk_ids())))


@dataclass(frozen=True)
class NewVectors:
    """The new vectors encoded on the trained index, cut by the owners of their lists."""

    blocks: dict[int, ListBlock]  # slice -> the vectors of its lists
    owner: np.ndarray  # [nlist] the owners, with the lists that had none and now hold vectors given one
    added: int


def centroids_of(trained) -> np.ndarray:
    ivf = faiss.extract_index_ivf(trained)
    return ivf.quantizer.reconstruct_n(0, ivf.nlist)


def new_vectors_by_slice(trained, embedding_paths: list[str], owner: np.ndarray) -> NewVectors:
    """The vectors of these embedding files encoded on the trained index (no vectors) and cut
    by the owners of their lists; a list without owner (empty at the build) that now holds
    vectors goes to the slice owning the nearest owned list."""
    part = faiss.clone_index(trained)
    added = add_in_file_order(part, embedding_paths)
    sizes = list_sizes(part)
    orphans = np.flatnonzero((owner < 0) & (sizes > 0))
    if len(orphans):
        centroids = centroids_of(trained)
        owned = np.flatnonzero(owner >= 0)
        nearest = faiss.IndexFlatL2(centroids.shape[1])
        nearest.add(np.ascontiguousarray(centroids[owned]))
        _, found = nearest.search(np.ascontiguousarray(centroids[orphans]), 1)
        owner = owner.copy()
        owner[orphans] = owner[owned[found.ravel()]]
    return NewVectors({block.index_slice: block for block in list_blocks(part, owner)}, owner, added)


def cut_slice(index_slice, trained, *, owner: np.ndarray, number: int, first_new: int, fits: int):
    """Slice `number`, holding more than `fits` vectors, cut into as many as its lists need
    (`slice_count`, `list_owners` over its lists, as the build cuts an index): the first keeps
    its number, the others are numbered from `first_new`. -> ([(number, slice)], owners)."""
    sizes = list_sizes(index_slice)
    held = np.flatnonzero(sizes)
    count = slice_count(sizes[held], fits)
    _, cut = np.unique(list_owners(centroids_of(trained)[held], sizes[held], count), return_inverse=True)
    numbers = np.array([number, *range(first_new, first_new + int(cut.max()))])
    owner = owner.copy()
    owner[held] = numbers[cut]
    pieces = []
    for block in list_blocks(index_slice, owner):
        piece = faiss.clone_index(trained)
        add_list_blocks(piece, [block])
        pieces.append((block.index_slice, piece))
    return sorted(pieces, key=lambda numbered: numbered[0]), owner


class MergedSearch:
    """What searching every slice and merging by score gives (slices searched one at a time,
    each at the index's depth, as the index build measures them): one index's `search`."""

    def __init__(self, queries: np.ndarray):
        self.queries = np.ascontiguousarray(queries, dtype=np.float32)
        self.found: list[tuple[np.ndarray, np.ndarray]] = []

    def add(self, index_slice) -> None:
        if len(self.queries):
            self.found.append(index_slice.search(self.queries, RECALL_K + 1))

    def search(self, _queries, width: int):
        return merge_slice_results(self.found, width)


def new_vector_recall(
    index,
    query_ids: np.ndarray,
    queries: np.ndarray,
    all_embedding_paths: list[str],
    deleted: DeletedRanges,
) -> NewVectorRecall:
    """The index (at its depth; or a `MergedSearch` of its slices) searched for the sampled
    new vectors, against their exact nearest other vector among every vector not deleted
    (streamed file by file: one file's vectors held at once)."""
    if not len(query_ids):
        return NewVectorRecall(1.0, 0)
    truth = None
    for path in all_embedding_paths:
        for ids, vectors in read_embeddings(path):
            kept = ~deleted.contains(ids)
            ids, vectors = ids[kept], vectors[kept]
            found = exact_nearest_other(query_ids, queries, ids, vectors)
            truth = found if truth is None else merge_nearest(truth, found)
    if truth is None:
        return NewVectorRecall(1.0, 0)
    return NewVectorRecall(one_recall_at_k(index, query_ids, queries, truth), len(query_ids))
