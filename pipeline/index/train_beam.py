"""`TrainIndex`: the trained (empty) index in Beam, from a sample no worker holds whole; with
two-level k-means each first-level cluster is clustered on its own worker.
"""

from __future__ import annotations

import posixpath
import threading
import uuid

import apache_beam as beam
import numpy as np
from apache_beam.metrics import Metrics
from apache_beam.transforms.window import GlobalWindows

from pipeline.common import fileio
from pipeline.common.sampling import TRAIN_SALT, in_sample
from pipeline.corpus.records import METRICS_NAMESPACE
from pipeline.index.factory import EmbeddingStats, IndexPlan, encoder_size, required_ivf_lists
from pipeline.index.files import EmbeddingFile, read_embeddings, write_index
from pipeline.index.kmeans import (
    REFINE_ITERATIONS,
    first_level_clusters,
    first_level_size,
    lists_per_cluster,
)
from pipeline.index.train import train_index
from pipeline.index.tuning import QuerySample
from pipeline.index.two_level import (
    FOLD_BYTES,
    BlockSums,
    CentroidBlocks,
    SumsRef,
    add_block_sums,
    assemble,
    build_assigner,
    clusters_of_file,
    file_block_sums,
    fold_block_sums,
    move_block,
    read_block_sums,
    read_ids,
    read_subset,
    read_vectors,
    sample_paths,
    second_level_pieces,
    step_directory,
    subset_file_of,
    subset_files,
    subset_of_file,
    train_first_level,
    write_block,
    write_block_sums,
    write_sample_part,
    write_subset_file,
)

TRAINED_FILE = "trained.faiss"


class EmbeddingFileStats(beam.CombineFn):
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


def sampled_rows(path: str, size: int, count: int, salt: int):
    """The rows of one embeddings file in the sample of `size` of `count` vectors salted so."""
    for ids, vectors in read_embeddings(path):
        keep = in_sample(ids, size, count, salt)
        yield from zip(ids[keep].tolist(), vectors[keep])


def query_sample_of(rows, dim: int, spans: dict | None) -> QuerySample:
    rows = sorted(rows, key=lambda r: r[0])
    if not rows:
        return QuerySample(np.zeros(0, np.int64), np.zeros((0, dim), np.float32), [] if spans is not None else None)
    ids = np.array([r[0] for r in rows], np.int64)
    documents = None if spans is None else [(tuple(spans[i]),) if i in spans else () for i in ids.tolist()]
    return QuerySample(ids, np.stack([r[1] for r in rows]).astype(np.float32), documents)


def file_stem(path: str) -> str:
    return posixpath.basename(path).rsplit(".", 1)[0]


def write_sample(path: str, plan: IndexPlan, out_dir: str) -> str:
    """One embeddings file's share of the training sample, written as sample/<file>.ids.npy and
    .vectors.npy: the sample travels as files, not as Beam rows, so it is held once, by the
    trainer. Yields the path prefix."""
    ids, vectors = [np.zeros(0, np.int64)], [np.zeros((0, plan.dim), np.float32)]
    for batch_ids, batch_vectors in read_embeddings(path):
        keep = in_sample(batch_ids, plan.train_size, plan.count, TRAIN_SALT)
        ids.append(batch_ids[keep])
        vectors.append(batch_vectors[keep])
    prefix = fileio.join(out_dir, "sample", file_stem(path))
    write_sample_part(prefix, np.concatenate(ids), np.concatenate(vectors))
    return prefix


def _gather_sample(prefixes, dim: int) -> np.ndarray:
    """The sample files' vectors in chunk-id order, copied once into one [n, d] array (the ids
    are read first, alone, to place them)."""
    file_ids = [read_ids(p) for p in prefixes]
    ids = np.sort(np.concatenate(file_ids or [np.zeros(0, np.int64)]))
    sample = np.empty((len(ids), dim), np.float32)
    for prefix, these in zip(prefixes, file_ids):
        sample[np.searchsorted(ids, these)] = read_vectors(prefix)
    return sample


def _train(sample_prefixes, plan: IndexPlan, out_dir):
    """One worker: train the empty index on the sample, write it for the fill workers."""
    sample = _gather_sample(sorted(sample_prefixes), plan.dim)
    path = fileio.join(out_dir, TRAINED_FILE)
    write_index(train_index(plan.factory, sample), path)
    Metrics.counter(METRICS_NAMESPACE, "index_training_vectors").inc(len(sample))
    return path


