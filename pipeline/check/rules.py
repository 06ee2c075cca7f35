"""The index rules `validate` checks, one function per unit: chunk files (ids, continuations,
document runs, boundaries), generations, embedding files, the faiss index (docs/design.md §4-5).
A shard and the references into the chunk files are `pipeline.check.shard_rules`.
"""

from __future__ import annotations

import faiss
import numpy as np

from pipeline.check.facts import (
    ChunkFileEnds,
    ChunkFileSummary,
    EmbeddingFileUnit,
    FaissFacts,
    IndexFacts,
    Probes,
)
from pipeline.check.problems import ValidationFailed, checked_parquet, of_kind, require
from pipeline.chunks.chunk_files import ChunkFileRanges, ChunkRows
from pipeline.common import fileio
from pipeline.common.errors import ChecksumMismatch
from pipeline.common.names import file_number
from pipeline.index.files import load_index, read_owners
from pipeline.index.routing import list_sizes
from pipeline.index.slices import merge_slice_results
from schemas.arrow import tensor_column_to_numpy
from schemas.manifest import Generation

NORM_TOLERANCE = 1e-3


@of_kind("chunk file")
def check_chunk_rules(index: IndexFacts, number: int, rows: ChunkRows) -> ChunkFileSummary:
    """One chunk file against the rules, within the file (its first row is checked against
    the file before it by `check_chunk_boundaries`)."""
    path = f"{index.directory}/chunks file {number}"
    m, pad, start = index.chunk_tokens, index.pad_id, index.chunks.start(number)
    ids, docs, positions, tokens = rows.chunk_id, rows.doc_id, rows.position, rows.tokens
    continuations = rows.continuation
    require(len(ids) > 0, f"{path}: holds no chunks")
    removed = docs[np.isin(docs, np.array(index.removed_doc_ids, np.int64))]
    require(
        not len(removed),
        f"{path}: holds chunks of document {removed[:1].tolist()}, removed as a near-duplicate of an "
        "evaluation document",
    )
    require(
        np.array_equal(ids, np.arange(start, start + len(ids))),
        f"{path}: chunk ids are not the dense run {start}..{start + len(ids) - 1}",
    )
    require(tokens.shape[1] == m, f"{path}: chunks hold {tokens.shape[1]} tokens, not {m}")
    require(not (tokens == pad).all(axis=1).any(), f"{path}: a chunk holds only padding")
    same_doc = docs[1:] == docs[:-1]  # each row with the one before it
    require(
        np.array_equal(positions[1:], np.where(same_doc, positions[:-1] + 1, 0)),
        f"{path}: documents are not runs of chunks at positions 0, 1, 2, ...",
    )
    # a continuation is the next chunk of its document, or padding at its end
    expected = np.where(same_doc[:, None], tokens[1:], pad)
    bad = np.flatnonzero((continuations[:-1] != expected).any(axis=1))
    require(
        len(bad) == 0,
        f"{path}: chunk {start + (bad[0] if len(bad) else 0)} continuation is "
        "not the next chunk of its document (or padding at its end)",
    )
    ends = ChunkFileEnds(
        number=number,
        first_doc=int(docs[0]),
        first_position=int(positions[0]),
        first_tokens=tokens[0].copy(),
        last_doc=int(docs[-1]),
        last_position=int(positions[-1]),
        last_continuation=continuations[-1].copy(),
    )
    live_starts = (positions == 0) & ~index.deleted.contains(ids)  # a replaced document's old run is deleted
    return ChunkFileSummary(ends, docs[live_starts].copy())


