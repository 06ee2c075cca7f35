"""Training the IVF lists: one k-means over all lists against two-level k-means (faiss's
scheme plus Lloyd refinement, `pipeline/index/kmeans.py`), for time and for the recall of the
index they give.

    .venv/bin/python benchmarks/index_training.py [--n 1000000]
        [--factories IVF1024,PQ32x8np IVF4096,PQ32x8np] [--two-level-only IVF16384_HNSW32,PQ32x8np]
    .venv/bin/python benchmarks/index_training.py --sample-files 256 [--spread-factory IVF4096,PQ32x8np]
        (1M vectors: 7 to 15 minutes on 2 shared cores, most of it the two trainings and the two fills)

In one process (faiss on every core), on `--n` 384-d `LowRankClusters` vectors: for each factory
and each clustering ('flat', 'two_level'), `train_index` on the build's own sample size (64
vectors per list) -> seconds; the index filled with all vectors; 1,000 held-out queries (same
distribution, not indexed) searched at nprobe 8 … 64 -> 1-recall@10 against exact search, ties
within the pipeline's tolerance counted as hits. `--two-level-only` factories are trained only
with two_level (one k-means there takes too long to wait for: its work grows as lists²).

`--sample-files N` instead compares, for `--spread-factory` (IVF4096,PQ32x8np), two-level
training in one process (`train_two_level`) with the same training spread over Beam steps
(`TrainIndex` on the in-process runner, the sample written as N sample files, drawn by chunk id
as the index stage draws it): seconds each, 1-recall@10 of both indexes at nprobe 16, whether
their coarse centroids are bit-equal; then each step's largest process, measured: the step's
function run alone in a fresh process (spawned; faiss's threads started first), its peak
resident memory (VmHWM, reset through /proc/self/clear_refs) above its resident memory just
before the step, beside the memory model's row for the same shapes (`two_level_steps`). The
per-file steps are measured on the first sample file, the per-cluster step on the largest
first-level cluster, the per-block steps on block 0; inputs a step receives from a shuffle
(the gathered subsets, a cluster's rows, the pieces and sums of a block) are read inside the
measured span.

Results: a table on stdout, JSON in benchmarks/results/index_training.json
(index_training_spread.json with --sample-files).
"""

from __future__ import annotations

import argparse
import os
import pickle
import shutil
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
from benchmarks.report import timed, write_results  # noqa: E402
from benchmarks.synthetic import LowRankClusters  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "index_training.json"
SPREAD_RESULTS = RESULTS.with_name("index_training_spread.json")
DIM, QUERIES, K, NPROBES = 384, 1000, 10, (8, 16, 32, 64)


def recall_at_k(index, vectors: np.ndarray, queries: np.ndarray, best: np.ndarray) -> float:
    """Share of queries with a top-K hit truly as similar as the exact best (within the
    tolerance): the hits' exact similarities, not the index's compressed ones."""
    from schemas.measures import TIE_TOLERANCE

    _, ids = index.search(queries, K)
    exact = np.where(ids >= 0, np.einsum("qkd,qd->qk", vectors[np.maximum(ids, 0)], queries), -np.inf)
    return float(np.mean(exact.max(axis=1) >= best - TIE_TOLERANCE))


def measure(factory: str, clustering: str, vectors, queries, best) -> dict:
    import faiss

    from pipeline.index.factory import training_size
    from pipeline.index.search import set_search_depth
    from pipeline.index.train import train_index

    rng = np.random.default_rng(5)
    chosen = np.sort(rng.choice(len(vectors), training_size(len(vectors), factory), replace=False))
    sample = vectors[chosen]  # two-level draws its subsets by these ids, as the index stage's workers do
    index, train_s = timed(lambda: train_index(factory, sample, clustering, ids=chosen, population=len(vectors)))
    _, fill_s = timed(lambda: index.add_with_ids(vectors, np.arange(len(vectors))))
    recall = {}
    for nprobe in NPROBES:
        set_search_depth(index, nprobe)
        recall[nprobe] = recall_at_k(index, vectors, queries, best)
    sizes = faiss.extract_index_ivf(index).invlists
    lengths = np.array([sizes.list_size(i) for i in range(sizes.nlist)])
    row = {
        "factory": factory,
        "clustering": clustering,
        "training_vectors": len(sample),
        "train_s": round(train_s, 2),
        "fill_s": round(fill_s, 2),
        "largest_list_x_mean": round(float(lengths.max() / lengths.mean()), 2),
        "recall_at_nprobe": recall,
    }
    print(
        f"{factory:<28} {clustering:<9} train {train_s:7.1f} s on {len(sample):>9,}  fill {fill_s:6.1f} s  "
        f"largest list {row['largest_list_x_mean']:5.1f}x mean  recall "
        + "  ".join(f"@{p}: {r:.3f}" for p, r in recall.items()),
        flush=True,
    )
    return row


