"""The index stage in Beam: `BuildIndex` builds the faiss index over chunk embeddings, chosen
from a memory budget, trained on a sample, filled in parallel, merged, and tuned to a measured
recall.

The rules (factory choice, sample, recall, tuning) are the Beam-free functions of
`pipeline.faiss_index`; `BuildIndex` wires them into Beam so that, for IVF types, no process
ever holds all embeddings:

    embeddings ─► stats (count, dims) ─► sample ─► train (one worker) ─► trained.faiss
         │                                                                   │
         └─► parts by chunk id ─► add_with_ids to the trained index ─► part-NNNNN.faiss
                              └─► exact top 100 of the query sample ─► ground truth
    parts ─► merge (IVF lists, in part order) ─► index.faiss ─► tune nprobe to target recall

With `index.shard_bytes`, consecutive parts are grouped into shards instead (`index_shards`):
each shard is assembled by its own worker into shard-NNNNN.faiss and searches the query sample
at every depth; one worker merges those results by score and tunes the one nprobe of all
shards. No worker holds more than one shard and the trained index.

Chunk ids are the faiss ids, so a search answers chunk ids.
"""

from __future__ import annotations

import io
import logging
import posixpath
import time
import types
from dataclasses import dataclass

import apache_beam as beam
import numpy as np
from apache_beam.metrics import Metrics

from pipeline import fileio
from pipeline.corpus import METRICS_NAMESPACE
from pipeline.faiss_index import (
    NEIGHBOUR_MEASURE,
    QUERY_SALT,
    RECALL_K,
    RECALL_MEASURE,
    REFINE_ITERATIONS,
    TRAIN_SALT,
    assign_first_level,
    build_index,
    embedding_file_info,
    encoder_size,
    exact_nearest_other,
    exact_nearest_outside,
    first_level_clusters,
    first_level_size,
    in_sample,
    index_from_centroids,
    ivf_lists,
    list_assigner,
    list_sums,
    lists_per_cluster,
    merge_nearest,
    merge_part,
    moved_centroids,
    one_recall_at_k,
    plan_index,
    query_rate,
    read_embeddings,
    read_index,
    recall_of,
    search_depth_range,
    search_each_excluding,
    second_level_centroids,
    set_search_depth,
    spherical_kmeans,
    train_index,
    truth_depth,
    tune_depth,
    write_index,
    write_part,
)
from pipeline.index_shards import assemble_shard, assign_shards, merge_shard_results
from pipeline.shards import widest_span
from schemas.config import IndexConfig

INDEX_FILE = "index.faiss"
SHARD_FILE = "shard-{:05d}.faiss"

log = logging.getLogger("ratrain")
TRAINED_FILE = "trained.faiss"
BUILD_INFO_FILE = "build_info.json"


class _Stats(beam.CombineFn):
    """(count, dims) over the files' footers."""

    def create_accumulator(self):
        return 0, frozenset()

    def add_input(self, acc, info):
        return acc[0] + info["rows"], acc[1] | {info["dim"]}

    def merge_accumulators(self, accs):
        accs = list(accs)
        return sum(a[0] for a in accs), frozenset().union(*(a[1] for a in accs))

    def extract_output(self, acc):
        return {"count": acc[0], "dims": sorted(acc[1])}


def _sample_rows(path: str, plan: dict, size_key: str, salt: int):
    for ids, vectors in read_embeddings(path):
        keep = in_sample(ids, plan[size_key], plan["count"], salt)
        yield from zip(ids[keep].tolist(), vectors[keep])


@dataclass(frozen=True)
class QuerySample:
    """The held-out queries the depth is tuned on: indexed vectors chosen by a hash of their ids."""

    ids: np.ndarray  # [q] chunk ids, ascending
    vectors: np.ndarray  # [q, d]
    documents: list | None  # per query, its document's chunk-id range ((start, end),); None: unknown


