"""build-index over a corpus that gained files, or with documents to delete: the new files
alone are read, chunked, embedded and added to the committed index, and the deleted
documents' vectors removed from it, as a new generation (docs/design.md §8, "Appending and
deleting"). An appended document whose id the index holds replaces it (the old one deleted).
Nothing already written is read again but the chunk files' chunk and doc ids (where each
document's chunks are) and, once, the embeddings (the new vectors' recall against exact search
over all of them).
"""

from __future__ import annotations

import logging

import apache_beam as beam

from pipeline.build_index.append_changes import (
    DELETE,
    NOT_FOUND,
    REPLACED_TAG,
    RUN,
    DeleteRequests,
    deletions,
    document_runs,
    replacing,
)
from pipeline.build_index.change_faiss import ChangeFaissFiles
from pipeline.build_index.files import index_staged
from pipeline.build_index.manifest import NEWEST_GENERATION_CHUNKS, next_generation_manifest
from pipeline.build_index.steps import chunk_and_embed, stage_tallies, write_sources
from pipeline.chunks.committed import CommittedFiles, CommittedIndexManifest
from pipeline.chunks.deleted import (
    DELETE_REQUESTED,
    DELETED_DIR,
    NOT_IN_ITS_FILE,
    REPLACED,
    DeletedDocument,
    deleted_table,
)
from pipeline.common import fileio
from pipeline.common.errors import StageError
from pipeline.common.names import file_name, file_number
from pipeline.common.rejected import WriteRejected
from pipeline.common.writers import parquet_bytes, write_file
from pipeline.corpus.records import doc_id_for
from pipeline.decontaminate.beam import ReadCorpusKeptClean
from pipeline.index.sources import SOURCES_DIR, documents_of
from pipeline.jobs.commit import REJECTED_STAGING
from pipeline.jobs.entry_pieces import EntryTotals, KeptEntries
from pipeline.jobs.job import Committed, Job, Submitted, Tokenization, index_dir
from pipeline.jobs.options import encoder_threads
from pipeline.jobs.reuse import CorpusChanges
from schemas.config import PipelineConfig
from schemas.manifest import FileEntry, IndexManifest, unversioned

log = logging.getLogger("ratrain")


def _write_deleted(documents: list[DeletedDocument], staging: str, number: int) -> list[FileEntry]:
    """This generation's deleted documents as deleted/deleted-GGGGG.parquet (none: no file)."""
    if not documents:
        return []
    name = file_name(DELETED_DIR, number, "parquet")
    return [
        write_file(
            fileio.join(staging, DELETED_DIR), name, parquet_bytes(deleted_table(documents)), len(documents), staging
        )
    ]


