"""Build the faiss index over chunk embeddings and measure its recall honestly.

Pure functions choose the factory string, build, tune nprobe and measure recall; `BuildIndex`
wires them into the pipeline. Chunk ids are the faiss ids, so a search answers chunk ids.
"""
from __future__ import annotations

import math
import os
import tempfile
import time

import apache_beam as beam
import faiss
import numpy as np

from pipeline import fileio
from schemas.config import IndexConfig

RECALL_K = 10
INDEX_FILE = "index.faiss"
BUILD_INFO_FILE = "build_info.json"
FLAT_MAX_VECTORS = 100_000     # exact search is fast enough below this on one core
MIN_POINTS_PER_CENTROID = 39   # faiss k-means warns below this
MAX_POINTS_PER_CENTROID = 256  # and subsamples above it


class IndexBuildError(ValueError):
    """An index that cannot be built as configured; the message says why."""


def choose_index_factory(num_vectors: int, dim: int, memory_budget: int) -> str:
    """'auto': exact `Flat` for small sets, `IVF{nlist},Flat` (nlist ≈ 4√N, a power of two,
    at least 39 training points per list) above. Both hold N·d·4 bytes of vectors."""
    vector_bytes = num_vectors * dim * 4
    if vector_bytes > memory_budget:
        raise IndexBuildError(
            f"index.memory_budget {memory_budget} B is smaller than the {vector_bytes} B of "
            f"{num_vectors} x {dim} float32 vectors; raise it (compressed index types are not "
            f"chosen automatically yet)")
    if num_vectors <= FLAT_MAX_VECTORS:
        return "Flat"
    nlist = 2 ** round(math.log2(4 * math.sqrt(num_vectors)))
    while nlist > 1 and num_vectors < MIN_POINTS_PER_CENTROID * nlist:
        nlist //= 2
    return f"IVF{nlist},Flat"


def ivf_lists(factory: str) -> int | None:
    for part in factory.split(","):
        if part.startswith("IVF"):
            return int(part[3:].split("_")[0])
    return None


def training_sample(num_vectors: int, factory: str) -> np.ndarray:
    """Deterministic, evenly spread positions to train on: at most 256 points per list."""
    nlist = ivf_lists(factory)
    if nlist is None:
        return np.arange(0)
    if num_vectors < MIN_POINTS_PER_CENTROID * nlist:
        raise IndexBuildError(
            f"{factory} needs at least {MIN_POINTS_PER_CENTROID * nlist} vectors to train "
            f"({MIN_POINTS_PER_CENTROID} per list), got {num_vectors}: use fewer lists or 'auto'")
    size = min(num_vectors, MAX_POINTS_PER_CENTROID * nlist)
    return np.linspace(0, num_vectors - 1, size).astype(np.int64)


def build_index(ids: np.ndarray, vectors: np.ndarray, factory: str):
    """A trained, filled inner-product index whose faiss ids are `ids`."""
    dim = vectors.shape[1]
    try:
        index = faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT)
    except RuntimeError as err:
        raise IndexBuildError(f"index.type {factory!r} is not a valid faiss factory string: "
                              f"{str(err).splitlines()[-1]}") from None
    if not index.is_trained:
        index.train(vectors[training_sample(len(vectors), factory)])
    if ivf_lists(factory) is None:
        index = faiss.IndexIDMap2(index)  # flat and graph indexes keep no ids of their own
    index.add_with_ids(vectors, ids)
    return index


def set_nprobe(index, nprobe: int) -> None:
    faiss.extract_index_ivf(index).nprobe = nprobe


def recall_sample(num_vectors: int, size: int) -> np.ndarray:
    return np.linspace(0, num_vectors - 1, min(size, num_vectors)).astype(np.int64)


def one_recall_at_k(index, ids: np.ndarray, vectors: np.ndarray, queries: np.ndarray,
                    k: int = RECALL_K) -> float:
    """Share of queries whose exact nearest neighbour is among the index's top k."""
    exact = faiss.IndexFlatIP(vectors.shape[1])
    exact.add(vectors)
    _, truth = exact.search(queries, 1)
    _, found = index.search(queries, k)
    return float(np.mean([ids[t[0]] in f for t, f in zip(truth, found)]))


