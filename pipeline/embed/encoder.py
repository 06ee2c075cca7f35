"""Loading the encoder, choosing its precision for this CPU, and encoding texts: the only
module that imports torch. The torch backend (`load_torch`, registered in schemas/backends.py)
is the encoder itself.

On a CPU the encoder's output depends on the number of intra-op threads (matrix kernels split
their sums by thread count), so every call runs with the job's fixed thread count
(`torch_threads`), recorded in the manifest.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.chunks.chunking import Chunk
from pipeline.common.models import resolve_model
from schemas.backends import REFERENCE_BACKEND, get_backend
from schemas.stage_config import EmbeddingConfig


def load_encoder(cfg: EmbeddingConfig):
    """The encoder of `cfg.model` on `cfg.device`, loaded once per process: the embed stage's
    RunInference model and the precision check's float32 reference are the same object (its
    weights stay float32; reduced precision is autocast around each call)."""
    return _loaded_encoder(resolve_model(cfg.model), cfg.device)


@functools.lru_cache(maxsize=4)
def _loaded_encoder(model: str, device: str):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(model, device=device)


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return {flag for line in f if line.startswith("flags") for flag in line.split(":", 1)[1].split()}
    except OSError:
        return set()


def cpu_summary() -> str:
    """The CPU's model name and its bfloat16 and int8 dot-product instructions, for benchmark and
    test reports."""
    name = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    flags = _cpu_flags()
    bf16 = [label for flag, label in (("avx512_bf16", "AVX512-BF16"), ("amx_bf16", "AMX-BF16")) if flag in flags]
    int8 = [label for flag, label in (("avx512_vnni", "AVX512-VNNI"), ("amx_int8", "AMX-INT8")) if flag in flags]
    return f"{name} ({', '.join(bf16) or 'no bfloat16 instructions'}; {', '.join(int8) or 'no int8 dot products'})"


def has_bfloat16_units() -> bool:
    """Whether this CPU runs bfloat16 natively (AVX512-BF16 or AMX)."""
    return bool(_cpu_flags() & {"avx512_bf16", "amx_bf16"})


@functools.lru_cache(maxsize=8)
def resolve_precision(precision: str, device: str) -> str:
    """`embedding.precision` on this worker's device: auto is bfloat16 where the device runs it
    natively (a CUDA GPU with bf16; a CPU with AVX512-BF16 or AMX), else float32."""
    if precision != "auto":
        return precision
    if device.startswith("cuda"):
        import torch

        return "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"
    return "bfloat16" if has_bfloat16_units() else "float32"


def resolved_precision(cfg: EmbeddingConfig) -> str:
    """`embedding.precision` as its backend runs it on this worker: the device's choice
    (`resolve_precision`) where the backend runs that, else float32 (ONNX Runtime's auto)."""
    precision = resolve_precision(cfg.precision, cfg.device)
    return precision if precision in get_backend(cfg.backend).precisions else "float32"


@contextmanager
def arithmetic(precision: str, device: str):
    """torch autocast to `precision` (resolved) on `device`; float32 runs as it is."""
    import torch

    if precision == "float32":
        yield
        return
    with torch.autocast(device_type=device.split(":")[0], dtype=getattr(torch, precision)):
        yield


def length_batches(counts: np.ndarray, batch_size: int) -> list[np.ndarray]:
    """Positions of texts in batches of `batch_size` with similar token counts, longest first
    (equal counts in position order), each batch's positions ascending. A batch is padded to
    its longest text; SentenceTransformer.encode's own sort by characters pads the
    quickstart's chunks to 5.8% more tokens than they hold, this sort to 0.7%."""
    order = np.argsort(-counts, kind="stable")
    return [np.sort(order[start : start + batch_size]) for start in range(0, len(order), batch_size)]


@dataclass(frozen=True)
class EmbeddedChunks:
    """A group of chunks' embeddings, in chunk-id order: what the embed stage gives, one element
    a group (thousands of chunks), not one per chunk."""

    chunk_ids: np.ndarray  # int64 [n]
    vectors: np.ndarray  # float32 [n, d], L2-normalised

    def __len__(self) -> int:
        return len(self.chunk_ids)

    @property
    def rows(self) -> list[tuple[int, np.ndarray]]:
        """(chunk id, vector) pairs: the embedding files' rows."""
        return list(zip(self.chunk_ids.tolist(), self.vectors))


@dataclass(frozen=True)
class Tokenized:
    """Texts tokenized once for the encoder: the model's inputs for all of them, padded to the
    longest (`model_inputs`), and each text's token count (special tokens included, at most
    max_seq_length). A batch's inputs are its rows cut to the columns its texts use, which is
    what tokenizing those texts alone gives, so the batching and every batch share one
    tokenizer pass."""

    features: dict
    counts: np.ndarray  # int64 [len(texts)]

    @classmethod
    def of(cls, model, texts: Sequence[str]) -> Tokenized:
        features = model_inputs(model, texts)
        return cls(features, features["attention_mask"].sum(1).numpy().astype(np.int64))

    def batches(self, batch_size: int) -> list[np.ndarray]:
        """`length_batches`, or all texts as one batch when they fit in one."""
        if len(self.counts) <= batch_size:
            return [np.arange(len(self.counts))]
        return length_batches(self.counts, batch_size)

    def batch(self, rows: np.ndarray) -> dict:
        """The inputs of the texts at `rows`, padded to the longest of them (on either side)."""
        import torch

        index = torch.from_numpy(rows)
        used = torch.nonzero(self.features["attention_mask"][index].any(0)).flatten()
        columns = slice(int(used[0]), int(used[-1]) + 1)
        return {
            name: value[index][:, columns] if isinstance(value, torch.Tensor) and value.ndim == 2 else value
            for name, value in self.features.items()
        }


def no_embeddings(model) -> np.ndarray:
    """The embeddings of no texts, [0, d] (the tokenizer makes no inputs of no texts)."""
    width = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension  # < 6.0
    return np.zeros((0, width()), dtype=np.float32)


def encode_texts(model, texts: Sequence[str], batch_size: int, precision: str = "float32") -> np.ndarray:
    """L2-normalised float32 embeddings [len(texts), d] (inner product = cosine), computed in
    `precision` (resolved: float32, bfloat16 or float16), in the batches of `length_batches`.
    A text's embedding depends on the batch it is in (at the 1e-7 level in float32, more in
    bfloat16), so on all of `texts` and their order; up to `batch_size` texts are one batch.
    Each batch runs as `SentenceTransformer.encode` runs one (its forward pass, then the
    normalisation), on inputs tokenized once for all texts (`Tokenized`)."""
    import torch
    from sentence_transformers.util import batch_to_device

    if not texts:
        return no_embeddings(model)
    tokenized = Tokenized.of(model, texts)
    batches = tokenized.batches(batch_size)
    model.eval()
    with torch.inference_mode(), arithmetic(precision, str(model.device)):
        encoded = [
            torch.nn.functional.normalize(
                model(batch_to_device(tokenized.batch(batch), model.device))["sentence_embedding"], p=2, dim=1
            )
            .float()
            .cpu()
            .numpy()
            for batch in batches
        ]
    return np.concatenate(encoded)[np.argsort(np.concatenate(batches))]


@dataclass(frozen=True)
class TorchEmbedder:
    """The torch backend's `Embedder`: the SentenceTransformer itself (`load_encoder`, so the
    precision check's float32 reference is the same object), run in `precision` by `encode_texts`."""

    model: Any
    precision: str
    backend: str = REFERENCE_BACKEND
    quantize: str = "none"

    def encode(self, texts: Sequence[str], batch_size: int) -> np.ndarray:
        return encode_texts(self.model, texts, batch_size, self.precision)


def load_torch(cfg: EmbeddingConfig, threads: int | None, calibration: Sequence[str] = ()) -> TorchEmbedder:
    """The torch backend's loader (schemas/backends.py). Its threads are set around each call
    (`embedder.embed_texts`), and it takes no calibration."""
    return TorchEmbedder(load_encoder(cfg), resolved_precision(cfg))


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


def model_inputs(model, texts: Sequence[str]) -> dict:
    """The model's inputs (torch tensors by name) for `texts`, padded to the longest, as
    `encode` makes them (`preprocess` since sentence-transformers 5, `tokenize` before)."""
    preprocess = getattr(model, "preprocess", None) or model.tokenize
    return preprocess(list(texts))


def export_onnx(model, path: str) -> None:
    """Write `model` (a loaded SentenceTransformer: every module, pooling included) as one ONNX
    graph from its tokenizer's inputs to the sentence embedding [batch, d], batch and sequence
    length dynamic (torch's dynamo exporter; needs onnxscript)."""
    import torch

    features = model_inputs(model, ["an example text", "a second, longer example text for the export"])
    names = [name for name in ("input_ids", "attention_mask", "token_type_ids") if name in features]

    class Sentence(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, token_type_ids=None):
            inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids}
            return self.model({name: inputs[name] for name in names})["sentence_embedding"]

    batch, length = torch.export.Dim("batch"), torch.export.Dim("sequence")
    with torch.no_grad():
        torch.onnx.export(
            Sentence().eval(),
            (),
            path,
            kwargs={name: features[name].to(model.device) for name in names},
            input_names=names,
            output_names=["sentence_embedding"],
            dynamic_shapes={name: {0: batch, 1: length} for name in names},
            dynamo=True,
            external_data=False,
            verbose=False,
        )
