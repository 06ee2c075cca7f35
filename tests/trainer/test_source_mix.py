"""Sources selected or weighted when an epoch is read (`trainer.source_mix`): exact totals per
source, spread over the shards by their rows of it, rows repeated only where a weight asks."""

import numpy as np
import pytest

from trainer.source_mix import SourceMix, SourceMixError

pytestmark = pytest.mark.unit

NAMES = ("web", "code", "kernel")
# rows per source in each of four shards
ROWS = np.array([[10, 5, 1], [9, 6, 0], [11, 4, 2], [3, 1, 0]], np.int64)


def test_a_selection_keeps_each_chosen_source_as_it_is():
    mix = SourceMix(NAMES, ["code", "kernel"], ROWS)
    assert np.array_equal(mix.draws, ROWS * [0, 1, 1]) and mix.wanted == {"code": None, "kernel": None}
    sources = np.array([0] * 10 + [1] * 5 + [2])
    assert mix.rows_of(0, sources, None).tolist() == list(range(10, 16))


def test_weights_give_each_source_its_share_of_the_epoch_exactly():
    mix = SourceMix(NAMES, {"web": 1, "code": 1, "kernel": 2}, ROWS)
    total = ROWS.sum()
    assert mix.draws.sum(axis=0).tolist() == [round(total / 4), round(total / 4), round(total / 2)]
    # each shard gives a source's draws in proportion to its rows of it
    assert np.all(np.abs(mix.draws[:, 2] - ROWS[:, 2] * mix.draws[:, 2].sum() / ROWS[:, 2].sum()) < 1)
    kernel_rows = np.array([0] * 10 + [1] * 5 + [2])
    drawn = mix.rows_of(0, kernel_rows, np.random.default_rng(0))
    assert len(drawn) == mix.shard_rows[0] and (drawn == 15).sum() == mix.draws[0, 2]  # one row, repeated
    # web's 10 rows give 4: the generator draws which; without one, the first four, in order
    web = int(mix.draws[0, 0])
    assert web == 4 and len(set(drawn[drawn < 10].tolist())) == web
    assert sorted(drawn[drawn < 10].tolist()) != list(range(web))
    unshuffled = mix.rows_of(0, kernel_rows, None).tolist()
    assert unshuffled == sorted(unshuffled) and unshuffled[:web] == list(range(web))


def test_a_selection_the_shards_cannot_give_is_an_error_naming_it():
    with pytest.raises(SourceMixError, match="no source 'books'"):
        SourceMix(NAMES, ["books"], ROWS)
    with pytest.raises(SourceMixError, match="at least 0, one above it"):
        SourceMix(NAMES, {"web": 0}, ROWS)
    with pytest.raises(SourceMixError, match="'kernel' has no rows"):
        SourceMix(NAMES, ["kernel"], ROWS * [1, 1, 0])
    with pytest.raises(SourceMixError, match="finite"):
        SourceMix(NAMES, {"web": float("nan"), "code": 1}, ROWS)
