import dataclasses
import json
import os

import apache_beam as beam
import faiss
import numpy as np
import pytest
from apache_beam.metrics.metric import MetricsFilter
from apache_beam.testing.util import assert_that, equal_to

from pipeline.common.sampling import TRAIN_SALT, in_sample
from pipeline.index import train_beam, two_level
from pipeline.index.build import BuildIndex
from pipeline.index.build_slices import FilledPart, SumListSizes, plan_slices
from pipeline.index.exact import exact_nearest_other
from pipeline.index.factory import (
    EmbeddingStats,
    IndexBuildError,
    IndexPlan,
    choose_index_factory,
    estimated_bytes,
    nlist_for,
    plan_index,
    resolve_clustering,
    training_size,
)
from pipeline.index.files import load_index, write_index
from pipeline.index.kmeans import REFINE_ITERATIONS, list_assigner, list_sums, moved_centroids
from pipeline.index.recall import one_recall_at_k
from pipeline.index.routing import list_sizes
from pipeline.index.search import EXCLUSION_MARGIN_CAP, search_each_excluding, search_excluding, set_search_depth
from pipeline.index.slices import vectors_per_slice
from pipeline.index.train import build_index, merge_part, train_index
from pipeline.index.tuning import tune_search_depth
from pipeline.jobs.options import new_pipeline
from schemas.stage_config import IndexConfig
from tests.helpers import local_pipeline, write_embedding_files


def clustered(n, d=32, clusters=50, seed=0):
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(clusters, d))
    x = centres[rng.integers(0, clusters, n)] + 0.3 * rng.normal(size=(n, d))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


MB = 10**6


@pytest.mark.parametrize(
    "n, budget, expected",
    [
        (5_000, 1000 * MB, "Flat"),
        (300_000, 1000 * MB, "IVF2048,Flat"),
        (300_000, 200 * MB, "IVF2048,SQ8"),  # a quarter of Flat: a byte per dimension
        (300_000, 64 * MB, "IVF2048,PQ128x8np"),
        (300_000, 20 * MB, "IVF2048,PQ32x8np"),
        (5_000_000, 1000 * MB, "IVF8192,PQ128x8np"),
        (50_000_000, 10_000 * MB, "IVF65536_HNSW32,PQ128x8np"),
        (50_000, 5 * MB, "IVF1024,PQ48x8np"),
    ],
)
@pytest.mark.unit
def test_auto_choice_follows_size_and_budget(n, budget, expected):
    factory = choose_index_factory(n, 384, budget)
    assert factory == expected
    assert estimated_bytes(factory, n, 384) <= budget


@pytest.mark.unit
def test_budget_too_small_for_any_index():
    with pytest.raises(IndexBuildError, match="too small for any index"):
        choose_index_factory(1_000_000, 384, 1 * MB)


@pytest.mark.unit
def test_nlist_keeps_39_points_per_list():
    assert nlist_for(300_000) == 2048 and nlist_for(1_000_000) == 4096
    assert nlist_for(20_000_000) == 65536 and nlist_for(3 * 10**9) == 2**20
    assert all(n >= 39 * nlist_for(n) for n in (100, 5_000, 80_000, 10**6))


@pytest.mark.unit
def test_training_size_follows_faiss_guidance():
    assert training_size(1_000_000, "IVF4096,Flat") == 64 * 4096
    assert training_size(50_000, "IVF1024,Flat") == 50_000
    assert training_size(10**6, "IVF256,PQ16x8") == 65_536  # PQ wants 256 x 256
    with pytest.raises(IndexBuildError, match="at least 2,496 vectors"):
        training_size(1000, "IVF64,Flat")


@pytest.mark.unit
def test_samples_are_deterministic_and_sized():
    ids = np.arange(100_000)
    chosen = in_sample(ids, 5_000, len(ids), 1)
    assert abs(chosen.sum() - 5_000) < 300
    assert np.array_equal(chosen, in_sample(ids[::-1], 5_000, len(ids), 1)[::-1])
    assert not np.array_equal(chosen, in_sample(ids, 5_000, len(ids), 2))


