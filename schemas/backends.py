"""The encoder backends `embedding.backend` may name: a registry of `Backend` records, each
what one backend accepts and needs, by name.

A record holds no code, only facts and the import path of its loader, so config validation,
the memory model and the manifests read it without importing torch or a runtime; the loader
(pipeline/embed/, `load_embedder`) is imported where the encoder loads. A new backend is one
module in pipeline/embed/ (a loader giving an `Embedder`) and one `register_backend` call: here
for the project's own, or in any module imported before the config is validated.
"""

from __future__ import annotations

from dataclasses import dataclass

# The setting every other is checked against (pipeline/embed/precision.py): torch in float32.
REFERENCE_BACKEND = "torch"
REFERENCE_PRECISION = "float32"

# The exported encoder in ONNX Runtime or OpenVINO beside the torch one the check keeps:
# 280-410 MB more than torch alone measured with MiniLM (Intel Xeon, 1,024 chunks, batch 64);
# a static int8 export's calibration in that process took 1.1 GB more, once per model.
EXPORTED_ENCODER = 450 * 2**20


@dataclass(frozen=True, kw_only=True)
class Backend:
    """What `embedding.backend: <name>` accepts and needs."""

    name: str
    # "module:function", called as function(EmbeddingConfig, threads, calibration texts) and
    # giving an Embedder; imported on first load only
    loader: str
    # what `embedding.precision` may name besides auto (float32 among them: auto falls back to
    # it where the backend does not run the device's choice, and the check compares with it)
    precisions: tuple[str, ...]
    # the config error's reason for any other precision (default: the ones it runs)
    precision_refused: str | None = None
    quantize: tuple[str, ...] = ("none",)
    # quantize values calibrated on texts of the corpus being embedded (the embed stage draws them)
    calibrated: tuple[str, ...] = ()
    cpu_only: bool = False
    # the memory model's term: what its runtime holds beside the torch encoder the check keeps
    runtime_bytes: int = 0


_REGISTERED: dict[str, Backend] = {}


def register_backend(backend: Backend) -> None:
    """Makes `backend.name` a value of `embedding.backend`."""
    if backend.name in _REGISTERED:
        raise ValueError(f"embedding backend {backend.name} is already registered")
    if REFERENCE_PRECISION not in backend.precisions or "none" not in backend.quantize:
        raise ValueError(f"embedding backend {backend.name} must run float32 and quantize none")
    _REGISTERED[backend.name] = backend


def unregister_backend(name: str) -> None:
    """Removes a registered backend (a test's, once it is done)."""
    del _REGISTERED[name]


def backend_names() -> tuple[str, ...]:
    return tuple(_REGISTERED)


def get_backend(name: str) -> Backend:
    """The registered backend `name`, or a ValueError naming those there are."""
    if name not in _REGISTERED:
        raise ValueError(f"{name!r} is not a registered backend ({', '.join(_REGISTERED)})")
    return _REGISTERED[name]


def setting_refused(name: str, precision: str, quantize: str, device: str, accelerator: str | None) -> str | None:
    """Why backend `name` cannot run this precision and quantisation on `device` (with
    `accelerator`), or None. Whether this CPU has bfloat16 units is for the loader to say: the
    launching machine may not be the worker."""
    backend = get_backend(name)
    if quantize not in backend.quantize:
        able = [b.name for b in _REGISTERED.values() if quantize in b.quantize]
        return f"{quantize} needs backend {' or '.join(able)}"
    if backend.cpu_only and (device != "cpu" or accelerator):
        return f"{name} runs on a CPU only (device {device}); use backend: {REFERENCE_BACKEND}"
    if precision != "auto" and precision not in backend.precisions:
        return backend.precision_refused or f"{name} runs {' or '.join(backend.precisions)} only"
    return None


register_backend(
    Backend(
        name=REFERENCE_BACKEND,
        loader="pipeline.embed.encoder:load_torch",
        precisions=("float32", "bfloat16", "float16"),
    )
)
register_backend(
    Backend(
        name="onnx",
        loader="pipeline.embed.backends:load_onnx",
        precisions=("float32",),
        precision_refused="ONNX Runtime runs float32 only; use backend: openvino for bfloat16",
        quantize=("none", "int8"),
        cpu_only=True,
        runtime_bytes=EXPORTED_ENCODER,
    )
)
register_backend(
    Backend(
        name="openvino",
        loader="pipeline.embed.backends:load_openvino",
        precisions=("float32", "bfloat16"),
        precision_refused="OpenVINO runs float32 or bfloat16 on a CPU",
        quantize=("none", "int8"),
        calibrated=("int8",),  # static int8
        cpu_only=True,
        runtime_bytes=EXPORTED_ENCODER,
    )
)
