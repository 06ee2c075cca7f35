"""build-shards: pack the training corpus into sequences, retrieve each chunk's neighbours
from the index, join their tokens and write the training shards, in one Beam job that commits
itself.
"""

from __future__ import annotations

import logging

import apache_beam as beam

from pipeline.build_index.files import documents_read_tally, load_committed_index, rejected_tally
from pipeline.build_shards.blend import CHUNKS_PER_BLOCK, ReadBlend
from pipeline.build_shards.manifest import neighbour_summary, neighbour_warnings, refreshes_of, shards_manifest
from pipeline.build_shards.refresh import RefreshPlan, RefreshShards, RewrittenRuns, committed_refresh
from pipeline.chunks.beam import ChunkDocuments, ReadParquetFiles
from pipeline.chunks.chunk_files import EMBEDDINGS_DIR, TRAINING_COLUMNS, TrainingChunks, chunk_arrays
from pipeline.chunks.chunking import Chunk
from pipeline.chunks.committed import CommittedChunkFiles, CommittedFiles
from pipeline.chunks.deleted import DeletedFiles
from pipeline.common import fileio
from pipeline.common.errors import StageError
from pipeline.common.progress import ReportProgress
from pipeline.common.rejected import WriteRejected
from pipeline.common.tally import Tally, counted
from pipeline.decontaminate.beam import ReadCorpusKeptClean
from pipeline.index.files import INDEX_FILE
from pipeline.jobs.commit import REJECTED_STAGING
from pipeline.jobs.entry_pieces import EntryTotals
from pipeline.jobs.job import (
    Committed,
    Job,
    Submitted,
    Tokenization,
    index_dir,
    shards_dir,
)
from pipeline.jobs.options import encoder_threads
from pipeline.retrieve.beam import (
    DocumentSpans,
    PackSequences,
    RetrieveNeighbours,
    SpansOfTrainingChunks,
)
from pipeline.retrieve.committed import CommittedIndex
from pipeline.retrieve.recall import MeasureNeighbourRecall
from pipeline.retrieve.search import LOST_DATA, QueryBlock, Retrieval
from pipeline.shards.rows import NeighbourIds, row_tally, source_tally
from pipeline.shards.write import WriteShards
from schemas.config import PipelineConfig
from schemas.file_table import entry_count
from schemas.manifest import ShardsManifest

log = logging.getLogger("ratrain")


def chunks_from_table(table) -> list[Chunk]:
    rows = chunk_arrays(table)
    return [
        Chunk(int(i), int(d), int(p), t, c)
        for i, d, p, t, c in zip(
            rows["chunk_id"], rows["doc_id"], rows["position"], rows["tokens"], rows["continuation"]
        )
    ]


def build_shards(
    cfg: PipelineConfig, beam_args: list[str], dry_run: bool = False, detach: bool = False, full: bool = False
) -> ShardsManifest | Submitted | dict:
    """Stages 4-5: training sequences + retrieved neighbours -> Arrow shards, committed.
    dry_run, detach: as for `build_index` (a dry run needs no committed index). Shards of this
    config built from an earlier generation of the index are refreshed from what changed
    (`pipeline.build_shards.refresh`) unless `full`.

    A job that fails because the runner lost shuffle data committed nothing; it runs once
    more, from fresh staging, and says so, and a second loss fails the stage. (Beam 2.77's
    local multi-process runner lost data through a race in its timed flush, which
    `pipeline_options` turns off: `options.no_timed_flush_on_local_runner`. The check and
    the retry stay, for any runner.)"""
    try:
        return _build_shards(cfg, beam_args, dry_run, detach, full)
    except Exception as err:  # the runner reraises the worker's error wrapped in its own type
        if dry_run or detach or LOST_DATA not in str(err):
            raise
        log.warning(
            "build-shards: the runner lost shuffle data (%s); nothing was committed, so the stage runs once more",
            str(err).strip().splitlines()[-1][:300],
        )
        return _build_shards(cfg, beam_args, dry_run, detach, full)


