"""Lean RETRO trainer: streams shard directories, imports neither Beam nor faiss."""

from trainer.dataset import ShardDataset

__all__ = ["ShardDataset"]