@pytest.mark.parametrize(
    "clustering, factory, expected",
    [
        ("auto", "IVF1024,PQ8", "flat"),
        ("auto", "IVF4096,PQ8", "two_level"),
        ("auto", "IVF65536_HNSW32,Flat", "two_level"),
        ("two_level", "IVF64,Flat", "two_level"),
        ("flat", "IVF65536,Flat", "flat"),
        ("two_level", "HNSW32", "flat"),
        ("auto", "Flat", "flat"),
        ("auto", "OPQ16,IVF8192,PQ16", "flat"),
    ],
)
@pytest.mark.unit
def test_clustering_choice(clustering, factory, expected):
    assert resolve_clustering(clustering, factory) == expected


@pytest.mark.unit
def test_an_accelerator_keeps_auto_clustering_on_one_k_means():
    assert resolve_clustering("auto", "IVF65536,PQ8", accelerator=True) == "flat"
    assert resolve_clustering("two_level", "IVF65536,PQ8", accelerator=True) == "two_level"


@pytest.mark.unit
def test_two_level_clustering_refuses_a_pre_transform():
    with pytest.raises(IndexBuildError, match="no pre-transform"):
        resolve_clustering("two_level", "OPQ16,IVF8192,PQ16")


def _recall_at_10(index, queries, truth, nprobe):
    """Share of queries whose exact nearest is among the index's top 10."""
    set_search_depth(index, nprobe)
    return float(np.mean(np.any(index.search(queries, 10)[1] == truth[:, None], axis=1)))


@pytest.mark.parametrize("factory", ["IVF256,Flat", "IVF128_HNSW16,Flat", "IVF128,PQ8x8np", "IVF128,SQ8"])
@pytest.mark.unit
def test_two_level_clustering_trains_every_list_and_keeps_recall(factory):
    vectors = clustered(30_000, clusters=400, seed=4)
    queries, base = vectors[:300], vectors[300:]
    truth = np.argmax(queries @ base.T, axis=1)
    sample = base[::2]
    recall = {}
    for clustering in ("flat", "two_level"):
        index = train_index(factory, sample, clustering)
        ivf = faiss.extract_index_ivf(index)
        assert index.is_trained and ivf.quantizer.ntotal == ivf.nlist
        index.add_with_ids(base, np.arange(len(base)))
        recall[clustering] = _recall_at_10(index, queries, truth, nprobe=4)
        if factory == "IVF256,Flat":  # inner product: spherical k-means, as faiss's own IVF training
            centroids = ivf.quantizer.reconstruct_n(0, ivf.nlist)
            assert np.allclose(np.linalg.norm(centroids, axis=1), 1, atol=1e-4)
    assert recall["two_level"] >= recall["flat"] - 0.02, recall


@pytest.mark.unit
def test_flat_index_answers_chunk_ids():
    vectors = clustered(500)
    ids = np.arange(1000, 1500, dtype=np.int64)
    _, found = build_index(ids, vectors, "Flat").search(vectors[:5], 1)
    assert found[:, 0].tolist() == ids[:5].tolist()


@pytest.mark.unit
def test_a_local_ivf_file_is_memory_mapped_and_searched_without_reading_ahead(tmp_path):
    vectors = clustered(2000)
    index = build_index(np.arange(2000, dtype=np.int64), vectors, "IVF16,PQ8x8np")
    faiss.write_index(index, str(tmp_path / "index.faiss"))
    loaded = load_index(str(tmp_path / "index.faiss"), depth=4, sha256=None)
    lists = faiss.downcast_InvertedLists(faiss.extract_index_ivf(loaded).invlists)
    assert isinstance(lists, faiss.OnDiskInvertedLists) and lists.prefetch_nthread == 0
    set_search_depth(index, 4)
    assert np.array_equal(loaded.search(vectors[:50], 5)[1], index.search(vectors[:50], 5)[1])


