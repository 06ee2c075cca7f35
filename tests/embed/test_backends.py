"""The encoder run by ONNX Runtime and OpenVINO (embedding.backend), float32, bfloat16 and int8,
against torch float32; the export's cache; the config rules. The exports are real: one copy of
the default model per session, exported beside it once (seconds)."""

import shutil

import apache_beam as beam
import numpy as np
import pytest
from apache_beam.testing.util import assert_that

from pipeline.common.models import resolve_model, resolve_tokenizer
from pipeline.common.sampling import sample_keys
from pipeline.console import error_line
from pipeline.embed import backends
from pipeline.embed.backends import ExportedModelUnusable, exported_model
from pipeline.embed.beam import EmbedChunks
from pipeline.embed.embedder import embed_texts, load_embedder
from pipeline.embed.encoder import chunk_texts, encode_texts, has_bfloat16_units, load_encoder
from pipeline.embed.precision import PrecisionTooLow, check_precision, top2_agreement
from schemas.config import ConfigError, config_from_dict, stable_hash
from schemas.stage_config import EmbeddingConfig
from tests.embed.test_embed import _chunks
from tests.helpers import local_pipeline


def _config(**embedding):
    return config_from_dict({"output": "out", "retrieval_corpus": {"paths": ["c.jsonl"]}, "embedding": embedding})


@pytest.mark.unit
@pytest.mark.parametrize(
    "embedding, says",
    [
        ({"quantize": "int8"}, "embedding.backend torch with quantize int8, precision auto: int8 needs backend onnx"),
        ({"backend": "onnx", "device": "cuda"}, "onnx runs on a CPU only"),
        ({"backend": "openvino", "accelerator": "type:nvidia-l4;count:1"}, "openvino runs on a CPU only"),
        ({"backend": "onnx", "precision": "bfloat16"}, "ONNX Runtime runs float32 only; use backend: openvino"),
        ({"backend": "openvino", "precision": "float16"}, "OpenVINO runs float32 or bfloat16"),
    ],
)
def test_a_setting_that_cannot_run_on_the_device_is_a_config_error_naming_it(embedding, says):
    with pytest.raises(ConfigError, match=says):
        _config(**embedding)


@pytest.mark.unit
def test_the_backend_and_quantisation_are_part_of_the_embed_hash():
    settings = [("torch", "none"), ("onnx", "none"), ("onnx", "int8"), ("openvino", "none"), ("openvino", "int8")]
    hashes = {_config(backend=b, quantize=q).embed_hash() for b, q in settings}
    assert len(hashes) == len(settings)
    # torch/none hashes as before these keys existed: committed outputs are not rebuilt
    cfg = _config()
    before = {  # the corpus's input bounds came later still, and are left out at their defaults too
        **cfg.model_dump(include={"tokenizer", "chunk_tokens", "chunk_file_rows"}),
        "retrieval_corpus": cfg.retrieval_corpus.model_dump(exclude={"max_record_bytes", "max_document_bytes"}),
        "embedding": cfg.embedding.model_dump(include={"model", "batch_size", "device", "precision"}),
    }
    assert cfg.embed_hash() == stable_hash(before)


@pytest.fixture(scope="session")
def model_copy(tmp_path_factory):
    """A copy of the default model, so that its exports (beside it) are this session's own."""
    target = tmp_path_factory.mktemp("model") / "minilm"
    shutil.copytree(resolve_model("all-MiniLM-L6-v2"), target)
    return str(target)


def _settings(model, **fields):
    return EmbeddingConfig(model=model, batch_size=16, **fields)


@pytest.mark.own_process
@pytest.mark.e2e  # the real encoder, exported
def test_every_backend_is_checked_against_torch_float32(model_copy):
    """float32 in ONNX Runtime and OpenVINO gives torch's embeddings (float rounding); OpenVINO
    in bfloat16 keeps the neighbours; int8 moves them on this model and the check fails it,
    naming the setting to use."""
    tokenizer, chunks = _chunks(count_docs=12)
    texts = chunk_texts(tokenizer, chunks)
    reference = encode_texts(load_encoder(_settings(model_copy)), texts, 16)
    sample = list(enumerate(chunks))

    def embedded(cfg):
        return embed_texts(cfg, load_embedder(cfg, 1, texts[:64] if cfg.quantize == "int8" else ()), texts, 1)

    for backend in ("onnx", "openvino"):
        cfg = _settings(model_copy, backend=backend, precision="float32")
        got = embedded(cfg)
        np.testing.assert_allclose(got, reference, atol=1e-4)
        report = check_precision(sample, list(zip([c.chunk_id for c in chunks], got)), cfg, resolve_tokenizer(None), 1)
        assert (report["backend"], report["quantize"], report["top2_agreement"]) == (backend, "none", 1.0)
    if has_bfloat16_units():
        cfg = _settings(model_copy, backend="openvino", precision="bfloat16")
        agreeing, slots = top2_agreement(reference, embedded(cfg))
        assert agreeing / slots >= 0.95
    for backend in ("onnx", "openvino"):
        cfg = _settings(model_copy, backend=backend, precision="float32", quantize="int8")
        stored = list(zip([c.chunk_id for c in chunks], embedded(cfg)))
        with pytest.raises(PrecisionTooLow, match=f"embedding {backend} float32 int8: .*set embedding.quantize: none"):
            check_precision(sample, stored, cfg, resolve_tokenizer(None), 1)