@dataclass(frozen=True)
class Truth:
    """The exact neighbours of the query sample, (scores, ids) [q, depth] each, merged over parts."""

    nearest_other: tuple  # every vector but the query itself
    outside_document: tuple | None  # every vector outside the query's document (None: unknown)

    def merge(self, other: Truth) -> Truth:
        outside = None
        if self.outside_document is not None:
            outside = merge_nearest(self.outside_document, other.outside_document)
        return Truth(merge_nearest(self.nearest_other, other.nearest_other), outside)


def _stack(rows, dim: int, spans: dict | None) -> QuerySample:
    rows = sorted(rows, key=lambda r: r[0])
    if not rows:
        return QuerySample(np.zeros(0, np.int64), np.zeros((0, dim), np.float32), [] if spans is not None else None)
    ids = np.array([r[0] for r in rows], np.int64)
    documents = None if spans is None else [(tuple(spans[i]),) if i in spans else () for i in ids.tolist()]
    return QuerySample(ids, np.stack([r[1] for r in rows]).astype(np.float32), documents)


def _file_stem(path: str) -> str:
    return posixpath.basename(path).rsplit(".", 1)[0]


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def _read_npy(path: str) -> np.ndarray:
    return np.load(io.BytesIO(fileio.read_bytes(path)))


def _write_sample(path: str, plan: dict, out_dir: str) -> str:
    """One embeddings file's share of the training sample, written as sample/<file>.ids.npy and
    .vectors.npy: the sample travels as files, not as Beam rows, so it is held once, by the
    trainer. Yields the path prefix."""
    ids, vectors = [np.zeros(0, np.int64)], [np.zeros((0, plan["dim"]), np.float32)]
    for batch_ids, batch_vectors in read_embeddings(path):
        keep = in_sample(batch_ids, plan["train_size"], plan["count"], TRAIN_SALT)
        ids.append(batch_ids[keep])
        vectors.append(batch_vectors[keep])
    prefix = fileio.join(out_dir, "sample", _file_stem(path))
    fileio.write_bytes(f"{prefix}.ids.npy", _npy_bytes(np.concatenate(ids)))
    fileio.write_bytes(f"{prefix}.vectors.npy", _npy_bytes(np.concatenate(vectors)))
    return prefix


def _gather_sample(prefixes, dim: int) -> np.ndarray:
    """The sample files' vectors in chunk-id order, copied once into one [n, d] array (the ids
    are read first, alone, to place them)."""
    file_ids = [_read_npy(f"{p}.ids.npy") for p in prefixes]
    ids = np.sort(np.concatenate(file_ids or [np.zeros(0, np.int64)]))
    sample = np.empty((len(ids), dim), np.float32)
    for prefix, these in zip(prefixes, file_ids):
        sample[np.searchsorted(ids, these)] = _read_npy(f"{prefix}.vectors.npy")
    return sample


def _train(sample_prefixes, plan, out_dir):
    """One worker: train the empty index on the sample, write it for the fill workers."""
    sample = _gather_sample(sorted(sample_prefixes), plan["dim"])
    path = fileio.join(out_dir, TRAINED_FILE)
    write_index(train_index(plan["factory"], sample), path)
    Metrics.counter(METRICS_NAMESPACE, "index_training_vectors").inc(len(sample))
    _delete_sample(sample_prefixes)
    return path


def _read_sample(prefixes, keep) -> tuple[np.ndarray, np.ndarray]:
    """Of the sample files, the rows whose ids `keep` selects, in chunk-id order."""
    ids, vectors = [np.zeros(0, np.int64)], []
    for prefix in sorted(prefixes):
        file_ids = _read_npy(f"{prefix}.ids.npy")
        chosen = keep(file_ids)
        ids.append(file_ids[chosen])
        vectors.append(_read_npy(f"{prefix}.vectors.npy")[chosen])
    order = np.argsort(np.concatenate(ids), kind="stable")
    return np.concatenate(ids)[order], np.concatenate(vectors)[order]


def _first_level(prefixes, plan) -> np.ndarray:
    """One worker: the first-level centroids, trained on a bounded subset of the sample."""
    size = first_level_size(plan["train_size"], ivf_lists(plan["factory"]))
    _, vectors = _read_sample(prefixes, lambda ids: in_sample(ids, size, plan["count"], TRAIN_SALT))
    return spherical_kmeans(vectors, first_level_clusters(ivf_lists(plan["factory"])))