@pytest.mark.unit
def test_parts_merged_equal_one_fill():
    vectors = clustered(6000, clusters=100)
    ids = np.arange(6000, dtype=np.int64) * 7  # sparse chunk ids survive as faiss ids
    trained = train_index("IVF32,Flat", vectors[:3000])
    whole = faiss.clone_index(trained)
    whole.add_with_ids(vectors, ids)
    merged = faiss.clone_index(trained)
    for part in range(3):
        filled = faiss.clone_index(trained)
        filled.add_with_ids(vectors[ids % 3 == part], ids[ids % 3 == part])
        merge_part(merged, filled)
    for index in (whole, merged):
        faiss.extract_index_ivf(index).nprobe = 32
    assert merged.ntotal == 6000
    assert np.array_equal(whole.search(vectors[:50], 5)[1], merged.search(vectors[:50], 5)[1])


@pytest.mark.unit
def test_ivf_depth_is_tuned_to_the_target_recall():
    vectors = clustered(8000, clusters=200)
    ids = np.arange(len(vectors), dtype=np.int64)
    index = build_index(ids, vectors, "IVF64,Flat")
    query_ids = ids[::40]
    truth = exact_nearest_other(query_ids, vectors[query_ids], ids, vectors)
    depth, recall, plateau = tune_search_depth(index, query_ids, vectors[query_ids], truth, target=0.9)
    assert recall >= 0.9 and 1 <= depth <= 64 and not plateau
    if depth > 1:  # one step shallower misses the target: the smallest depth was chosen
        faiss.extract_index_ivf(index).nprobe = depth // 2
        assert one_recall_at_k(index, query_ids, vectors[query_ids], truth) < 0.9


@pytest.mark.unit
def test_recall_counts_a_tied_neighbour_as_found():
    """40 groups of 25 identical vectors: every copy is an exact nearest neighbour, so any of
    them in the top 10 is a hit, whichever id exact search happened to list first."""
    base = clustered(40, clusters=40, seed=3)
    vectors = np.repeat(base, 25, axis=0)
    ids = np.arange(len(vectors), dtype=np.int64)
    query_ids = ids[::50]
    truth = exact_nearest_other(query_ids, vectors[query_ids], ids, vectors)
    # 24 ties per query: equal scores up to the matrix product's rounding, which on some CPUs
    # (an AMD EPYC without AVX512) differs by an ulp between rows of one block and the next
    assert np.abs(truth[0][:, :24] - truth[0][:, :1]).max() <= 1e-6
    index = faiss.IndexIDMap2(faiss.IndexFlatIP(vectors.shape[1]))
    index.add_with_ids(vectors[::-1].copy(), ids[::-1].copy())  # ties come back in another order
    assert one_recall_at_k(index, query_ids, vectors[query_ids], truth) == 1.0
    strict = [
        t in [f for f in row if f != q][:10]
        for q, t, row in zip(query_ids, truth[1][:, 0], index.search(vectors[query_ids], 11)[1])
    ]
    assert np.mean(strict) < 1.0  # what counting the exact nearest id alone would have said


@pytest.mark.unit
def test_tuning_stops_at_a_plateau_below_an_unreachable_target():
    vectors = clustered(8000, clusters=200)
    ids = np.arange(len(vectors), dtype=np.int64)
    index = build_index(ids, vectors, "IVF64,PQ4x4np")  # 2 bytes a vector: recall is capped
    query_ids = ids[::40]
    truth = exact_nearest_other(query_ids, vectors[query_ids], ids, vectors)
    depth, recall, plateau = tune_search_depth(index, query_ids, vectors[query_ids], truth, target=0.999)
    assert plateau and recall < 0.999 and depth < 64  # never the exhaustive nlist
    faiss.extract_index_ivf(index).nprobe = 2 * depth
    assert one_recall_at_k(index, query_ids, vectors[query_ids], truth) - recall < 0.005


def _exact_excluding(vectors, queries, k, excluded):
    scores = queries @ vectors.T
    for start, end in excluded:
        scores[:, start:end] = -np.inf
    return np.argsort(-scores, axis=1, kind="stable")[:, :k], scores


