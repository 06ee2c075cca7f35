"""The rules `validate` checks, one function per unit: chunk files (ids, continuations, document
runs, boundaries), embedding files, the faiss index, a shard and the references into the chunk
files (docs/design.md §4-5).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import faiss
import numpy as np
import pyarrow as pa

from pipeline.check.chunk_reads import ChunkRowsRead, read_row_groups, read_whole
from pipeline.check.facts import (
    ChunkFileChecked,
    ChunkFileEnds,
    ChunkFiles,
    ChunkFileSummary,
    ChunkFileUnit,
    EmbeddingFileUnit,
    FaissFacts,
    IndexFacts,
    Probes,
    ShardsFacts,
)
from pipeline.check.problems import ValidationFailed, _kind, _parquet, _read_checked, _require
from pipeline.chunks.chunk_files import ChunkRows
from pipeline.common import fileio
from pipeline.common.arrays import ranges_of
from pipeline.common.names import file_number
from pipeline.index.files import load_index, read_owners
from pipeline.index.routing import list_sizes
from pipeline.index.slices import merge_slice_results
from schemas.arrow import (
    check_schema_version,
    read_shard_table,
    shard_column,
    tensor_column_to_numpy,
)
from schemas.manifest import (
    Generation,
    ShardEntry,
)

NORM_TOLERANCE = 1e-3


@_kind("chunk file")
def _check_chunk_rules(index: IndexFacts, number: int, rows: ChunkRows) -> ChunkFileSummary:
    """One chunk file against the rules, within the file (its first row is checked against
    the file before it by `check_chunk_boundaries`)."""
    path = f"{index.directory}/chunks file {number}"
    m, pad, start = index.chunk_tokens, index.pad_id, int(index.chunks.starts[number])
    ids, docs, positions, tokens = rows.chunk_id, rows.doc_id, rows.position, rows.tokens
    continuations = rows.continuation
    _require(len(ids) > 0, f"{path}: holds no chunks")
    removed = docs[np.isin(docs, np.array(index.removed_doc_ids, np.int64))]
    _require(
        not len(removed),
        f"{path}: holds chunks of document {removed[:1].tolist()}, removed as a near-duplicate of an "
        "evaluation document",
    )
    _require(
        np.array_equal(ids, np.arange(start, start + len(ids))),
        f"{path}: chunk ids are not the dense run {start}..{start + len(ids) - 1}",
    )
    _require(tokens.shape[1] == m, f"{path}: chunks hold {tokens.shape[1]} tokens, not {m}")
    _require(not (tokens == pad).all(axis=1).any(), f"{path}: a chunk holds only padding")
    same_doc = docs[1:] == docs[:-1]  # each row with the one before it
    _require(
        np.array_equal(positions[1:], np.where(same_doc, positions[:-1] + 1, 0)),
        f"{path}: documents are not runs of chunks at positions 0, 1, 2, ...",
    )
    # a continuation is the next chunk of its document, or padding at its end
    expected = np.where(same_doc[:, None], tokens[1:], pad)
    bad = np.flatnonzero((continuations[:-1] != expected).any(axis=1))
    _require(
        len(bad) == 0,
        f"{path}: chunk {start + (bad[0] if len(bad) else 0)} continuation is "
        "not the next chunk of its document (or padding at its end)",
    )
    ends = ChunkFileEnds(
        number,
        int(docs[0]),
        int(positions[0]),
        tokens[0].copy(),
        int(docs[-1]),
        int(positions[-1]),
        continuations[-1].copy(),
    )
    live_starts = (positions == 0) & ~index.deleted.contains(ids)  # a replaced document's old run is deleted
    return ChunkFileSummary(ends, docs[live_starts].copy())


@_kind("chunk file")
def check_chunk_boundaries(index: IndexFacts, ends: list[ChunkFileEnds]) -> None:
    """The rows across each boundary between two chunk files that were both checked: the
    first file starts a document, runs go on across a boundary, each continuation is the next
    file's first chunk (or padding), the last chunk's continuation is padding."""
    by_number = {e.number: e for e in ends}
    pad = index.pad_id
    first = by_number.get(0)
    _require(
        first is None or first.first_position == 0,
        f"{index.directory}/chunks file 0: documents are not runs of chunks at positions 0, 1, 2, ...",
    )
    for number, after in sorted(by_number.items()):
        before = by_number.get(number - 1)
        if before is None:
            continue
        path = f"{index.directory}/chunks file {number}"
        # a generation's first file starts a document: an appended one may have the id of the last one before
        opens_generation = int(index.chunks.starts[number]) in index.generation_starts
        same_doc = after.first_doc == before.last_doc and not opens_generation
        _require(
            after.first_position == (before.last_position + 1 if same_doc else 0),
            f"{path}: documents are not runs of chunks at positions 0, 1, 2, ...",
        )
        _require(
            np.array_equal(
                before.last_continuation, after.first_tokens if same_doc else np.full_like(after.first_tokens, pad)
            ),
            f"{path}: chunk {int(index.chunks.starts[number]) - 1} continuation is not the next "
            "chunk of its document (or padding at its end)",
        )
    last = by_number.get(index.chunks.count - 1)
    _require(
        last is None or (last.last_continuation == pad).all(),
        f"{index.directory}: the last chunk's continuation is not padding",
    )


@_kind("documents")
def check_generations(directory: str, generations: list[Generation], chunks: ChunkFiles, num_documents: int) -> None:
    """An index's generations (none: an older manifest) follow each other: numbered 0, 1, …,
    each chunk-id range starting where the one before ended and at a chunk file's first row,
    together the manifest's chunks and documents."""
    if not generations:
        return
    _require(
        [g.number for g in generations] == list(range(len(generations))),
        f"{directory}: generations numbered {[g.number for g in generations]}",
        "manifest",
    )
    next_id = 0
    for generation in generations:
        _require(
            generation.first_chunk_id == next_id and next_id in chunks.starts,
            f"{directory}: generation {generation.number} starts at chunk id {generation.first_chunk_id}, "
            f"not at {next_id} or not at a chunk file's first row",
            "manifest",
        )
        next_id += generation.num_chunks
    _require(
        next_id == chunks.num_chunks and sum(g.num_documents for g in generations) == num_documents,
        f"{directory}: generations hold {next_id} chunks and {sum(g.num_documents for g in generations)} "
        f"documents, the manifest {chunks.num_chunks} and {num_documents}",
        "manifest",
    )


