import json

import apache_beam as beam
import numpy as np
import pytest
from apache_beam.testing.util import assert_that, equal_to

from pipeline.index import (BuildIndex, IndexBuildError, build_and_measure, build_index,
                            choose_index_factory, load_index, one_recall_at_k, training_sample)
from schemas.config import IndexConfig
from tests.conftest import local_pipeline


def clustered(n, d=32, clusters=50, seed=0):
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(clusters, d))
    x = centres[rng.integers(0, clusters, n)] + 0.3 * rng.normal(size=(n, d))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def test_auto_choice_follows_size_and_budget():
    assert choose_index_factory(5_000, 384, 2**30) == "Flat"
    assert choose_index_factory(1_000_000, 384, 2**31) == "IVF4096,Flat"
    with pytest.raises(IndexBuildError, match="memory_budget"):
        choose_index_factory(1_000_000, 384, 2**20)


def test_training_sample_respects_points_per_list():
    assert len(training_sample(100_000, "IVF64,Flat")) == 64 * 256
    with pytest.raises(IndexBuildError, match="at least 2496 vectors"):
        training_sample(1000, "IVF64,Flat")


def test_flat_index_answers_chunk_ids():
    vectors = clustered(500)
    ids = np.arange(1000, 1500, dtype=np.int64)
    index = build_index(ids, vectors, "Flat")
    _, found = index.search(vectors[:5], 1)
    assert found[:, 0].tolist() == ids[:5].tolist()


def test_ivf_nprobe_is_tuned_to_the_target_recall():
    vectors = clustered(8000, clusters=200)
    ids = np.arange(len(vectors), dtype=np.int64)
    index, info = build_and_measure(ids, vectors, IndexConfig(type="IVF64,Flat", target_recall=0.9))
    assert info["index_factory"] == "IVF64,Flat" and info["nprobe"] >= 1
    assert info["recall_at_k"]["value"] >= 0.9
    # an outside measurement at the recorded nprobe agrees with the manifest's figure
    queries = vectors[np.random.default_rng(1).choice(len(vectors), 300, replace=False)]
    assert abs(one_recall_at_k(index, ids, vectors, queries) - info["recall_at_k"]["value"]) < 0.08


def test_invalid_factory_string_is_a_clear_error():
    with pytest.raises(IndexBuildError, match="not a valid faiss factory"):
        build_index(np.arange(10), clustered(10), "NoSuchIndex")


def test_build_index_transform_writes_a_loadable_index(tmp_path):
    vectors = clustered(300)
    rows = [(i, vectors[i]) for i in range(300)]
    with local_pipeline() as p:
        info = p | beam.Create(rows) | BuildIndex(IndexConfig(), str(tmp_path))
        assert_that(info | beam.Map(lambda i: (i["index_factory"], i["num_vectors"])),
                    equal_to([("Flat", 300)]))
    index = load_index(str(tmp_path / "index.faiss"))
    assert index.ntotal == 300
    assert json.loads((tmp_path / "build_info.json").read_text())["recall_at_k"]["value"] == 1.0