@dataclass(frozen=True)
class Work:
    """What a measured step reads: the sample files and what the steps before it left."""

    factory: str
    population: int
    prefixes: list[str]
    first: str  # first-level centroids (.npy)
    lists: str  # lists per first-level cluster (.npy)
    cluster: int  # the largest first-level cluster
    blocks: object  # a CentroidBlocks of the trained centroids
    pieces: str  # block 0's pieces (pickled)
    file_sums: str  # every sample file's sums for block 0 (pickled one after another)
    block_sums: str  # block 0's combined sums (pickled)
    out: str


def _stream(path: str):
    with open(path, "rb") as f:
        while True:
            try:
                yield pickle.load(f)
            except EOFError:
                return


def _run_step(step: str, w: Work) -> None:
    from pipeline.index.factory import encoder_size, ivf_lists, training_size
    from pipeline.index.kmeans import first_level_size
    from pipeline.index.two_level import (
        CentroidBlocks,
        add_block_sums,
        assemble,
        build_assigner,
        clusters_of_file,
        file_block_sums,
        move_block,
        read_vectors,
        second_level_pieces,
        subset_of_file,
        train_first_level,
        write_block,
    )

    nlist, first = ivf_lists(w.factory) or 1, np.load(w.first)
    subset = first_level_size(training_size(w.population, w.factory), nlist)
    blocks = w.blocks
    assert isinstance(blocks, CentroidBlocks)
    if step == "subsets":
        for size in (subset, encoder_size(w.factory)):
            subset_of_file(w.prefixes[0], size, w.population)
    elif step == "first":
        train_first_level([r for p in w.prefixes for r in subset_of_file(p, subset, w.population)], DIM, nlist)
    elif step == "assign":
        clusters_of_file(w.prefixes[0], first)
    elif step == "cluster":
        parts = [rows for p in w.prefixes for c, rows in clusters_of_file(p, first) if c == w.cluster]
        second_level_pieces(w.cluster, parts, np.load(w.lists), DIM)
    elif step == "write":
        write_block(CentroidBlocks.of_step(w.out, 9, nlist), 0, _stream(w.pieces))
    elif step == "lloyd":
        file_block_sums(build_assigner(first, blocks), read_vectors(w.prefixes[0]))
    elif step == "combine":
        add_block_sums(_stream(w.file_sums))
    elif step == "move":
        move_block(blocks, CentroidBlocks.of_step(w.out, 9, nlist), 0, next(_stream(w.block_sums)))
    elif step == "assemble":
        parts = [r for p in w.prefixes for r in subset_of_file(p, encoder_size(w.factory), w.population)]
        assemble(blocks, parts, w.factory, DIM, os.path.join(w.out, "assembled.faiss"))


def _proc_kib(field: str) -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1])


def _measured_in_child(step: str, w: Work) -> int:
    """Bytes the step's process grows by at its peak (run in a fresh process)."""
    import faiss

    faiss.IndexFlatIP(8).search(np.zeros((64, 8), np.float32), 1)  # start faiss's threads first
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _proc_kib("VmRSS")
    _run_step(step, w)
    return (_proc_kib("VmHWM") - before) * 1024


MODEL_ROWS = {  # measured step -> the memory model's row
    "subsets": "index: first-level and encoder subsets of one sample file",
    "first": "index: train first level",
    "assign": "index: assign one sample file to the first level",
    "cluster": "index: train one first-level cluster",
    "write": "index: write one block of centroids",
    "lloyd": "index: Lloyd step over one sample file",
    "combine": "index: Lloyd step: combine one block's sums",
    "move": "index: Lloyd step: move one block",
    "assemble": "index: assemble trained",
}


