"""ratrain-generate's choice of the next token and of its input window, without a model."""

import pytest
import torch

from trainer.generate import choose_token, window_start

pytestmark = pytest.mark.unit

LOGITS = torch.log(torch.tensor([0.1, 0.4, 0.2, 0.3]))


def draws(top_p: float, seed: int, count: int = 200) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return [choose_token(LOGITS, top_p, 1.0, generator) for _ in range(count)]


def test_greedy_takes_the_most_probable_token():
    assert choose_token(LOGITS, None, 1.0, None) == 1


def test_top_p_samples_only_the_smallest_set_reaching_p_and_repeats_with_its_seed():
    assert set(draws(0.5, seed=0)) == {1, 3}  # 0.4 alone is short of 0.5; 0.4 + 0.3 reaches it
    assert set(draws(1e-6, seed=0)) == {1}  # the most probable is always kept
    assert set(draws(1.0, seed=0)) == {0, 1, 2, 3}
    assert draws(0.5, seed=7) == draws(0.5, seed=7) != draws(0.5, seed=8)


def test_a_low_temperature_sharpens_towards_the_most_probable():
    generator = torch.Generator().manual_seed(0)
    assert {choose_token(LOGITS, 1.0, 0.01, generator) for _ in range(100)} == {1}


@pytest.mark.parametrize(("length", "start"), [(1, 0), (128, 0), (129, 32), (160, 32), (161, 64)])
def test_the_window_slides_by_whole_chunks_to_fit_the_sequence(length, start):
    assert window_start(length, 128, 32) == start
