"""Embed chunks with a frozen sentence-transformers encoder through Beam `RunInference`.

Batches are formed from chunk-id ranges (`chunk_id // batch_size`), not from bundles: the
encoder's output depends on batch composition at the 1e-7 level, so this is what keeps the
embeddings byte-identical whatever the runner or the number of workers. On a CPU it also
depends on the number of intra-op threads (matrix kernels split their sums by thread
count, e.g. AMX kernels on small batches), so every encoder call runs with the job's fixed
thread count (`options.encoder_threads`), recorded in the manifest.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterable, Optional, Sequence

import apache_beam as beam
import numpy as np
from apache_beam.metrics import Metrics
from apache_beam.ml.inference.base import ModelHandler, RunInference

from pipeline.chunking import Chunk, load_tokenizer
from pipeline.corpus import METRICS_NAMESPACE
from pipeline.models import resolve_model
from schemas.config import EmbeddingConfig


def load_encoder(cfg: EmbeddingConfig):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(resolve_model(cfg.model), device=cfg.device)


def encode_texts(model, texts: Sequence[str], batch_size: int) -> np.ndarray:
    """L2-normalised float32 embeddings [len(texts), d] (inner product = cosine)."""
    return model.encode(list(texts), batch_size=batch_size, normalize_embeddings=True,
                        convert_to_numpy=True, show_progress_bar=False).astype(np.float32)


@contextmanager
def torch_threads(threads: Optional[int]):
    """Run torch's CPU kernels with `threads` intra-op threads (None: as the process has them),
    restoring the process's count after."""
    import torch

    before = torch.get_num_threads()
    if threads is not None and threads != before:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def chunk_texts(tokenizer, chunks: Sequence[Chunk]) -> list[str]:
    """The text the encoder sees: a chunk's tokens decoded, padding and special tokens dropped."""
    return tokenizer.decode_batch([c.tokens.tolist() for c in chunks], skip_special_tokens=True)


class SentenceEncoderHandler(ModelHandler):
    """RunInference handler; one element = one pre-formed batch (chunk ids, texts).

    The model is loaded once per worker process by RunInference (Beam `Shared`); on GPU
    runners `model_copies=1` shares one copy between a machine's processes.
    """

    def __init__(self, cfg: EmbeddingConfig, threads: Optional[int], model_copies: Optional[int] = None):
        # One element is already a batch, so RunInference must not batch again.
        super().__init__(min_batch_size=1, max_batch_size=1, model_copies=model_copies)
        self.cfg, self.threads = cfg, threads

    def load_model(self):
        return load_encoder(self.cfg)

    def run_inference(self, batch, model, inference_args=None) -> Iterable:
        for chunk_ids, texts in batch:
            with torch_threads(self.threads):
                embeddings = encode_texts(model, texts, self.cfg.batch_size)
            yield chunk_ids, embeddings

    def get_num_bytes(self, batch) -> int:
        return sum(len(t) for _, texts in batch for t in texts)

    def get_metrics_namespace(self) -> str:
        return "EmbedChunks"


class _PrepareBatch(beam.DoFn):
    def __init__(self, tokenizer_path: str):
        self.tokenizer_path = tokenizer_path

    def setup(self):
        self.tokenizer = load_tokenizer(self.tokenizer_path)

    def process(self, keyed):
        _, chunks = keyed
        chunks = sorted(chunks, key=lambda c: c.chunk_id)
        yield (np.array([c.chunk_id for c in chunks], dtype=np.int64),
               chunk_texts(self.tokenizer, chunks))


def _split_batch(result):
    chunk_ids, embeddings = result
    Metrics.counter(METRICS_NAMESPACE, "chunks_embedded").inc(len(chunk_ids))
    yield from zip(chunk_ids.tolist(), embeddings)


class EmbedChunks(beam.PTransform):
    """Chunk rows -> (chunk_id, float32 embedding [d]), batched by chunk-id range, encoded with
    `threads` intra-op threads on a CPU. With `embedding.accelerator` set, the stage carries
    that Beam resource hint (GPU workers)."""

    def __init__(self, cfg: EmbeddingConfig, tokenizer_path: str, threads: Optional[int]):
        super().__init__()
        self.cfg, self.tokenizer_path, self.threads = cfg, tokenizer_path, threads
        if cfg.accelerator:
            self.with_resource_hints(accelerator=cfg.accelerator)

    def expand(self, chunks):
        size = self.cfg.batch_size
        return (chunks
                | "KeyByBatch" >> beam.Map(lambda c: (c.chunk_id // size, c))
                | "GroupBatches" >> beam.GroupByKey()
                | "DecodeTexts" >> beam.ParDo(_PrepareBatch(self.tokenizer_path))
                | "Encode" >> RunInference(SentenceEncoderHandler(self.cfg, self.threads, self.cfg.model_copies))
                | "SplitBatches" >> beam.FlatMap(_split_batch))