def check_document_runs(index: IndexFacts, runs: int, distinct: int, files: int) -> None:
    """Each document not deleted is one run of chunks: as many runs as distinct documents starting them
    in the `files` chunk files checked against the rules, and, when those were all of them,
    as many as the manifest says."""
    _require(
        runs == distinct,
        f"{index.directory}: {runs} document runs of {distinct} documents (a document split into several runs)",
    )
    _require(
        files < index.chunks.count or runs == index.num_documents,
        f"{index.directory}: {runs} document runs not deleted for {index.num_documents} documents not deleted",
    )


@_kind("embeddings")
def check_embedding_file(index: IndexFacts, unit: EmbeddingFileUnit, probes_per_file: int) -> Probes:
    """An embedding file: one unit vector per chunk, in order; returns some of them to search
    the faiss index with."""
    entry, start = unit.entry, unit.start
    where = f"{index.directory}/{entry.path}"
    table = _parquet(index.directory, entry)
    ids = table["chunk_id"].to_numpy()
    _require(
        np.array_equal(ids, np.arange(start, start + len(ids))),
        f"{where}: embeddings do not cover the chunks one to one, in order",
    )
    vectors = tensor_column_to_numpy(table["embedding"])
    _require(
        vectors.shape[1] == index.dim, f"{where}: embeddings of width {vectors.shape[1]}, manifest says {index.dim}"
    )
    norms = np.linalg.norm(vectors, axis=1)
    _require(
        np.isfinite(vectors).all() and (np.abs(norms - 1) < NORM_TOLERANCE).all(),
        f"{where}: embeddings are not finite unit vectors",
    )
    searchable = np.flatnonzero(~index.deleted.contains(ids))  # a deleted chunk is in no search
    rows = searchable[np.linspace(0, len(searchable) - 1, min(len(searchable), probes_per_file)).astype(np.int64)]
    return Probes(ids[rows], vectors[rows].copy())


