"""The one reuse policy: what a committed directory lets a job skip (docs/design.md §8).

An index directory whose manifest matches the config's index hash is reused whole; one whose
chunks and embeddings match (the embed hash) keeps them and gets a new faiss index; anything
else, or no readable manifest, is built from scratch. Shards are reused when their config hash
and the sha256 of the index manifest they were built from both match.
"""

from __future__ import annotations

from typing import Literal, TypeVar

from pydantic import BaseModel

from pipeline.common import fileio
from schemas.config import PipelineConfig
from schemas.manifest import IndexManifest, ShardsManifest

Model = TypeVar("Model", bound=BaseModel)
IndexAction = Literal["reuse", "rebuild_faiss", "build"]


def committed(directory: str, model: type[Model]) -> Model | None:
    """The committed manifest of `directory`, or None: none there, or an older or foreign one
    (which nothing can be reused from)."""
    try:
        return fileio.committed_manifest(directory, model)
    except ValueError:
        return None


def index_action(cfg: PipelineConfig, previous: IndexManifest | None) -> IndexAction:
    if previous is None:
        return "build"
    if previous.config_hash == cfg.index_hash():
        return "reuse"
    return "rebuild_faiss" if previous.embed_config_hash == cfg.embed_hash() else "build"


def shards_reusable(cfg: PipelineConfig, previous: ShardsManifest | None, index_sha: str) -> bool:
    return (
        previous is not None
        and previous.config_hash == cfg.shards_hash()
        and previous.index_manifest_sha256 == index_sha
    )
