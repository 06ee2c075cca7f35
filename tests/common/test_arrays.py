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