def _assign_sample(prefix: str, first: np.ndarray):
    """One sample file's vectors keyed by their first-level cluster: (cluster, (ids, vectors))."""
    ids, vectors = _read_npy(f"{prefix}.ids.npy"), _read_npy(f"{prefix}.vectors.npy")
    cluster = assign_first_level(first, vectors)
    for c in np.unique(cluster):
        yield int(c), (ids[cluster == c], vectors[cluster == c])


def _lists_per_cluster(sizes, plan) -> np.ndarray:
    counts = np.zeros(first_level_clusters(ivf_lists(plan["factory"])), np.int64)
    for cluster, size in sizes:
        counts[cluster] = size
    return lists_per_cluster(counts, ivf_lists(plan["factory"]))


def _second_level(keyed, lists):
    """One first-level cluster (all its training vectors, in chunk-id order) -> its lists'
    centroids."""
    cluster, blocks = keyed
    ids = np.concatenate([b[0] for b in blocks])
    vectors = np.concatenate([b[1] for b in blocks])[np.argsort(ids, kind="stable")]
    return cluster, second_level_centroids(vectors, int(lists[cluster]))


def _concatenated(clusters) -> np.ndarray:
    """The lists' centroids, in first-level cluster order."""
    return np.concatenate([c for _, c in sorted(clusters, key=lambda kv: kv[0])])


def _file_list_sums(prefix: str, first: np.ndarray, centroids: np.ndarray):
    """One sample file's share of a Lloyd step: (list, (vector sum, count)) per list touched."""
    touched, sums, counts = list_sums(list_assigner(first, centroids), _read_npy(f"{prefix}.vectors.npy"))
    yield from zip(touched.tolist(), zip(sums, counts.tolist()))


def _moved(sums, centroids: np.ndarray) -> np.ndarray:
    sums = sorted(sums, key=lambda kv: kv[0])
    touched = np.array([lst for lst, _ in sums], np.int64)
    return moved_centroids(centroids, touched, np.stack([total for _, (total, _) in sums]))


def _add_sums(pairs):
    pairs = list(pairs)
    return sum(p[0] for p in pairs), sum(p[1] for p in pairs)


def _assemble_trained(centroids, prefixes, plan, out_dir) -> str:
    """One worker: the lists' centroids into the coarse quantizer, the encoder trained on its
    share of the sample; written for the fill workers."""
    size = encoder_size(plan["factory"])
    _, encoder_sample = _read_sample(prefixes, lambda ids: in_sample(ids, size, plan["count"], TRAIN_SALT))
    path = fileio.join(out_dir, TRAINED_FILE)
    write_index(index_from_centroids(plan["factory"], centroids, encoder_sample), path)
    Metrics.counter(METRICS_NAMESPACE, "index_training_vectors").inc(plan["train_size"])
    _delete_sample(prefixes)
    return path


def _delete_sample(prefixes) -> None:
    beam.io.filesystems.FileSystems.delete([f"{p}.{kind}.npy" for p in prefixes for kind in ("ids", "vectors")])


