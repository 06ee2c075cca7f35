"""The index stage in Beam: `BuildIndex` builds the faiss index over chunk embeddings, chosen
from a memory budget, trained on a sample, filled in parallel, merged, and tuned to a measured
recall.

The rules (factory choice, sample, recall, tuning) are the Beam-free functions of
`pipeline.index`; `BuildIndex` wires them into Beam so that, for IVF types, no process
ever holds all embeddings:

    embeddings ─► stats (count, dims) ─► sample ─► train (one worker) ─► trained.faiss
         │                                                                   │
         └─► parts by chunk id ─► add_with_ids to the trained index ─► part-NNNNN.faiss
                              └─► exact top 100 of the query sample ─► ground truth
    parts ─► merge (IVF lists, in part order) ─► index.faiss ─► tune nprobe to target recall

With `index.slice_bytes`, the lists are shared out among slices instead (`routing`): each
slice owns whole lists, nearby ones (a k-means of the centroids), cut to equal vectors once
the filled parts say how many each list holds; each part sends the codes of its lists
through a shuffle to pieces of their slices (a slice's codes from a run of consecutive files,
so that no group through the shuffle is a whole slice), and each slice is merged from its
pieces by its own worker into slice-NNNNN.faiss (lists sorted by chunk id) and searches the
query sample at every depth;
those results are merged by score as they come (a combiner), and one worker tunes the one
nprobe of all slices on them and writes
quantizer.faiss (the trained index: the coarse assignment build-shards routes queries by)
and list_owners.npy. No worker holds more than one slice and the trained index. Those steps
are `pipeline.index.build_slices`.

Chunk ids are the faiss ids, so a search answers chunk ids.
"""

from __future__ import annotations

import apache_beam as beam
import numpy as np
from apache_beam.metrics import Metrics

from pipeline.common import fileio
from pipeline.common.arrays import widest_span
from pipeline.common.combining import MergedBy
from pipeline.common.names import file_number
from pipeline.common.sampling import QUERY_SALT, in_sample
from pipeline.corpus.records import METRICS_NAMESPACE
from pipeline.index.build_info import write_build_info
from pipeline.index.build_slices import (
    AssembledSlices,
    AssemblePiece,
    FilledPart,
    SumListSizes,
    assemble_slice,
    plan_slices,
    split_part,
    tune_slices,
)
from pipeline.index.exact import exact_nearest_other, exact_nearest_outside, truth_depth
from pipeline.index.factory import IndexPlan, plan_index
from pipeline.index.files import (
    INDEX_FILE,
    EmptiedTrained,
    embedding_file_info,
    read_embeddings,
    read_index,
    write_index,
)
from pipeline.index.recall import RECALL_K, one_recall_at_k, recall_of
from pipeline.index.routing import list_sizes
from pipeline.index.search import query_rate, search_depth_range, search_each_excluding, set_search_depth
from pipeline.index.train import build_index, merge_part, write_part
from pipeline.index.train_beam import (
    EmbeddingFileStats,
    TrainIndex,
    file_stem,
    query_sample_of,
    sampled_rows,
    write_sample,
)
from pipeline.index.tuning import QuerySample, Truth, tune_index_depth
from schemas.stage_config import IndexConfig


def _truth_of(queries: QuerySample, ids, vectors, k: int) -> Truth:
    outside = None
    if queries.documents is not None:
        outside = exact_nearest_outside(queries.vectors, queries.documents, ids, vectors, truth_depth(k))
    return Truth(exact_nearest_other(queries.ids, queries.vectors, ids, vectors), outside)


