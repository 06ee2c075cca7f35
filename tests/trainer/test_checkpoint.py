from dataclasses import asdict

import pytest
import torch

from trainer.checkpoint import CheckpointError, load_model
from trainer.model import Retro, RetroConfig

pytestmark = pytest.mark.unit


def test_load_model_gives_back_the_saved_model(tmp_path):
    config = RetroConfig(vocab_size=50, sequence_tokens=16, chunk_tokens=4, dim=16, depth=2, heads=2, encoder_depth=1)
    torch.manual_seed(0)
    model = Retro(config).eval()
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "model_config": asdict(config), "step": 1}, path)
    loaded = load_model(str(path))
    tokens = torch.randint(1, 50, (2, 16))
    neighbours = torch.randint(0, 50, (2, 4, 2, 8))
    assert not loaded.training
    assert torch.equal(loaded(tokens, neighbours), model(tokens, neighbours))


def test_load_model_refuses_what_is_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        load_model(str(tmp_path / "missing.pt"))
    torch.save({"weights": {}}, tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match="not a ratrain-train checkpoint"):
        load_model(str(tmp_path / "other.pt"))