class _PerProcess:
    """One object per worker process, rebuilt when its key changes. The previous one is dropped
    before the next is built (Beam's `Shared` keeps it until the new one exists: two Lloyd
    steps' assigners at once)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._key, self._value = None, None

    def get(self, key, build):
        with self._lock:
            if self._key != key:
                self._key = self._value = None
                self._value, self._key = build(), key
            return self._value


_ASSIGNER = _PerProcess()  # a Lloyd step's list assigner: every sample file of the step uses it


def _file_sums(prefix: str, first: np.ndarray, current: CentroidBlocks):
    def build():
        Metrics.counter(METRICS_NAMESPACE, "list_assigner_builds").inc()
        return build_assigner(first, current)

    return file_block_sums(_ASSIGNER.get(current, build), read_vectors(prefix))


class SumLists(beam.DoFn):
    """A Lloyd step's sums of a bundle's sample files (`file_block_sums`), folded per block and
    written to a sums file each time they pass `fold_bytes` and at the bundle's end; where each
    block's lies (`SumsRef`) goes on to the block's move, which reads them one at a time. A
    runner's own combining ahead of a shuffle (`CombinePerKey`) keeps a value per block for the
    whole bundle: every list's sums at most (3.2 GB at 2^20 lists, 384-d) in one worker; and a
    block's sums sent whole were all held at once where a runner hands over a group whole."""

    def __init__(self, directory: str, fold_bytes: int):
        self.directory, self.fold_bytes = directory, fold_bytes

    def start_bundle(self):
        self._totals: dict[int, BlockSums] = {}

    def process(self, prefix, first, current):
        if current is None:
            return
        for block, part in _file_sums(prefix, first, current):
            self._totals[block] = fold_block_sums(self._totals.get(block), part)
        if sum(t.sums.nbytes for t in self._totals.values()) > self.fold_bytes:
            yield from self._written()

    def finish_bundle(self):
        for block, ref in self._written():
            yield GlobalWindows.windowed_value((block, ref))

    def _written(self) -> list[tuple[int, SumsRef]]:
        totals, self._totals = sorted(self._totals.items(), key=lambda kv: kv[0]), {}
        if not totals:
            return []
        Metrics.counter(METRICS_NAMESPACE, "lloyd_block_sums_written").inc(len(totals))
        return write_block_sums(totals, fileio.join(self.directory, f"sums-{uuid.uuid4().hex}.bin"))


def _blocks_written(
    blocks, out_dir: str, step: int, plan: IndexPlan, previous: CentroidBlocks | None = None
) -> list[CentroidBlocks]:
    """The step's centroids, once every block is written; after a Lloyd step, a block no vector
    chose keeps the previous step's centroids. A fresh token: a rerun into the same directory
    is not mistaken for this one by a process's cached assigner."""
    written = CentroidBlocks.of_step(out_dir, step, required_ivf_lists(plan.factory), uuid.uuid4().hex)
    unchosen = sorted(set(range(written.block_count)) - set(blocks)) if previous is not None else []
    Metrics.counter(METRICS_NAMESPACE, "centroid_blocks_unchosen").inc(len(unchosen))
    written.check_written([*blocks, *(move_block(previous, written, b, None) for b in unchosen if previous)])
    return [written]


def _lists_per_cluster(sizes, plan: IndexPlan) -> np.ndarray:
    nlist = required_ivf_lists(plan.factory)
    counts = np.zeros(first_level_clusters(nlist), np.int64)
    for cluster, size in sizes:
        counts[cluster] = size
    return lists_per_cluster(counts, nlist)


def _assemble(final: CentroidBlocks, encoder_parts, plan: IndexPlan, out_dir: str) -> str:
    """One worker: the quantizer and the encoder. The centroid blocks stay for a retry of this
    step: the commit discards them with the staging."""
    path = assemble(final, read_subset(encoder_parts), plan.factory, plan.dim, fileio.join(out_dir, TRAINED_FILE))
    Metrics.counter(METRICS_NAMESPACE, "index_training_vectors").inc(plan.train_size)
    return path