class _FillPart(beam.DoFn):
    """One embeddings file = one part: its vectors added (chunk ids as faiss ids) to the
    trained index, streamed batch by batch, written as part-<file>.faiss without the coarse
    quantizer (only its lists and codes travel); plus the part's exact nearest neighbour of
    every query of the recall sample. The trained index is read once per DoFn instance (a
    worker thread; at 2^20 lists it is 2-3.7 GB, and there is a part per embedding file),
    emptied before each part and dropped when the instance is torn down."""

    def __init__(self, out_dir, neighbours: int):
        self.out_dir, self.neighbours = out_dir, neighbours
        self._trained = EmptiedTrained()

    def teardown(self):
        self._trained.drop()

    def process(self, path, trained_path, queries):
        index = self._trained(trained_path)
        truth = None
        for ids, vectors in read_embeddings(path):
            index.add_with_ids(vectors, ids)
            found = _truth_of(queries, ids, vectors, self.neighbours)
            truth = found if truth is None else truth.merge(found)
            Metrics.counter(METRICS_NAMESPACE, "index_vectors_added").inc(len(ids))
        part_path = fileio.join(self.out_dir, "parts", f"part-{file_stem(path)}.faiss")
        write_part(index, part_path)
        if truth is not None:
            yield beam.pvalue.TaggedOutput("truth", truth)
        yield FilledPart.of(path, part_path, list_sizes(index))


def _merge_and_tune(
    parts, trained_path, *, plan: IndexPlan, queries, truth, cfg: IndexConfig, out_dir, neighbours: int
):
    """One worker: merge the parts ((embedding file number, part path)) into the trained index
    in input-file order, tune, write."""
    index = read_index(trained_path, sha256=None)
    part_paths = [path for _, path in sorted(parts)]  # chunk-id order
    for path in part_paths:
        merge_part(index, read_index(path, sha256=None))
    info = _finish(
        index,
        plan=plan,
        queries=queries,
        truth=truth,
        cfg=cfg,
        out_dir=out_dir,
        parts=len(part_paths),
        neighbours=neighbours,
    )
    return info  # the parts and the trained index stay for a retry: the commit discards them with the staging


def _build_in_one(paths, *, plan: IndexPlan, queries: QuerySample, cfg: IndexConfig, out_dir, neighbours: int):
    """Flat and graph indexes: one worker adds everything (they cannot be merged)."""
    batches = [batch for path in sorted(paths, key=file_number) for batch in read_embeddings(path)]
    ids = np.concatenate([b[0] for b in batches])
    vectors = np.concatenate([b[1] for b in batches])
    if np.any(ids[1:] < ids[:-1]):  # files in order hold ids in order: no copy of every vector then
        order = np.argsort(ids, kind="stable")
        ids, vectors = ids[order], vectors[order]
    index = build_index(ids, vectors, plan.factory)
    return _finish(
        index,
        plan=plan,
        queries=queries,
        truth=_truth_of(queries, ids, vectors, neighbours),
        cfg=cfg,
        out_dir=out_dir,
        parts=1,
        neighbours=neighbours,
    )


