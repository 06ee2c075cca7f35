"""The backend registry (schemas/backends.py) and `load_embedder`: a backend defined here and
registered through `register_backend` alone is one `embedding.backend` may name, its own rules
refuse what it cannot run, and a real build-index embeds with it, records it in the manifest
and the online Retriever embeds its queries with it."""

import hashlib
from dataclasses import dataclass

import numpy as np
import pytest

from pipeline.build_index.job import build_index
from pipeline.jobs.memory_model import Corpus, stage_memory
from pipeline.retrieve.online import IndexNotUsable, Retriever
from schemas.backends import Backend, backend_names, register_backend, unregister_backend
from schemas.config import ConfigError, config_from_dict
from tests.helpers import sample_documents, small_config, write_jsonl

HASHED = "hashed"
DIM = 384  # the precision check compares the stored vectors with the default encoder's
RUNTIME = 64 * 2**20


def hash_vector(text: str) -> np.ndarray:
    """A unit vector drawn from a generator seeded by the text's sha256: nothing an encoder
    gives, so stored vectors equal to it came from this backend."""
    seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")
    vector = np.random.default_rng(seed).standard_normal(DIM).astype(np.float32)
    return vector / np.linalg.norm(vector)


@dataclass(frozen=True)
class HashEmbedder:
    backend: str = HASHED
    precision: str = "float32"
    quantize: str = "none"

    def encode(self, texts, batch_size: int) -> np.ndarray:
        return np.stack([hash_vector(t) for t in texts]) if texts else np.zeros((0, DIM), np.float32)


def load_hashed(cfg, threads, calibration) -> HashEmbedder:
    return HashEmbedder()


def register_hashed() -> None:
    register_backend(
        Backend(name=HASHED, loader=f"{__name__}:load_hashed", precisions=("float32",), runtime_bytes=RUNTIME)
    )


def _config(**embedding):
    config = {"output": "out", "retrieval_corpus": {"paths": ["c.jsonl"]}, "embedding": embedding}
    return config_from_dict(config)


@pytest.mark.unit
def test_a_registered_backend_is_validated_and_held_in_memory_by_its_own_record():
    with pytest.raises(ConfigError, match="'hashed' is not a registered backend \\(torch, onnx, openvino\\)"):
        _config(backend=HASHED)
    register_hashed()
    try:
        with pytest.raises(ValueError, match="hashed is already registered"):
            register_hashed()
        assert _config(backend=HASHED, precision="float32").embedding.backend == HASHED
        with pytest.raises(ConfigError, match="precision bfloat16: hashed runs float32 only"):
            _config(backend=HASHED, precision="bfloat16")
        with pytest.raises(ConfigError, match="quantize int8, precision auto: int8 needs backend onnx or openvino"):
            _config(backend=HASHED, quantize="int8")
        (embed,) = [s for s in stage_memory(_config(backend=HASHED), Corpus.of(1e6)) if s["stage"] == "embed"]
        (torch,) = [s for s in stage_memory(_config(), Corpus.of(1e6)) if s["stage"] == "embed"]
        assert embed["terms"] == {**torch["terms"], "hashed runtime": RUNTIME}
    finally:
        unregister_backend(HASHED)
    assert backend_names() == ("torch", "onnx", "openvino")


@pytest.mark.e2e  # a whole build-index (~25 s); the precision check loads the real encoder
def test_a_backend_registered_alone_embeds_a_real_build_and_serves_its_retriever(tmp_path):
    """Nothing but the registration names the hashed backend: the build's embeddings are its
    vectors of the chunk texts, the manifest records it, and the Retriever opened on the index
    embeds with it and finds a chunk from its own text (and, once it is unregistered, refuses
    the index in one line)."""
    write_jsonl(tmp_path / "corpus" / "a.jsonl", sample_documents(3))
    embedding = {"backend": HASHED, "batch_size": 32, "cpu_threads": 1, "min_agreement": 0}
    config = small_config(tmp_path / "out", str(tmp_path / "corpus" / "*.jsonl"), embedding=embedding)
    register_hashed()
    try:
        manifest = build_index(config_from_dict(config), [])  # the in-process runner: it sees the registration
        check = manifest.embedding_precision
        assert (check.backend, check.precision, check.quantize) == (HASHED, "float32", "none")
        retriever = Retriever.open(str(tmp_path / "out" / "index"))
        assert retriever.embedding.backend == HASHED
        files = retriever.chunk_files
        tokens = np.concatenate([files.read(n, ["tokens"])["tokens"] for n in range(files.num_files)])
        stored = np.concatenate([files.read_embeddings(n) for n in range(files.num_files)])
        texts = retriever.tokenizer.decode_batch([row.tolist() for row in tokens], skip_special_tokens=True)
        assert len(texts) == manifest.num_chunks > 20
        np.testing.assert_array_equal(stored, np.stack([hash_vector(t) for t in texts]))
        full = next(i for i, row in enumerate(tokens) if (row != retriever.pad_id).all())  # a chunk, unpadded
        np.testing.assert_array_equal(retriever.embed(tokens[full]), hash_vector(texts[full])[None])
        assert retriever.retrieve(tokens[full]).ids[0, 0] == full
    finally:
        unregister_backend(HASHED)
    with pytest.raises(IndexNotUsable, match="embedded by backend hashed, not registered in this process"):
        Retriever.open(str(tmp_path / "out" / "index"))