class TrainIndex(beam.PTransform):
    """Sample file prefixes -> the path of the trained empty index (IVF types only).

    'flat' clustering: one worker gathers the sample and trains. 'two_level' (the steps in
    `two_level`): each sample file gives its rows of the first-level subset (√nlist × 256
    vectors) and of the encoder's (65,536), written as subset files of about 16 MB (the rows
    grouped by a hash of their sample file), whose paths one worker each gathers; every sample file's
    vectors are assigned to the first-level clusters where the file is; each first-level
    cluster is split by its own worker into its share of the lists (the sample goes through one
    shuffle, grouped by cluster), the centroids written in blocks of LIST_BLOCK lists;
    REFINE_ITERATIONS Lloyd steps move them (each sample file sums its vectors per list with
    an assigner built once per process and step; the sums are combined and the centroids moved
    per block, on many workers); one worker puts the centroids into the quantizer and trains
    the encoder. No worker holds the whole sample nor every list's sums; between steps the
    centroids travel as files, named by a small side input. Both branches are in the graph;
    the plan picks one. The sample files are deleted, in parallel, once the index is written."""

    def __init__(self, plan, out_dir: str, accelerator: str | None):
        super().__init__()
        self.plan, self.out_dir, self.accelerator = plan, out_dir, accelerator

    def expand(self, prefixes):
        plan, out_dir = self.plan, self.out_dir

        def picked(p, clustering):
            return p.mergeable and p.clustering == clustering

        def subset(label, size_of):  # -> the subset's file prefixes (`two_level.write_subset_file`)
            def chosen_rows(prefix, p):
                if not picked(p, "two_level"):
                    return []
                files = subset_files(size_of(p), p.dim)
                return [(subset_file_of(prefix, files), rows) for rows in subset_of_file(prefix, size_of(p), p.count)]

            return (
                prefixes
                | f"{label}Subset" >> beam.FlatMap(chosen_rows, plan)
                | f"Group{label}Subset" >> beam.GroupByKey()
                | f"Write{label}Subset"
                >> beam.MapTuple(lambda number, parts: write_subset_file(out_dir, label.lower(), number, parts))
                | f"Gather{label}Subset" >> beam.combiners.ToList()
            )

        one_level = (
            prefixes
            # only where one worker trains on the whole sample: a list per file gathered otherwise is waste
            | "ForOneLevel" >> beam.Filter(lambda prefix, p: picked(p, "flat"), plan)
            | "GatherSample" >> beam.combiners.ToList()
            | "Train"
            >> beam.FlatMap(
                lambda ps, p: [_train(ps, p, out_dir)] if picked(p, "flat") else [], plan
            ).with_resource_hints(**({"accelerator": self.accelerator} if self.accelerator else {}))
        )
        first = beam.pvalue.AsSingleton(
            subset("FirstLevel", lambda p: first_level_size(p.train_size, required_ivf_lists(p.factory)))
            | "TrainFirstLevel"
            >> beam.FlatMap(
                lambda parts, p: (
                    [train_first_level(read_subset(parts), p.dim, required_ivf_lists(p.factory))]
                    if picked(p, "two_level")
                    else []
                ),
                plan,
            ),
            default_value=None,
        )
        by_cluster = prefixes | "AssignFirstLevel" >> beam.FlatMap(
            lambda prefix, c: clusters_of_file(prefix, c) if c is not None else [], first
        )
        lists = beam.pvalue.AsSingleton(
            by_cluster
            | "ClusterSizes" >> beam.Map(lambda kv: (kv[0], len(kv[1].ids)))
            | "SumClusterSizes" >> beam.CombinePerKey(sum)
            | "GatherClusterSizes" >> beam.combiners.ToList()
            | "ListsPerCluster" >> beam.Map(lambda sizes, p: _lists_per_cluster(sizes, p) if sizes else None, plan)
        )
        centroids = (
            by_cluster
            | "GroupByFirstLevel" >> beam.GroupByKey()
            | "TrainSecondLevel" >> beam.FlatMap(lambda kv, n, p: second_level_pieces(*kv, n, p.dim), lists, plan)
            | "GroupByListBlock" >> beam.GroupByKey()
            | "WriteBlocks0"
            >> beam.Map(
                lambda kv, p: write_block(CentroidBlocks.of_step(out_dir, 0, required_ivf_lists(p.factory)), *kv),
                plan,
            )
            | "GatherBlocks0" >> beam.combiners.ToList()
            | "Centroids0" >> beam.FlatMap(lambda bs, p: _blocks_written(bs, out_dir, 0, p) if bs else [], plan)
        )
        for step in range(1, REFINE_ITERATIONS + 1):  # Lloyd steps: sums per list where the sample files are
            current = beam.pvalue.AsSingleton(centroids, default_value=None)
            centroids = (
                prefixes
                | f"SumLists{step}"
                >> beam.ParDo(
                    SumLists(step_directory(out_dir, step), FOLD_BYTES),
                    first,
                    current,
                )
                | f"SumBlocks{step}" >> beam.GroupByKey()
                | f"MoveBlocks{step}"
                >> beam.MapTuple(
                    lambda block, refs, c, n=step: move_block(
                        c,
                        CentroidBlocks.of_step(out_dir, n, c.nlist),
                        block,
                        add_block_sums(read_block_sums(r) for r in sorted(refs, key=lambda r: (r.path, r.offset))),
                    ),
                    current,
                )
                | f"GatherBlocks{step}" >> beam.combiners.ToList()
                | f"Centroids{step}"
                >> beam.FlatMap(
                    lambda bs, p, c, n=step: _blocks_written(bs, out_dir, n, p, c) if c is not None else [],
                    plan,
                    current,
                )
            )
        two_level = centroids | "AssembleQuantizer" >> beam.FlatMap(
            lambda c, parts, p: [_assemble(c, parts, p, out_dir)],
            beam.pvalue.AsSingleton(subset("Encoder", lambda p: encoder_size(p.factory))),
            plan,
        )
        trained = (one_level, two_level) | "Trained" >> beam.Flatten()
        # the sample's disk back once training is done; a retried deletion deletes what is left
        _ = prefixes | "DeleteSample" >> beam.Map(
            lambda prefix, _path: fileio.delete_existing(sample_paths(prefix)), beam.pvalue.AsSingleton(trained)
        )
        return trained