def _finish(
    index,
    *,
    plan: IndexPlan,
    queries: QuerySample,
    truth: Truth,
    cfg: IndexConfig,
    out_dir,
    parts: int,
    neighbours: int,
):
    def plain_at(depth):
        if depth is not None:
            set_search_depth(index, depth)
        return one_recall_at_k(index, queries.ids, queries.vectors, truth.nearest_other)

    def own_at(depth):
        if depth is not None:
            set_search_depth(index, depth)
        found = search_each_excluding(index, queries.vectors, neighbours, queries.documents).ids
        return recall_of(truth.outside_document, found)

    tuned, curve, own = tune_index_depth(
        search_depth_range(index), plain_at, own_at if truth.outside_document is not None else None, cfg, neighbours
    )
    if tuned[0] is not None:
        set_search_depth(index, tuned[0])
    index_bytes, index_sha256 = write_index(index, fileio.join(out_dir, INDEX_FILE))
    files = [{"path": INDEX_FILE, "rows": int(index.ntotal), "bytes": index_bytes, "sha256": index_sha256}]
    return write_build_info(
        plan,
        cfg,
        out_dir=out_dir,
        parts=parts,
        files=files,
        tuned=(*tuned, len(queries.ids)),
        rate=query_rate(index, queries.vectors),
        curve=curve,
        own=own,
    )


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
                if in_sample(np.array([chunk_doc[0]]), p.queries, p.count, QUERY_SALT)[0]
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
        footers = paths | "ReadFooters" >> beam.Map(embedding_file_info)
        plan = beam.pvalue.AsSingleton(
            footers | "Stats" >> beam.CombineGlobally(EmbeddingFileStats()) | "Plan" >> beam.Map(plan_index, cfg)
        )
        query_documents = self._query_documents(plan)
        queries = beam.pvalue.AsSingleton(
            paths
            | "QuerySample" >> beam.FlatMap(lambda path, p: sampled_rows(path, p.queries, p.count, QUERY_SALT), plan)
            | "GatherQueries" >> beam.combiners.ToList()
            | "StackQueries"
            >> beam.Map(
                lambda rows, p, spans=None: query_sample_of(rows, p.dim, spans),
                plan,
                *([query_documents] if query_documents is not None else []),
            )
        )

        # IVF: sample, train, fill per file, merge. Each branch is empty unless the plan picks it.
        trained = (
            paths
            | "TrainSample"
            >> beam.FlatMap(lambda path, p: [write_sample(path, p, out_dir)] if p.mergeable else [], plan)
            | "TrainIndex" >> TrainIndex(plan, out_dir, cfg.accelerator)
        )
        trained_path = beam.pvalue.AsSingleton(trained, default_value=None)
        filled = (
            paths
            | "ForMerge" >> beam.Filter(lambda path, p: p.mergeable, plan)
            | "FillParts"
            >> beam.ParDo(_FillPart(out_dir, k), trained_path, queries).with_outputs("truth", main="parts")
        )
        truth = beam.pvalue.AsSingleton(
            filled.truth | "MergeTruth" >> beam.CombineGlobally(MergedBy(Truth.merge)).without_defaults(),
            default_value=None,
        )
        slicing = beam.pvalue.AsSingleton(  # a ListSlicing, or None for one index file
            filled.parts
            | "SumListSizes" >> beam.CombineGlobally(SumListSizes())
            | "PlanSlices" >> beam.Map(plan_slices, trained_path, plan, cfg.slice_bytes)
        )
        merged = (  # one index file: the parts gathered as paths (their list sizes went to the slicing plan)
            filled.parts
            | "ForOneFile"
            >> beam.FlatMap(
                lambda part, slices: [(file_number(part.embeddings), part.path)] if slices is None else [], slicing
            )
            | "GatherParts" >> beam.combiners.ToList()
            | "MergeAndTune"
            >> beam.FlatMap(
                lambda parts, trained, p, q, t, slices: (
                    [
                        _merge_and_tune(
                            parts, trained, plan=p, queries=q, truth=t, cfg=cfg, out_dir=out_dir, neighbours=k
                        )
                    ]
                    if p.mergeable and slices is None
                    else []
                ),
                trained_path,
                plan,
                queries,
                truth,
                slicing,
            )
        )
        sliced = (
            filled.parts
            | "ListsBySlice" >> beam.FlatMap(split_part, slicing)
            | "GroupPieces" >> beam.GroupByKey()
            | "AssemblePieces" >> beam.ParDo(AssemblePiece(out_dir), trained_path)
            | "GroupSlices" >> beam.GroupByKey()
            | "AssembleSlices"
            >> beam.Map(
                assemble_slice, trained_path=trained_path, queries=queries, cfg=cfg, out_dir=out_dir, neighbours=k
            )
            | "MergeSlices" >> beam.CombineGlobally(MergedBy(AssembledSlices.merged)).without_defaults()
            | "TuneSlices"
            >> beam.Map(
                lambda slices, trained, s, p, q, t: tune_slices(
                    slices,
                    trained_path=trained,
                    slicing=s,
                    plan=p,
                    queries=q,
                    truth=t,
                    cfg=cfg,
                    out_dir=out_dir,
                    k=k,
                ),
                trained_path,
                slicing,
                plan,
                queries,
                truth,
            )
        )

        # Flat / HNSW: one worker.
        whole = (
            paths
            | "ForOneWorker" >> beam.Filter(lambda path, p: not p.mergeable, plan)
            | "GatherPaths" >> beam.combiners.ToList()
            | "BuildInOne"
            >> beam.FlatMap(
                lambda all_paths, p, q: (
                    []
                    if p.mergeable
                    else [_build_in_one(all_paths, plan=p, queries=q, cfg=cfg, out_dir=out_dir, neighbours=k)]
                ),
                plan,
                queries,
            )
        )
        return (merged, sliced, whole) | "Info" >> beam.Flatten()