class TrainIndex(beam.PTransform):
    """Sample file prefixes -> the path of the trained empty index (IVF types only).

    'flat' clustering: one worker gathers the sample and trains. 'two_level': one worker
    trains √nlist first-level centroids on a bounded subset; every sample file's vectors are
    assigned to them where the file is; each first-level cluster is split into its share of
    the lists by its own worker (the sample goes through one shuffle, grouped by cluster);
    REFINE_ITERATIONS Lloyd steps move the lists' centroids (each sample file sums its vectors
    per list; the sums are combined per list); one worker puts the centroids into the
    quantizer and trains the encoder (PQ) on 65,536 of the vectors. No worker holds the whole
    sample; the centroids (nlist × d) travel as side inputs. Both branches are in the graph;
    the plan picks one."""

    def __init__(self, plan, out_dir: str, accelerator: str | None):
        super().__init__()
        self.plan, self.out_dir, self.accelerator = plan, out_dir, accelerator

    def expand(self, prefixes):
        plan, out_dir = self.plan, self.out_dir

        def picked(p, clustering):
            return p["mergeable"] and p["clustering"] == clustering

        one_level = (
            prefixes
            | "GatherSample" >> beam.combiners.ToList()
            | "Train"
            >> beam.FlatMap(
                lambda ps, p: [_train(ps, p, out_dir)] if picked(p, "flat") else [], plan
            ).with_resource_hints(**({"accelerator": self.accelerator} if self.accelerator else {}))
        )
        all_prefixes = prefixes | "GatherPrefixes" >> beam.combiners.ToList()
        first = beam.pvalue.AsSingleton(
            all_prefixes
            | "TrainFirstLevel"
            >> beam.FlatMap(lambda ps, p: [_first_level(ps, p)] if picked(p, "two_level") else [], plan),
            default_value=None,
        )
        blocks = prefixes | "AssignFirstLevel" >> beam.FlatMap(
            lambda prefix, c: _assign_sample(prefix, c) if c is not None else [], first
        )
        lists = beam.pvalue.AsSingleton(
            blocks
            | "ClusterSizes" >> beam.Map(lambda kv: (kv[0], len(kv[1][0])))
            | "SumClusterSizes" >> beam.CombinePerKey(sum)
            | "GatherClusterSizes" >> beam.combiners.ToList()
            | "ListsPerCluster" >> beam.Map(lambda sizes, p: _lists_per_cluster(sizes, p) if sizes else None, plan)
        )
        centroids = (
            blocks
            | "GroupByFirstLevel" >> beam.GroupByKey()
            | "TrainSecondLevel" >> beam.Map(_second_level, lists)
            | "GatherCentroids" >> beam.combiners.ToList()
            | "ConcatenateCentroids" >> beam.FlatMap(lambda clusters: [_concatenated(clusters)] if clusters else [])
        )
        for step in range(REFINE_ITERATIONS):  # Lloyd steps: sums per list where the sample files are
            current = beam.pvalue.AsSingleton(centroids)
            centroids = (
                prefixes
                | f"AssignLists{step}"
                >> beam.FlatMap(
                    lambda prefix, f, c: _file_list_sums(prefix, f, c) if f is not None else [], first, current
                )
                | f"SumLists{step}" >> beam.CombinePerKey(_add_sums)
                | f"GatherSums{step}" >> beam.combiners.ToList()
                | f"MoveCentroids{step}" >> beam.FlatMap(lambda sums, c: [_moved(sums, c)] if sums else [], current)
            )
        two_level = centroids | "AssembleQuantizer" >> beam.FlatMap(
            lambda c, ps, p: [_assemble_trained(c, ps, p, out_dir)], beam.pvalue.AsSingleton(all_prefixes), plan
        )
        return (one_level, two_level) | "Trained" >> beam.Flatten()


def _truth_of(queries: QuerySample, ids, vectors, k: int) -> Truth:
    outside = None
    if queries.documents is not None:
        outside = exact_nearest_outside(queries.vectors, queries.documents, ids, vectors, truth_depth(k))
    return Truth(exact_nearest_other(queries.ids, queries.vectors, ids, vectors), outside)


class _FillPart(beam.DoFn):
    """One embeddings file = one part: its vectors added (chunk ids as faiss ids) to a copy of
    the trained index, streamed batch by batch, written as part-<file>.faiss without the coarse
    quantizer (only its lists and codes travel); plus the part's exact nearest neighbour of
    every query of the recall sample."""

    def __init__(self, out_dir, neighbours: int):
        self.out_dir, self.neighbours = out_dir, neighbours

    def process(self, path, trained_path, queries):
        index = read_index(trained_path)
        truth = None
        for ids, vectors in read_embeddings(path):
            index.add_with_ids(vectors, ids)
            found = _truth_of(queries, ids, vectors, self.neighbours)
            truth = found if truth is None else truth.merge(found)
            Metrics.counter(METRICS_NAMESPACE, "index_vectors_added").inc(len(ids))
        part_path = fileio.join(self.out_dir, "parts", f"part-{_file_stem(path)}.faiss")
        write_part(index, part_path)
        if truth is not None:
            yield beam.pvalue.TaggedOutput("truth", truth)
        yield path, part_path