@pytest.mark.own_process
@pytest.mark.beam
def test_static_int8_is_calibrated_on_hash_chosen_chunks_of_the_corpus(model_copy):
    """The stage's openvino int8 model is the one calibrated on the CALIBRATION_CHUNKS chunks
    with the smallest hashes (salt CALIBRATION_SALT): its embeddings are that model's, and the
    manifest's report names the setting."""
    cfg = _settings(model_copy, backend="openvino", precision="float32", quantize="int8", min_agreement=0)
    tokenizer, chunks = _chunks(count_docs=60)
    ids = np.array([c.chunk_id for c in chunks])
    picked = np.lexsort((ids, sample_keys(ids, backends.CALIBRATION_SALT)))[: backends.CALIBRATION_CHUNKS]
    assert len(picked) < len(chunks)  # a choice was made
    calibration = chunk_texts(tokenizer, [chunks[i] for i in sorted(picked)])
    group = cfg.batch_size * 32
    model = load_embedder(cfg, 1, calibration)
    expected = np.concatenate(
        [model.encode(chunk_texts(tokenizer, chunks[i : i + group]), 16) for i in range(0, len(chunks), group)]
    )

    def check(groups):
        got = np.concatenate([g.vectors for g in sorted(groups, key=lambda g: g.chunk_ids[0])])
        np.testing.assert_array_equal(got, expected)

    def checked(reports):
        (report,) = reports
        assert (report["backend"], report["quantize"], report["precision"]) == ("openvino", "int8", "float32")

    with local_pipeline() as p:
        embeddings, report = p | beam.Create(chunks) | EmbedChunks(cfg, resolve_tokenizer(None), 1)
        assert_that(embeddings, check)
        assert_that(report, checked, label="CheckReport")


@pytest.mark.own_process
@pytest.mark.beam
def test_a_corrupt_export_fails_the_build_in_one_line_and_is_exported_again(model_copy):
    cfg = _settings(model_copy, backend="onnx", quantize="int8", min_agreement=0)
    _, chunks = _chunks(count_docs=2)
    path = exported_model(model_copy, "int8")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # cut short after it was written
    exported_model.cache_clear()  # a new worker process
    backends.loaded_exported.cache_clear()
    with pytest.raises(Exception) as failed:
        with local_pipeline() as p:
            _ = p | beam.Create(chunks) | EmbedChunks(cfg, resolve_tokenizer(None), 1)
    line = error_line(failed.value)
    assert f"exported model {path} is unusable (sha256" in line and "the next run exports it again" in line
    assert not path.exists()
    exported_model.cache_clear()
    assert exported_model(model_copy, "int8") == path and path.exists()  # the next run exports it again
    stale = path.with_name(f"{path.name}.tmp-99999")  # an export killed before its rename
    stale.write_bytes(b"half an export")
    exported_model.cache_clear()
    assert exported_model(model_copy, "int8") == path and not stale.exists()
    # a file whose recorded sha256 matches but that the runtime cannot read: the same
    path.write_bytes(b"not an onnx model")
    path.with_name(path.name + ".sha256").write_text(backends.file_sha256(path))
    backends.loaded_exported.cache_clear()
    with pytest.raises(ExportedModelUnusable, match="onnx cannot load it"):
        load_embedder(cfg, 1)
    assert not path.exists()


@pytest.mark.unit
def test_inspect_and_the_report_name_the_setting_and_older_manifests_read_as_torch():
    from schemas.measures import PrecisionCheck

    fields = {"sample_size": 256, "top2_agreement": 0.996, "agreement_upper_bound": 1.0, "min_cosine": 0.9991}
    check = PrecisionCheck(precision="bfloat16", backend="openvino", quantize="none", min_agreement=0.98, **fields)
    assert check.summary().startswith("openvino bfloat16: top-2 neighbours of 256 sampled chunks agree with torch")
    int8 = check.model_copy(update={"quantize": "int8", "precision": "float32"})
    assert int8.summary().startswith("openvino float32 int8: ")
    older = PrecisionCheck.model_validate({"precision": "float32", "min_agreement": 0.98, **fields})
    assert (older.backend, older.quantize) == ("torch", "none")
    assert older.summary() == "torch float32 (the reference itself: nothing to check)"
