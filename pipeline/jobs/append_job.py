"""build-index over a corpus that only gained files: the new files alone are read, chunked,
embedded and added to the committed index, as a new generation (docs/design.md §8,
"Appending"). Nothing already written is read again but the chunk files' doc ids (to refuse a
document the index already holds) and, once, the embeddings (the new vectors' recall against
exact search over all of them).
"""

from __future__ import annotations

import logging

import apache_beam as beam

from pipeline.chunks.chunk_files import ChunkFileRanges
from pipeline.common import fileio
from pipeline.common.names import file_number
from pipeline.common.writers import WriteRejected
from pipeline.corpus.records import ALREADY_INDEXED, Document, Rejected
from pipeline.decontaminate.beam import ReadCorpusKeptClean
from pipeline.index.append import add_in_file_order, new_vector_recall, sampled_vectors
from pipeline.index.build import INDEX_FILE
from pipeline.index.files import read_index, write_index
from pipeline.jobs.commit import REJECTED_STAGING
from pipeline.jobs.index_files import _index_staged
from pipeline.jobs.index_job import chunk_and_embed, stage_tallies
from pipeline.jobs.job import Job, Submitted, Tokenization, _sorted_entries, index_dir
from pipeline.jobs.options import encoder_threads
from schemas.config import PipelineConfig
from schemas.manifest import MANIFEST_FILE, FileEntry, Generation, IndexManifest, InputFile, PrecisionCheck

log = logging.getLogger("ratrain")

KNOWN = "known"  # CoGroupByKey tag: a doc id an earlier generation holds


def first_chunk_doc_ids(ranges: ChunkFileRanges, number: int):
    """The doc ids of the documents that begin in chunk file `number` (one per document)."""
    columns = ranges.read(number, ["doc_id", "position"])
    for doc_id in columns["doc_id"][columns["position"] == 0].tolist():
        yield doc_id, True


def not_indexed(keyed):
    """A new document joined with its id's presence in the index -> the document, or its
    rejection (a document is appended once; replacing one is not built yet)."""
    _, joined = keyed
    known = bool(list(joined[KNOWN]))
    for doc in joined["document"]:
        if not known:
            yield doc
            continue
        yield beam.pvalue.TaggedOutput(
            "rejected",
            Rejected(
                doc.source,
                doc.position,
                ALREADY_INDEXED,
                f"id {doc.identity!r} is already in the index (an earlier generation)",
                (("doc_id", doc.doc_id),),
            ),
        )


def _append_vectors(
    _, new_entries: list[FileEntry], previous: IndexManifest, directory: str, staging: str, sample: int
):
    """One worker: the committed index read, the new vectors added in chunk-id order, written
    to staging; the new vectors' recall at the index's depth measured -> (file entry, recall)."""
    new_paths = [fileio.join(staging, e.path) for e in sorted(new_entries, key=lambda e: file_number(e.path))]
    old_paths = [
        fileio.join(directory, e.path)
        for e in sorted(previous.files, key=lambda e: file_number(e.path))
        if e.path.startswith("embeddings/")
    ]
    index = read_index(fileio.join(directory, "faiss", INDEX_FILE))
    added = add_in_file_order(index, new_paths)
    query_ids, queries = sampled_vectors(new_paths, sample, added)
    recall = new_vector_recall(index, previous.nprobe, query_ids, queries, old_paths + new_paths)
    size, sha256 = write_index(index, fileio.join(staging, "faiss", INDEX_FILE))
    return FileEntry(path=f"faiss/{INDEX_FILE}", rows=int(index.ntotal), bytes=size, sha256=sha256), recall


def _appended_manifest(
    new_entries,
    appended,
    tallies: dict[str, int],
    precision: PrecisionCheck,
    previous: IndexManifest,
    new_files: list[InputFile],
    cfg: PipelineConfig,
) -> IndexManifest:
    faiss_entry, recall = appended
    kept = [e for e in previous.files if not e.path.startswith("faiss/")]
    num_chunks = sum(e.rows for e in new_entries if e.path.startswith("chunks/"))
    generation = Generation(
        number=len(previous.generations),
        inputs=sorted(new_files, key=lambda f: f.path),
        first_chunk_id=previous.num_chunks,
        num_chunks=num_chunks,
        num_documents=tallies.get("documents_chunked", 0),
        new_vector_recall=recall.value,
        embedding_precision=precision,
    )
    earlier = [*previous.generations[:-1], previous.generations[-1].model_copy(update={"timings": previous.timings})]
    counters = dict(previous.counters)
    for name, count in {**tallies, "index_vectors_added": faiss_entry.rows - previous.num_chunks}.items():
        counters[name] = counters.get(name, 0) + count
    return previous.model_copy(
        update={
            "config_hash": cfg.index_hash(),
            "embed_config_hash": cfg.embed_hash(),
            "generations": [*earlier, generation],
            "num_chunks": previous.num_chunks + num_chunks,
            "num_documents": previous.num_documents + generation.num_documents,
            "files": _sorted_entries(kept + list(new_entries) + [faiss_entry]),
            "counters": dict(sorted(counters.items())),
            "timings": None,
        }
    )