class _MergeTruth(beam.CombineFn):
    def create_accumulator(self):
        return None

    def add_input(self, acc, truth):
        return truth if acc is None else acc.merge(truth)

    def merge_accumulators(self, accs):
        result = None
        for acc in accs:
            if acc is not None:
                result = acc if result is None else result.merge(acc)
        return result

    def extract_output(self, acc):
        return acc


def _merge_and_tune(parts, trained_path, plan, queries, truth, cfg: IndexConfig, out_dir, neighbours: int):
    """One worker: merge the parts into the trained index in input-file order, tune, write."""
    index = read_index(trained_path)
    part_paths = [part for _, part in sorted(parts)]
    for path in part_paths:
        merge_part(index, read_index(path))
    info = _finish(index, plan, queries, truth, cfg, out_dir, len(part_paths), neighbours)
    beam.io.filesystems.FileSystems.delete(part_paths + [trained_path])  # only once it is written
    return info


def _build_in_one(paths, plan, queries: QuerySample, cfg: IndexConfig, out_dir, neighbours: int):
    """Flat and graph indexes: one worker adds everything (they cannot be merged)."""
    batches = [batch for path in sorted(paths) for batch in read_embeddings(path)]
    ids = np.concatenate([b[0] for b in batches])
    vectors = np.concatenate([b[1] for b in batches])
    order = np.argsort(ids, kind="stable")
    ids, vectors = ids[order], vectors[order]
    index = build_index(ids, vectors, plan["factory"])
    return _finish(index, plan, queries, _truth_of(queries, ids, vectors, neighbours), cfg, out_dir, 1, neighbours)


def _recorded(curve: list, recall_at, depth: int) -> float:
    """The recall at `depth` from the curve, measured (and appended) if it is not there."""
    for point in curve:
        if point["depth"] == depth:
            return point["recall"]
    curve.append({"depth": depth, "recall": recall_at(depth)})
    return curve[-1]["recall"]


def tune_index_depth(depths, plain_at, own_at, cfg: IndexConfig, neighbours: int) -> tuple:
    """The depth an index is searched at, from two measures on the query sample: plain_at(depth),
    RECALL_MEASURE (the query itself excluded), and own_at(depth) (None: documents unknown),
    NEIGHBOUR_MEASURE at k = neighbours with the query's whole document excluded, as
    build-shards searches. Each is tuned to cfg.target_recall (`tune_depth`) and the deeper
    depth is kept: on long documents a chunk's nearest lists are its own document's, and the
    depth that finds its nearest other vector misses its nearest chunks of other documents.
    depths: those to try (None: an exact index). -> ((depth, recall, plateau), curve, own)."""
    own = None
    if depths is None:
        if own_at is not None:
            own = {"measure": NEIGHBOUR_MEASURE, "k": neighbours, "value": own_at(None), "depth": None, "curve": None}
        return (None, plain_at(None), False), None, own
    curve: list = []
    if cfg.nprobe is not None:
        depth, recall, plateau = cfg.nprobe, _recorded(curve, plain_at, cfg.nprobe), False
    else:
        depth, recall, plateau = tune_depth(depths, plain_at, cfg.target_recall, curve)
    if own_at is not None:
        own_curve: list = []
        if cfg.nprobe is not None:
            own_depth, own_plateau = cfg.nprobe, False
        else:
            own_depth, _, own_plateau = tune_depth(depths, own_at, cfg.target_recall, own_curve)
        if own_depth > depth:
            depth = own_depth
            recall = _recorded(curve, plain_at, depth)
            plateau = plateau and recall < cfg.target_recall
        own = {
            "measure": NEIGHBOUR_MEASURE,
            "k": neighbours,
            "value": _recorded(own_curve, own_at, depth),
            "depth": own_depth,
            "plateau": own_plateau,
            "curve": own_curve,
        }
    return (depth, recall, plateau), curve, own


