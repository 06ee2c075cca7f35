"""`TrainIndex`: the trained (empty) index in Beam, from a sample no worker holds whole; with
two-level k-means each first-level cluster is clustered on its own worker.
"""

from __future__ import annotations

import io
import posixpath

import apache_beam as beam
import numpy as np
from apache_beam.metrics import Metrics

from pipeline.common import fileio
from pipeline.corpus.records import METRICS_NAMESPACE
from pipeline.index.factory import EmbeddingStats, IndexPlan, encoder_size, required_ivf_lists
from pipeline.index.files import EmbeddingFile, read_embeddings, write_index
from pipeline.index.kmeans import (
    REFINE_ITERATIONS,
    assign_first_level,
    first_level_clusters,
    first_level_size,
    index_from_centroids,
    list_assigner,
    list_sums,
    lists_per_cluster,
    moved_centroids,
    second_level_centroids,
    spherical_kmeans,
)
from pipeline.index.sampling import TRAIN_SALT, in_sample
from pipeline.index.train import train_index
from pipeline.index.tuning import QuerySample

TRAINED_FILE = "trained.faiss"


class _Stats(beam.CombineFn):
    """(count, dims) over the files' footers."""

    def create_accumulator(self):
        return 0, frozenset()

    def add_input(self, acc, info: EmbeddingFile):
        return acc[0] + info.rows, acc[1] | {info.dim}

    def merge_accumulators(self, accs):
        accs = list(accs)
        return sum(a[0] for a in accs), frozenset().union(*(a[1] for a in accs))

    def extract_output(self, acc) -> EmbeddingStats:
        return EmbeddingStats(acc[0], tuple(sorted(acc[1])))


def _sample_rows(path: str, size: int, count: int, salt: int):
    """The rows of one embeddings file in the sample of `size` of `count` vectors salted so."""
    for ids, vectors in read_embeddings(path):
        keep = in_sample(ids, size, count, salt)
        yield from zip(ids[keep].tolist(), vectors[keep])


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


def _write_sample(path: str, plan: IndexPlan, out_dir: str) -> str:
    """One embeddings file's share of the training sample, written as sample/<file>.ids.npy and
    .vectors.npy: the sample travels as files, not as Beam rows, so it is held once, by the
    trainer. Yields the path prefix."""
    ids, vectors = [np.zeros(0, np.int64)], [np.zeros((0, plan.dim), np.float32)]
    for batch_ids, batch_vectors in read_embeddings(path):
        keep = in_sample(batch_ids, plan.train_size, plan.count, TRAIN_SALT)
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


def _train(sample_prefixes, plan: IndexPlan, out_dir):
    """One worker: train the empty index on the sample, write it for the fill workers."""
    sample = _gather_sample(sorted(sample_prefixes), plan.dim)
    path = fileio.join(out_dir, TRAINED_FILE)
    write_index(train_index(plan.factory, sample), path)
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


def _first_level(prefixes, plan: IndexPlan) -> np.ndarray:
    """One worker: the first-level centroids, trained on a bounded subset of the sample."""
    nlist = required_ivf_lists(plan.factory)
    size = first_level_size(plan.train_size, nlist)
    _, vectors = _read_sample(prefixes, lambda ids: in_sample(ids, size, plan.count, TRAIN_SALT))
    return spherical_kmeans(vectors, first_level_clusters(nlist))


def _assign_sample(prefix: str, first: np.ndarray):
    """One sample file's vectors keyed by their first-level cluster: (cluster, (ids, vectors))."""
    ids, vectors = _read_npy(f"{prefix}.ids.npy"), _read_npy(f"{prefix}.vectors.npy")
    cluster = assign_first_level(first, vectors)
    for c in np.unique(cluster):
        yield int(c), (ids[cluster == c], vectors[cluster == c])


def _lists_per_cluster(sizes, plan: IndexPlan) -> np.ndarray:
    nlist = required_ivf_lists(plan.factory)
    counts = np.zeros(first_level_clusters(nlist), np.int64)
    for cluster, size in sizes:
        counts[cluster] = size
    return lists_per_cluster(counts, nlist)


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


def _assemble_trained(centroids, prefixes, plan: IndexPlan, out_dir) -> str:
    """One worker: the lists' centroids into the coarse quantizer, the encoder trained on its
    share of the sample; written for the fill workers."""
    size = encoder_size(plan.factory)
    _, encoder_sample = _read_sample(prefixes, lambda ids: in_sample(ids, size, plan.count, TRAIN_SALT))
    path = fileio.join(out_dir, TRAINED_FILE)
    write_index(index_from_centroids(plan.factory, centroids, encoder_sample), path)
    Metrics.counter(METRICS_NAMESPACE, "index_training_vectors").inc(plan.train_size)
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
            return p.mergeable and p.clustering == clustering

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
