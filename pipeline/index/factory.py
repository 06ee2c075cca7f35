"""Which faiss index: the factory chosen from a memory budget (Flat, IVF-Flat, IVF-SQ8, IVF-PQ),
its sizes and lists, the clustering to train it with, and the build plan.

Chunk ids are the faiss ids, so a search answers chunk ids. Importing the `index` modules
imports no Beam: files go through `pipeline.common.fileio`, imported inside the functions that
open one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import faiss

from schemas.stage_config import IndexConfig

ID_BYTES = 8  # faiss keeps an int64 id per vector
FLAT_MAX_VECTORS = 100_000  # exact search stays fast below this
IVF_FLAT_MAX_VECTORS = 1_000_000
HNSW_QUANTIZER_MIN_LISTS = 16384  # above this many lists, assign with a graph, not a scan
HNSW_M = 32
PQ_CHOICES = (128, 96, 64, 48, 32, 24, 16, 8, 4)  # sub-quantizers (bytes per code), largest first
MIN_POINTS_PER_CENTROID = 39  # faiss k-means warns below this
MAX_POINTS_PER_CENTROID = 256  # and subsamples above it
TRAIN_POINTS_PER_CENTROID = 64  # what we sample, between the two
TWO_LEVEL_MIN_LISTS = 4096  # 'auto' clustering: two-level k-means from this many lists


class IndexBuildError(ValueError):
    """An index that cannot be built as configured; the message says why."""


def nlist_for(num_vectors: int) -> int:
    """IVF lists: ≈ 4√N (a power of two) below 10M vectors, 2^16 … 2^20 above, lowered until
    every list gets at least 39 training points. (autofaiss switches to 2^16 at 1M; training
    2^16 lists is hours of k-means on a CPU worker, 4√N is minutes.)"""
    if num_vectors < 10_000_000:
        nlist = 2 ** max(0, round(math.log2(4 * math.sqrt(max(num_vectors, 1)))))
    elif num_vectors < 100_000_000:
        nlist = 2**16
    elif num_vectors < 1_000_000_000:
        nlist = 2**18
    else:
        nlist = 2**20
    while nlist > 1 and num_vectors < MIN_POINTS_PER_CENTROID * nlist:
        nlist //= 2
    return nlist


def _coarse(nlist: int) -> str:
    return f"IVF{nlist}_HNSW{HNSW_M}" if nlist >= HNSW_QUANTIZER_MIN_LISTS else f"IVF{nlist}"


def estimated_bytes(factory: str, num_vectors: int, dim: int) -> int:
    """Memory (≈ file size) of an index of this factory string holding num_vectors."""
    parts = factory.split(",")
    nlist = ivf_lists(factory)
    width = dim
    total = 0
    for part in parts:
        if part.startswith("OPQ"):
            width = int(part.split("_")[1])
            total += 4 * dim * width
    if nlist:
        total += 4 * nlist * width
        if "_HNSW" in factory:
            total += nlist * (4 * width + 2 * 4 * HNSW_M)
    codec = parts[-1]
    if codec.startswith("SQ"):  # SQ8, SQ6, SQ4: bits per dimension; SQfp16: 16
        bits = 16 if codec == "SQfp16" else int(codec[2:])
        per_vector = math.ceil(width * bits / 8) + ID_BYTES
        total += 2 * 4 * width  # each dimension's range
    elif codec.startswith("PQ"):
        pq = int(codec[2:].split("x")[0])
        per_vector = pq + ID_BYTES
        total += 4 * width * 256  # PQ centroids: 256 per sub-quantizer
    elif codec.startswith("HNSW"):
        per_vector = 4 * dim + 2 * 4 * int(codec[4:] or HNSW_M) + ID_BYTES
    else:  # Flat
        per_vector = 4 * width + ID_BYTES
    return total + num_vectors * per_vector


def choose_index_factory(num_vectors: int, dim: int, memory_budget: int) -> str:
    """`index.type: auto`: the most exact index that fits `memory_budget` bytes.

    1. `Flat` (exact) up to 100k vectors;
    2. `IVF{nlist},Flat` up to 1M vectors (nlist from `nlist_for`);
    3. `IVF{nlist}[_HNSW32],SQ8`: a byte per dimension, a quarter of Flat, and as exact as
       Flat for neighbours (measured: recall@2 1.000 where PQ128 plateaued at 0.90, long
       documents with their own excluded, benchmarks/long_document_recall.py);
    4. `IVF{nlist}[_HNSW32],PQ{pq}x8np` with the largest pq in 128 … 4 (dividing d) that fits;
    each only if its estimated memory fits the budget. Never chosen, but honoured when given:
    plain HNSW (it can be neither trained on a sample nor filled in parallel) and an OPQ
    rotation (training OPQ128 on 65k vectors took 137 s for 10 of its default 50 iterations
    on 2 cores; with ≤ 4 dims per sub-quantizer PQ alone is already fine-grained).
    """
    if num_vectors <= 0:
        raise IndexBuildError("no vectors to index: every input record was rejected or empty")
    nlist = nlist_for(num_vectors)
    candidates = []
    if num_vectors <= FLAT_MAX_VECTORS:
        candidates.append("Flat")
    if num_vectors <= IVF_FLAT_MAX_VECTORS and nlist > 1:
        candidates.append(f"{_coarse(nlist)},Flat")
    if nlist > 1:
        # "np": no polysemous training, which searches never use and which took 178 s of a
        # 10k-vector IVF64,PQ48x8 build on one core (14 s without)
        candidates.append(f"{_coarse(nlist)},SQ8")
        candidates += [f"{_coarse(nlist)},PQ{pq}x8np" for pq in PQ_CHOICES if dim % pq == 0]
    else:
        candidates.append("Flat")
    for factory in candidates:
        if estimated_bytes(factory, num_vectors, dim) <= memory_budget:
            return factory
    smallest = min(estimated_bytes(f, num_vectors, dim) for f in candidates)
    raise IndexBuildError(
        f"index.memory_budget of {memory_budget:,} B is too small for any index of "
        f"{num_vectors:,} x {dim} vectors: the smallest ({candidates[-1]}) needs about "
        f"{smallest:,} B"
    )


def ivf_lists(factory: str) -> int | None:
    """The inverted lists of an IVF factory string; None for a type without lists."""
    for part in factory.split(","):
        if part.startswith("IVF"):
            return int(part[3:].split("_")[0])
    return None


def required_ivf_lists(factory: str) -> int:
    """`ivf_lists` where only an IVF index will do (two-level training): a type without
    inverted lists is an error."""
    nlist = ivf_lists(factory)
    if nlist is None:
        raise IndexBuildError(f"{factory} has no inverted lists: two-level clustering needs an IVF index")
    return nlist


def training_size(num_vectors: int, factory: str) -> int:
    """Vectors to train on: 64 per IVF list (faiss wants 39 … 256), at least PQ's 256 × 256
    when there is a PQ; 0 for types that need no training."""
    nlist = ivf_lists(factory)
    if nlist is None:
        return min(num_vectors, 256 * 256) if "PQ" in factory else 0
    if num_vectors < MIN_POINTS_PER_CENTROID * nlist:
        raise IndexBuildError(
            f"{factory} needs at least {MIN_POINTS_PER_CENTROID * nlist:,} vectors to train "
            f"({MIN_POINTS_PER_CENTROID} per list), got {num_vectors:,}: use fewer lists or 'auto'"
        )
    return min(num_vectors, max(TRAIN_POINTS_PER_CENTROID * nlist, 256 * 256 if "PQ" in factory else 0))


def new_index(factory: str, dim: int):
    try:
        index = faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT)
    except RuntimeError as err:
        raise IndexBuildError(
            f"index.type {factory!r} is not a valid faiss factory string for "
            f"dim {dim}: {str(err).strip().splitlines()[-1]}"
        ) from None
    return index if is_ivf(index) else faiss.IndexIDMap2(index)  # others keep no ids of their own


def is_ivf(index) -> bool:
    try:
        faiss.extract_index_ivf(index)
        return True
    except RuntimeError:
        return False


def resolve_clustering(clustering: str, factory: str, accelerator: bool = False) -> str:
    """`index.clustering` for this factory: 'auto' is two-level k-means from
    TWO_LEVEL_MIN_LISTS lists (benchmarks/index_training.py), 'flat' below or when the training
    step has an accelerator (one k-means on its GPUs); types without inverted lists, or with a
    pre-transform (OPQ, PCA), train in one k-means ('flat')."""
    nlist = ivf_lists(factory)
    transformed = not factory.split(",")[0].startswith("IVF")
    if clustering == "two_level" and nlist and transformed:
        raise IndexBuildError(f"index.clustering two_level takes no pre-transform ({factory}): use 'flat' or 'auto'")
    if clustering != "auto" or not nlist:
        return clustering if nlist else "flat"
    return "flat" if transformed or accelerator or nlist < TWO_LEVEL_MIN_LISTS else "two_level"


def encoder_size(factory: str) -> int:
    """Training vectors an IVF index's encoder needs beyond its lists: PQ's 256 × 256, and as
    many for a scalar quantizer's per-dimension ranges."""
    return 256 * 256 if "PQ" in factory or ",SQ" in factory else 0