@pytest.mark.parametrize("factory", ["Flat", "IVF64,Flat", "HNSW16"])
@pytest.mark.unit
def test_search_excluding_skips_the_ranges_and_fills_every_slot(factory):
    """Clusters are contiguous id ranges; each query's own cluster (its nearest vectors) is
    excluded, so at the tuned depth its probed lists hold almost only excluded vectors."""
    rng = np.random.default_rng(4)
    centres = rng.normal(size=(40, 32))
    vectors = np.repeat(centres, 200, axis=0) + 0.05 * rng.normal(size=(8000, 32))
    vectors = (vectors / np.linalg.norm(vectors, axis=1, keepdims=True)).astype(np.float32)
    ids = np.arange(len(vectors), dtype=np.int64)
    index = build_index(ids, vectors, factory)
    set_search_depth(index, 1 if "IVF" in factory else 16)  # no-op for Flat
    queries = vectors[[10, 2010, 4010]]
    excluded = [(0, 200), (2000, 2200), (4000, 4200)]
    scores, found, deeper = search_excluding(index, queries, 5, excluded)
    assert (found >= 0).all()
    assert not any(start <= f < end for f in found.ravel() for start, end in excluded)
    expected, exact = _exact_excluding(vectors, queries, 5, excluded)
    if factory == "Flat":
        assert deeper == 0 and np.allclose(scores, np.take_along_axis(exact, expected, 1), atol=1e-5)
    if "IVF" in factory:
        assert deeper > 0  # one list held only excluded vectors: the search went deeper


@pytest.mark.parametrize("factory", ["Flat", "IVF64,Flat", "IVF64,PQ8x8np", "HNSW16"])
@pytest.mark.unit
def test_one_batched_search_answers_as_each_query_searched_alone(factory):
    """Queries with their own ranges: short ones (inside the margin), long ones (beyond
    EXCLUSION_MARGIN_CAP: most of their nearest are excluded), none, and ranges that empty
    the probed lists (deepening): every row equal to its search alone with the exclusion
    inside faiss (ties aside), and rows left short counted."""
    rng = np.random.default_rng(5)
    centres = rng.normal(size=(40, 32))  # documents of 200 consecutive ids about one centre each
    vectors = _unit(np.repeat(centres, 200, axis=0) + 0.3 * rng.normal(size=(8000, 32)))
    index = build_index(np.arange(len(vectors), dtype=np.int64), vectors, factory)
    set_search_depth(index, 2 if "IVF" in factory else 16)
    rows = rng.choice(len(vectors), 96, replace=False)
    excluded = []
    for number, row in enumerate(rows.tolist()):
        reach = [0, 3, 40, 200, 2000][number % 5]  # the chunks either side of the query excluded
        ranges = [(max(row - reach, 0), row + reach + 1)] if reach else []
        if number % 7 == 0:
            ranges.append((7000, 7500))
        excluded.append(sorted(ranges))
    found = search_each_excluding(index, vectors[rows], 4, excluded)
    for row, ranges in enumerate(excluded):
        scores, ids, deeper = search_excluding(index, vectors[rows[row : row + 1]], 4, ranges)
        assert not any(start <= f < end for f in found.ids[row] for start, end in ranges)
        np.testing.assert_allclose(found.scores[row], scores[0], rtol=1e-5, atol=1e-5)
        same = found.ids[row] == ids[0]
        assert same.all() or np.allclose(found.scores[row][~same], scores[0][~same], atol=1e-5)  # ties
        assert found.deeper[row] == (deeper > 0)
    long_rows = np.array([len(r) > 0 and r[0][1] - r[0][0] > 2 * EXCLUSION_MARGIN_CAP for r in excluded])
    assert found.searched_alone[long_rows].mean() > 0.5 and not found.searched_alone[~long_rows].all()
    assert (found.ids >= 0).all()
    assert found.deeper.any() == (factory != "Flat")  # excluded documents filled the probed lists (or walk)


@pytest.mark.unit
def test_plan_errors_are_clear():
    with pytest.raises(IndexBuildError, match="mixed dimensions"):
        plan_index(EmbeddingStats(10, (384, 768)), IndexConfig())
    with pytest.raises(IndexBuildError, match="not a valid faiss factory"):
        plan_index(EmbeddingStats(10, (32,)), IndexConfig(type="NoSuchIndex"))