def _prepare_steps(w_dir: Path, factory: str, n: int, prefixes: list[str], sample: np.ndarray, centroids) -> Work:
    """The inputs of each measured step, from the one-process run's centroids."""
    from pipeline.index.factory import ivf_lists, training_size
    from pipeline.index.kmeans import assign_first_level, first_level_size, lists_per_cluster
    from pipeline.index.two_level import (
        CentroidBlocks,
        add_block_sums,
        build_assigner,
        cut_into_blocks,
        file_block_sums,
        read_vectors,
        subset_of_file,
        train_first_level,
    )

    nlist = ivf_lists(factory) or 1
    subset = first_level_size(training_size(n, factory), nlist)
    first = train_first_level([r for p in prefixes for r in subset_of_file(p, subset, n)], DIM, nlist)
    sizes = np.bincount(assign_first_level(first, sample), minlength=len(first))
    lists = lists_per_cluster(sizes, nlist)
    blocks = CentroidBlocks.of_step(str(w_dir), 0, nlist)
    os.makedirs(blocks.directory, exist_ok=True)
    for block, piece in cut_into_blocks(0, centroids):
        np.save(blocks.path(block), piece.centroids)
    np.save(w_dir / "first.npy", first)
    np.save(w_dir / "lists.npy", lists)
    with open(w_dir / "pieces.pkl", "wb") as f:  # block 0 as the clusters' pieces, cut at their bounds
        bounds = np.concatenate([[0], np.cumsum(lists)])
        for start, end in zip(bounds[:-1], bounds[1:]):
            for block, piece in cut_into_blocks(int(start), centroids[start:end]):
                if block == 0:
                    pickle.dump(piece, f)
    assigner = build_assigner(first, blocks)
    with open(w_dir / "file_sums.pkl", "wb") as f:
        for prefix in prefixes:
            for block, part in file_block_sums(assigner, read_vectors(prefix)):
                if block == 0:
                    pickle.dump(part, f)
    with open(w_dir / "block_sums.pkl", "wb") as f:
        pickle.dump(add_block_sums(_stream(str(w_dir / "file_sums.pkl"))), f)
    return Work(
        factory, n, prefixes, str(w_dir / "first.npy"), str(w_dir / "lists.npy"), int(np.argmax(sizes)), blocks,
        str(w_dir / "pieces.pkl"), str(w_dir / "file_sums.pkl"), str(w_dir / "block_sums.pkl"), str(w_dir),
    )  # fmt: skip


