"""What one worker process holds, stage by stage, as a function of the config and the corpus size.

An estimate from the code's own sizes (docs/scale.md's memory model prints it at two scales, and
`--dry-run --corpus-chunks N` for yours): every term is something a step holds at once, so the
largest stage says how much memory a worker process needs. Terms that change with the corpus are
marked (one sample file's share of the training sample shrinks as it grows); all others are
fixed by the config. Process sizes were measured on the local runner; the two-level training
steps' rows by benchmarks/index_training.py --sample-files.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipeline.chunks.chunking import BUCKET_BITS
from pipeline.index.factory import (
    choose_index_factory,
    estimated_bytes,
    ivf_lists,
)
from pipeline.index.files import READ_BATCH
from pipeline.index.slices import vectors_per_slice
from pipeline.jobs.memory_commit import FILE_ENTRY, commit_steps
from pipeline.jobs.memory_slices import block_bytes, piece_bytes, piece_step, slice_steps
from pipeline.jobs.memory_training import training_steps
from pipeline.retrieve.refresh import QUERY_BLOCK, NewVectors, refresh_budget
from pipeline.retrieve.search import CANDIDATE, SEQUENCES_PER_SEARCH
from schemas.backends import get_backend
from schemas.config import PipelineConfig
from schemas.file_table import TABLE_ROW_GROUP
from schemas.shard_columns import row_bytes

MB = 2**20
SDK_PROCESS = 400 * MB  # a Beam SDK process with pyarrow, numpy and tokenizers (210-440 MB measured)
ENCODER = 600 * MB  # torch and a MiniLM-sized encoder on top of it, batches included
ROW_OVERHEAD = 250  # bytes of Python objects around one row held as a Python object
PARQUET_ROW_GROUP = 128 * MB  # what pyarrow decodes at once from a Parquet input (writers' usual row group)
BYTES_PER_TOKEN = 4  # of English text, for a corpus size given in bytes
GZIP_RATIO = 3.5  # text compresses about this much
SEARCH_BATCH = 4096  # queries searched at once, with their candidates
PART_PATH = 200  # a filled part as gathered for the merge: (file number, path) as Python objects
APPEND_SHARE = 0.1  # an append of this share of the corpus, for the change step's new vectors


@dataclass(frozen=True)
class Corpus:
    chunks: int
    documents: int

    @classmethod
    def of(cls, chunks: float, documents: float | None = None) -> Corpus:
        """`documents` defaults to one per ten chunks (web pages of ~640 tokens)."""
        chunks = int(chunks)
        return cls(chunks, int(documents) if documents else max(1, chunks // 10))

    @classmethod
    def from_input_bytes(cls, sizes: dict[str, int], chunk_tokens: int) -> Corpus:
        """From the sizes of the input files: ~4 bytes of text per token, gzip ~3.5x."""
        text = sum(size * (GZIP_RATIO if path.endswith(".gz") else 1) for path, size in sizes.items())
        return cls.of(max(1, text / BYTES_PER_TOKEN / chunk_tokens))


def _runtime_held(backend: str) -> dict[str, int]:
    """The backend's runtime beside the torch encoder the check keeps (schemas/backends.py;
    nothing for torch itself)."""
    held = get_backend(backend).runtime_bytes
    return {f"{backend} runtime": held} if held else {}


def _change_steps(
    factory: str,
    *,
    dim: int,
    held: str,
    held_bytes: float,
    sliced: bool,
    new_codes: float,
    slices: int,
    file_rows: int,
    auto_grows: list[int],
) -> list[tuple]:
    """An append's and a delete's steps (pipeline/build_index/change_faiss.py). One index file:
    one worker holds it and every new vector's code. Slices: each new file encoded on its own
    (as a fill), a slice's new codes from a run of new files assembled into a piece, a worker
    per slice holding it, one of its pieces at a time and, when it is cut, its cut parts; then
    one step numbers the cut parts and writes the list owners."""
    trained = estimated_bytes(factory, 0, dim)
    per_vector = estimated_bytes(factory, 1, dim) - trained
    if not sliced:
        new = f"the new vectors' codes (an append of {APPEND_SHARE:.0%} of the corpus)"
        return [("index: change (append, delete)", {held: held_bytes, new: new_codes}, [0, 1])]
    lists = ivf_lists(factory) or 0
    new_vectors = int(new_codes / per_vector)
    new_files = math.ceil(new_vectors / file_rows)
    piece = piece_bytes(new_vectors, files=new_files, slices=slices, per_vector=per_vector)
    block = block_bytes(new_vectors, files=new_files, slices=slices, per_vector=per_vector)
    grown = (1 + APPEND_SHARE) * held_bytes
    return [
        (
            "index: change: encode one new embeddings file",
            {"trained index": trained, f"codes of {file_rows:,} vectors": file_rows * per_vector},
            auto_grows,
        ),
        piece_step(
            f"index: change: assemble one piece of a slice's new codes (an append of {APPEND_SHARE:.0%})",
            trained=trained,
            piece=piece,
            block=block,
            auto_grows=auto_grows,
        ),
        (
            "index: change one slice (append, delete)",
            {
                f"{held}, grown by its new codes (an append of {APPEND_SHARE:.0%})": grown,
                "its lists' spare room as they grow": grown,
                "its cut parts, when it outgrows the slice size": grown,
                "one piece of its new codes read": piece,
            },
            [],
        ),
        (
            "index: change: number cut pieces, write list owners",
            {
                f"list owners ({lists:,} lists), before and after": 2 * 4 * lists,
                f"a changed slice's file entries (of {slices:,} slices)": slices * FILE_ENTRY,
            },
            [*auto_grows[:1], 1],
        ),
    ]


def stage_memory(cfg: PipelineConfig, corpus: Corpus, dim: int = 384) -> list[dict]:
    """[{stage, bytes, terms: {what: bytes}, grows: [terms that grow with the corpus]}], one entry
    per step, for one worker process."""
    m, rows, C, D = cfg.chunk_tokens, cfg.chunk_file_rows, corpus.chunks, corpus.documents
    chunk_row = 2 * m * 4 + ROW_OVERHEAD  # tokens + continuation
    per_bucket = math.ceil(D / 2**BUCKET_BITS)
    factory = cfg.index.type if cfg.index.type != "auto" else choose_index_factory(C, dim, cfg.index.memory_budget)
    # index.type auto: the lists (up to 2^20) and the codes follow the corpus size and the budget
    auto_grows = [0, 1] if cfg.index.type == "auto" else []
    index_bytes = estimated_bytes(factory, C, dim)
    # merged and searched by slice: IVF indexes only, as the build does
    if cfg.index.slice_bytes is not None and ivf_lists(factory) and index_bytes > cfg.index.slice_bytes:
        slices = math.ceil(C / vectors_per_slice(factory, dim, cfg.index.slice_bytes))
        held, held_bytes, held_grows = f"one index slice (of {slices:,})", cfg.index.slice_bytes, []
    else:
        held, held_bytes, held_grows, slices = f"the whole index ({C:,} vectors)", index_bytes, [0], 0
    per_vector = estimated_bytes(factory, 1, dim) - estimated_bytes(factory, 0, dim)
    shard_row = row_bytes(cfg.shard_dims) + ROW_OVERHEAD
    shard = cfg.rows_per_shard() * shard_row
    stages = [
        ("read", {"one record, or a Parquet row group": PARQUET_ROW_GROUP}, []),
        (
            "chunk: one doc-id bucket",
            {
                f"{per_bucket:,} documents' tokens and chunks": per_bucket * math.ceil(C / D) * (m * 4 + chunk_row),
                f"bucket offsets (2^{BUCKET_BITS})": 2**BUCKET_BITS * 64,
            },
            [0],
        ),
        ("write chunks", {f"one file: {rows:,} chunk rows and their Parquet bytes": rows * chunk_row * 2}, []),
        (
            "embed",
            {
                "encoder": ENCODER,
                **_runtime_held(cfg.embedding.backend),
                f"one file: {rows:,} embeddings and their Parquet bytes": rows * (dim * 4 + ROW_OVERHEAD) * 2,
                # embedded where the chunk file is written: the file's chunk rows are held too
                f"the chunk file's {rows:,} rows": rows * chunk_row,
            },
            [],
        ),
        *training_steps(
            factory,
            C=C,
            dim=dim,
            clustering=cfg.index.clustering,
            accelerator=cfg.index.accelerator is not None,
            auto=cfg.index.type == "auto",
            file_rows=rows,
        ),
        (
            "index: fill one embeddings file",
            {
                "trained index": estimated_bytes(factory, 0, dim),
                f"codes of {rows:,} vectors": rows * per_vector,
                "a read batch": READ_BATCH * dim * 4,
            },
            auto_grows,
        ),
        *(
            [
                # the parts' lists are appended to the index's: faiss's arrays double as they grow,
                # so up to the index again in spare room (measured: benchmarks/scale_rehearsal.py)
                ("index: merge", {held: held_bytes, "its lists' spare room as they grow": held_bytes}, [0, 1]),
                # the merge is given every part's path (never its codes or list sizes)
                (
                    "index: gather the filled parts (one index file)",
                    {f"(file number, path) of {math.ceil(C / rows):,} filled parts": math.ceil(C / rows) * PART_PATH},
                    [0],
                ),
            ]
            if held_grows
            else slice_steps(
                factory,
                chunks=C,
                dim=dim,
                slices=slices,
                file_rows=rows,
                neighbours=cfg.neighbours,
                recall_sample=cfg.index.recall_sample,
                auto_grows=auto_grows,
            )
        ),
        *_change_steps(
            factory,
            dim=dim,
            held=held,
            held_bytes=held_bytes,
            sliced=not held_grows,
            new_codes=APPEND_SHARE * C * per_vector,
            slices=slices,
            file_rows=rows,
            auto_grows=auto_grows,
        ),
        (
            "build-shards: search",
            {
                f"{held}, one copy per process": held_bytes,
                # a sliced index routes queries by its quantizer: one copy per process, shared by every round
                **(
                    {
                        "the quantizer and list owners, one copy per process": estimated_bytes(factory, 0, dim)
                        + 4 * (ivf_lists(factory) or 0)
                    }
                    if not held_grows
                    else {}
                ),
                f"{SEARCH_BATCH:,} queries and candidates": SEARCH_BATCH * (dim * 4 + 64 * 12),
                # over its own chunks, the search reads its queries' embeddings file (`FileQueries`)
                **(
                    {
                        f"the queries' file: {rows:,} embeddings and their Parquet bytes": rows
                        * (dim * 4 + ROW_OVERHEAD)
                        * 2
                    }
                    if cfg.training_corpus == "same"
                    else {}
                ),
            },
            held_grows or auto_grows[1:],  # sliced: the quantizer follows the lists `auto` picks
        ),
        *_candidate_step(cfg),
        ("build-shards: join one chunk file", {f"tokens and continuations of {rows:,} chunks": rows * chunk_row}, []),
        (
            "build-shards: write one shard",
            {
                # assembled where it is written: 7 shards' worth at 1,024 rows, the same at 4x the corpus
                # (tracemalloc in the scale rehearsal's workers, docs/scale.md; native allocators not counted)
                "the shard's grouped input as received (the data channel's bytes and Beam's copy)": 2 * shard,
                "its neighbour blocks decoded and joined": 2 * shard,
                "its rows, their columns stacked and the Arrow bytes": 3 * shard,
            },
            [],
        ),
    ]
    stages.append(_refresh_step(cfg, C, dim, shard_row, ivf_lists(factory)))
    stages.extend(commit_steps(cfg, C, APPEND_SHARE))
    out = []
    for name, terms, growing in stages:
        total = SDK_PROCESS + sum(terms.values())
        out.append(
            {
                "stage": name,
                "bytes": int(total),
                "terms": {k: int(v) for k, v in terms.items()},
                "grows_with_corpus": [list(terms)[i] for i in growing],
            }
        )
    return out


def _refresh_step(cfg: PipelineConfig, chunks: float, dim: int, shard_row: int, lists: int | None) -> tuple:
    """A refresh's shards of one chunk file, after an append of APPEND_SHARE (`_RefreshShards`):
    the new vectors held whole (they grow with the change; a change beyond the workers' memory
    (index.min_ram), else a slice, else index.memory_budget for an index in one file, is built
    whole instead: `refresh_budget`), the
    file's chunks and embeddings,
    one shard's rows as stored and refreshed, a row group of the refreshed commit's shard
    entries, and its queries' exact search among the new vectors, a block at a time."""
    m, rows, R = cfg.chunk_tokens, cfg.chunk_file_rows, cfg.rows_per_shard()
    queries = R * cfg.sequence_tokens // m
    shards = math.ceil(chunks / (queries or 1))
    new = (
        f"the new vectors' embeddings, slot values and, with an IVF index, its trained lists holding them (an "
        f"append of {APPEND_SHARE:.0%} of the corpus; at most index.min_ram, else a slice, else index.memory_budget: "
        "a larger change is built whole)"
    )
    return (
        "build-shards: refresh one chunk file's shards",
        {
            new: min(
                NewVectors.held_bytes(int(APPEND_SHARE * chunks), dim, m, lists),
                refresh_budget(cfg.index),
            ),
            f"the chunk file's {rows:,} doc ids and tokens, and its embeddings": rows * (8 + m * 4 + dim * 4) * 2,
            f"one shard's {R:,} rows, stored and refreshed": 2 * R * shard_row,
            # looked up by number a row group of the file table at a time (`EntriesByNumber`)
            f"a row group ({TABLE_ROW_GROUP:,}) of the refreshed commit's shard entries": (
                min(shards, TABLE_ROW_GROUP) * FILE_ENTRY
            ),
            # faiss's flat search scores blocks of at most 4,096 queries x 1,024 vectors
            f"its {queries:,} queries, {QUERY_BLOCK:,} at a time searched among the new vectors": (
                queries * dim * 4 + min(QUERY_BLOCK, 4096) * 1024 * 4
            ),
        },
        [0],  # the new vectors up to the budget
    )


