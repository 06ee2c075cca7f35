"""Lean RETRO trainer: streams shard directories, imports neither Beam nor faiss. Its modules, one
line each: docs/design.md §2."""

from trainer.dataset import ShardDataset

__all__ = ["ShardDataset"]