def _finish(index, plan, queries: QuerySample, truth: Truth, cfg: IndexConfig, out_dir, parts: int, neighbours: int):
    def plain_at(depth):
        if depth is not None:
            set_search_depth(index, depth)
        return one_recall_at_k(index, queries.ids, queries.vectors, truth.nearest_other)

    def own_at(depth):
        if depth is not None:
            set_search_depth(index, depth)
        found = search_each_excluding(index, queries.vectors, neighbours, queries.documents)[1]
        return recall_of(truth.outside_document, found)

    tuned, curve, own = tune_index_depth(
        search_depth_range(index), plain_at, own_at if truth.outside_document is not None else None, cfg, neighbours
    )
    if tuned[0] is not None:
        set_search_depth(index, tuned[0])
    index_bytes, index_sha256 = write_index(index, fileio.join(out_dir, INDEX_FILE))
    files = [{"path": INDEX_FILE, "rows": int(index.ntotal), "bytes": index_bytes, "sha256": index_sha256}]
    return _build_info(
        plan,
        cfg,
        out_dir,
        parts,
        files,
        (*tuned, len(queries.ids)),
        query_rate(index, queries.vectors),
        curve,
        own,
    )


def _build_info(
    plan,
    cfg: IndexConfig,
    out_dir,
    parts: int,
    files: list[dict],
    tuned,
    rate: float,
    curve: list[dict] | None,
    own: dict | None,
) -> dict:
    """build_info.json: what the manifest records of the index, and its faiss files; `curve`:
    the recall at each depth measured (None for an exact index); `own`: the recall with the
    query's own document excluded (None: documents unknown)."""
    depth, recall, plateau, sample_size = tuned
    info = {
        "index_factory": plan["factory"],
        "nprobe": depth,
        "dim": plan["dim"],
        "metric": "inner_product",
        "num_vectors": sum(f["rows"] for f in files),
        "training_vectors": plan["train_size"],
        "clustering": plan["clustering"],
        "parts": parts,
        "recall_at_k": {
            "measure": RECALL_MEASURE,
            "value": recall,
            "sample_size": int(sample_size),
            "nprobe": depth,
            "target": cfg.target_recall,
            "plateau": plateau,
            "curve": curve,
            "own_document_excluded": own,
        },
        "queries_per_second": round(rate, 1),
        "index_bytes": sum(f["bytes"] for f in files),
        "files": files,
        "memory_budget": cfg.memory_budget,
        "shard_bytes": cfg.shard_bytes if len(files) > 1 else None,
    }
    fileio.write_json_atomic(fileio.join(out_dir, BUILD_INFO_FILE), info)
    return info


def _plan_shards(footers: list[dict], plan: dict, shard_bytes: int | None) -> dict[str, int]:
    """{embeddings file: shard} for an IVF index in shards; {} for one index file."""
    if shard_bytes is not None and not plan["mergeable"]:
        log.warning("index.shard_bytes applies to IVF indexes; %s is built as one file", plan["factory"])
        return {}
    return assign_shards({f["path"]: f["rows"] for f in footers}, plan["factory"], plan["dim"], shard_bytes)


