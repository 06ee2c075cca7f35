"""The faiss side of the chunk index, without Beam: the factory chosen from a memory budget,
the deterministic training and query samples, training, filling and merging IVF parts,
searching with id ranges excluded, exact search and the recall measured against it, tuning the
search depth to a target recall, the build plan, and reading and writing index and embedding
files.

Chunk ids are the faiss ids, so a search answers chunk ids. `pipeline.index` wires these
functions into the Beam index stage; the shards stage, validation and the benchmarks call them
directly. Importing this module imports no Beam: files go through `pipeline.fileio` (Beam's
FileSystems, for local paths and gs://), imported inside the functions that open one, so only
those calls load Beam (`load_index` memory-maps a local file with faiss alone).
"""

from __future__ import annotations

import hashlib
import math
import time

import faiss
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from schemas.arrow import tensor_column_to_numpy
from schemas.config import IndexConfig

RECALL_K = 10
TIE_TOLERANCE = 1e-3  # ann-benchmarks' epsilon: similarities this close are a tie
# Share of queries for which one of the index's top 10 (the query excluded) is as similar as
# the exact nearest other vector, within TIE_TOLERANCE: near-duplicates are interchangeable.
RECALL_MEASURE = f"1-recall@{RECALL_K} with ties within {TIE_TOLERANCE:g}"
TRUTH_DEPTH = 100  # exact best per query kept as ground truth (ties beyond it count as misses)
PLATEAU_GAIN = 0.005  # stop deepening the search when two doublings of the depth gain less recall
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
IO_BLOCK = 1 << 22  # bytes per read / write call when streaming an index


class IndexBuildError(ValueError):
    """An index that cannot be built as configured; the message says why."""


# --- choosing the factory string ------------------------------------------------------------


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
    for part in factory.split(","):
        if part.startswith("IVF"):
            return int(part[3:].split("_")[0])
    return None


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


def sample_keys(ids: np.ndarray, salt: int) -> np.ndarray:
    """A deterministic pseudo-random 32-bit key per id (splitmix64 finaliser): samples do not
    depend on input order or on the number of workers."""
    with np.errstate(over="ignore"):
        x = ids.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(salt)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return (x ^ (x >> np.uint64(31))) >> np.uint64(32)