def append_index(
    cfg: PipelineConfig, previous: IndexManifest, new_files: list[InputFile], beam_args: list[str], detach: bool = False
) -> IndexManifest | Submitted:
    """The files of `new_files` (corpus files no generation of `previous` read) appended to the
    committed index as its next generation: chunk ids from `previous.num_chunks`, chunk and
    embedding files numbered after the last, vectors added to the trained index."""
    directory = index_dir(cfg)
    number = len(previous.generations)
    log.info(
        "build-index: appending %d new corpus file(s) to %s as generation %d (%s chunks there)",
        len(new_files),
        directory,
        number,
        f"{previous.num_chunks:,}",
    )
    manifest_sha = fileio.sha256_bytes(fileio.read_bytes(fileio.join(directory, MANIFEST_FILE)))
    tok = Tokenization.of(cfg)
    job = Job(
        "build-index (append)",
        "chunks",
        cfg.output,
        directory,
        IndexManifest,
        beam_args,
        staging="index",
        detach=detach,
        max_rejected_fraction=cfg.max_rejected_fraction,
        replace=("faiss",),
        replaces=manifest_sha,
    )
    pipeline, staging = job.pipeline, job.staging
    threads = encoder_threads(cfg.embedding.cpu_threads, cfg.embedding.device, pipeline.options)
    ranges = ChunkFileRanges.from_entries(directory, previous.files)
    corpus = pipeline | "ReadNewFiles" >> ReadCorpusKeptClean(
        cfg, "retrieval", only=frozenset(f.path for f in new_files)
    )
    known = (
        pipeline
        | "ChunkFiles" >> beam.Create(range(len(ranges.paths)))
        | "SpreadChunkFiles" >> beam.Reshuffle()
        | "IndexedDocuments" >> beam.FlatMap(lambda n: first_chunk_doc_ids(ranges, n))
    )
    fresh = (
        {"document": corpus.documents | "ById" >> beam.Map(lambda d: (d.doc_id, d)), KNOWN: known}
        | "JoinIndexed" >> beam.CoGroupByKey()
        | "NotIndexed" >> beam.FlatMap(not_indexed).with_outputs("rejected", main="documents")
    )
    documents: beam.PCollection[Document] = fresh.documents
    first_file = max(file_number(path) for path in ranges.paths) + 1 if ranges.paths else 0
    written = chunk_and_embed(documents, cfg, tok, staging, threads, previous.num_chunks, first_file)
    all_rejected = (corpus.rejected, fresh.rejected, written.unusable) | "MergeRejected" >> beam.Flatten()
    rejected_files = all_rejected | "WriteRejected" >> WriteRejected(
        fileio.join(staging, REJECTED_STAGING), f"build-index-g{number:05d}"
    )
    tallies = stage_tallies(corpus, all_rejected, written, tok.pad_id)
    new_embeddings = beam.pvalue.AsList(written.embedding_files)
    appended = (
        pipeline
        | "OneWorker" >> beam.Create([None])
        | "AppendVectors"
        >> beam.Map(_append_vectors, new_embeddings, previous, directory, staging, cfg.index.recall_sample)
    )
    entries = (written.chunk_files, written.embedding_files) | "FileEntries" >> beam.Flatten()
    manifest = (
        entries
        | "GatherEntries" >> beam.combiners.ToList()
        | "AppendedManifest"
        >> beam.Map(
            _appended_manifest,
            beam.pvalue.AsSingleton(appended),
            beam.pvalue.AsDict(tallies),
            beam.pvalue.AsSingleton(written.precision),
            previous,
            new_files,
            cfg,
        )
    )
    in_place = _index_staged(previous) + [e.path for e in previous.files if not e.path.startswith("faiss/")]
    job.commit(manifest, staged=entries, staged_of=lambda m: in_place, after=(rejected_files,))
    manifest = job.run()
    if isinstance(manifest, IndexManifest):
        latest = manifest.generations[-1]
        log.info(
            "committed %s generation %d: %s chunks from %d files (chunk ids from %s); new vectors' %s = %.3f "
            "(the build measured %.3f)",
            directory,
            latest.number,
            f"{latest.num_chunks:,}",
            len(latest.inputs),
            f"{latest.first_chunk_id:,}",
            manifest.recall_at_k.measure,
            latest.new_vector_recall,
            manifest.recall_at_k.value,
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