def _assemble(keyed, trained_path, queries: QuerySample, cfg: IndexConfig, out_dir, neighbours: int):
    """One worker per shard: its parts (in chunk-id order) merged into a copy of the trained
    index, written as shard-NNNNN.faiss; then the query sample searched at every depth the
    tuning may pick (plainly, and with each query's own document excluded as build-shards
    searches a shard), for the merge step to combine with the other shards' results."""
    number, parts = keyed
    part_paths = [part for _, part in sorted(parts)]
    shard = assemble_shard(read_index(trained_path), (read_index(p) for p in part_paths))
    name = SHARD_FILE.format(number)
    shard_bytes, sha256 = write_index(shard, fileio.join(out_dir, name))
    results, own = {}, {}
    for depth in [cfg.nprobe] if cfg.nprobe is not None else search_depth_range(shard):
        set_search_depth(shard, depth)
        start = time.perf_counter()
        scores, ids = shard.search(np.ascontiguousarray(queries.vectors, np.float32), RECALL_K + 1)
        results[depth] = (scores, ids, time.perf_counter() - start)
        if queries.documents is not None:
            own[depth] = search_each_excluding(shard, queries.vectors, neighbours, queries.documents)
    beam.io.filesystems.FileSystems.delete(part_paths)
    return {
        "file": {"path": name, "rows": int(shard.ntotal), "bytes": shard_bytes, "sha256": sha256},
        "number": number,
        "parts": len(part_paths),
        "results": results,
        "own": own,
    }


def _tune_shards(shards, trained_path, plan, queries: QuerySample, truth: Truth, cfg: IndexConfig, out_dir, k: int):
    """One worker: the shards' results merged by score per depth, the one nprobe of all shards
    tuned on them as on one index (the same lists are probed, so the same recall)."""
    shards = sorted(shards, key=lambda s: s["number"])

    def plain_at(depth):
        merged = merge_shard_results([s["results"][depth][:2] for s in shards], RECALL_K + 1)
        searcher = types.SimpleNamespace(search=lambda q, width: merged)
        return one_recall_at_k(searcher, queries.ids, queries.vectors, truth.nearest_other)

    def own_at(depth):
        return recall_of(truth.outside_document, merge_shard_results([s["own"][depth] for s in shards], k)[1])

    measured = own_at if truth.outside_document is not None else None
    tuned, curve, own = tune_index_depth(sorted(shards[0]["results"]), plain_at, measured, cfg, k)
    seconds = sum(s["results"][tuned[0]][2] for s in shards)
    info = _build_info(
        plan,
        cfg,
        out_dir,
        sum(s["parts"] for s in shards),
        [s["file"] for s in shards],
        (*tuned, len(queries.ids)),
        len(queries.ids) / seconds if seconds else 0.0,
        curve,
        own,
    )
    beam.io.filesystems.FileSystems.delete([trained_path])
    return info


