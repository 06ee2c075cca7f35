"""Changing a committed index: the new vectors added to the trained, filled index (no
retraining: the lists stay as trained), deleted documents' vectors removed, and how well its
tuned depth still finds the new vectors' neighbours, which tells when retraining is due
(docs/design.md §8, "Appending and deleting").

The index is one file (Flat, HNSW or IVF; HNSW cannot remove vectors); index slices are not
changed in place yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import faiss
import numpy as np

from pipeline.index.deleted import DeletedRanges
from pipeline.index.exact import exact_nearest_other, merge_nearest
from pipeline.index.files import read_embeddings
from pipeline.index.recall import one_recall_at_k
from pipeline.index.sampling import QUERY_SALT, in_sample
from pipeline.index.search import set_search_depth


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


def new_vector_recall(
    index,
    depth: int | None,
    query_ids: np.ndarray,
    queries: np.ndarray,
    all_embedding_paths: list[str],
    deleted: DeletedRanges,
) -> NewVectorRecall:
    """The index searched at `depth` for the sampled new vectors, against their exact nearest
    other vector among every vector not deleted (streamed file by file: one file's vectors
    held at once)."""
    if not len(query_ids):
        return NewVectorRecall(1.0, 0)
    truth = None
    for path in all_embedding_paths:
        for ids, vectors in read_embeddings(path):
            kept = ~deleted.contains(ids)
            ids, vectors = ids[kept], vectors[kept]
            found = exact_nearest_other(query_ids, queries, ids, vectors)
            truth = found if truth is None else merge_nearest(truth, found)
    if depth is not None:
        set_search_depth(index, depth)
    if truth is None:
        return NewVectorRecall(1.0, 0)
    return NewVectorRecall(one_recall_at_k(index, query_ids, queries, truth), len(query_ids))
