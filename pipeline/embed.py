"""Embed chunks with a frozen sentence-transformers encoder through Beam `RunInference`.

Batches are formed from chunk-id ranges (`chunk_id // batch_size`), not from bundles: the
encoder's output depends on batch composition at the 1e-7 level, so this is what keeps the
embeddings byte-identical whatever the runner or the number of workers. On a CPU it also
depends on the number of intra-op threads (matrix kernels split their sums by thread
count, e.g. AMX kernels on small batches), so every encoder call runs with the job's fixed
thread count (`options.encoder_threads`), recorded in the manifest.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Iterable, Sequence
from contextlib import contextmanager

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


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return {flag for line in f if line.startswith("flags") for flag in line.split(":", 1)[1].split()}
    except OSError:
        return set()


def cpu_summary() -> str:
    """The CPU's model name and its bfloat16 instructions, for benchmark and test reports."""
    name = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    flags = _cpu_flags()
    bf16 = [label for flag, label in (("avx512_bf16", "AVX512-BF16"), ("amx_bf16", "AMX-BF16")) if flag in flags]
    return f"{name} ({', '.join(bf16) or 'no bfloat16 instructions'})"


@functools.lru_cache(maxsize=8)
def resolve_precision(precision: str, device: str) -> str:
    """`embedding.precision` on this worker's device: auto is bfloat16 where the device runs it
    natively (a CUDA GPU with bf16; a CPU with AVX512-BF16 or AMX), else float32."""
    if precision != "auto":
        return precision
    if device.startswith("cuda"):
        import torch

        return "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"
    return "bfloat16" if _cpu_flags() & {"avx512_bf16", "amx_bf16"} else "float32"


@contextmanager
def arithmetic(precision: str, device: str):
    """torch autocast to `precision` (resolved) on `device`; float32 runs as it is."""
    import torch

    if precision == "float32":
        yield
        return
    with torch.autocast(device_type=device.split(":")[0], dtype=getattr(torch, precision)):
        yield


def encode_texts(model, texts: Sequence[str], batch_size: int, precision: str = "float32") -> np.ndarray:
    """L2-normalised float32 embeddings [len(texts), d] (inner product = cosine), computed in
    `precision` (resolved: float32, bfloat16 or float16)."""
    with arithmetic(precision, str(model.device)):
        encoded = model.encode(
            list(texts),
            batch_size=batch_size,
            normalize_embeddings=True,
            convert_to_tensor=True,
            show_progress_bar=False,
        )
    return encoded.float().cpu().numpy()


@contextmanager
def torch_threads(threads: int | None):
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

    def __init__(self, cfg: EmbeddingConfig, threads: int | None, model_copies: int | None = None):
        # One element is already a batch, so RunInference must not batch again.
        super().__init__(min_batch_size=1, max_batch_size=1, model_copies=model_copies)
        self.cfg, self.threads = cfg, threads

    def load_model(self):
        return load_encoder(self.cfg)

    def run_inference(self, batch, model, inference_args=None) -> Iterable:
        precision = resolve_precision(self.cfg.precision, self.cfg.device)
        for chunk_ids, texts in batch:
            with torch_threads(self.threads):
                embeddings = encode_texts(model, texts, self.cfg.batch_size, precision)
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
        yield (np.array([c.chunk_id for c in chunks], dtype=np.int64), chunk_texts(self.tokenizer, chunks))


def _split_batch(result):
    chunk_ids, embeddings = result
    Metrics.counter(METRICS_NAMESPACE, "chunks_embedded").inc(len(chunk_ids))
    yield from zip(chunk_ids.tolist(), embeddings)


class PrecisionTooLow(RuntimeError):
    """Embeddings in reduced precision whose neighbours disagree with float32's."""


TIE_TOLERANCE = 1e-3  # a neighbour as similar as float32's within this agrees (near-duplicates)
PRECISION_SALT = 4
# One-sided 99% normal quantile: the build fails only when the agreement is below
# min_agreement with 99% confidence, so a small sample is not failed by one near-tie.
AGREEMENT_CONFIDENCE_Z = 2.326


def top2_agreement(reference: np.ndarray, reduced: np.ndarray) -> tuple[int, int]:
    """(slots that agree, slots) over the sample's top-2 neighbours (within the sample, self
    excluded) found in reduced precision: a slot agrees when its neighbour is float32's, or as
    similar as float32's 2nd best within TIE_TOLERANCE (exact ties between duplicate chunks
    have no order)."""
    k = min(2, len(reference) - 1)
    if k < 1:
        return 0, 0
    exact, approximate = reference @ reference.T, reduced @ reduced.T
    np.fill_diagonal(exact, -np.inf)
    np.fill_diagonal(approximate, -np.inf)
    kth = -np.sort(-exact, axis=1)[:, k - 1]
    found = np.argsort(-approximate, axis=1, kind="stable")[:, :k]
    agree = np.take_along_axis(exact, found, axis=1) >= kth[:, None] - TIE_TOLERANCE
    return int(agree.sum()), int(agree.size)