@of_kind("chunk file")
def check_chunk_boundaries(index: IndexFacts, ends: list[ChunkFileEnds]) -> None:
    """The rows across each boundary between two chunk files that were both checked: the
    first file starts a document, runs go on across a boundary, each continuation is the next
    file's first chunk (or padding), the last chunk's continuation is padding."""
    by_number = {e.number: e for e in ends}
    pad = index.pad_id
    first = by_number.get(0)
    require(
        first is None or first.first_position == 0,
        f"{index.directory}/chunks file 0: documents are not runs of chunks at positions 0, 1, 2, ...",
    )
    for number, after in sorted(by_number.items()):
        before = by_number.get(number - 1)
        if before is None:
            continue
        path = f"{index.directory}/chunks file {number}"
        # a generation's first file starts a document: an appended one may have the id of the last one before
        opens_generation = index.chunks.start(number) in index.generation_starts
        same_doc = after.first_doc == before.last_doc and not opens_generation
        require(
            after.first_position == (before.last_position + 1 if same_doc else 0),
            f"{path}: documents are not runs of chunks at positions 0, 1, 2, ...",
        )
        require(
            np.array_equal(
                before.last_continuation, after.first_tokens if same_doc else np.full_like(after.first_tokens, pad)
            ),
            f"{path}: chunk {index.chunks.start(number) - 1} continuation is not the next "
            "chunk of its document (or padding at its end)",
        )
    last = by_number.get(index.chunks.num_files - 1)
    require(
        last is None or (last.last_continuation == pad).all(),
        f"{index.directory}: the last chunk's continuation is not padding",
    )


@of_kind("documents")
def check_generations(
    directory: str, generations: list[Generation], chunks: ChunkFileRanges, num_documents: int
) -> None:
    """An index's generations (none: an older manifest) follow each other: numbered 0, 1, …,
    each chunk-id range starting where the one before ended and at a chunk file's first row,
    together the manifest's chunks and documents."""
    if not generations:
        return
    require(
        [g.number for g in generations] == list(range(len(generations))),
        f"{directory}: generations numbered {[g.number for g in generations]}",
        "manifest",
    )
    next_id = 0
    for generation in generations:
        require(
            generation.first_chunk_id == next_id and chunks.starts_a_file(next_id),
            f"{directory}: generation {generation.number} starts at chunk id {generation.first_chunk_id}, "
            f"not at {next_id} or not at a chunk file's first row",
            "manifest",
        )
        next_id += generation.num_chunks
    require(
        next_id == chunks.num_chunks and sum(g.num_documents for g in generations) == num_documents,
        f"{directory}: generations hold {next_id} chunks and {sum(g.num_documents for g in generations)} "
        f"documents, the manifest {chunks.num_chunks} and {num_documents}",
        "manifest",
    )


def check_document_runs(index: IndexFacts, runs: int, distinct: int, files: int) -> None:
    """Each document not deleted is one run of chunks: as many runs as distinct documents starting them
    in the `files` chunk files checked against the rules, and, when those were all of them,
    as many as the manifest says."""
    require(
        runs == distinct,
        f"{index.directory}: {runs} document runs of {distinct} documents (a document split into several runs)",
    )
    require(
        files < index.chunks.num_files or runs == index.num_documents,
        f"{index.directory}: {runs} document runs not deleted for {index.num_documents} documents not deleted",
    )


@of_kind("embeddings")
def check_embedding_file(index: IndexFacts, unit: EmbeddingFileUnit, probes_per_file: int) -> Probes:
    """An embedding file: one unit vector per chunk, in order; returns some of them to search
    the faiss index with."""
    entry, start = unit.entry, unit.start
    where = f"{index.directory}/{entry.path}"
    table = checked_parquet(index.directory, entry)
    ids = table["chunk_id"].to_numpy()
    require(
        np.array_equal(ids, np.arange(start, start + len(ids))),
        f"{where}: embeddings do not cover the chunks one to one, in order",
    )
    vectors = tensor_column_to_numpy(table["embedding"])
    require(
        vectors.shape[1] == index.dim, f"{where}: embeddings of width {vectors.shape[1]}, manifest says {index.dim}"
    )
    norms = np.linalg.norm(vectors, axis=1)
    require(
        np.isfinite(vectors).all() and (np.abs(norms - 1) < NORM_TOLERANCE).all(),
        f"{where}: embeddings are not finite unit vectors",
    )
    searchable = np.flatnonzero(~index.deleted.contains(ids))  # a deleted chunk is in no search
    rows = searchable[np.linspace(0, len(searchable) - 1, min(len(searchable), probes_per_file)).astype(np.int64)]
    return Probes(ids[rows], vectors[rows].copy())