def change_index(
    cfg: PipelineConfig,
    previous: IndexManifest,
    *,
    previous_sha256: str,
    changes: CorpusChanges,
    beam_args: list[str],
    delete: tuple[str, ...] = (),
    detach: bool = False,
    dry_run: bool = False,
) -> IndexManifest | Submitted | dict:
    """The committed index's next generation: the documents of the new and changed corpus files
    (`changes`) appended (chunk ids from `previous.num_chunks`, chunk and embedding files
    numbered after the last, vectors added to the trained index), each replacing the indexed
    document of its id; the documents of changed and gone files that they no longer hold, and
    those whose identities `delete` names, deleted. Its commit fails if the committed manifest
    is no longer the one `previous_sha256` names. The job's graph carries the committed index as
    its directory and manifest sha256 (`CommittedIndexManifest`), read on the workers, so its
    size grows with the change, not with the index. dry_run: build the graph, read and write
    nothing, return `describe(pipeline)`."""
    directory = index_dir(cfg)
    number = len(previous.generations)
    if delete and "HNSW" in previous.index_factory and "IVF" not in previous.index_factory:
        raise StageError(f"{directory}: an HNSW index cannot remove vectors; delete by rebuilding (--force)")
    log.info(
        "build-index: generation %d of %s: %d new, %d changed and %d gone corpus file(s), %d document(s) to delete "
        "(%s chunks there)",
        number,
        directory,
        len(changes.new),
        len(changes.changed),
        len(changes.gone),
        len(delete),
        f"{previous.num_chunks:,}",
    )
    tok = Tokenization.of(cfg)
    job = Job(
        "build-index (append)",
        records=NEWEST_GENERATION_CHUNKS,
        output=cfg.output,
        directory=directory,
        model=IndexManifest,
        beam_args=beam_args,
        staging="index",
        detach=detach,
        dry_run=dry_run,
        max_rejected_fraction=cfg.max_rejected_fraction,
        keep_commits=cfg.keep_commits,
        replaces=previous_sha256,
    )
    committed = CommittedIndexManifest(directory, previous_sha256, previous.num_chunks)

    requested = {doc_id_for(identity) for identity in delete}

    def graph(pipeline, staging) -> Committed:
        threads = encoder_threads(cfg.embedding.cpu_threads, cfg.embedding.device, pipeline.options)
        corpus = pipeline | "ReadNewFiles" >> ReadCorpusKeptClean(
            cfg, "retrieval", only=frozenset(f.path for f in changes.to_read), match=not dry_run
        )
        runs = (
            pipeline
            | "Index" >> beam.Create([committed])
            | "ChunkFiles" >> beam.FlatMap(lambda index: range(index.chunk_files().num_files))
            | "SpreadChunkFiles" >> beam.Reshuffle()
            | "DocumentRuns" >> beam.FlatMap(lambda n: document_runs(committed.chunk_files(), n, committed.deleted()))
        )
        fresh = (
            {"document": corpus.documents | "ById" >> beam.Map(lambda d: (d.doc_id, d)), RUN: runs}
            | "JoinIndexed" >> beam.CoGroupByKey()
            | "Replacing" >> beam.FlatMap(replacing).with_outputs(REPLACED_TAG, main="documents")
        )
        stale_files = frozenset([f.path for f in changes.changed] + changes.gone)
        requests = (
            pipeline
            | "DeleteRequests" >> beam.Create([DeleteRequests.staged(requested, staging, write=not dry_run)])
            | "RequestedIds" >> beam.FlatMap(lambda requests: requests.doc_ids())
            | "Requested" >> beam.Map(lambda doc_id: (doc_id, DELETE_REQUESTED)),
            fresh[REPLACED_TAG] | "Replaced" >> beam.Map(lambda doc_id: (doc_id, REPLACED)),
            pipeline
            | "IndexSources"
            >> beam.Create([CommittedFiles(directory, previous_sha256, SOURCES_DIR)] if stale_files else [])
            | "SourcesFiles" >> beam.FlatMap(lambda files: files.paths())
            | "DocumentsOfStaleFiles" >> beam.FlatMap(documents_of, stale_files)
            | "NotInItsFile" >> beam.MapTuple(lambda doc_id, _source: (doc_id, NOT_IN_ITS_FILE)),
        )
        deleted = (
            {RUN: runs, DELETE: requests | "AllRequests" >> beam.Flatten()}
            | "JoinRequests" >> beam.CoGroupByKey()
            | "Deletions" >> beam.FlatMap(deletions).with_outputs(NOT_FOUND, main="deleted")
        )
        deleted_now = beam.pvalue.AsList(deleted.deleted)
        # numbered on from the committed chunk files, read a row group of the file table at a time
        first_file = max((file_number(p) + 1 for p in fileio.listed_paths(previous, directory, "chunks")), default=0)
        written = chunk_and_embed(
            fresh.documents,
            cfg,
            tok,
            staging=staging,
            threads=threads,
            first_chunk_id=previous.num_chunks,
            first_file=first_file,
        )
        all_rejected = (corpus.rejected, written.unusable) | "MergeRejected" >> beam.Flatten()
        rejected_files = all_rejected | "WriteRejected" >> WriteRejected(
            fileio.join(staging, REJECTED_STAGING), f"build-index-g{number:05d}"
        )
        tallies = (
            stage_tallies(corpus, all_rejected, written, tok.pad_id),
            deleted[NOT_FOUND] | "TallyNotFound" >> beam.Map(lambda _: ("delete_ids_not_found", 1)),
        ) | "AllTallies" >> beam.Flatten()
        changed = (written.embedding_files, deleted.deleted) | "ChangeFaissFiles" >> ChangeFaissFiles(
            committed, previous, directory=directory, staging=staging, sample=cfg.index.recall_sample
        )
        deleted_files_written = (
            pipeline
            | "OneWriter" >> beam.Create([None])
            | "WriteDeleted" >> beam.FlatMap(lambda _, docs: _write_deleted(docs, staging, number), deleted_now)
        )
        sources = corpus.documents | "WriteSources" >> write_sources(staging, number)
        entries = (
            written.chunk_files,
            written.embedding_files,
            deleted_files_written,
            sources,
        ) | "FileEntries" >> beam.Flatten()
        manifest = (
            entries
            | "EntryTotals" >> beam.CombineGlobally(EntryTotals())
            | "ChangedManifest"
            >> beam.Map(
                lambda totals, changed, **kw: next_generation_manifest(
                    totals, changed, previous=committed.summary(), **kw
                ),
                beam.pvalue.AsSingleton(changed),
                deleted_now=deleted_now,
                tallies=beam.pvalue.AsDict(tallies | "SumTallies" >> beam.CombinePerKey(sum)),
                precision=beam.pvalue.AsSingleton(written.precision),
                previous_sha256=previous_sha256,
                changes=changes,
                cfg=cfg,
            )
        )
        # the manifest lists the faiss files changed, staged; the rest of the previous commit's stay in place
        kept = changed | "KeptEntries" >> beam.Map(
            lambda change: KeptEntries(committed, dropped_names=frozenset(unversioned(e.path) for e in change.files))
        )
        return Committed(manifest=manifest, staged=entries, kept=kept, staged_of=index_staged, after=(rejected_files,))

    manifest = job.run(graph)
    if isinstance(manifest, IndexManifest):
        latest = manifest.generations[-1]
        recall = (
            ""
            if latest.new_vector_recall is None
            else (
                f"; new vectors' {manifest.recall_at_k.measure} = {latest.new_vector_recall:.3f} "
                f"(the build measured {manifest.recall_at_k.value:.3f})"
            )
        )
        log.info(
            "committed %s generation %d: %s chunks from %d file(s) (chunk ids from %s), %d document(s) deleted%s",
            directory,
            latest.number,
            f"{latest.num_chunks:,}",
            len(latest.inputs),
            f"{latest.first_chunk_id:,}",
            latest.deleted_documents,
            recall,
        )
        missing = manifest.counters.get("delete_ids_not_found", 0) - previous.counters.get("delete_ids_not_found", 0)
        if missing:
            log.warning(
                "%s: %d of the ids to delete are not in the index (nothing to delete for them)", directory, missing
            )
        _warn_on_drift(manifest)
    return manifest


# New vectors found this much less often than the build's own sample say the lists have drifted.
DRIFT_WARNING = 0.02


def _warn_on_drift(manifest: IndexManifest) -> None:
    latest = manifest.generations[-1].new_vector_recall
    if latest is not None and latest < manifest.recall_at_k.value - DRIFT_WARNING:
        log.warning(
            "the appended vectors' recall (%.3f) is %.3f below the index build's (%.3f): the trained lists fit "
            "the new documents less well; rebuild the index (build-index --force) to retrain them",
            latest,
            manifest.recall_at_k.value - latest,
            manifest.recall_at_k.value,
        )
