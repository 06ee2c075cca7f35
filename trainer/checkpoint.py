"""A trained model read back from a `ratrain-train` checkpoint, for scoring and generation."""

from __future__ import annotations

import os

import torch

from trainer.model import Retro, RetroConfig


class CheckpointError(ValueError):
    """A checkpoint that is missing or holds no model."""


def load_model(path: str, device: str | torch.device = "cpu") -> Retro:
    """The model a checkpoint holds (its shape from the checkpoint's `model_config`), in eval mode."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: no such checkpoint")
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    if "model" not in checkpoint or "model_config" not in checkpoint:
        raise CheckpointError(f"{path}: not a ratrain-train checkpoint (no model or model_config)")
    config = RetroConfig(**checkpoint["model_config"])
    model = Retro(config)
    model.load_state_dict(checkpoint["model"])
    return model.to(device).eval()
