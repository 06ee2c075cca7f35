"""The encoder exported to ONNX and run on a CPU by ONNX Runtime (`embedding.backend: onnx`)
or OpenVINO (`openvino`), in float32, bfloat16 (OpenVINO) or with int8 weight products, and
the export's cache: the loaders of those two backends (`load_onnx`, `load_openvino`; their
records are in schemas/backends.py).

The export (`encoder.export_onnx`, torch's exporter) runs once per model, quantisation and
calibration set, on the worker, from the local model directory, into a cache beside it (or
in ~/.cache/ratrain-pipeline/exports where that is not writable), keyed by the sha256 of the
model's files and the versions of torch, onnxscript and onnxruntime. A file is written under
a temporary name and renamed, with the sha256 of its bytes beside it; one that does not match
it, or that the runtime cannot load, is removed and fails the build with one line, and the
next run exports it again.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib
import importlib.metadata
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.common.fileio import sha256_file
from pipeline.common.models import fingerprint_path, resolve_model
from pipeline.embed.encoder import (
    Tokenized,
    cpu_summary,
    export_onnx,
    has_bfloat16_units,
    load_encoder,
    no_embeddings,
    resolved_precision,
)
from schemas.stage_config import EmbeddingConfig

# Part of every cache key: raise it when the export or the quantisation below changes what a
# cached file holds.
EXPORT_FORMAT = 1
# Chunks whose texts calibrate static int8 (OpenVINO): hash-chosen from the corpus being
# embedded, with a salt of their own so that the precision check is not judged on them.
CALIBRATION_CHUNKS = 256
CALIBRATION_SALT = 5
CALIBRATION_BATCH = 32


class ExportedModelUnusable(RuntimeError):
    """An exported model file that is corrupt or that the runtime cannot load (removed)."""


def exports_root(model_dir: Path) -> Path:
    beside = model_dir.parent / f"{model_dir.name}.exports"
    if os.access(beside if beside.exists() else model_dir.parent, os.W_OK):
        return beside
    return Path.home() / ".cache" / "ratrain-pipeline" / "exports"


def file_sha256(path: Path) -> str:
    return sha256_file(str(path))[0]


def _write_verified(path: Path, write) -> None:
    """`write(temporary path)`, then the file renamed into place and its sha256 beside it."""
    temporary = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        write(str(temporary))
        digest = file_sha256(temporary)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    path.with_name(path.name + ".sha256").write_text(digest + "\n")


def _remove(path: Path) -> None:
    path.unlink(missing_ok=True)
    path.with_name(path.name + ".sha256").unlink(missing_ok=True)


def unusable(path: Path, reason: str) -> ExportedModelUnusable:
    """Removes the file and says so: the next run exports it again."""
    _remove(path)
    return ExportedModelUnusable(
        f"exported model {path} is unusable ({reason}); removed, the next run exports it again"
    )


def _verified(path: Path) -> bool:
    """Whether `path` is a complete export: False when absent or without its sha256 (an export
    cut short); raises ExportedModelUnusable when its bytes do not match the sha256."""
    digest_file = path.with_name(path.name + ".sha256")
    if not path.exists() or not digest_file.exists():
        return False
    expected, found = digest_file.read_text().strip(), file_sha256(path)
    if found != expected:
        raise unusable(path, f"sha256 {found[:12]}..., written as {expected[:12]}...")
    return True


def _activation_products(model_path: str) -> list[str]:
    """MatMul nodes between two activations (attention scores and their weighting): left in
    float32, only products with a weight matrix go to int8."""
    import onnx

    graph = onnx.load(model_path).graph
    weights = {w.name for w in graph.initializer}
    return [n.name for n in graph.node if n.op_type == "MatMul" and not set(n.input) & weights]


def _quantize(source: str, target: str, calibration: Sequence[str], model) -> None:
    """int8 weight products: dynamic (activations scaled per batch; ONNX Runtime) without
    calibration texts, else static QDQ calibrated on them (OpenVINO runs it in int8)."""
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_dynamic, quantize_static

    keep = _activation_products(source)
    common = dict(per_channel=True, weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul"], nodes_to_exclude=keep)
    if not calibration:
        quantize_dynamic(source, target, **common)
        return
    from onnxruntime.quantization import CalibrationDataReader

    class Reader(CalibrationDataReader):
        def __init__(self):
            tokenized = Tokenized.of(model, calibration)
            self.batches = iter([_features(tokenized, batch) for batch in tokenized.batches(CALIBRATION_BATCH)])

        def get_next(self):
            return next(self.batches, None)

    quantize_static(source, target, Reader(), quant_format=QuantFormat.QDQ, activation_type=QuantType.QUInt8, **common)


# What a runtime runs: a batch's inputs by name -> the sentence embeddings [batch, d].
RunBatch = Callable[[dict[str, np.ndarray]], np.ndarray]


@dataclass(frozen=True)
class Runtime:
    """A CPU runtime of the exported model: the backend it serves, its Python module (installed
    by the extra of the backend's name) and how it opens a file (`opener(module, path,
    precision, threads)`)."""

    backend: str
    module: str
    opener: Callable[..., RunBatch]

    def imported(self):
        """The runtime's module, or an error naming the extra."""
        try:
            return importlib.import_module(self.module)
        except ImportError:
            raise ValueError(
                f"embedding.backend {self.backend} needs {self.module}: pip install -e '.[{self.backend}]' "
                "(or make install)"
            ) from None


def _open_onnx(runtime, path: Path, precision: str, threads: int | None) -> RunBatch:
    options = runtime.SessionOptions()
    if threads is not None:
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    session = runtime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return lambda features: session.run(None, features)[0]


def _open_openvino(runtime, path: Path, precision: str, threads: int | None) -> RunBatch:
    config: dict = {"INFERENCE_PRECISION_HINT": "bf16" if precision == "bfloat16" else "f32"}
    if threads is not None:
        config["INFERENCE_NUM_THREADS"] = threads
    request = runtime.Core().compile_model(str(path), "CPU", config).create_infer_request()
    return lambda features: request.infer(features)[0].copy()


ONNX_RUNTIME = Runtime("onnx", "onnxruntime", _open_onnx)
OPENVINO = Runtime("openvino", "openvino", _open_openvino)


@functools.lru_cache(maxsize=8)
def exported_model(model: str, quantize: str, calibration: tuple[str, ...] = ()) -> Path:
    """The ONNX file of `model` (resolved) for `quantize` (none | int8; int8 with calibration
    texts is static), exported on first use in this process or any before it."""
    model_dir = Path(model)
    if not model_dir.is_dir():
        raise ValueError(f"embedding.backend onnx/openvino exports a local model directory; {model} is not one")
    calibration_key = hashlib.sha256("\0".join(calibration).encode()).hexdigest()[:16] if calibration else ""
    # the exporter's and the quantiser's versions too: workers with the same ones run the same bytes
    tools = ":".join(importlib.metadata.version(name) for name in ("torch", "onnxscript", "onnxruntime"))
    key = hashlib.sha256(f"{EXPORT_FORMAT}:{tools}:{fingerprint_path(model)}".encode()).hexdigest()[:24]
    folder = exports_root(model_dir) / key
    folder.mkdir(parents=True, exist_ok=True)
    float32 = folder / "model.onnx"
    int8 = f"model-int8-{calibration_key}.onnx" if calibration else "model-int8.onnx"
    target = float32 if quantize == "none" else folder / int8
    with open(folder / ".lock", "w") as lock:  # worker processes of one machine export once
        fcntl.flock(lock, fcntl.LOCK_EX)
        for stale in folder.glob("*.tmp-*"):  # left by an export killed before it finished
            stale.unlink(missing_ok=True)
        if target != float32 and _verified(target):  # the int8 file alone is needed: its source stays unread
            return target
        if not _verified(float32):
            _write_verified(float32, lambda path: export_onnx(load_encoder(EmbeddingConfig(model=model)), path))
        if target != float32:
            torch_model = load_encoder(EmbeddingConfig(model=model))
            _write_verified(target, lambda path: _quantize(str(float32), path, calibration, torch_model))
    return target


def _features(tokenized: Tokenized, rows: np.ndarray) -> dict[str, np.ndarray]:
    """The exported graph's inputs for the texts at `rows`, exactly as sentence-transformers
    makes them, padded to the longest."""
    features = tokenized.batch(rows)
    names = ("input_ids", "attention_mask", "token_type_ids")
    return {name: features[name].numpy() for name in names if name in features}


class ExportedEncoder:
    """The exported model in its runtime with a fixed thread count (an `Embedder`); tokenises
    with the torch model's tokenizer, batches as `encode_texts` does."""

    def __init__(self, model, path: Path, *, runtime: Runtime, precision: str, quantize: str, threads: int | None):
        self.model, self.backend, self.precision, self.quantize = model, runtime.backend, precision, quantize
        module = runtime.imported()
        try:
            self._run = runtime.opener(module, path, precision, threads)
        except Exception as err:  # whatever the runtime says of a bad file
            reason = str(err).strip().splitlines()[0][:200]
            raise unusable(path, f"{runtime.backend} cannot load it: {reason}") from None

    def encode(self, texts: Sequence[str], batch_size: int) -> np.ndarray:
        """L2-normalised float32 embeddings [len(texts), d], in the batches of `encode_texts`."""
        if not texts:
            return no_embeddings(self.model)
        tokenized = Tokenized.of(self.model, texts)
        batches = tokenized.batches(batch_size)
        encoded = []
        for batch in batches:
            vectors = np.asarray(self._run(_features(tokenized, batch)), dtype=np.float32)
            encoded.append(vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12))
        return np.concatenate(encoded)[np.argsort(np.concatenate(batches))]


@functools.lru_cache(maxsize=4)
def loaded_exported(cfg: EmbeddingConfig, threads: int | None, calibration: tuple[str, ...], runtime: Runtime):
    runtime.imported()  # before exporting: a missing extra is named first
    precision = resolved_precision(cfg)
    if precision == "bfloat16" and not has_bfloat16_units():
        raise ValueError(
            f"embedding.backend {cfg.backend} with precision bfloat16: this CPU ({cpu_summary()}) has no "
            "bfloat16 units; use precision: auto or float32"
        )
    model = resolve_model(cfg.model)
    path = exported_model(model, cfg.quantize, calibration)
    return ExportedEncoder(
        load_encoder(cfg), path, runtime=runtime, precision=precision, quantize=cfg.quantize, threads=threads
    )


def load_onnx(cfg: EmbeddingConfig, threads: int | None, calibration: Sequence[str] = ()) -> ExportedEncoder:
    """The onnx backend's loader, once per process: int8 is dynamic, or static when given
    calibration texts."""
    return loaded_exported(cfg, threads, tuple(calibration), ONNX_RUNTIME)


def load_openvino(cfg: EmbeddingConfig, threads: int | None, calibration: Sequence[str] = ()) -> ExportedEncoder:
    """The openvino backend's loader, once per process: its int8 is static, calibrated on texts
    of the corpus (schemas/backends.py: `calibrated`)."""
    return loaded_exported(cfg, threads, tuple(calibration), OPENVINO)
