import numpy as np
import pytest

from pipeline.common.arrays import groups, positions_of


@pytest.mark.unit
def test_groups_give_each_key_its_positions_in_order():
    keys = np.array([3, 1, 3, 2, 1, 3])
    assert [(key, at.tolist()) for key, at in groups(keys)] == [(1, [1, 4]), (2, [3]), (3, [0, 2, 5])]
    assert list(groups(np.zeros(0, np.int64))) == []


@pytest.mark.unit
def test_positions_of_finds_present_ids_and_flags_missing_ones():
    at, present = positions_of(np.array([2, 5, 9]), np.array([5, 9, 3, 10, 2]))
    assert present.tolist() == [True, True, False, False, True]
    assert at[present].tolist() == [1, 2, 0]
    _, none = positions_of(np.zeros(0, np.int64), np.array([1, 2]))
    assert none.tolist() == [False, False]


@pytest.mark.unit
def test_ranges_of_lays_runs_end_to_end_as_a_loop_would():
    from pipeline.chunks.deleted import DeletedDocument, DeletedRanges
    from pipeline.common.arrays import ranges_of

    starts, counts = np.array([5, 0, 40, 9]), np.array([3, 0, 2, 1])
    loop = [i for s, c in zip(starts.tolist(), counts.tolist()) for i in range(s, s + c)]
    assert ranges_of(starts, counts).tolist() == loop
    assert ranges_of(np.zeros(0, np.int64), np.zeros(0, np.int64)).tolist() == []
    deleted = DeletedRanges.of([DeletedDocument(1, 40, 2, "replaced"), DeletedDocument(2, 5, 3, "replaced")])
    assert deleted.chunk_ids().tolist() == [5, 6, 7, 40, 41]