@dataclass(frozen=True)
class EmbeddingStats:
    """What the embeddings files' footers say together."""

    count: int
    dims: tuple[int, ...]  # every vector width seen, sorted (one, for a usable index)


@dataclass(frozen=True, kw_only=True)
class IndexPlan:
    """What the index stage builds, decided once from the embeddings' stats and the config."""

    factory: str  # the faiss index_factory string
    dim: int
    count: int  # vectors to index
    train_size: int  # vectors in the training sample
    clustering: str  # 'flat' or 'two_level' ('flat' for an index without lists)
    mergeable: bool  # IVF: filled in parts and merged; else built by one worker
    queries: int  # vectors in the query sample the depth is tuned on


def plan_index(stats: EmbeddingStats, cfg: IndexConfig) -> IndexPlan:
    """Factory string, training size and query sample size from the stats."""
    if len(stats.dims) > 1:
        raise IndexBuildError(f"embeddings have mixed dimensions {list(stats.dims)}: one index needs one dimension")
    count = stats.count
    if count == 0:
        raise IndexBuildError("no vectors to index: every input record was rejected or empty")
    dim = stats.dims[0]
    factory = choose_index_factory(count, dim, cfg.memory_budget) if cfg.type == "auto" else cfg.type
    new_index(factory, dim)  # a bad factory string fails here, with its reason
    return IndexPlan(
        factory=factory,
        dim=dim,
        count=count,
        train_size=training_size(count, factory),
        clustering=resolve_clustering(cfg.clustering, factory, cfg.accelerator is not None),
        mergeable=ivf_lists(factory) is not None,
        queries=min(cfg.recall_sample, count),
    )
