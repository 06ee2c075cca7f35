"""build-index: read, chunk, embed and index the retrieval corpus in one Beam job that commits
itself.
"""

from __future__ import annotations

import logging

import apache_beam as beam

from pipeline.build_index.append import change_index
from pipeline.build_index.faiss_only import rebuild_faiss
from pipeline.build_index.files import (
    check_index_type,
    index_staged,
    log_index,
)
from pipeline.build_index.manifest import built_manifest
from pipeline.build_index.steps import chunk_and_embed, stage_tallies, write_sources
from pipeline.common import fileio
from pipeline.common.errors import StageError
from pipeline.common.rejected import WriteRejected
from pipeline.decontaminate.beam import ReadCorpusKeptClean
from pipeline.index.build import BuildIndex
from pipeline.jobs.commit import REJECTED_STAGING
from pipeline.jobs.entry_pieces import EntryTotals
from pipeline.jobs.job import (
    Committed,
    Job,
    Submitted,
    Tokenization,
    index_dir,
)
from pipeline.jobs.options import encoder_threads
from pipeline.jobs.reuse import committed_index, corpus_changes, index_action, listed_corpus_files
from schemas.config import PipelineConfig
from schemas.manifest import (
    IndexManifest,
)

log = logging.getLogger("ratrain")


def build_index(
    cfg: PipelineConfig,
    beam_args: list[str],
    *,
    force: bool = False,
    dry_run: bool = False,
    detach: bool = False,
    delete: tuple[str, ...] = (),
) -> IndexManifest | Submitted | dict:
    """Stages 1-3: retrieval corpus -> chunks, embeddings, faiss index, committed manifest.

    When the committed chunks and embeddings match the config (only `index.*` changed), only
    the faiss index is rebuilt from them; when the corpus only gained files, they are appended
    (`change_index`). `delete`: identities of documents to delete from the committed index (as
    the corpus's id field gives them), any new files appended in the same generation.
    dry_run: build the graph, touch no input or output, run nothing; return
    `describe(pipeline)`. detach: submit and return.
    """
    check_index_type(cfg)
    previous, previous_sha = (None, None) if force or dry_run else committed_index(index_dir(cfg))
    if delete and (previous is None or not previous.generations):
        raise StageError(
            f"{index_dir(cfg)}: no committed index to delete documents from"
            + (" that records its generations (rebuild it once with --force)" if previous is not None else "")
            + ("; --force builds from scratch, without them" if force else "")
        )
    if previous is not None:
        listed = listed_corpus_files(cfg)
        action = index_action(cfg, previous, listed)
        if action == "append" or (delete and action == "reuse"):
            assert previous_sha is not None  # read with the manifest
            changes = corpus_changes(previous, listed)
            return change_index(
                cfg,
                previous,
                previous_sha256=previous_sha,
                changes=changes,
                beam_args=beam_args,
                delete=delete,
                detach=detach,
            )
        needs = "faiss rebuild" if action == "rebuild_faiss" else "build"
        if delete:
            raise StageError(
                f"{index_dir(cfg)}: documents can be deleted only from an index that matches the config "
                f"(this config needs a {needs}); run build-index first"
            )
        if action == "reuse" and previous.deleted_documents:  # a faiss rebuild would bring them back
            log.info("build-index: %s matches the config and its corpus files; nothing to build", index_dir(cfg))
            return previous
        if previous.deleted_documents:  # the corpus files still hold them
            raise StageError(
                f"{index_dir(cfg)}: this config needs a {needs}, "
                f"which would bring back the {previous.deleted_documents:,} documents deleted from the index: "
                "remove them from the corpus files, then run build-index --force"
            )
        if action != "build":  # asked to build: at least the faiss files
            assert previous_sha is not None  # read with the manifest
            return rebuild_faiss(cfg, previous, beam_args, detach, previous_sha256=previous_sha)
    tok = Tokenization.of(cfg)
    job = Job(
        "build-index",
        records="chunks",
        output=cfg.output,
        directory=index_dir(cfg),
        model=IndexManifest,
        beam_args=beam_args,
        staging="index",
        dry_run=dry_run,
        detach=detach,
        max_rejected_fraction=cfg.max_rejected_fraction,
        keep_commits=cfg.keep_commits,
    )

    def graph(pipeline, staging) -> Committed:
        threads = encoder_threads(cfg.embedding.cpu_threads, cfg.embedding.device, pipeline.options)
        corpus = pipeline | "ReadRetrievalCorpus" >> ReadCorpusKeptClean(cfg, "retrieval", match=not dry_run)
        written = chunk_and_embed(corpus.documents, cfg, tok, staging=staging, threads=threads)
        chunks = written.chunks
        info = (
            written.embedding_files
            | "EmbeddingPaths" >> beam.Map(lambda entry: fileio.join(staging, entry.path))
            | "BuildIndex"
            >> BuildIndex(
                cfg.index,
                fileio.join(staging, "faiss"),
                chunks | "DocumentOfChunk" >> beam.Map(lambda c: (c.chunk_id, c.doc_id)),
                cfg.neighbours,
            )
        )
        all_rejected = (corpus.rejected, written.unusable) | "MergeRejected" >> beam.Flatten()
        rejected_files = all_rejected | "WriteRejected" >> WriteRejected(
            fileio.join(staging, REJECTED_STAGING), "build-index"
        )
        tallies = stage_tallies(corpus, all_rejected, written, tok.pad_id)
        sources = corpus.documents | "WriteSources" >> write_sources(staging, 0)
        entries = (written.chunk_files, written.embedding_files, sources) | "FileEntries" >> beam.Flatten()
        manifest = (
            entries
            | "EntryTotals" >> beam.CombineGlobally(EntryTotals())
            | "IndexManifest"
            >> beam.Map(
                built_manifest,
                beam.pvalue.AsSingleton(info),
                tallies=beam.pvalue.AsDict(tallies),
                precision=beam.pvalue.AsSingleton(written.precision),
                files_read=beam.pvalue.AsList(corpus.files),
                cfg=cfg,
                tok=tok,
                threads=threads,
            )
        )
        return Committed(manifest=manifest, staged=entries, staged_of=index_staged, after=(rejected_files,))

    manifest = job.run(graph)
    if isinstance(manifest, IndexManifest):
        log_index(index_dir(cfg), manifest)
    return manifest