def _build_shards(
    cfg: PipelineConfig, beam_args: list[str], dry_run: bool, detach: bool, full: bool
) -> ShardsManifest | Submitted | dict:
    index: CommittedIndex | None = None
    try:
        # a dry run needs no index (with a usable one, it builds the job's real graph); over a
        # cloud output it builds the graph without looking: no credentials, no network
        if not (dry_run and "://" in cfg.output):
            index = load_committed_index(cfg)
    except StageError:
        if not dry_run:
            raise
    refresh = committed_refresh(shards_dir(cfg), index, cfg, full) if index is not None and not dry_run else None
    tok = Tokenization.of(cfg)
    job = Job(
        "build-shards",
        records="sequences",
        output=cfg.output,
        directory=shards_dir(cfg),
        model=ShardsManifest,
        beam_args=beam_args,
        staging="shards",
        dry_run=dry_run,
        detach=detach,
        max_rejected_fraction=cfg.max_rejected_fraction,
        keep_commits=cfg.keep_commits,
        # a change of the index (or of the shards refreshed) committed while this job runs fails
        # it, rather than mixing generations
        reads=(
            (() if index is None else ((index.directory, index.manifest_sha256),))
            + (() if refresh is None else ((shards_dir(cfg), refresh.previous_sha256),))
        ),
        # over its own chunk database nothing it shuffles has a registered coder (decontamination's
        # does), so Beam's type inference would only cost time
        type_check=cfg.training_corpus != "same",
    )

    def graph(pipeline, staging) -> Committed:
        L, m, k = cfg.chunks_per_sequence, cfg.chunk_tokens, cfg.neighbours
        idx = index_dir(cfg)
        threads = None
        chunk_files = CommittedChunkFiles(
            idx, 0 if index is None else index.num_chunks, "" if index is None else index.manifest_sha256
        )
        deleted = index.deleted() if index is not None else DeletedFiles(())
        # the files the index manifest lists (a dry run without an index: a glob, never read)
        database_chunks: str | CommittedFiles = fileio.join(idx, "chunks", "*.parquet")
        database_embeddings: str | CommittedFiles = fileio.join(idx, EMBEDDINGS_DIR, "*.parquet")
        if index is not None:
            database_chunks = CommittedFiles(idx, index.manifest_sha256, "chunks")
            database_embeddings = CommittedFiles(idx, index.manifest_sha256, EMBEDDINGS_DIR)
        # a dry run without a committed index builds the graph of one index file
        index_path, routing = index.searched() if index is not None else (fileio.join(idx, "faiss", INDEX_FILE), None)
        spec = Retrieval(
            index_path=index_path,
            depth=None if index is None else index.nprobe,
            chunk_files=chunk_files,
            chunks_per_seq=L,
            chunk_tokens=m,
            neighbours=k,
            candidates=cfg.neighbour_candidates,
            pad_id=tok.pad_id,
            dedupe=cfg.dedupe_neighbours,
            probes=cfg.neighbour_recall_sample,
            embeddings=database_embeddings,
            target_recall=cfg.index.target_recall,
            recall_below_target=cfg.recall_below_target,
            routing=routing,
            deleted=deleted if deleted else None,
            tokens_from_chunk_files=cfg.training_corpus == "same",
        )
        retrieve = RetrieveNeighbours(spec, cfg.rows_per_shard(), cfg.index.min_ram, validate=not dry_run)
        # nothing is read that could be rejected, nothing is embedded: no steps for them
        rejected, precision, read_tallies, unchanged, blend_plan = None, None, (), None, None
        kept_ids: tuple = ()  # a refresh's unchanged rows' NeighbourIds
        if refresh is not None:
            assert index is not None  # a refresh is planned from the committed index
            plan = RefreshPlan(
                shards_directory=shards_dir(cfg),
                shards_manifest_sha256=refresh.previous_sha256,
                chunk_files=chunk_files,
                deleted=deleted,
                new_chunks=refresh.change.new_chunks,
                # an IVF index's new vectors searched in its lists at the depth the shards were searched at
                trained_index=None if index.nlist is None else routing.quantizer if routing else index_path,
                depth=refresh.previous.search_depth.depth if refresh.previous.search_depth else index.nprobe,
                chunks_per_seq=L,
                chunk_tokens=m,
                pad_id=tok.pad_id,
                shard_rows=cfg.rows_per_shard(),
            )
            spans = pipeline | "DocumentSpans" >> DocumentSpans(database_chunks, deleted=deleted)
            refreshed = spans | "RefreshShards" >> RefreshShards(plan, retrieve)
            retrieved, to_write, unchanged = refreshed.retrieved, refreshed.rows, refreshed.unchanged
            chunk_tallies = refreshed.tallies  # with the unchanged shards' rows' tallies
            kept_ids = (refreshed.neighbour_ids,)
        else:
            if cfg.training_corpus == "same":
                # a deleted document's chunks are in no sequence: the sequences they would be in are not made
                training_chunks = (
                    pipeline
                    | "ReadChunkDatabase"
                    >> ReadParquetFiles(database_chunks, columns=list(TRAINING_COLUMNS), validate=not dry_run)
                    # packed from each chunk's first token: the rows' assembly reads the tokens again
                    | "TrainingChunks" >> beam.Map(lambda batch: TrainingChunks.of(batch, deleted.ranges()).heads())
                )
                spans = training_chunks | "DocumentSpans" >> SpansOfTrainingChunks()
                queries = None  # the search reads them from the database's embedding files
                sequences = training_chunks | "PackSequences" >> PackSequences(L, tok.pad_id)
            elif cfg.blended:
                threads = encoder_threads(cfg.embedding.cpu_threads, cfg.embedding.device, pipeline.options)
                blend = pipeline | "ReadBlend" >> ReadBlend(cfg, tok, threads, match=not dry_run)
                sequences, queries, training_chunks = blend.sequences, blend.queries, blend.chunks
                rejected = blend.rejected
                read_tallies, precision = blend.tallies, beam.pvalue.AsSingleton(blend.precision)
                blend_plan = blend.plan
                spans = pipeline | "DocumentSpans" >> DocumentSpans(database_chunks, not dry_run, deleted)
            else:
                corpus = pipeline | "ReadTrainingCorpus" >> ReadCorpusKeptClean(cfg, "training", match=not dry_run)
                chunks, unusable = corpus.documents | "ChunkTrainingDocuments" >> ChunkDocuments(
                    tok.path, m, tok.pad_id
                )
                from pipeline.embed.beam import EmbedChunks

                threads = encoder_threads(cfg.embedding.cpu_threads, cfg.embedding.device, pipeline.options)
                training_chunks = (
                    chunks
                    | "BatchChunks" >> beam.BatchElements(max_batch_size=CHUNKS_PER_BLOCK)
                    | "ChunkBlocks" >> beam.Map(TrainingChunks.of_chunks)
                )
                embedded, precision_used = chunks | "EmbedTrainingChunks" >> EmbedChunks(
                    cfg.embedding, tok.path, threads
                )
                queries = embedded | "QueryBlocks" >> beam.Map(lambda group: QueryBlock(group.chunk_ids, group.vectors))
                rejected = (corpus.rejected, unusable) | "MergeRejected" >> beam.Flatten()
                read_tallies = (
                    *documents_read_tally(corpus.documents, rejected, "Training"),
                    corpus.tallies,
                    rejected_tally(rejected, "TallyRejected"),
                )
                precision = beam.pvalue.AsSingleton(precision_used)
                spans = pipeline | "DocumentSpans" >> DocumentSpans(database_chunks, not dry_run, deleted)
                sequences = training_chunks | "PackSequences" >> PackSequences(L, tok.pad_id)
            inputs = (sequences, spans) if queries is None else (sequences, queries, spans)
            retrieved = inputs | "RetrieveNeighbours" >> retrieve
            to_write = retrieved.rows
            chunk_tallies = counted("training_chunks", training_chunks, len)
        rows = to_write | "ShardProgress" >> ReportProgress("retrieve", "sequences", lambda batch: len(batch.rows))
        written = rows | "WriteShards" >> WriteShards(
            staging, cfg.rows_per_shard(), tok.pad_id, sources=cfg.source_names(), blend=cfg.blended
        )
        shard_files = written if unchanged is None else (written, unchanged) | "EveryShard" >> beam.Flatten()
        rejected_files = (
            ()
            if rejected is None
            else (rejected | "WriteRejected" >> WriteRejected(fileio.join(staging, REJECTED_STAGING), "build-shards"),)
        )
        # the recall check reads every row's neighbour ids: a refresh's unchanged rows send only those
        ids = (to_write | "NeighbourIds" >> beam.Map(NeighbourIds.of), *kept_ids) | "EveryRowsIds" >> beam.Flatten()
        recall = (retrieved.probes, retrieved.truth, ids) | "MeasureNeighbourRecall" >> MeasureNeighbourRecall(k)
        tallies = (
            *read_tallies,
            retrieved.tallies,
            chunk_tallies,
            to_write | "TallyRows" >> beam.FlatMap(row_tally, m, tok.pad_id),
            *(() if blend_plan is None else (to_write | "TallySources" >> beam.FlatMap(source_tally, tok.pad_id),)),
        ) | "Tallies" >> Tally()
        refreshes: tuple = ()
        if refresh is not None and unchanged is not None and index is not None:  # all or none
            summary = refresh.summary(index.generation)  # what the record needs: not the shards' manifest
            refreshes = (
                summary,
                beam.pvalue.AsSingleton(written | "RewrittenRuns" >> beam.CombineGlobally(RewrittenRuns())),
                beam.pvalue.AsSingleton(unchanged | "KeptShards" >> beam.combiners.Count.Globally()),
            )
        manifest = (
            pipeline
            | "Once" >> beam.Create([None])  # the manifest is made once, when every side input is complete
            | "ShardsManifest"
            >> beam.Map(
                lambda _, *refreshed, totals, **facts: shards_manifest(
                    totals, refreshes=refreshes_of(*refreshed, tallies=facts["tallies"]), **facts
                ),
                *refreshes,
                totals=beam.pvalue.AsSingleton(shard_files | "ShardTotals" >> beam.CombineGlobally(EntryTotals())),
                tallies=beam.pvalue.AsDict(tallies),
                recall=beam.pvalue.AsSingleton(recall),
                search_depth=beam.pvalue.AsSingleton(retrieved.search_depth),
                precision=precision,
                cfg=cfg,
                index_sha=None if index is None else index.manifest_sha256,
                index_generation=None if index is None else index.generation,
                threads=threads,
                pad_id=tok.pad_id,
                plan=None if blend_plan is None else beam.pvalue.AsSingleton(blend_plan),
            )
        )
        return Committed(manifest=manifest, staged=shard_files, after=rejected_files)

    manifest = job.run(graph)
    if isinstance(manifest, ShardsManifest):
        log.info(
            "committed %s (%d sequences in %d shards, %s)",
            shards_dir(cfg),
            manifest.num_sequences,
            entry_count(manifest),
            neighbour_summary(manifest),
        )
        for warning in neighbour_warnings(manifest, cfg):
            log.warning("%s: %s", shards_dir(cfg), warning)
    return manifest