def _build(paths, cfg, out_dir, beam_args=()):
    with new_pipeline(list(beam_args)) as p:
        _ = p | beam.Create(paths) | BuildIndex(cfg, str(out_dir))
    return json.loads((out_dir / "build_info.json").read_text())


@pytest.mark.beam
def test_build_index_transform_flat(tmp_path):
    vectors = clustered(300)
    paths = write_embedding_files(tmp_path / "emb", np.arange(300), vectors, files=2)
    with local_pipeline() as p:
        info = p | beam.Create(paths) | BuildIndex(IndexConfig(), str(tmp_path / "faiss"))
        assert_that(info | beam.Map(lambda i: (i.index_factory, i.num_vectors)), equal_to([("Flat", 300)]))
    assert load_index(str(tmp_path / "faiss" / "index.faiss"), sha256=None).ntotal == 300
    assert json.loads((tmp_path / "faiss" / "build_info.json").read_text())["recall_at_k"]["value"] == 1.0


@pytest.mark.parametrize("clustering", ["flat", "two_level"])
@pytest.mark.beam
def test_build_index_transform_ivf_in_parts(tmp_path, clustering):
    vectors = clustered(10_000, clusters=100)
    ids = np.arange(10_000, dtype=np.int64) * 3 + 5
    paths = write_embedding_files(tmp_path / "emb", ids, vectors, files=4)
    info = _build(
        paths,
        IndexConfig(type="IVF64,Flat", target_recall=0.9, recall_sample=200, clustering=clustering),
        tmp_path / "faiss",
    )
    assert info["parts"] == 4 and info["num_vectors"] == 10_000 and info["clustering"] == clustering
    assert info["recall_at_k"]["value"] >= 0.9 and info["recall_at_k"]["sample_size"] > 150
    assert any((tmp_path / "faiss" / "parts").iterdir())  # kept for a retry: the commit discards the staging
    index = load_index(str(tmp_path / "faiss" / "index.faiss"), info["nprobe"], sha256=None)
    _, found = index.search(vectors[:20], 1)
    assert found[:, 0].tolist() == ids[:20].tolist()  # chunk ids survive as faiss ids


@pytest.mark.beam
def test_the_fill_reads_the_trained_index_once_per_process_and_fills_each_part_alone(tmp_path, monkeypatch):
    """Each embedding file's part starts from the trained index read once (not once a file),
    emptied: the merged index holds each vector once, found under its chunk id."""
    import pipeline.index.build as build_module
    import pipeline.index.files as files_module

    reads, original = [], build_module.read_index
    for module in (build_module, files_module):  # the merge's reads, and the fill's (`EmptiedTrained`)
        monkeypatch.setattr(
            module,
            "read_index",
            lambda path, *a, **kw: reads.append(os.path.basename(path)) or original(path, *a, **kw),
        )
    vectors = clustered(4_000, clusters=50)
    ids = np.arange(4_000, dtype=np.int64) * 2 + 1
    paths = write_embedding_files(tmp_path / "emb", ids, vectors, files=6)
    info = _build(paths, IndexConfig(type="IVF32,Flat", nprobe=32, recall_sample=100), tmp_path / "faiss")
    assert info["parts"] == 6
    assert reads.count("trained.faiss") == 2  # once by the fill (6 parts), once by the merge
    index = load_index(str(tmp_path / "faiss" / "index.faiss"), 32, sha256=None)
    assert index.ntotal == 4_000
    _, found = index.search(vectors[::400], 1)
    assert found[:, 0].tolist() == ids[::400].tolist()