@of_kind("faiss index")
def check_faiss_index(faiss_index: FaissFacts, probes: list[Probes]) -> None:
    """The index (or each of its slices, one at a time, each within the slice size) holds the
    manifest's vectors, and the probes find themselves in it (slices' results merged by score)."""
    directory, n = faiss_index.directory, faiss_index.num_vectors
    listed = sum(rows for _, rows, _ in faiss_index.files)
    require(listed == n, f"{directory}: the faiss files hold {listed} vectors, manifest says {n}")
    ids = np.concatenate([p.ids for p in probes]) if probes else np.zeros(0, np.int64)
    vectors = np.concatenate([p.vectors for p in probes]).astype(np.float32) if probes else None
    results = []
    for relative, rows, size in faiss_index.files:  # size: checked against the file with every hash
        path = fileio.join(directory, relative)
        try:
            index = load_index(path, faiss_index.nprobe, sha256=faiss_index.sha256[relative])
        except ChecksumMismatch as err:
            raise ValidationFailed(str(err)) from None
        except RuntimeError as err:
            raise ValidationFailed(f"{path}: faiss cannot read it: {err}") from None
        require(
            index.ntotal == rows and index.d == faiss_index.dim,
            f"{path}: holds {index.ntotal} x {index.d}, manifest says {rows} x {faiss_index.dim}",
        )
        require(
            faiss_index.slice_bytes is None or size <= faiss_index.slice_bytes,
            f"{path}: {size} bytes, more than the slice size {faiss_index.slice_bytes}",
        )
        if vectors is not None:
            results.append(index.search(vectors, 10))
        del index
    if faiss_index.routing is not None:
        _check_list_owners(faiss_index)
    if not results:
        return
    _, found = merge_slice_results(results, 10)
    require(
        ((found >= 0) & (found < faiss_index.num_ids) | (found == -1)).all(), f"{directory}: index returns unknown ids"
    )
    require(
        not faiss_index.deleted.contains(found[found >= 0]).any(),
        f"{directory}: index returns a chunk of a deleted document",
    )
    self_hits = np.mean([chunk_id in row for chunk_id, row in zip(ids, found)])
    require(self_hits >= 0.5, f"{directory}: only {self_hits:.0%} of indexed vectors find themselves")


def _check_list_owners(faiss_index: FaissFacts) -> None:
    """Slices by inverted lists: the quantizer holds no vectors, the owners name a slice for
    each of its lists, and every slice holds vectors only in the lists it owns (a query is
    sent only to the owner of each list it probes)."""
    quantizer_relative, owners_relative = faiss_index.routing or ("", "")
    quantizer_path, owners_path = (fileio.join(faiss_index.directory, p) for p in (quantizer_relative, owners_relative))
    quantizer = load_index(quantizer_path, sha256=faiss_index.sha256[quantizer_relative])
    owner = read_owners(owners_path)
    nlist = faiss.extract_index_ivf(quantizer).nlist
    require(quantizer.ntotal == 0, f"{quantizer_path}: holds {quantizer.ntotal} vectors, should hold none")
    require(
        len(owner) == nlist and owner.max(initial=-1) < len(faiss_index.files),
        f"{owners_path}: {len(owner)} owners of {nlist} lists, naming slices up to {owner.max(initial=-1)} "
        f"of {len(faiss_index.files)}",
    )
    numbers = [file_number(relative) for relative, _, _ in faiss_index.files]
    require(
        numbers == list(range(len(numbers))), f"{faiss_index.directory}: slices numbered {numbers[:5]}…, not 0 … S-1"
    )
    for number, (relative, _, _) in enumerate(faiss_index.files):
        path = fileio.join(faiss_index.directory, relative)
        held = np.flatnonzero(list_sizes(load_index(path, sha256=faiss_index.sha256[relative])))
        strays = held[owner[held] != number]
        require(not len(strays), f"{relative}: holds vectors in lists {strays[:5].tolist()} it does not own")