def _candidate_step(cfg: PipelineConfig) -> list[tuple]:
    """With dedupe_neighbours: the token keys of one chunk file's candidates, which arrive as
    one block per search batch and are handled a block at a time (`_CandidateTokens`)."""
    if not cfg.dedupe_neighbours:
        return []
    rows, L = cfg.chunk_file_rows, cfg.sequence_tokens // cfg.chunk_tokens
    block = SEQUENCES_PER_SEARCH * L * cfg.neighbour_candidates  # hits of a search batch, all in one file at most
    return [
        (
            "build-shards: candidate tokens of one chunk file",
            {
                f"tokens and a token key of {rows:,} chunks": rows * (cfg.chunk_tokens * 4 + 8),
                f"one block of at most {block:,} candidates, and its sorted copy": block * CANDIDATE.itemsize * 2,
            },
            [],
        )
    ]


def largest(stages: list[dict]) -> dict:
    return max(stages, key=lambda s: s["bytes"])


def estimate(cfg: PipelineConfig, chunks: float | None = None, documents: float | None = None) -> dict:
    """What `--dry-run` prints: the corpus size assumed (given, or from the sizes of a local
    retrieval corpus's files: a listing, no content read; a dry run contacts no remote store),
    each step's bytes per worker process, and the largest."""
    from pipeline.common.models import embedding_dim
    from pipeline.corpus.parse import match_corpus

    if chunks:
        corpus, source = Corpus.of(chunks, documents), "given"
    elif any("://" in path for path in cfg.retrieval_corpus.paths):
        return {"corpus": "unknown: pass --corpus-chunks (a dry run lists no remote files)"}
    else:
        files = match_corpus(cfg.retrieval_corpus)
        corpus = Corpus.from_input_bytes({f.path: f.size for f in files}, cfg.chunk_tokens)
        source = f"from {len(files):,} input files (~{BYTES_PER_TOKEN} bytes per token)"
    stages = stage_memory(cfg, corpus, embedding_dim(cfg.embedding.model) or 384)
    return {
        "corpus": {"chunks": corpus.chunks, "documents": corpus.documents, "source": source},
        "per_worker_process": stages,
        "largest": largest(stages)["stage"],
    }