@pytest.mark.beam
@pytest.mark.parametrize("several", [False, True])
def test_two_level_k_means_in_one_process_finds_the_centroids_the_workers_find(tmp_path, monkeypatch, several):
    """TrainIndex's graph and `train_two_level` draw the same subsets by chunk id and run the
    same steps: one set of coarse centroids, whichever runs it, the first level's subset
    reaching its trainer as one file or as several (no Beam value holds the subset), a Lloyd
    step's sums written once a bundle or after every sample file; the one worker process
    builds each Lloyd step's list assigner once for all 8 sample files."""
    if several:
        monkeypatch.setattr(two_level, "SUBSET_FILE_BYTES", 20_000)
        monkeypatch.setattr(train_beam, "FOLD_BYTES", 1)
    factory, vectors = "IVF64,Flat", clustered(10_000, clusters=100)
    ids = np.arange(10_000, dtype=np.int64) * 3 + 5
    paths = write_embedding_files(tmp_path / "emb", ids, vectors, files=8)
    p = new_pipeline([])
    _ = (
        p
        | beam.Create(paths)
        | BuildIndex(IndexConfig(type=factory, nprobe=1, clustering="two_level"), str(tmp_path / "faiss"))
    )
    result = p.run()
    result.wait_until_finish()
    builds = result.metrics().query(MetricsFilter().with_name("list_assigner_builds"))["counters"]
    assert sum(c.committed for c in builds) == REFINE_ITERATIONS
    sent = result.metrics().query(MetricsFilter().with_name("lloyd_block_sums_written"))["counters"]
    assert (sum(c.committed for c in sent) >= 8 * REFINE_ITERATIONS) == several  # 64 lists: one block
    sample = np.flatnonzero(in_sample(ids, training_size(len(ids), factory), len(ids), TRAIN_SALT))[::-1]  # any order
    alone = train_index(factory, vectors[sample], "two_level", ids=ids[sample], population=len(ids))

    def centroids(index):
        return faiss.extract_index_ivf(index).quantizer.reconstruct_n(0, 64)

    assert np.array_equal(centroids(load_index(str(tmp_path / "faiss" / "index.faiss"), sha256=None)), centroids(alone))
    subset = sorted((tmp_path / "faiss" / two_level.SUBSETS_DIR).glob("firstlevel-*.vectors.npy"))
    assert subset and (len(subset) > 1) == several


@pytest.mark.parametrize("clustering", ["flat", "two_level"])
@pytest.mark.beam
def test_one_and_two_workers_build_the_same_index(tmp_path, monkeypatch, clustering):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # new_pipeline shares the cores
    vectors = clustered(12_000, clusters=100, seed=3)
    paths = write_embedding_files(tmp_path / "emb", np.arange(12_000), vectors, files=3)
    cfg = IndexConfig(type="IVF32,PQ8x8np", target_recall=0.5, recall_sample=100, clustering=clustering)
    one = _build(paths, cfg, tmp_path / "one")
    two = _build(paths, cfg, tmp_path / "two", ["--direct_num_workers=2", "--direct_running_mode=multi_processing"])
    assert {k: v for k, v in one.items() if k != "queries_per_second"} == {
        k: v for k, v in two.items() if k != "queries_per_second"
    }
    a, b = (load_index(str(tmp_path / d / "index.faiss"), one["nprobe"], sha256=None) for d in ("one", "two"))
    assert np.array_equal(a.search(vectors[::60], 10)[1], b.search(vectors[::60], 10)[1])


@pytest.mark.beam
def test_mixed_dimensions_are_refused(tmp_path):
    paths = write_embedding_files(tmp_path / "a", np.arange(50), clustered(50, d=16), files=1)
    paths += write_embedding_files(tmp_path / "b", np.arange(50, 100), clustered(50, d=8), files=1)
    with pytest.raises(Exception, match="mixed dimensions"):
        _build(paths, IndexConfig(), tmp_path / "faiss")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--memory-budget", "10B"], "too small for any index"),
        (["--type", "IVF64,Flat"], "needs at least 2,496 vectors"),
        (["--type", "Bogus9"], "not a valid faiss factory string"),
    ],
)
@pytest.mark.e2e  # the `index` job runs: it fails once the plan is made from the files' footers
def test_index_command_errors_are_one_line(tmp_path, capsys, args, message):
    from pipeline.cli import main

    paths = write_embedding_files(tmp_path / "emb", np.arange(40), clustered(40, d=8), files=1)
    with pytest.raises(SystemExit) as exit_info:
        main(["index", "--embeddings", paths[0], "--output", str(tmp_path / "out"), *args])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 1 and len(lines) == 1 and message in lines[0], lines
    assert not (tmp_path / "out" / "manifest.json").exists()


