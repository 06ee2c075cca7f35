"""What runs the encoder, whatever `embedding.backend` names: the `Embedder` a backend's loader
gives, `load_embedder` (the loader the backend's record in schemas/backends.py names, imported
on first use) and `embed_texts`, the one way the embed stage, its check's setting and the
online Retriever encode texts.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from pipeline.embed.encoder import resolved_precision, torch_threads
from schemas.backends import get_backend
from schemas.measures import setting_name
from schemas.stage_config import EmbeddingConfig


class Embedder(Protocol):
    """A loaded backend: texts in, their L2-normalised float32 embeddings [len(texts), d] out
    (inner product = cosine), encoded in batches of at most `batch_size`; and the setting it
    runs, which the index manifest's precision check records."""

    @property
    def backend(self) -> str: ...  # its registered name

    @property
    def precision(self) -> str: ...  # the arithmetic it runs in (resolved: never auto)

    @property
    def quantize(self) -> str: ...

    def encode(self, texts: Sequence[str], batch_size: int) -> np.ndarray: ...


def needs_calibration(cfg: EmbeddingConfig) -> bool:
    """Whether the backend's model is calibrated on texts of the corpus being embedded (static
    int8 in OpenVINO): the embed stage draws them, the Retriever cannot."""
    return cfg.quantize in get_backend(cfg.backend).calibrated


def load_embedder(cfg: EmbeddingConfig, threads: int | None, calibration: Sequence[str] = ()) -> Embedder:
    """The encoder of `cfg` in its backend, with `threads` intra-op threads (`calibration`:
    texts for a calibrated quantisation). Each loader keeps what it loads for the process."""
    module, function = get_backend(cfg.backend).loader.split(":")
    embedder = getattr(importlib.import_module(module), function)(cfg, threads, tuple(calibration))
    # the manifest records the configured setting: a loader running another would falsify it
    recorded = (cfg.backend, resolved_precision(cfg), cfg.quantize)
    if (embedder.backend, embedder.precision, embedder.quantize) != recorded:
        ran = setting_name(embedder.backend, embedder.precision, embedder.quantize)
        raise RuntimeError(f"embedding.backend {cfg.backend} loaded {ran}, not {setting_name(*recorded)}")
    return embedder


def embed_texts(cfg: EmbeddingConfig, model: Embedder, texts: Sequence[str], threads: int | None) -> np.ndarray:
    """L2-normalised float32 embeddings of `texts` by `model` (from `load_embedder`) in batches
    of `cfg.batch_size`, torch's CPU kernels (the torch backend's; any backend's tokenized
    batches) with `threads` intra-op threads."""
    with torch_threads(threads):
        return model.encode(texts, cfg.batch_size)