def agreement_upper_bound(agreeing: int, slots: int, z: float = AGREEMENT_CONFIDENCE_Z) -> float:
    """The Wilson score upper bound on the true agreement given `agreeing` of `slots`: the
    largest agreement the sample does not rule out at the bound's confidence (1.0 for no
    slots). 29 of 30 slots -> 0.995; 497 of 512 -> 0.984; 490 of 512 -> 0.974."""
    if slots == 0:
        return 1.0
    p, z2 = agreeing / slots, z * z
    centre = p + z2 / (2 * slots)
    spread = z * math.sqrt(p * (1 - p) / slots + z2 / (4 * slots * slots))
    return min(1.0, (centre + spread) / (1 + z2 / slots))


def check_precision(sample, stored, cfg: EmbeddingConfig, tokenizer_path: str, threads: int | None) -> dict:
    """The precision check: the sampled chunks embedded again in float32, compared with what
    the stage stored. Raises PrecisionTooLow when even the upper confidence bound of the
    agreement (`agreement_upper_bound`) is below cfg.min_agreement."""
    precision = resolve_precision(cfg.precision, cfg.device)
    chunks = sorted((chunk for _, chunk in sample), key=lambda c: c.chunk_id)
    report = {
        "precision": precision,
        "sample_size": len(chunks),
        "top2_agreement": 1.0,
        "agreement_upper_bound": 1.0,
        "min_cosine": 1.0,
        "min_agreement": cfg.min_agreement,
    }
    if precision == "float32" or not chunks:
        return report
    stored = dict(stored)
    reduced = np.stack([stored[c.chunk_id] for c in chunks])
    with torch_threads(threads):
        reference = encode_texts(load_encoder(cfg), chunk_texts(load_tokenizer(tokenizer_path), chunks), cfg.batch_size)
    agreeing, slots = top2_agreement(reference, reduced)
    report.update(
        top2_agreement=agreeing / slots if slots else 1.0,
        agreement_upper_bound=agreement_upper_bound(agreeing, slots),
        min_cosine=float(np.min(np.sum(reference * reduced, axis=1))),
    )
    if report["agreement_upper_bound"] < cfg.min_agreement:
        raise PrecisionTooLow(
            f"embedding.precision {precision}: only {agreeing} of {slots} top-2 neighbour slots of "
            f"{len(chunks)} sampled chunks agree with float32 ({report['top2_agreement']:.3f}; at 99% "
            f"confidence at most {report['agreement_upper_bound']:.3f}, below min_agreement "
            f"{cfg.min_agreement}); set embedding.precision: float32"
        )
    return report


def _in_sample(embedding, sampled: set) -> bool:
    return embedding[0] in sampled


class EmbedChunks(beam.PTransform):
    """Chunk rows -> ((chunk_id, float32 embedding [d]), precision check report), batched by
    chunk-id range, encoded in `embedding.precision` with `threads` intra-op threads on a CPU.
    With `embedding.accelerator` set, the stage carries that Beam resource hint (GPU workers).

    The check: `precision_sample` chunks (the smallest hashes of their ids, so the same ones
    whatever the bundling) are embedded again in float32 and compared with what was stored."""

    def __init__(self, cfg: EmbeddingConfig, tokenizer_path: str, threads: int | None):
        super().__init__()
        self.cfg, self.tokenizer_path, self.threads = cfg, tokenizer_path, threads
        if cfg.accelerator:
            self.with_resource_hints(accelerator=cfg.accelerator)

    def expand(self, chunks):
        from pipeline.faiss_index import sample_keys

        cfg, size = self.cfg, self.cfg.batch_size
        embeddings = (
            chunks
            | "KeyByBatch" >> beam.Map(lambda c: (c.chunk_id // size, c))
            | "GroupBatches" >> beam.GroupByKey()
            | "DecodeTexts" >> beam.ParDo(_PrepareBatch(self.tokenizer_path))
            | "Encode" >> RunInference(SentenceEncoderHandler(cfg, self.threads, cfg.model_copies))
            | "SplitBatches" >> beam.FlatMap(_split_batch)
        )
        sample = (
            chunks
            | "KeyForPrecisionCheck"
            >> beam.Map(lambda c: (int(sample_keys(np.array([c.chunk_id]), PRECISION_SALT)[0]), c.chunk_id, c))
            | "PrecisionSample" >> beam.combiners.Top.Smallest(cfg.precision_sample, key=lambda s: s[:2])
            | "SampleChunks" >> beam.Map(lambda picked: [(key, chunk) for key, _, chunk in picked])
        )
        sampled = sample | "SampledIds" >> beam.Map(lambda picked: {c.chunk_id for _, c in picked})
        stored = (
            embeddings
            | "StoredForCheck" >> beam.Filter(_in_sample, beam.pvalue.AsSingleton(sampled))
            | "GatherStored" >> beam.combiners.ToList()
        )
        report = sample | "CheckPrecision" >> beam.Map(
            check_precision, beam.pvalue.AsSingleton(stored), cfg, self.tokenizer_path, self.threads
        )
        return embeddings, report