@pytest.mark.e2e
def test_index_command_writes_index_and_manifest(tmp_path):
    from pipeline.check.validate import validate_path
    from pipeline.cli import main

    vectors = clustered(3000, d=16, clusters=30)
    write_embedding_files(tmp_path / "emb", np.arange(3000) + 10, vectors, files=3)
    main(
        [
            "index",
            "--embeddings",
            str(tmp_path / "emb" / "*.parquet"),
            "--output",
            str(tmp_path / "out"),
            "--type",
            "IVF16,Flat",
            "--target-recall",
            "0.9",
        ]
    )
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["num_vectors"] == 3000 and manifest["recall_at_k"]["value"] >= 0.9
    assert [f["path"] for f in manifest["files"]] == ["faiss/index.faiss"]
    assert len(manifest["inputs"]) == 3
    assert validate_path(str(tmp_path / "out"))[0].startswith("OK vector index")
    assert (tmp_path / "emb").is_dir() and len(list((tmp_path / "emb").iterdir())) == 3  # inputs untouched


@pytest.mark.beam
def test_slice_bytes_on_an_index_that_cannot_be_sliced_builds_one_file_and_says_so(tmp_path, caplog):
    vectors = np.random.default_rng(0).standard_normal((300, 8)).astype(np.float32)
    paths = write_embedding_files(tmp_path / "emb", np.arange(300, dtype=np.int64), vectors, files=3)
    with caplog.at_level("WARNING", logger="ratrain"):
        info = _build(paths, IndexConfig(type="Flat", slice_bytes=10_000), tmp_path / "faiss")
    assert [f["path"] for f in info["files"]] == ["index.faiss"] and info["slice_bytes"] is None
    assert load_index(str(tmp_path / "faiss" / "index.faiss"), sha256=None).ntotal == 300
    assert "applies to IVF indexes" in caplog.text


