"""A shard's refresh without Beam (`pipeline.retrieve.refresh`): a row none of whose neighbours
changed stays as stored; a new vector above a chunk's k-th neighbour takes its place with its
own tokens; a deleted neighbour sends only its chunk to be searched again; a sequence that packs
differently is searched whole and one no longer packed is dropped; the search's answer replaces
only the chunks it searched."""

from dataclasses import replace

import numpy as np
import pytest

from pipeline.chunks.deleted import DeletedDocument, DeletedRanges
from pipeline.retrieve.refresh import NewVectors, heads_of, in_trained_lists, refresh_shard, with_searched
from pipeline.shards.rows import Sequence, ShardRow

pytestmark = pytest.mark.unit

M, L, K, PAD = 2, 2, 2, 0


def value_of(chunk_id: int) -> np.ndarray:
    """What a neighbour slot holds for a chunk here: derived from its id, so a test can tell."""
    return (chunk_id * 100 + np.arange(2 * M)).astype(np.int32)


def stored_row(seq_id: int, ids, scores, docs=(1,)) -> ShardRow:
    ids, scores = np.array(ids, np.int64), np.array(scores, np.float32)
    neighbours = np.stack([[value_of(i) if i >= 0 else np.full(2 * M, PAD) for i in chunk] for chunk in ids])
    return ShardRow(
        seq_id=seq_id,
        tokens=np.arange(L * M + 1, dtype=np.int32) + 10 * seq_id,
        neighbours=neighbours.astype(np.int32),
        neighbour_ids=ids,
        neighbour_scores=scores,
        doc_ids=docs,
    )


def packed(row: ShardRow, docs=None) -> Sequence:
    """The sequence packing gives for a stored row (heads: each chunk's first token, the target),
    or the same with other documents."""
    return replace(heads_of(row, M), doc_ids=docs) if docs else heads_of(row, M)


ROWS = [
    stored_row(0, [[3, 4], [5, 6]], [[0.9, 0.5], [0.8, 0.7]]),
    stored_row(1, [[7, 8], [9, -1]], [[0.6, 0.4], [0.3, 0]]),
]
QUERIES = {0: [1.0, 0.0], 1: [0.0, 1.0], 2: [1.0, 0.0], 3: [0.0, 1.0]}  # chunk id -> its embedding


def queries(chunk_ids):
    return np.array([QUERIES[int(c)] for c in chunk_ids], np.float32)


def deleting(*chunk_ids: int) -> DeletedRanges:
    return DeletedRanges.of(DeletedDocument(100 + c, c, 1, "delete_requested") for c in chunk_ids)


def new_vectors(vectors: dict[int, list[float]]) -> NewVectors:
    ids = np.array(sorted(vectors), np.int64)
    return NewVectors(ids, np.array([vectors[i] for i in ids], np.float32), np.stack([value_of(i) for i in ids]))


def refresh(rows=ROWS, sequences=None, *, new=None, deleted=None):
    sequences = [packed(r) for r in rows] if sequences is None else sequences
    return refresh_shard(
        rows, sequences, new=new, deleted=deleted or DeletedRanges.none(), queries=queries, m=M, pad_id=PAD
    )


def test_a_shard_nothing_reached_stays_as_stored():
    done = refresh(ROWS[:1], new=new_vectors({20: [-1.0, -1.0]}))  # a new vector below every k-th neighbour
    assert not done.changed and done.searched == [] and done.narrowed is None
    assert len(done.rows) == 1 and done.rows[0] is ROWS[0]


def test_a_new_vector_above_the_kth_neighbour_takes_its_slot_with_its_own_tokens():
    done = refresh(new=new_vectors({20: [0.65, 0.0]}))  # 0.65 with chunks 0 and 2, 0 with 1 and 3
    assert done.changed and done.searched == [] and done.counts["sequences_neighbours_refreshed"] == 2
    first, second = done.rows
    assert first.neighbour_ids.tolist() == [[3, 20], [5, 6]]
    assert np.allclose(first.neighbour_scores, [[0.9, 0.65], [0.8, 0.7]])
    assert np.array_equal(first.neighbours[0], np.stack([value_of(3), value_of(20)]))
    assert np.array_equal(first.neighbours[1], ROWS[0].neighbours[1])
    # the row the build left short is filled: 20 scores 0 with chunk 3, above nothing
    assert second.neighbour_ids.tolist() == [[20, 7], [9, 20]]
    assert np.array_equal(second.neighbours[0], np.stack([value_of(20), value_of(7)]))


def test_a_deleted_neighbour_sends_only_its_chunk_to_be_searched_again():
    done = refresh(deleted=deleting(5))
    assert done.changed and [s.seq_id for s in done.searched] == [0]
    assert done.narrowed.seq_ids.tolist() == [0] and done.narrowed.chunks.tolist() == [[False, True]]
    assert done.counts["chunks_searched_again"] == 1 and done.counts["sequences_searched_again"] == 1
    assert done.rows[1] is ROWS[1]


def test_a_sequence_packed_differently_is_searched_whole_and_one_no_longer_packed_is_dropped():
    sequences = [packed(ROWS[0], docs=(1, 2))]  # its next chunk's document changed; sequence 1 is gone
    done = refresh(sequences=sequences)
    assert done.changed and done.rows == [] and done.narrowed is None
    assert [s.seq_id for s in done.searched] == [0] and done.searched[0].doc_ids == (1, 2)
    assert done.counts["sequences_packed_again"] == 1 and done.counts["sequences_dropped"] == 1


def test_the_search_replaces_only_the_chunks_it_searched():
    searched = stored_row(0, [[11, 12], [13, 14]], [[0.95, 0.94], [0.93, 0.92]])
    merged = with_searched(ROWS[0], searched, np.array([False, True]))
    assert merged.neighbour_ids.tolist() == [[3, 4], [13, 14]]
    assert np.array_equal(merged.neighbours[1], searched.neighbours[1])
    assert np.array_equal(merged.neighbours[0], ROWS[0].neighbours[0])
    assert np.allclose(merged.neighbour_scores, [[0.9, 0.5], [0.93, 0.92]])


def test_new_vectors_in_an_ivf_index_s_trained_lists_are_found_as_the_exact_search_finds_them():
    import faiss

    rng = np.random.default_rng(0)
    base = rng.standard_normal((2000, 16)).astype(np.float32)
    index = faiss.index_factory(16, "IVF16,Flat", faiss.METRIC_INNER_PRODUCT)
    index.train(base)
    index.add_with_ids(base, np.arange(2000))  # the build's vectors: none of them is a new one
    added = rng.standard_normal((300, 16)).astype(np.float32)
    new = NewVectors(np.arange(5000, 5300), added, np.stack([value_of(i) for i in range(5000, 5300)]))
    in_lists = NewVectors(new.ids, new.vectors, new.values, lists=in_trained_lists(index, new))
    assert in_lists.lists.ntotal == 300  # the index's own vectors are gone from it
    queries = rng.standard_normal((50, 16)).astype(np.float32)
    index.nprobe = 16  # every list: exact
    assert np.array_equal(in_lists.best(queries, 3)[1], new.best(queries, 3)[1])
    index.nprobe = 1  # the index's depth: only what its probed lists hold, all of it new
    scores, ids = in_lists.best(queries, 3)
    assert ((ids >= 5000) | (ids == -1)).all() and (ids >= 0).any()