def tune_nprobe(index, ids, vectors, queries, target: float) -> tuple[int | None, float]:
    """Smallest power-of-two nprobe reaching `target` 1-recall@10 (None for non-IVF)."""
    if ivf_lists_of(index) is None:
        return None, one_recall_at_k(index, ids, vectors, queries)
    nlist, nprobe = ivf_lists_of(index), 1
    while True:
        set_nprobe(index, nprobe)
        recall = one_recall_at_k(index, ids, vectors, queries)
        if recall >= target or nprobe >= nlist:
            return nprobe, recall
        nprobe = min(nprobe * 2, nlist)


def ivf_lists_of(index) -> int | None:
    try:
        return faiss.extract_index_ivf(index).nlist
    except RuntimeError:
        return None


def query_rate(index, queries: np.ndarray, k: int = RECALL_K) -> float:
    start = time.perf_counter()
    index.search(queries, k)
    return len(queries) / max(time.perf_counter() - start, 1e-9)


def serialize(index) -> bytes:
    return faiss.serialize_index(index).tobytes()


def load_index(path: str, nprobe: int | None = None):
    """Read an index file from any Beam filesystem path."""
    if "://" in path:
        with tempfile.NamedTemporaryFile(suffix=".faiss", delete=False) as tmp:
            tmp.write(fileio.read_bytes(path))
        index = faiss.read_index(tmp.name)
        os.unlink(tmp.name)
    else:
        index = faiss.read_index(path)
    if nprobe is not None:
        set_nprobe(index, nprobe)
    return index


def build_and_measure(ids: np.ndarray, vectors: np.ndarray, cfg: IndexConfig):
    """(index, info) for sorted ids and their vectors: factory, nprobe, measured recall."""
    if len(ids) == 0:
        raise IndexBuildError("no chunks to index: every input record was rejected or empty")
    factory = (choose_index_factory(len(ids), vectors.shape[1], cfg.memory_budget)
               if cfg.type == "auto" else cfg.type)
    index = build_index(ids, vectors, factory)
    queries = vectors[recall_sample(len(ids), cfg.recall_sample)]
    if cfg.nprobe is not None and ivf_lists_of(index) is not None:
        set_nprobe(index, cfg.nprobe)
        nprobe, recall = cfg.nprobe, one_recall_at_k(index, ids, vectors, queries)
    else:
        nprobe, recall = tune_nprobe(index, ids, vectors, queries, cfg.target_recall)
    info = {"index_factory": factory, "nprobe": nprobe, "dim": int(vectors.shape[1]),
            "metric": "inner_product", "num_vectors": int(len(ids)),
            "recall_at_k": {"measure": f"1-recall@{RECALL_K}", "value": recall,
                            "sample_size": int(len(queries)), "nprobe": nprobe},
            "queries_per_second": round(query_rate(index, queries), 1)}
    return index, info


def _build(embeddings: list, cfg: IndexConfig, out_dir: str):
    embeddings.sort(key=lambda e: e[0])
    ids = np.fromiter((e[0] for e in embeddings), dtype=np.int64, count=len(embeddings))
    vectors = np.stack([e[1] for e in embeddings]).astype(np.float32) if embeddings else \
        np.zeros((0, 1), np.float32)
    index, info = build_and_measure(ids, vectors, cfg)
    data = serialize(index)
    fileio.write_bytes(fileio.join(out_dir, INDEX_FILE), data)
    info["index_bytes"] = len(data)
    fileio.write_json_atomic(fileio.join(out_dir, BUILD_INFO_FILE), info)
    yield info


class BuildIndex(beam.PTransform):
    """(chunk_id, embedding) -> `faiss/index.faiss` plus its build info under `out_dir`.

    This version gathers the vectors in one worker; the index stage is its own transform so
    that a sampled-training, parallel-fill build can replace it without touching the rest.
    """

    def __init__(self, cfg: IndexConfig, out_dir: str):
        super().__init__()
        self.cfg, self.out_dir = cfg, out_dir

    def expand(self, embeddings):
        return (embeddings
                | "GatherVectors" >> beam.combiners.ToList()
                | "TrainFillMeasure" >> beam.FlatMap(_build, cfg=self.cfg, out_dir=self.out_dir))