@pytest.mark.unit
def test_lists_are_shared_out_among_slices_only_when_there_are_several(tmp_path, caplog):
    """`plan_slices` on real filled parts of a real trained index: None for one index file;
    else every list's owner, slices numbered 0 … S-1, -1 exactly for the lists no part filled,
    and no slice holding more vectors than a slice of that size holds."""
    factory, dim = "IVF16,Flat", 8
    vectors = clustered(3000, d=dim, clusters=16)
    trained = train_index(factory, vectors)
    write_index(trained, str(tmp_path / "trained.faiss"))
    _, listed = faiss.extract_index_ivf(trained).quantizer.search(vectors, 1)
    kept = np.flatnonzero(listed[:, 0] >= 3)  # lists 0, 1 and 2 stay empty
    parts, dense = [], []
    for number, rows in enumerate(np.array_split(kept, 3)):
        part = faiss.clone_index(trained)
        part.add_with_ids(vectors[rows], rows.astype(np.int64))
        dense.append(list_sizes(part))
        parts.append(FilledPart.of(f"embeddings-{number:05d}.parquet", f"part-{number:05d}.faiss", dense[-1]))
    assert all((part.counts > 0).all() and len(part.lists) < part.nlist for part in parts)  # only the lists filled
    summed = SumListSizes()
    totals = summed.extract_output(
        summed.merge_accumulators(
            [summed.add_input(summed.create_accumulator(), part) for part in parts] + [summed.create_accumulator()]
        )
    )
    sizes = np.sum(dense, axis=0)
    assert (totals[0] == sizes).all() and totals[1] == 3
    plan = IndexPlan(
        factory=factory, dim=dim, count=len(kept), train_size=3000, clustering="flat", mergeable=True, queries=100
    )
    trained_path = str(tmp_path / "trained.faiss")
    third = estimated_bytes(factory, len(kept) // 3, dim)

    assert plan_slices(totals, trained_path, plan, None) is None
    assert plan_slices(totals, trained_path, plan, 10**9) is None  # all fit one
    graph = dataclasses.replace(plan, factory="HNSW32", mergeable=False)
    with caplog.at_level("WARNING", logger="ratrain"):
        assert plan_slices(totals, trained_path, graph, third) is None
    assert "applies to IVF indexes" in caplog.text

    slicing = plan_slices(totals, trained_path, plan, third)
    assert slicing is not None and slicing.parts == 3
    owner = slicing.owner
    assert ((owner == -1) == (sizes == 0)).all() and (sizes[:3] == 0).all()
    count = int(owner.max()) + 1
    assert count >= 3 and set(owner[owner >= 0].tolist()) == set(range(count))
    per_slice = np.bincount(owner[owner >= 0], weights=sizes[owner >= 0], minlength=count)
    assert per_slice.max() <= vectors_per_slice(factory, dim, third)


@pytest.mark.unit
def test_a_vector_whose_nearest_first_level_clusters_own_no_list_still_moves_its_nearest_list():
    """Lloyd steps look among the lists of a vector's REFINE_PROBE nearest first-level clusters;
    where none of those owns a list, the vector goes to its nearest list of all (it once got
    list -1, and its sum overwrote the last list's centroid)."""
    dim = 16
    first = np.eye(dim, dtype=np.float32)[:10]  # ten first-level clusters
    lists = _unit(np.eye(dim, dtype=np.float32)[[0, 0]] + np.array([[0, 0.1] + [0] * 14, [0, -0.1] + [0] * 14]))
    away = _unit(np.eye(dim, dtype=np.float32)[[9]] - 0.5 * np.eye(dim, dtype=np.float32)[[0]])  # cluster 0 ranks last
    touched, sums, counts = list_sums(list_assigner(first, lists), np.concatenate([lists, away]))
    assert (touched >= 0).all() and counts.sum() == 3
    moved = moved_centroids(lists, touched, sums)
    assert np.isfinite(moved).all() and np.allclose(np.linalg.norm(moved, axis=1), 1, atol=1e-5)


def _unit(vectors: np.ndarray) -> np.ndarray:
    return (vectors / np.linalg.norm(vectors, axis=1, keepdims=True)).astype(np.float32)


@pytest.mark.unit
def test_an_hnsw_coarse_quantizer_walks_deep_enough_for_every_list_a_deepened_search_asks_for():
    """Deepening raises nprobe towards nlist; an HNSW quantizer returns at most about efSearch
    lists, so it walks as deep as the lists asked for: with 3 vectors left outside the excluded
    ranges, every slot is filled (at efSearch 16 it found 1 or 2 of the 3)."""
    vectors = _unit(np.random.default_rng(0).standard_normal((60_000, 16)))
    index = faiss.index_factory(16, "IVF1024_HNSW32,Flat", faiss.METRIC_INNER_PRODUCT)
    index.train(vectors[:50_000])
    index.add_with_ids(vectors, np.arange(60_000))
    set_search_depth(index, 16)
    _, found, deeper = search_excluding(index, vectors[:4], 3, [(0, 5), (6, 30_000), (30_001, 59_999)])
    assert deeper > 0 and [sorted(row) for row in found.tolist()] == [[5, 30_000, 59_999]] * 4


@pytest.mark.unit
def test_an_index_file_is_checked_against_its_sha256_before_faiss_parses_it(tmp_path):
    import hashlib

    from pipeline.common.errors import ChecksumMismatch
    from pipeline.index.files import read_index

    path = str(tmp_path / "index.faiss")
    _, sha256 = write_index(faiss.IndexFlatIP(8), path)
    assert load_index(path, sha256=sha256).d == read_index(path, sha256=sha256).d == 8
    (tmp_path / "index.faiss").write_bytes(b"not an index at all")  # faiss itself would raise RuntimeError
    with pytest.raises(ChecksumMismatch, match="of its 19 bytes is not the manifest's"):
        load_index(path, sha256=sha256)
    with pytest.raises(ChecksumMismatch):
        read_index(path, sha256=sha256)
    right = hashlib.sha256(b"not an index at all").hexdigest()
    with pytest.raises(RuntimeError) as parsed:  # what the check spares a reader: faiss's own failure
        read_index(path, sha256=right)
    assert not isinstance(parsed.value, ChecksumMismatch)
