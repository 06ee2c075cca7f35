"""A trained model read back from a `ratrain-train` checkpoint, for scoring and generation."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from trainer.model import Retro, RetroConfig


class CheckpointError(ValueError):
    """A checkpoint that is missing or holds no model."""


@dataclass(frozen=True)
class TrainedModel:
    model: Retro  # in eval mode
    step: int | None  # the optimizer step it was written at (None: a checkpoint that does not say)


def rank_states(checkpoint: dict) -> list[dict]:
    """Each rank's "dataset" (data position) and "rng" state in a `ratrain-train` checkpoint;
    one from before multi-rank training held one rank's at the top level."""
    return checkpoint.get("ranks") or [{"dataset": checkpoint["dataset"], "rng": checkpoint["rng"]}]


def read_checkpoint(path: str, device: str | torch.device = "cpu") -> TrainedModel:
    """The model a checkpoint holds (its shape from the checkpoint's `model_config`), in eval
    mode, and the step it was written at."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: no such checkpoint")
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    if "model" not in checkpoint or "model_config" not in checkpoint:
        raise CheckpointError(f"{path}: not a ratrain-train checkpoint (no model or model_config)")
    config = RetroConfig(**checkpoint["model_config"])
    model = Retro(config)
    model.load_state_dict(checkpoint["model"])
    step = checkpoint.get("step")
    return TrainedModel(model.to(device).eval(), None if step is None else int(step))


def load_model(path: str, device: str | torch.device = "cpu") -> Retro:
    """The model a checkpoint holds (its shape from the checkpoint's `model_config`), in eval mode."""
    return read_checkpoint(path, device).model