class BuildIndex(beam.PTransform):
    """Paths of embeddings Parquet files -> `<out_dir>/index.faiss` + `build_info.json`;
    yields the build info.

    IVF types: trained on a deterministic sample in one worker; each file is a part, filled by
    whichever worker reads it (vectors never go through a shuffle), and the parts are merged
    in file order. Flat and HNSW are built in one worker (the budget rule keeps them small).

    `documents` ((chunk id, doc id) per vector; None: not known) lets the depth be tuned also
    on the search build-shards makes: each query's whole document excluded, `neighbours` (k)
    kept (`tune_index_depth`).
    """

    def __init__(self, cfg: IndexConfig, out_dir: str, documents=None, neighbours: int = RECALL_K):
        super().__init__()
        self.cfg, self.out_dir, self.documents, self.neighbours = cfg, out_dir, documents, neighbours
        if cfg.min_ram:  # high-memory workers for training and merging
            self.with_resource_hints(min_ram=cfg.min_ram)

    def _query_documents(self, plan):
        """{query chunk id: its document's (first chunk id, last + 1)} as a singleton side
        input, or None."""
        if self.documents is None:
            return None
        spans = (
            self.documents
            | "DocumentChunk" >> beam.Map(lambda chunk_doc: (chunk_doc[1], (chunk_doc[0], chunk_doc[0] + 1)))
            | "DocumentSpans" >> beam.CombinePerKey(widest_span)
        )
        queries = self.documents | "QueryDocuments" >> beam.FlatMap(
            lambda chunk_doc, p: (
                [(chunk_doc[1], chunk_doc[0])]
                if in_sample(np.array([chunk_doc[0]]), p["queries"], p["count"], QUERY_SALT)[0]
                else []
            ),
            plan,
        )
        return beam.pvalue.AsSingleton(
            {"span": spans, "query": queries}
            | "JoinQueryDocuments" >> beam.CoGroupByKey()
            | "QuerySpans" >> beam.FlatMap(lambda kv: [(c, s) for c in kv[1]["query"] for s in kv[1]["span"]])
            | "GatherQuerySpans" >> beam.combiners.ToDict()
        )

    def expand(self, paths):
        cfg, out_dir, k = self.cfg, self.out_dir, self.neighbours
        paths = paths | "SpreadFiles" >> beam.Reshuffle()
        footers = paths | "ReadFooters" >> beam.Map(lambda path: {**embedding_file_info(path), "path": path})
        plan = beam.pvalue.AsSingleton(
            footers | "Stats" >> beam.CombineGlobally(_Stats()) | "Plan" >> beam.Map(plan_index, cfg)
        )
        shard_of = beam.pvalue.AsSingleton(  # {embeddings file: shard}, empty for one index file
            footers
            | "GatherFileRows" >> beam.combiners.ToList()
            | "PlanShards" >> beam.Map(_plan_shards, plan, cfg.shard_bytes)
        )
        query_documents = self._query_documents(plan)
        queries = beam.pvalue.AsSingleton(
            paths
            | "QuerySample" >> beam.FlatMap(lambda path, p: _sample_rows(path, p, "queries", QUERY_SALT), plan)
            | "GatherQueries" >> beam.combiners.ToList()
            | "StackQueries"
            >> beam.Map(
                lambda rows, p, spans=None: _stack(rows, p["dim"], spans),
                plan,
                *([query_documents] if query_documents is not None else []),
            )
        )

        # IVF: sample, train, fill per file, merge. Each branch is empty unless the plan picks it.
        trained = (
            paths
            | "TrainSample"
            >> beam.FlatMap(lambda path, p: [_write_sample(path, p, out_dir)] if p["mergeable"] else [], plan)
            | "TrainIndex" >> TrainIndex(plan, out_dir, cfg.accelerator)
        )
        trained_path = beam.pvalue.AsSingleton(trained, default_value=None)
        filled = (
            paths
            | "ForMerge" >> beam.Filter(lambda path, p: p["mergeable"], plan)
            | "FillParts"
            >> beam.ParDo(_FillPart(out_dir, k), trained_path, queries).with_outputs("truth", main="parts")
        )
        truth = beam.pvalue.AsSingleton(
            filled.truth | "MergeTruth" >> beam.CombineGlobally(_MergeTruth()).without_defaults(), default_value=None
        )
        merged = (
            filled.parts
            | "GatherParts" >> beam.combiners.ToList()
            | "MergeAndTune"
            >> beam.FlatMap(
                lambda parts, trained, p, q, t, shards: (
                    [_merge_and_tune(parts, trained, p, q, t, cfg, out_dir, k)] if p["mergeable"] and not shards else []
                ),
                trained_path,
                plan,
                queries,
                truth,
                shard_of,
            )
        )
        sharded = (
            filled.parts
            | "KeyByShard" >> beam.FlatMap(lambda part, shards: [(shards[part[0]], part)] if shards else [], shard_of)
            | "GroupShards" >> beam.GroupByKey()
            | "AssembleShards" >> beam.Map(_assemble, trained_path, queries, cfg, out_dir, k)
            | "GatherShards" >> beam.combiners.ToList()
            | "TuneShards"
            >> beam.FlatMap(
                lambda shards, trained, p, q, t: (
                    [_tune_shards(shards, trained, p, q, t, cfg, out_dir, k)] if shards else []
                ),
                trained_path,
                plan,
                queries,
                truth,
            )
        )

        # Flat / HNSW: one worker.
        whole = (
            paths
            | "GatherPaths" >> beam.combiners.ToList()
            | "BuildInOne"
            >> beam.FlatMap(
                lambda all_paths, p, q: [] if p["mergeable"] else [_build_in_one(all_paths, p, q, cfg, out_dir, k)],
                plan,
                queries,
            )
        )
        return (merged, sharded, whole) | "Info" >> beam.Flatten()