@_kind("faiss index")
def check_faiss_index(faiss_index: FaissFacts, probes: list[Probes]) -> None:
    """The index (or each of its slices, one at a time, each within the slice size) holds the
    manifest's vectors, and the probes find themselves in it (slices' results merged by score)."""
    directory, n = faiss_index.directory, faiss_index.num_vectors
    listed = sum(rows for _, rows, _ in faiss_index.files)
    _require(listed == n, f"{directory}: the faiss files hold {listed} vectors, manifest says {n}")
    ids = np.concatenate([p.ids for p in probes]) if probes else np.zeros(0, np.int64)
    vectors = np.concatenate([p.vectors for p in probes]).astype(np.float32) if probes else None
    results = []
    for relative, rows, size in faiss_index.files:  # size: checked against the file with every hash
        path = fileio.join(directory, relative)
        try:
            index = load_index(path, faiss_index.nprobe)
        except RuntimeError as err:
            raise ValidationFailed(f"{path}: faiss cannot read it: {err}") from None
        _require(
            index.ntotal == rows and index.d == faiss_index.dim,
            f"{path}: holds {index.ntotal} x {index.d}, manifest says {rows} x {faiss_index.dim}",
        )
        _require(
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
    _require(
        ((found >= 0) & (found < faiss_index.num_ids) | (found == -1)).all(), f"{directory}: index returns unknown ids"
    )
    _require(
        not faiss_index.deleted.contains(found[found >= 0]).any(),
        f"{directory}: index returns a chunk of a deleted document",
    )
    self_hits = np.mean([chunk_id in row for chunk_id, row in zip(ids, found)])
    _require(self_hits >= 0.5, f"{directory}: only {self_hits:.0%} of indexed vectors find themselves")


def _check_list_owners(faiss_index: FaissFacts) -> None:
    """Slices by inverted lists: the quantizer holds no vectors, the owners name a slice for
    each of its lists, and every slice holds vectors only in the lists it owns (a query is
    sent only to the owner of each list it probes)."""
    quantizer_path, owners_path = (fileio.join(faiss_index.directory, p) for p in faiss_index.routing or ())
    quantizer, owner = load_index(quantizer_path), read_owners(owners_path)
    nlist = faiss.extract_index_ivf(quantizer).nlist
    _require(quantizer.ntotal == 0, f"{quantizer_path}: holds {quantizer.ntotal} vectors, should hold none")
    _require(
        len(owner) == nlist and owner.max(initial=-1) < len(faiss_index.files),
        f"{owners_path}: {len(owner)} owners of {nlist} lists, naming slices up to {owner.max(initial=-1)} "
        f"of {len(faiss_index.files)}",
    )
    numbers = [file_number(relative) for relative, _, _ in faiss_index.files]
    _require(
        numbers == list(range(len(numbers))), f"{faiss_index.directory}: slices numbered {numbers[:5]}…, not 0 … S-1"
    )
    for number, (relative, _, _) in enumerate(faiss_index.files):
        held = np.flatnonzero(list_sizes(load_index(fileio.join(faiss_index.directory, relative))))
        strays = held[owner[held] != number]
        _require(not len(strays), f"{relative}: holds vectors in lists {strays[:5].tolist()} it does not own")


REFERENCE = np.dtype(
    [("chunk_id", "<i8"), ("seq_id", "<i8"), ("own", "?"), ("docs_start", "<i8"), ("docs_count", "<i4")]
)


@dataclass(frozen=True)
class ReferenceBlock:
    """References into one chunk file: which chunk, which sequence, neighbour or the
    sequence's own chunk, where its doc ids are in `docs`; their tokens [r, 2m]; the doc ids."""

    refs: np.ndarray
    values: np.ndarray
    docs: np.ndarray


@dataclass(frozen=True)
class ShardResult:
    path: str
    first_seq: int
    last_seq: int
    references: dict = field(repr=False)  # chunk file number -> ReferenceBlock


def _contains(docs: np.ndarray, starts: np.ndarray, counts: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """Per reference r: is wanted[r] among docs[starts[r] : starts[r] + counts[r]]?"""
    owner = np.repeat(np.arange(len(starts)), counts)
    hits = np.asarray(docs[ranges_of(starts, counts)]) == wanted[owner]
    return np.bincount(owner, weights=hits, minlength=len(starts)) > 0


def _shard_references(
    shards: ShardsFacts,
    table: pa.Table,
    present: np.ndarray,
    ids: np.ndarray,
    neighbours: np.ndarray,
    tokens: np.ndarray,
) -> dict[int, ReferenceBlock]:
    """A shard's references, grouped by the chunk file holding their chunk."""
    m, pad, L = shards.chunk_tokens, shards.pad_id, shards.chunks_per_sequence
    seq_ids = table["seq_id"].to_numpy()
    doc_lists = table["doc_ids"].combine_chunks()
    doc_offsets = doc_lists.offsets.to_numpy()
    doc_values = doc_lists.values.to_numpy()
    row, j, slot = np.nonzero(present)
    chunk_id, value, own = ids[row, j, slot], neighbours[row, j, slot], np.zeros(len(row), bool)
    if shards.same_corpus:  # sequence s holds chunks s·L ... s·L + L - 1
        own_row, own_j = np.divmod(np.arange(len(seq_ids) * L), L)
        own_value = np.full((len(own_row), 2 * m), pad, np.int32)
        own_value[:, :m] = tokens[:, : L * m].reshape(-1, m)  # row-major: (own_row, own_j)
        row, chunk_id = np.concatenate([row, own_row]), np.concatenate([chunk_id, seq_ids[own_row] * L + own_j])
        value, own = np.concatenate([value, own_value]), np.concatenate([own, np.ones(len(own_row), bool)])
    numbers = shards.chunks.file_of(chunk_id)
    blocks = {}
    for number in np.unique(numbers):
        here = numbers == number
        rows_here = np.unique(row[here])
        counts = doc_offsets[rows_here + 1] - doc_offsets[rows_here]
        docs = doc_values[ranges_of(doc_offsets[rows_here], counts)]
        local_start = np.cumsum(counts) - counts
        where = np.searchsorted(rows_here, row[here])
        refs = np.zeros(int(here.sum()), REFERENCE)
        refs["chunk_id"], refs["seq_id"], refs["own"] = chunk_id[here], seq_ids[row[here]], own[here]
        refs["docs_start"], refs["docs_count"] = local_start[where], counts[where]
        blocks[int(number)] = ReferenceBlock(refs, value[here].astype(np.int32), docs.astype(np.int64))
    return blocks


@_kind("shard")
def check_shard(shards: ShardsFacts, entry: ShardEntry) -> ShardResult:
    """One shard: its bytes, schema metadata, rows, shapes, sequence ids, absent neighbours;
    returns its references for the chunk files to check."""
    n, m, k, pad, L = (
        shards.sequence_tokens,
        shards.chunk_tokens,
        shards.neighbours,
        shards.pad_id,
        shards.chunks_per_sequence,
    )
    path = fileio.join(shards.directory, entry.path)
    table = read_shard_table(pa.BufferReader(_read_checked(shards.directory, entry)))
    meta = {key.decode(): value.decode() for key, value in (table.schema.metadata or {}).items()}
    check_schema_version(meta.get("schema_version"), path)
    for key, value in shards.metadata:
        _require(meta.get(key) == value, f"{path}: metadata {key}={meta.get(key)} disagrees with the manifest")
    _require(table.num_rows == entry.rows, f"{path}: {table.num_rows} rows, manifest says {entry.rows}")
    seq_ids = table["seq_id"].to_numpy()
    tokens = shard_column(table, "tokens")
    neighbours = shard_column(table, "neighbours")
    ids = shard_column(table, "neighbour_ids")
    scores = shard_column(table, "neighbour_scores")
    _require(
        tokens.shape[1:] == (n + 1,) and neighbours.shape[1:] == (L, k, 2 * m) and ids.shape[1:] == (L, k),
        f"{path}: column shapes disagree with n={n} m={m} k={k}",
    )
    _require(len(seq_ids) > 0 and (np.diff(seq_ids) > 0).all(), f"{path}: seq_ids are not sorted and unique")
    _require(
        not shards.same_corpus or (seq_ids[0] >= 0 and (seq_ids[-1] + 1) * L <= shards.chunks.num_chunks),
        f"{path}: seq_ids point outside the chunk database (training_corpus: same)",
    )
    row_docs = table["doc_ids"].combine_chunks().flatten().to_numpy()
    removed = row_docs[np.isin(row_docs, np.array(shards.removed_doc_ids, np.int64))]
    _require(
        not len(removed),
        f"{path}: a sequence holds document {removed[:1].tolist()}, removed as a near-duplicate of an evaluation "
        "document",
    )
    present = ids >= 0
    _require(
        (ids < shards.chunks.num_chunks).all() and (present | (ids == -1)).all(),
        f"{path}: neighbour_ids point outside the chunk database",
    )
    _require(
        not shards.deleted.contains(ids[present]).any(),
        f"{path}: a neighbour is a chunk of a document deleted from the index",
    )
    if shards.same_corpus:
        own = (seq_ids[:, None] * L + np.arange(L)).ravel()
        _require(
            not shards.deleted.contains(own).any(),
            f"{path}: a sequence holds a chunk of a document deleted from the index (training_corpus: same)",
        )
    _require(
        (neighbours[~present] == pad).all() and (scores[~present] == 0).all(),
        f"{path}: an absent neighbour (id -1) is not padding",
    )
    filled = int(present.sum())
    _require(
        entry.neighbour_slots_filled in (None, filled),
        f"{path}: {filled} neighbour slots filled, manifest says {entry.neighbour_slots_filled}",
    )
    return ShardResult(
        path, int(seq_ids[0]), int(seq_ids[-1]), _shard_references(shards, table, present, ids, neighbours, tokens)
    )


@_kind("reference")
def check_references(chunks: ChunkFiles, unit: ChunkFileUnit, read: ChunkRowsRead, block: ReferenceBlock) -> None:
    """References into a chunk file (`read`: its rows they point at): a neighbour's tokens are
    the chunk and its continuation and it is from none of the sequence's documents; a
    sequence's own chunks hold its tokens and their documents are among its doc_ids."""
    refs, values, docs, rows = block.refs, block.values, block.docs, read.rows
    m = rows.tokens.shape[1]
    local = read.at[np.searchsorted(read.asked, refs["chunk_id"] - int(chunks.starts[unit.number]))]
    path = fileio.join(chunks.directory, unit.entry.path)
    _require(
        np.array_equal(rows.chunk_id[local], refs["chunk_id"]),
        f"{path} does not hold the chunk ids its manifest implies",
        "chunk file",
    )
    expected = np.concatenate([rows.tokens[local], rows.continuation[local]], axis=1)
    own = refs["own"]
    wrong = np.where(own, (values[:, :m] != expected[:, :m]).any(axis=1), (values != expected).any(axis=1))
    if wrong.any():
        first = np.flatnonzero(wrong)[0]
        what = "tokens differ from its chunks" if own[first] else "neighbour tokens differ from the chunk database"
        raise ValidationFailed(f"seq {refs['seq_id'][first]}: {what} (chunk {refs['chunk_id'][first]}, {path})")
    chunk_docs = rows.doc_id[local]
    inside = _contains(docs, refs["docs_start"], refs["docs_count"], chunk_docs)
    leak = ~own & inside
    if leak.any():
        first = np.flatnonzero(leak)[0]
        raise ValidationFailed(
            f"seq {refs['seq_id'][first]} has a neighbour from its own "
            f"document {chunk_docs[first]} (chunk {refs['chunk_id'][first]})"
        )
    missing = own & ~inside
    if missing.any():
        first = np.flatnonzero(missing)[0]
        raise ValidationFailed(
            f"seq {refs['seq_id'][first]}: doc_ids miss document {chunk_docs[first]}, which it holds"
        )


def check_chunk_file(chunks: ChunkFiles, unit: ChunkFileUnit, blocks, index: IndexFacts | None):
    """A chunk file, read once: whole and against the rules when it is sampled (and `index` is
    the index being validated), else only the row groups the references (`blocks`, iterable
    twice, or None) point into; then against the references. Yields what it read (with the
    summary) before the references are checked, so a caller that gathers problems keeps it for
    the checks across files."""
    if unit.sampled:
        read = read_whole(chunks.directory, unit.entry)
    elif blocks:
        start = int(chunks.starts[unit.number])
        local = np.unique(np.concatenate([block.refs["chunk_id"] for block in blocks]) - start)
        _require(
            local[0] >= 0 and local[-1] < unit.entry.rows,
            f"{fileio.join(chunks.directory, unit.entry.path)}: references outside the file",
            "reference",
        )
        read = read_row_groups(chunks.directory, unit.entry, local)
    else:
        return
    rules = index is not None and unit.sampled
    summary = _check_chunk_rules(index, unit.number, read.rows) if rules else None
    yield ChunkFileChecked(read.bytes_read, summary)
    for block in blocks or ():
        check_references(chunks, unit, read, block)


@_kind("shard")
def check_seq_ranges(ranges: list[tuple[int, int, str]]) -> None:
    """No sequence in two shards: (first seq_id, last seq_id, path) of each shard checked."""
    ranges = sorted(ranges)
    for (_, last, a), (first, _, b) in zip(ranges, ranges[1:]):
        _require(first > last, f"{a} and {b}: seq_id ranges overlap (a duplicate sequence?)")