def spread(factory: str, files: int, vectors, queries, best) -> dict:
    """One-process against Beam-spread two-level training on the same sample; each step's peak."""
    import apache_beam as beam
    import faiss

    from pipeline.common.sampling import TRAIN_SALT, in_sample
    from pipeline.index.factory import IndexPlan, training_size
    from pipeline.index.kmeans import train_two_level
    from pipeline.index.search import set_search_depth
    from pipeline.index.train_beam import TRAINED_FILE, TrainIndex
    from pipeline.index.two_level import write_sample_part
    from pipeline.jobs.memory_training import two_level_steps
    from pipeline.jobs.options import new_pipeline

    n = len(vectors)
    ids = np.arange(n, dtype=np.int64)
    keep = in_sample(ids, training_size(n, factory), n, TRAIN_SALT)
    work = Path(tempfile.mkdtemp(prefix="index_training_"))
    prefixes = []
    for number, rows in enumerate(np.array_split(ids, files)):  # an embeddings file's share, as the stage writes it
        prefixes.append(str(work / "sample" / f"embeddings-{number:05d}"))
        write_sample_part(prefixes[-1], rows[keep[rows]], vectors[rows[keep[rows]]])
    alone, alone_s = timed(lambda: train_two_level(factory, ids[keep], vectors[keep], n))
    print(f"one process: {alone_s:.1f} s on {int(keep.sum()):,} training vectors in {files} sample files", flush=True)
    centroids = faiss.extract_index_ivf(alone).quantizer.reconstruct_n(0, faiss.extract_index_ivf(alone).nlist)

    steps = _prepare_steps(work / "steps", factory, n, prefixes, vectors[keep], centroids)
    model = {s.name: s.terms for s in two_level_steps(factory, n, DIM, -(-n // files))}
    measured = []
    for step, row in MODEL_ROWS.items():
        with ProcessPoolExecutor(1, mp_context=get_context("spawn"), max_tasks_per_child=1) as pool:
            peak = pool.submit(_measured_in_child, step, steps).result()
        name = next(k for k in model if k.startswith(row))
        modelled = sum(model[name].values())
        measured.append({"step": name, "measured_bytes": peak, "model_bytes": modelled, "ratio": peak / modelled})
        print(f"{name:<62} measured {peak / 2**20:7.1f} MB  model {modelled / 2**20:7.1f} MB", flush=True)

    plan = IndexPlan(
        factory=factory,
        dim=DIM,
        count=n,
        train_size=int(keep.sum()),
        clustering="two_level",
        mergeable=True,
        queries=0,
    )
    out = work / "beam"

    def run_beam():
        with new_pipeline([]) as p:
            the_plan = beam.pvalue.AsSingleton(p | "Plan" >> beam.Create([plan]))
            _ = p | "Prefixes" >> beam.Create(prefixes) | TrainIndex(the_plan, str(out), None)
        return faiss.read_index(str(out / TRAINED_FILE))

    spread_index, spread_s = timed(run_beam)
    print(f"TrainIndex on the in-process runner: {spread_s:.1f} s ({spread_s / alone_s:.2f}x)", flush=True)
    spread_centroids = faiss.extract_index_ivf(spread_index).quantizer.reconstruct_n(0, len(centroids))
    recall = {}
    for name, index in (("one_process", alone), ("beam", spread_index)):
        index.add_with_ids(vectors, ids)
        set_search_depth(index, 16)
        recall[name] = recall_at_k(index, vectors, queries, best)
    print(f"1-recall@10 at nprobe 16: {recall}", flush=True)
    shutil.rmtree(work)
    return {
        "factory": factory,
        "sample_files": files,
        "training_vectors": int(keep.sum()),
        "one_process_s": round(alone_s, 1),
        "beam_s": round(spread_s, 1),
        "beam_over_one_process": round(spread_s / alone_s, 2),
        "recall_at_nprobe_16": recall,
        "centroids_bit_equal": bool(np.array_equal(centroids, spread_centroids)),
        "steps": measured,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1_000_000)
    parser.add_argument("--factories", nargs="*", default=["IVF1024,PQ32x8np", "IVF4096,PQ32x8np"])
    parser.add_argument("--two-level-only", nargs="*", default=["IVF16384_HNSW32,PQ32x8np"])
    parser.add_argument("--sample-files", type=int, default=0, help="compare one process with TrainIndex instead")
    parser.add_argument("--spread-factory", default="IVF4096,PQ32x8np")
    args = parser.parse_args()
    import faiss

    data = LowRankClusters(DIM)
    vectors = data.sample(args.n, np.random.default_rng(1))
    queries = data.sample(QUERIES, np.random.default_rng(2))
    exact = faiss.IndexFlatIP(DIM)
    exact.add(vectors)
    best = exact.search(queries, 1)[0][:, 0]
    del exact
    print(
        f"{args.n:,} x {DIM} vectors, {QUERIES:,} held-out queries, {faiss.omp_get_max_threads()} faiss threads",
        flush=True,
    )
    if args.sample_files:
        result = spread(args.spread_factory, args.sample_files, vectors, queries, best)
        write_results({"n": args.n, "dim": DIM, "cores": os.cpu_count(), **result}, SPREAD_RESULTS)
        return
    rows = [
        measure(factory, clustering, vectors, queries, best)
        for factory in args.factories
        for clustering in ("flat", "two_level")
    ]
    rows += [measure(factory, "two_level", vectors, queries, best) for factory in args.two_level_only]
    write_results({"n": args.n, "dim": DIM, "queries": QUERIES, "cores": os.cpu_count(), "rows": rows}, RESULTS)


if __name__ == "__main__":
    main()
