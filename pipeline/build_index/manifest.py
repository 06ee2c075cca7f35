"""The one place an index's manifest is made, for each way a job changes an index directory:
built from scratch (`built_manifest`, generation 0), its faiss files rebuilt from the committed
embeddings (`faiss_rebuilt_manifest`), or a next generation appended and deleted
(`next_generation_manifest`); and the `index` command's (`vector_index_manifest`). Each runs in
the job's last step, from what the job wrote.
"""

from __future__ import annotations

from pipeline.build_index.change_faiss import Changed
from pipeline.build_index.files import index_counters, index_entries
from pipeline.chunks.deleted import DeletedDocument
from pipeline.common.models import fingerprint_path, resolve_model
from pipeline.index.build_info import BuildInfo
from pipeline.jobs.entry_pieces import sorted_entries
from pipeline.jobs.job import Tokenization
from pipeline.jobs.reuse import CorpusChanges
from schemas.config import PipelineConfig
from schemas.manifest import CREATED_BY, Fingerprint, Generation, IndexManifest, VectorIndexManifest
from schemas.measures import PrecisionCheck

NEWEST_GENERATION_CHUNKS = "newest_generation_chunks"  # a counter: the chunks the last change added


def _chunk_rows(totals: dict[str, dict[str, int]]) -> int:
    """The chunks in the chunk files written (`EntryTotals` of the staged entries)."""
    return totals.get("chunks", {}).get("rows", 0)


def built_manifest(
    totals, info: BuildInfo, *, tallies, precision, files_read, cfg: PipelineConfig, tok: Tokenization, threads
) -> IndexManifest:
    """Generation 0: the chunk, embedding and sources files written (their entries go to the
    commit as pieces; `totals` sums them), the faiss files built."""
    files = sorted_entries(index_entries(info))
    num_chunks = _chunk_rows(totals)
    num_documents = tallies.get("documents_chunked", 0)
    return IndexManifest(
        config_hash=cfg.index_hash(),
        embed_config_hash=cfg.embed_hash(),
        encoding_config_hash=cfg.encoding_hash(),
        generations=[
            Generation(
                number=0,
                inputs=sorted(files_read, key=lambda f: f.path),
                first_chunk_id=0,
                num_chunks=num_chunks,
                num_documents=num_documents,
            )
        ],
        tokenizer=Fingerprint(name=tok.name, fingerprint=fingerprint_path(tok.path)),
        embedding_model=Fingerprint(
            name=cfg.embedding.model, fingerprint=fingerprint_path(resolve_model(cfg.embedding.model))
        ),
        encoder_threads=threads,
        embedding_precision=precision,
        num_documents=num_documents,
        num_chunks=num_chunks,
        chunk_tokens=cfg.chunk_tokens,
        pad_id=tok.pad_id,
        files=files,
        counters=dict(sorted({**tallies, **index_counters(info)}.items())),
        created_by=CREATED_BY,
        **info.vector_index(),
    )


def faiss_rebuilt_manifest(info: BuildInfo, *, previous: IndexManifest, index_hash: str) -> IndexManifest:
    """`previous` (its fields) with new faiss files: only `index.*` changed, the chunks and
    embeddings stay (the commit keeps the previous commit's entries but its faiss files,
    `KeptEntries`)."""
    earlier = {k: v for k, v in previous.counters.items() if not k.startswith("index_")}
    return IndexManifest.model_validate(
        {
            **previous.model_dump(mode="json"),
            "config_hash": index_hash,
            "files": sorted_entries(index_entries(info)),
            "file_table": None,
            "counters": dict(sorted({**earlier, **index_counters(info)}.items())),
            "created_by": CREATED_BY,
            **info.vector_index(),
        }
    )


def vector_index_manifest(info: BuildInfo, *, config_hash: str, inputs: list[dict]) -> VectorIndexManifest:
    """The `index` command's: a faiss index over embedding files `inputs` (path and bytes)."""
    return VectorIndexManifest(
        config_hash=config_hash,
        num_vectors=info.num_vectors,
        inputs=inputs,
        files=index_entries(info),
        counters=index_counters(info),
        created_by=CREATED_BY,
        **info.vector_index(),
    )


def next_generation_manifest(
    totals,
    changed: Changed,
    *,
    deleted_now: list[DeletedDocument],
    tallies: dict[str, int],
    precision: PrecisionCheck,
    previous: IndexManifest,
    previous_sha256: str,
    changes: CorpusChanges,
    cfg: PipelineConfig,
) -> IndexManifest:
    """The next generation of `previous` (its fields; its manifest's sha256 is
    `previous_sha256`): its entries the faiss files changed (the new files' go to the commit as
    pieces, `totals` summing them; the previous commit's others stay, `KeptEntries`), the
    generation's documents, chunks and deletions counted, counters summed."""
    num_chunks = _chunk_rows(totals)
    deleted_chunks = sum(d.num_chunks for d in deleted_now)
    generation = Generation(
        number=len(previous.generations),
        based_on=previous_sha256,
        inputs=changes.to_read,
        removed_inputs=changes.gone,
        first_chunk_id=previous.num_chunks,
        num_chunks=num_chunks,
        num_documents=tallies.get("documents_chunked", 0),
        deleted_documents=len(deleted_now),
        deleted_chunks=deleted_chunks,
        new_vector_recall=changed.recall.value if changed.recall.sample_size else None,
        embedding_precision=precision if num_chunks else None,
    )
    earlier = [*previous.generations[:-1], previous.generations[-1].model_copy(update={"timings": previous.timings})]
    counters = dict(previous.counters)
    this_job = {
        **tallies,
        "index_vectors_added": changed.vectors + changed.removed - (previous.num_chunks - previous.deleted_chunks),
    }
    for name, count in this_job.items():
        counters[name] = counters.get(name, 0) + count
    counters[NEWEST_GENERATION_CHUNKS] = num_chunks  # what this job's throughput counts
    return previous.model_copy(
        update={
            "config_hash": cfg.index_hash(),
            "embed_config_hash": cfg.embed_hash(),
            "generations": [*earlier, generation],
            "num_chunks": previous.num_chunks + num_chunks,
            "num_documents": previous.num_documents + generation.num_documents,
            "deleted_documents": previous.deleted_documents + len(deleted_now),
            "deleted_chunks": previous.deleted_chunks + deleted_chunks,
            "files": sorted_entries(changed.files),
            "file_table": None,
            "counters": dict(sorted(counters.items())),
            "timings": None,
        }
    )