def in_sample(ids, size: int, population: int, salt: int):
    """True for about `size` of `population` ids, chosen by `sample_keys`."""
    keys = sample_keys(np.asarray(ids, dtype=np.int64), salt)
    return (
        keys < np.uint64(min(size, population) * (1 << 32) // max(population, 1))
        if size < population
        else np.ones(keys.shape, dtype=bool)
    )


TRAIN_SALT, QUERY_SALT = 1, 2


# --- building, filling, measuring -----------------------------------------------------------


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


# Two-level k-means (faiss.contrib.clustering's scheme, split into steps that can run on
# different workers): √nlist first-level clusters trained on a bounded subsample, every training
# vector assigned to one, each cluster split into lists in proportion to its size, the lists'
# centroids concatenated; then a few Lloyd iterations over the whole sample, each vector
# assigned among the lists of its REFINE_PROBE nearest first-level clusters (the split alone
# leaves lists fitted to their cluster's side of a boundary: measured 0.03 lower PQ recall,
# recovered by 3 iterations). About √nlist / 2 times fewer distance computations than one
# k-means over nlist lists, and no step holds more than one cluster.
FIRST_LEVEL_POINTS = 256  # training vectors per first-level cluster (faiss subsamples above 256)
KMEANS_SEED = 1234  # faiss's default: the same clusters on every run
REFINE_ITERATIONS = 3
REFINE_PROBE = 8
SUM_SCALE = 2.0**36  # fixed point for unit vectors' sums: 2^26 of them fit an int64


def first_level_clusters(nlist: int) -> int:
    return max(1, math.isqrt(nlist))


def first_level_size(train_size: int, nlist: int) -> int:
    """Training vectors the first level trains on: a subset of the sample."""
    return min(train_size, FIRST_LEVEL_POINTS * first_level_clusters(nlist))


def spherical_kmeans(vectors: np.ndarray, k: int) -> np.ndarray:
    """[k, d] unit centroids (inner-product search: spherical, as faiss trains IVF lists for it)."""
    kmeans = faiss.Kmeans(vectors.shape[1], k, spherical=True, seed=KMEANS_SEED)
    kmeans.train(np.ascontiguousarray(vectors, dtype=np.float32))
    return kmeans.centroids


def assign_first_level(centroids: np.ndarray, vectors: np.ndarray) -> np.ndarray:
    """The first-level cluster of each vector (most similar centroid)."""
    quantizer = faiss.IndexFlatIP(centroids.shape[1])
    quantizer.add(centroids)
    return quantizer.search(np.ascontiguousarray(vectors, dtype=np.float32), 1)[1][:, 0]


def lists_per_cluster(cluster_sizes: np.ndarray, nlist: int) -> np.ndarray:
    """IVF lists for each first-level cluster, in proportion to its training vectors, summing
    to nlist (cumulative rounding, as faiss.contrib.clustering)."""
    bounds = np.cumsum(cluster_sizes) * nlist // max(int(np.sum(cluster_sizes)), 1)
    return np.diff(bounds, prepend=0)


def second_level_centroids(vectors: np.ndarray, lists: int) -> np.ndarray:
    """One first-level cluster's share of the lists ([lists, d]); fewer vectors than lists keeps
    the vectors themselves (padded by repeating them)."""
    if lists == 0:
        return np.zeros((0, vectors.shape[1]), np.float32)
    if len(vectors) <= lists:
        return np.ascontiguousarray(vectors[np.arange(lists) % len(vectors)], dtype=np.float32)
    return spherical_kmeans(vectors, lists)


def list_assigner(first: np.ndarray, centroids: np.ndarray):
    """An index over the lists' centroids answering a vector's most similar list among the
    lists of its REFINE_PROBE most similar first-level clusters."""
    dim = centroids.shape[1]
    quantizer = faiss.IndexFlatIP(dim)
    quantizer.add(np.ascontiguousarray(first, dtype=np.float32))
    assigner = faiss.IndexIVFFlat(quantizer, dim, len(first), faiss.METRIC_INNER_PRODUCT)
    assigner.train(np.zeros((0, dim), np.float32))  # the quantizer is full: nothing to train
    assigner.add(np.ascontiguousarray(centroids, dtype=np.float32))
    assigner.nprobe = min(REFINE_PROBE, len(first))
    return assigner  # faiss's Python wrapper keeps `quantizer` alive with it


def list_sums(assigner, vectors: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One Lloyd step's partial result over `vectors`: (lists touched, their vector sums [.., d]
    in fixed point, counts). Integer sums add up to the same bits in any order, so the
    centroids do not depend on how the runner split the work."""
    lists = assigner.search(np.ascontiguousarray(vectors, dtype=np.float32), 1)[1][:, 0]
    touched, inverse, counts = np.unique(lists, return_inverse=True, return_counts=True)
    sums = np.zeros((len(touched), vectors.shape[1]), np.int64)
    np.add.at(sums, inverse, np.round(vectors * SUM_SCALE).astype(np.int64))
    return touched, sums, counts


def moved_centroids(centroids: np.ndarray, touched: np.ndarray, sums: np.ndarray) -> np.ndarray:
    """The Lloyd update: each touched list's centroid becomes its vectors' normalised mean
    (spherical); lists no vector chose keep theirs."""
    moved = centroids.copy()
    mean = sums.astype(np.float64)
    moved[touched] = (mean / np.linalg.norm(mean, axis=1, keepdims=True)).astype(np.float32)
    return moved


def index_from_centroids(factory: str, centroids: np.ndarray, encoder_sample: np.ndarray):
    """An IVF index of `factory` whose coarse quantizer holds `centroids` (nlist of them), its
    encoder (PQ, if any) trained on `encoder_sample` assigned to them."""
    index = new_index(factory, centroids.shape[1])
    ivf = faiss.extract_index_ivf(index)
    if len(centroids) != ivf.nlist:
        raise IndexBuildError(f"{factory}: {len(centroids)} centroids for {ivf.nlist} lists")
    ivf.quantizer.train(centroids)
    ivf.quantizer.add(centroids)
    index.train(np.ascontiguousarray(encoder_sample, dtype=np.float32))  # faiss skips the full quantizer
    return index


def encoder_size(factory: str) -> int:
    """Training vectors an IVF index's encoder needs beyond its lists: PQ's 256 × 256, and as
    many for a scalar quantizer's per-dimension ranges."""
    return 256 * 256 if "PQ" in factory or ",SQ" in factory else 0


def _train_two_level(factory: str, sample: np.ndarray):
    """Two-level training in one process: the steps BuildIndex spreads over workers."""
    nlist = ivf_lists(factory)
    first = spherical_kmeans(
        sample[_spread(len(sample), first_level_size(len(sample), nlist))], first_level_clusters(nlist)
    )
    cluster = assign_first_level(first, sample)
    lists = lists_per_cluster(np.bincount(cluster, minlength=len(first)), nlist)
    centroids = np.concatenate([second_level_centroids(sample[cluster == c], int(lists[c])) for c in range(len(first))])
    for _ in range(REFINE_ITERATIONS):
        touched, sums, _ = list_sums(list_assigner(first, centroids), sample)
        centroids = moved_centroids(centroids, touched, sums)
    return index_from_centroids(factory, centroids, sample[_spread(len(sample), encoder_size(factory))])


def _spread(n: int, size: int) -> np.ndarray:
    """`size` row numbers spread evenly over n rows."""
    return np.unique(np.linspace(0, n - 1, min(size, n)).astype(np.int64))


def train_index(factory: str, sample: np.ndarray, clustering: str = "flat"):
    """A new index of `factory` trained on `sample`. An IVF's coarse k-means is one k-means over
    all lists ('flat', on every GPU this faiss build sees: none with faiss-cpu) or faiss's
    two-level clustering ('two_level', on the CPU); see resolve_clustering."""
    index = new_index(factory, sample.shape[1])
    sample = np.ascontiguousarray(sample, dtype=np.float32)
    if index.is_trained:
        return index
    if resolve_clustering(clustering, factory) == "two_level":
        return _train_two_level(factory, sample)
    if is_ivf(index) and faiss.get_num_gpus() > 0:  # not measured on a GPU yet
        ivf = faiss.extract_index_ivf(index)
        ivf.clustering_index = faiss.index_cpu_to_all_gpus(faiss.IndexFlatL2(ivf.d))
    index.train(sample)
    return index


def build_index(ids: np.ndarray, vectors: np.ndarray, factory: str):
    """In one process: a trained, filled index whose faiss ids are `ids`, trained on the same
    sample the Beam stage would draw (for small sets, the non-mergeable types and baselines)."""
    index = train_index(factory, vectors[in_sample(ids, training_size(len(ids), factory), len(ids), TRAIN_SALT)])
    index.add_with_ids(np.ascontiguousarray(vectors, dtype=np.float32), ids.astype(np.int64))
    return index


def merge_part(merged, part) -> None:
    """Move the inverted lists of a filled IVF part into `merged` (same trained index). Only the
    lists move, so a part written without its coarse quantizer (`write_part`) merges too."""
    target, source = faiss.extract_index_ivf(merged), faiss.extract_index_ivf(part)
    if (target.nlist, target.code_size) != (source.nlist, source.code_size):
        raise IndexBuildError(
            f"a part of {source.nlist} lists of {source.code_size} B codes does not "
            f"merge into an index of {target.nlist} lists of {target.code_size} B"
        )
    target.invlists.merge_from(source.invlists, 0)
    target.ntotal += source.ntotal
    source.ntotal = 0
    merged.ntotal = target.ntotal  # a pre-transform wrapper counts too


def write_part(index, path: str) -> tuple[int, str]:
    """`write_index` of a filled IVF part with an empty coarse quantizer in place of the trained
    one: every part shares it (it comes back from the trained index at merge time), and at
    2^20 lists it is ~2 GB per file while a part's codes are a few MB."""
    ivf = faiss.extract_index_ivf(index)
    trained, owned = ivf.quantizer, ivf.own_fields
    empty = faiss.IndexFlat(ivf.d, ivf.metric_type)
    ivf.quantizer, ivf.own_fields = empty, False
    try:
        return write_index(index, path)
    finally:
        ivf.quantizer, ivf.own_fields = trained, owned


def set_search_depth(index, depth: int) -> None:
    """nprobe for IVF, efSearch for HNSW."""
    if is_ivf(index):
        faiss.extract_index_ivf(index).nprobe = depth
    elif _hnsw(index) is not None:
        _hnsw(index).efSearch = depth


def _hnsw(index):
    inner = faiss.downcast_index(index.index) if isinstance(index, faiss.IndexIDMap) else index
    return inner.hnsw if hasattr(inner, "hnsw") else None


def search_depth(index) -> int | None:
    """The depth searches run at: nprobe (IVF), efSearch (HNSW), None (exhaustive types)."""
    if is_ivf(index):
        return faiss.extract_index_ivf(index).nprobe
    hnsw = _hnsw(index)
    return None if hnsw is None else hnsw.efSearch


def deepest_search(index) -> int | None:
    """The depth at which a search reaches every vector: all lists (IVF), a candidate list as
    long as the index (HNSW); None for exhaustive types."""
    if is_ivf(index):
        return faiss.extract_index_ivf(index).nlist
    return None if _hnsw(index) is None else max(int(index.ntotal), 1)


def _search_params(index, selector, depth: int | None):
    """faiss SearchParameters with `selector` at `depth` (faiss params replace the index's own
    nprobe / efSearch, so the depth is always given)."""
    if is_ivf(index):
        return faiss.SearchParametersIVF(sel=selector, nprobe=depth)
    if _hnsw(index) is not None:
        return faiss.SearchParametersHNSW(sel=selector, efSearch=depth)
    return faiss.SearchParameters(sel=selector)


def exclusion_selector(excluded: list[tuple[int, int]]):
    """(a faiss selector of every id outside the [start, end) ranges, or None for no ranges;
    the selectors it is built of, which the caller keeps alive while searching: they hold raw
    pointers to each other)."""
    parts = [faiss.IDSelectorRange(int(start), int(end)) for start, end in excluded]
    keep, union = list(parts), parts[0] if parts else None
    for part in parts[1:]:
        union = faiss.IDSelectorOr(union, part)
        keep.append(union)
    return (faiss.IDSelectorNot(union) if parts else None), keep


def search_deepening(search_at, depth: int | None, deepest: int | None):
    """`search_at(depth)` -> (scores, ids); the rows that come back with an empty slot are
    searched again at twice the depth, up to `deepest` (None: never).
    -> (scores [q, k], ids [q, k] (-1 = none), deeper searches made)."""
    scores, ids = search_at(depth)
    deeper = 0
    while deepest is not None and depth < deepest and (ids < 0).any():
        depth = min(2 * depth, deepest)
        deeper += 1
        # the same query block again (fixed shape), keeping the rows that were already full
        more_scores, more_ids = search_at(depth)
        short = (ids < 0).any(axis=1)
        scores[short], ids[short] = more_scores[short], more_ids[short]
    return scores, ids, deeper


def search_excluding(index, queries: np.ndarray, k: int, excluded: list[tuple[int, int]]):
    """The k best ids outside the id ranges `excluded` ([start, end) each) per query, skipped
    by faiss during the search itself, so they never take a place in the top k. A query that
    comes back with fewer than k (an IVF whose probed lists, or an HNSW walk, hold mostly
    excluded vectors) is searched again at twice the depth, up to the deepest: a slot stays
    empty only when the index holds fewer than k vectors outside the ranges.
    -> (scores [q, k], ids [q, k] (-1 = none), deeper searches made)."""
    selector, _keep = exclusion_selector(excluded)
    queries = np.ascontiguousarray(queries, dtype=np.float32)
    return search_deepening(
        lambda depth: index.search(queries, k, params=_search_params(index, selector, depth)),
        search_depth(index),
        deepest_search(index),
    )


def search_depth_range(index) -> list[int] | None:
    """Depths to try, smallest first; None when the index is exact or has no depth knob."""
    if is_ivf(index):
        nlist = faiss.extract_index_ivf(index).nlist
        return sorted({min(2**i, nlist) for i in range(int(math.log2(nlist)) + 2)})
    return [16, 32, 64, 128, 256, 512, 1024] if _hnsw(index) is not None else None


EXACT_BLOCK = 32768  # vectors per block of the exact search: bounds its [q, block] scores


def exact_top(scores: np.ndarray, ids: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row of scores [n, r] over `ids` [r] (excluded entries -inf), the k best (higher
    score, then lower id): (scores [n, k] float32, ids [n, k]); -inf / -1 past the reachable."""
    n = len(scores)
    top_scores, top_ids = np.full((n, k), -np.inf, np.float32), np.full((n, k), -1, np.int64)
    if scores.shape[1] > k:  # the k best in linear time, then only those sorted
        best = np.argpartition(-scores, k - 1, axis=1)[:, :k]
        scores, candidates = np.take_along_axis(scores, best, axis=1), ids[best]
    else:
        candidates = np.broadcast_to(ids, scores.shape)
    order = np.lexsort((candidates, -scores), axis=1)
    found = np.take_along_axis(scores, order, axis=1)
    top_scores[:, : found.shape[1]] = found
    top_ids[:, : found.shape[1]] = np.where(np.isfinite(found), np.take_along_axis(candidates, order, axis=1), -1)
    return top_scores, top_ids


def merge_top(a, b, k: int):
    """Associative merge of two (scores, ids) top-k lists of the same queries."""
    scores = np.concatenate([a[0], b[0]], axis=1)
    ids = np.concatenate([a[1], b[1]], axis=1)
    order = np.lexsort((ids, -scores), axis=1)[:, :k]
    return np.take_along_axis(scores, order, axis=1), np.take_along_axis(ids, order, axis=1)


def exact_nearest_other(query_ids, queries, ids, vectors, depth: int = TRUTH_DEPTH):
    """Per query, the `depth` nearest vectors among `ids` other than itself: (scores, ids)
    [q, depth], merged over blocks with `merge_top`."""
    result = None
    for start in range(0, len(ids), EXACT_BLOCK):
        block_ids = ids[start : start + EXACT_BLOCK]
        scores = queries @ vectors[start : start + EXACT_BLOCK].T  # [q, block]
        scores[query_ids[:, None] == block_ids[None, :]] = -np.inf
        found = exact_top(scores, block_ids, depth)
        result = found if result is None else merge_top(result, found, depth)
    return result


def truth_depth(k: int) -> int:
    """Exact best kept per query for a recall@k: enough to read the similarity of any
    neighbour that can count (one beyond the list is below its k-th best)."""
    return max(TRUTH_DEPTH, 4 * k)


def exact_nearest_outside(queries, excluded, ids, vectors, depth: int):
    """Per query, the `depth` nearest vectors among `ids` outside that query's [start, end) id
    ranges (`excluded`, one tuple of ranges per query): (scores, ids) [q, depth]. Rows in any
    order; merge over blocks with `merge_top`."""
    order = np.argsort(ids, kind="stable")
    ids, vectors = ids[order], np.asarray(vectors, np.float32)[order]
    scores = np.asarray(queries, np.float32) @ vectors.T  # [q, r]
    for row, ranges in enumerate(excluded):
        for start, end in ranges:
            scores[row, np.searchsorted(ids, start) : np.searchsorted(ids, end)] = -np.inf
    return exact_top(scores, ids, depth)


def merge_nearest(a, b):
    """Associative merge of two ground truths (`exact_nearest_other` results)."""
    return merge_top(a, b, a[0].shape[1])


def one_recall_at_k(index, query_ids, queries, truth, k: int = RECALL_K) -> float:
    """RECALL_MEASURE: share of queries one of whose top k from the index (self excluded) is
    within TIE_TOLERANCE of the exact nearest other vector's similarity. A returned vector's
    exact similarity comes from the truth list; one beyond it is a miss unless the list
    ends above the tie line (then it cannot be told, and counts as a miss)."""
    truth_scores, truth_ids = truth
    _, found = index.search(np.ascontiguousarray(queries, dtype=np.float32), k + 1)
    hits = 0
    for q, row, t_scores, t_ids in zip(query_ids, found, truth_scores, truth_ids):
        returned = [f for f in row if f != q and f >= 0][:k]
        similarity = dict(zip(t_ids.tolist(), t_scores.tolist()))
        hits += any(similarity.get(f, -np.inf) >= t_scores[0] - TIE_TOLERANCE for f in returned)
    return hits / len(query_ids) if len(query_ids) else 1.0


# The neighbour measure: what build-shards checks, and what the index stage tunes on when it
# knows each query's document.
NEIGHBOUR_MEASURE = f"recall@k with ties within {TIE_TOLERANCE:g} (empty slot = miss)"


def recall_with_ties(exact_scores: np.ndarray, ours_exact: np.ndarray) -> tuple[int, int]:
    """(right neighbours, slots that exact search fills) over the sampled queries.

    exact_scores [n, >= k]: exact search's best scores (-inf where fewer exist), of which the
    first k count; ours_exact [n, k]: the exact score of each of our neighbours (nan for an
    empty slot). A neighbour is right when it is within TIE_TOLERANCE of the exact k-th best
    (near-duplicates are interchangeable); an empty slot is a miss unless exact search has
    nothing to offer either."""
    k = ours_exact.shape[1]
    slots = np.isfinite(exact_scores[:, :k]).sum(axis=1)  # [n]
    kth = np.where(slots > 0, exact_scores[np.arange(len(slots)), np.maximum(slots - 1, 0)], np.inf)
    with np.errstate(invalid="ignore"):
        right = (ours_exact >= kth[:, None] - TIE_TOLERANCE).sum(axis=1)  # nan compares False
    return int(np.minimum(right, slots).sum()), int(slots.sum())


def exact_scores_of(truth, found: np.ndarray) -> np.ndarray:
    """The exact similarity of each found id [n, k] to its query, from the truth lists (scores,
    ids [n, depth]): nan for an empty slot (-1), -inf for an id beyond the list (below its
    depth-th best, so below the k-th)."""
    truth_scores, truth_ids = truth
    hit = (found[:, :, None] == truth_ids[:, None, :]) & (found[:, :, None] >= 0)  # [n, k, depth]
    ours = np.where(hit, truth_scores[:, None, :].astype(np.float64), -np.inf).max(axis=2, initial=-np.inf)
    ours[found < 0] = np.nan
    return ours


def recall_of(truth, found: np.ndarray) -> float:
    """NEIGHBOUR_MEASURE of found ids [n, k] against the truth (scores, ids) of the same queries."""
    right, slots = recall_with_ties(truth[0], exact_scores_of(truth, found))
    return right / slots if slots else 1.0


def search_each_excluding(index, queries: np.ndarray, k: int, excluded) -> tuple[np.ndarray, np.ndarray]:
    """Each query searched alone with its own id ranges skipped (`search_excluding`, deepening
    included) at the index's depth: (scores, ids) [q, k]."""
    found = [search_excluding(index, query[None], k, list(ranges))[:2] for query, ranges in zip(queries, excluded)]
    if not found:
        return np.zeros((0, k), np.float32), np.zeros((0, k), np.int64)
    return np.concatenate([f[0] for f in found]), np.concatenate([f[1] for f in found])


def tune_depth(depths: list[int], recall_at, target: float, curve: list | None = None):
    """Over `depths` (smallest first), `recall_at(depth)` until one reaches `target`, or until
    two doublings of the depth in a row gain less than PLATEAU_GAIN together (then the depth
    before that plateau: deeper would cost time for nothing, the codes, not the depth, limit
    recall). One flat doubling is not a plateau: with a query's own document excluded, the
    first lists probed can all be its document's, and the gain comes after them.
    -> (depth, recall, plateaued). Each measurement is appended to `curve` as {depth, recall}."""
    measured: list[tuple[int, float]] = []
    for depth in depths:
        recall = recall_at(depth)
        if curve is not None:
            curve.append({"depth": depth, "recall": recall})
        if recall >= target:
            return depth, recall, False
        if len(measured) >= 2 and recall - measured[-2][1] < PLATEAU_GAIN:
            return measured[-2][0], measured[-2][1], True
        measured.append((depth, recall))
    return depth, recall, False


def tune_search_depth(index, query_ids, queries, truth, target: float, curve: list | None = None):
    """Smallest search depth of `index` reaching `target` (`tune_depth`, which fills `curve`),
    set on it: (depth, recall, plateaued); depth None for an index without a depth knob."""
    depths = search_depth_range(index)
    if depths is None:
        return None, one_recall_at_k(index, query_ids, queries, truth), False

    def recall_at(depth):
        set_search_depth(index, depth)
        return one_recall_at_k(index, query_ids, queries, truth)

    depth, recall, plateau = tune_depth(depths, recall_at, target, curve)
    set_search_depth(index, depth)
    return depth, recall, plateau


def query_rate(index, queries: np.ndarray, k: int = RECALL_K) -> float:
    start = time.perf_counter()
    index.search(np.ascontiguousarray(queries, dtype=np.float32), k)
    return len(queries) / max(time.perf_counter() - start, 1e-9)


def write_index(index, path: str) -> tuple[int, str]:
    """Stream the index to any Beam filesystem path, never as one bytes object (that would be
    a second copy of the index in memory): (bytes written, sha256)."""
    from pipeline import fileio

    digest, size = hashlib.sha256(), 0
    with fileio.open_write(path) as f:

        def write(block: bytes) -> int:
            nonlocal size
            digest.update(block)
            f.write(block)
            size += len(block)
            return len(block)

        faiss.write_index(index, faiss.PyCallbackIOWriter(write, IO_BLOCK))
    return size, digest.hexdigest()


def read_index(path: str):
    """Read an index file from any Beam filesystem path, streamed (no bytes copy)."""
    from pipeline import fileio

    with fileio.open_read(path) as f:
        return faiss.read_index(faiss.PyCallbackIOReader(f.read, IO_BLOCK))


def load_index(path: str, depth: int | None = None):
    """`read_index`, but local IVF files are memory-mapped."""
    if "://" in path:
        index = read_index(path)
    else:
        try:
            index = faiss.read_index(path, faiss.IO_FLAG_MMAP | faiss.IO_FLAG_READ_ONLY)
        except RuntimeError:
            index = faiss.read_index(path)
    if depth is not None:
        set_search_depth(index, depth)
    return index


# --- embedding files and the build plan -----------------------------------------------------

READ_BATCH = 16384  # rows per record batch read from an embeddings file


def embedding_file_info(path: str) -> dict:
    """Rows and vector width of one embeddings Parquet file (from its footer only)."""
    from pipeline import fileio

    with fileio.open_read(path) as f:
        parquet = pq.ParquetFile(f)
        schema = parquet.schema_arrow
        if "chunk_id" not in schema.names or "embedding" not in schema.names:
            raise IndexBuildError(f"{path}: needs columns chunk_id and embedding, has {schema.names}")
        vector = schema.field("embedding").type
        if not pa.types.is_fixed_size_list(vector) or vector.value_type not in (pa.float32(), pa.float16()):
            raise IndexBuildError(f"{path}: embedding must be fixed_size_list<float32 or float16>[d], is {vector}")
        return {"rows": parquet.metadata.num_rows, "dim": vector.list_size}


def read_embeddings(path: str):
    """(ids int64 [b], vectors float32 [b, d]) record batch by record batch."""
    from pipeline import fileio

    with fileio.open_read(path) as f:
        for batch in pq.ParquetFile(f).iter_batches(batch_size=READ_BATCH, columns=["chunk_id", "embedding"]):
            ids = batch.column("chunk_id").to_numpy().astype(np.int64)
            yield ids, tensor_column_to_numpy(batch.column("embedding")).astype(np.float32)


def plan_index(stats: dict, cfg: IndexConfig) -> dict:
    """Factory string, training size and query sample size from the stats."""
    if len(stats["dims"]) > 1:
        raise IndexBuildError(f"embeddings have mixed dimensions {stats['dims']}: one index needs one dimension")
    count = stats["count"]
    if count == 0:
        raise IndexBuildError("no vectors to index: every input record was rejected or empty")
    dim = stats["dims"][0]
    factory = choose_index_factory(count, dim, cfg.memory_budget) if cfg.type == "auto" else cfg.type
    new_index(factory, dim)  # a bad factory string fails here, with its reason
    return {
        "factory": factory,
        "dim": dim,
        "count": count,
        "train_size": training_size(count, factory),
        "clustering": resolve_clustering(cfg.clustering, factory, cfg.accelerator is not None),
        "mergeable": ivf_lists(factory) is not None,
        "queries": min(cfg.recall_sample, count),
    }
