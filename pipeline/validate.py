"""`validate`: check an index or shard directory end to end against docs/design.md §4-5.

Every check is a function of one unit that reads the committed files themselves (never the
pipeline's memory): a listed file, a shard, a chunk file with the references into it, an
embedding file. The in-process check here and the Beam job (`pipeline.validate_job`) run the
same functions, each holding one unit at a time:

- every file a manifest lists: its size and sha256 (streamed, or while it is read below);
- index: each chunk file against the rules, the rows across the boundaries between chunk
  files (continuations), the document runs, each embedding file, then the faiss index
  against probes taken from the embedding files checked;
- shards: each shard; its neighbours (and, for `training_corpus: same`, the sequence's own
  chunks) become references grouped by the chunk file holding their chunk (on local disk
  here, a GroupByKey in the job), and each chunk file is read once to check them: tokens
  equal the chunk database, no neighbour from the sequence's documents.

With `sample` < 1, ceil(sample x count) shards, chunk files and embedding files are checked,
chosen by a hash of their file names (the same ones every time, at least one of each), plus
every chunk file the sampled shards reference; sizes and sha256 are still checked for every
listed file.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import posixpath
import tempfile
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline import fileio
from pipeline.chunkdb import chunk_arrays, in_file_order
from pipeline.faiss_index import load_index
from pipeline.index_shards import merge_shard_results
from schemas.arrow import (
    SHARD_METADATA_KEYS,
    SchemaVersionError,
    check_schema_version,
    read_shard_table,
    shard_column,
    tensor_column_to_numpy,
)
from schemas.manifest import (
    MANIFEST_FILE,
    FileEntry,
    IndexManifest,
    ShardEntry,
    ShardsManifest,
    VectorIndexManifest,
    read_manifest,
)

NORM_TOLERANCE = 1e-3
INDEX_PROBES = 64  # embeddings searched for themselves in the faiss index
REFERENCE_BLOCK = 65536  # references checked at a time against a chunk file
PROBLEMS_KEPT = 10  # problems of each kind a failed Beam job reports in full


class ValidationFailed(ValueError):
    """The directory breaks a contract; the message names the file and the problem. `kind`
    names the check that found it (a Beam job reports problems counted by kind)."""

    def __init__(self, message: str, kind: str | None = None):
        super().__init__(message)
        self.kind = kind


def _require(condition, message: str, kind: str | None = None) -> None:
    if not condition:
        raise ValidationFailed(message, kind)


def _kind(kind: str):
    """Problems a check raises are of this kind unless a step inside it named another."""

    def wrap(check):
        @functools.wraps(check)
        def run(*args, **kwargs):
            try:
                return check(*args, **kwargs)
            except ValidationFailed as problem:
                problem.kind = problem.kind or kind
                raise
            except SchemaVersionError as err:  # a problem of the data like any other
                raise ValidationFailed(str(err), kind) from None

        return run

    return wrap


# --- sampling ---------------------------------------------------------------------------------


def _name_hash(path: str) -> bytes:
    return hashlib.sha256(posixpath.basename(path).encode()).digest()


def sampled(entries: list, fraction: float) -> list:
    """The ceil(fraction x len) entries (at least one) whose file names hash lowest, in their
    own order: the same sample on every run, whatever else the directory holds."""
    if fraction >= 1 or not entries:
        return list(entries)
    count = max(1, math.ceil(fraction * len(entries) - 1e-9))  # 0.07 x 100 is 7.000000000000001
    chosen = set(sorted(range(len(entries)), key=lambda i: _name_hash(entries[i].path))[:count])
    return [entry for i, entry in enumerate(entries) if i in chosen]


# --- reading listed files ---------------------------------------------------------------------


def _manifest_problem(message: str) -> ValidationFailed:
    """What a missing, non-JSON or invalid manifest raises here (`read_manifest`'s `error`)."""
    return ValidationFailed(message, "manifest")


def _read_checked(directory: str, entry: FileEntry) -> bytes:
    """A listed file's bytes, after checking its size and sha256 against the manifest."""
    path = fileio.join(directory, entry.path)
    _require(fileio.exists(path), f"{path}: listed in the manifest but missing", "file")
    data = fileio.read_bytes(path)
    _require(len(data) == entry.bytes, f"{path}: {len(data)} bytes, manifest says {entry.bytes}", "file")
    _require(fileio.sha256_bytes(data) == entry.sha256, f"{path}: sha256 differs from the manifest", "file")
    return data


@_kind("file")
def check_listed_file(directory: str, entry: FileEntry) -> None:
    """Size and sha256 of a listed file, read block by block (never held whole)."""
    path = fileio.join(directory, entry.path)
    _require(fileio.exists(path), f"{path}: listed in the manifest but missing")
    digest, size = fileio.sha256_file(path)
    _require(size == entry.bytes, f"{path}: {size} bytes, manifest says {entry.bytes}")
    _require(digest == entry.sha256, f"{path}: sha256 differs from the manifest")


def _parquet(directory: str, entry: FileEntry) -> pa.Table:
    table = pq.read_table(pa.BufferReader(_read_checked(directory, entry)))
    _require(
        table.num_rows == entry.rows,
        f"{directory}/{entry.path}: {table.num_rows} rows, manifest says {entry.rows}",
        "file",
    )
    return table


class ChunkFiles:
    """The chunk files of an index directory, in chunk-id order: file f holds the dense ids
    starts[f] ... starts[f + 1] - 1 (checked against the rules by `check_chunk_file`)."""

    def __init__(self, directory: str, manifest: IndexManifest):
        self.directory = directory
        self.entries = in_file_order(manifest.files, "chunks")
        _require(self.entries, f"{directory}: manifest lists no chunk files", "manifest")
        self.starts = np.cumsum([0] + [entry.rows for entry in self.entries])

    @property
    def num_chunks(self) -> int:
        return int(self.starts[-1])

    def file_of(self, chunk_ids: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.starts, chunk_ids, side="right") - 1

    def path(self, number: int) -> str:
        return fileio.join(self.directory, self.entries[number].path)

    def read(self, number: int) -> dict:
        rows = chunk_arrays(_parquet(self.directory, self.entries[number]))
        return {
            "ids": rows["chunk_id"],
            "docs": rows["doc_id"],
            "positions": rows["position"],
            "tokens": rows["tokens"],
            "continuations": rows["continuation"],
        }


# --- what the checks need of each manifest (small and picklable: it travels to Beam workers) --


@dataclass(frozen=True)
class IndexFacts:
    directory: str
    chunk_tokens: int
    pad_id: int
    num_documents: int
    chunks: ChunkFiles
    embeddings: tuple  # the embedding files' entries, in chunk-id order
    embedding_starts: tuple  # embedding file e holds chunk ids from embedding_starts[e]
    dim: int  # the embeddings' width


@dataclass(frozen=True)
class ShardsFacts:
    directory: str
    sequence_tokens: int
    chunk_tokens: int
    neighbours: int
    pad_id: int
    same_corpus: bool
    metadata: tuple  # (key, value) every shard's schema metadata must hold
    chunks: ChunkFiles  # the chunk database the neighbours point into

    @property
    def chunks_per_sequence(self) -> int:
        return self.sequence_tokens // self.chunk_tokens


@dataclass(frozen=True)
class FaissFacts:
    directory: str
    nprobe: int | None
    num_vectors: int
    dim: int
    files: tuple  # (path, vectors, bytes) of index.faiss or of each shard, in chunk-id order
    shard_bytes: int | None

    @classmethod
    def of(cls, directory: str, manifest, num_vectors: int) -> FaissFacts:
        files = tuple((f.path, f.rows, f.bytes) for f in manifest.files if f.path.startswith("faiss/"))
        return cls(directory, manifest.nprobe, num_vectors, manifest.dim, files, manifest.shard_bytes)


# --- index checks -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ChunkFileEnds:
    """The first and last rows of a chunk file: what the check across its boundaries needs."""

    number: int
    first_doc: int
    first_position: int
    first_tokens: np.ndarray
    last_doc: int
    last_position: int
    last_continuation: np.ndarray


@dataclass(frozen=True)
class ChunkFileSummary:
    ends: ChunkFileEnds
    doc_starts: np.ndarray  # doc ids of the documents whose first chunk it holds


@_kind("chunk file")
def _check_chunk_rules(index: IndexFacts, number: int, rows: dict) -> ChunkFileSummary:
    """One chunk file against the rules, within the file (its first row is checked against
    the file before it by `check_chunk_boundaries`)."""
    path = f"{index.directory}/chunks file {number}"
    m, pad, start = index.chunk_tokens, index.pad_id, int(index.chunks.starts[number])
    ids, docs, positions, tokens = rows["ids"], rows["docs"], rows["positions"], rows["tokens"]
    continuations = rows["continuations"]
    _require(len(ids) > 0, f"{path}: holds no chunks")
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
    return ChunkFileSummary(ends, docs[positions == 0].copy())


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
        same_doc = after.first_doc == before.last_doc
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
    last = by_number.get(len(index.chunks.entries) - 1)
    _require(
        last is None or (last.last_continuation == pad).all(),
        f"{index.directory}: the last chunk's continuation is not padding",
    )


@_kind("documents")
def check_document_runs(index: IndexFacts, runs: int, distinct: int, files: int) -> None:
    """Each document is one run of chunks: as many runs as distinct documents starting them
    in the `files` chunk files checked against the rules, and, when those were all of them,
    as many as the manifest says."""
    _require(
        runs == distinct,
        f"{index.directory}: {runs} document runs of {distinct} documents (a document split into several runs)",
    )
    _require(
        files < len(index.chunks.entries) or runs == index.num_documents,
        f"{index.directory}: {runs} document runs for {index.num_documents} documents",
    )


@dataclass(frozen=True)
class Probes:
    ids: np.ndarray  # chunk ids
    vectors: np.ndarray  # their embeddings


@_kind("embeddings")
def check_embedding_file(index: IndexFacts, position: int, probes_per_file: int) -> Probes:
    """Embedding file `position` (in chunk-id order): one unit vector per chunk, in order;
    returns some of them to search the faiss index with."""
    entry, start = index.embeddings[position], index.embedding_starts[position]
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
    rows = np.linspace(0, len(ids) - 1, min(len(ids), probes_per_file)).astype(np.int64)
    return Probes(ids[rows], vectors[rows].copy())


@_kind("faiss index")
def check_faiss_index(faiss_index: FaissFacts, probes: list[Probes]) -> None:
    """The index (or each of its shards, one at a time, each within the shard size) holds the
    manifest's vectors, and the probes find themselves in it (shards' results merged by score)."""
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
            faiss_index.shard_bytes is None or size <= faiss_index.shard_bytes,
            f"{path}: {size} bytes, more than the shard size {faiss_index.shard_bytes}",
        )
        if vectors is not None:
            results.append(index.search(vectors, 10))
        del index
    if not results:
        return
    _, found = merge_shard_results(results, 10)
    _require(((found >= 0) & (found < n) | (found == -1)).all(), f"{directory}: index returns unknown ids")
    self_hits = np.mean([chunk_id in row for chunk_id, row in zip(ids, found)])
    _require(self_hits >= 0.5, f"{directory}: only {self_hits:.0%} of indexed vectors find themselves")


# --- shard checks -----------------------------------------------------------------------------

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


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The indexes starts[r] ... starts[r] + counts[r] - 1 of every r, concatenated."""
    within = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(starts, counts) + within


def _contains(docs: np.ndarray, starts: np.ndarray, counts: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """Per reference r: is wanted[r] among docs[starts[r] : starts[r] + counts[r]]?"""
    owner = np.repeat(np.arange(len(starts)), counts)
    hits = np.asarray(docs[_ranges(starts, counts)]) == wanted[owner]
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
        docs = doc_values[_ranges(doc_offsets[rows_here], counts)]
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
    present = ids >= 0
    _require(
        (ids < shards.chunks.num_chunks).all() and (present | (ids == -1)).all(),
        f"{path}: neighbour_ids point outside the chunk database",
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
def check_references(chunks: ChunkFiles, number: int, rows: dict, block: ReferenceBlock) -> None:
    """References into chunk file `number` (its `rows`): a neighbour's tokens are the chunk and
    its continuation and it is from none of the sequence's documents; a sequence's own chunks
    hold its tokens and their documents are among its doc_ids."""
    refs, values, docs = block.refs, block.values, block.docs
    m = rows["tokens"].shape[1]
    local = refs["chunk_id"] - int(chunks.starts[number])
    expected = np.concatenate([rows["tokens"][local], rows["continuations"][local]], axis=1)
    own = refs["own"]
    wrong = np.where(own, (values[:, :m] != expected[:, :m]).any(axis=1), (values != expected).any(axis=1))
    if wrong.any():
        first = np.flatnonzero(wrong)[0]
        what = "tokens differ from its chunks" if own[first] else "neighbour tokens differ from the chunk database"
        raise ValidationFailed(
            f"seq {refs['seq_id'][first]}: {what} (chunk {refs['chunk_id'][first]}, {chunks.path(number)})"
        )
    chunk_docs = rows["docs"][local]
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


def check_chunk_file(chunks: ChunkFiles, number: int, blocks, index: IndexFacts | None, sampled: bool):
    """Chunk file `number`, read once when it is sampled or referenced (`blocks` not None: the
    references into it): against the rules when `index` is the index being validated, and
    against the references; otherwise only its size and sha256 are checked. Yields its
    summary (rules checked) before the references are, so a caller that gathers problems
    keeps it for the checks across files."""
    if blocks is None and not sampled:
        check_listed_file(chunks.directory, chunks.entries[number])
        return
    rows = chunks.read(number)
    if index is not None:
        yield _check_chunk_rules(index, number, rows)
    for block in blocks or ():
        check_references(chunks, number, rows, block)


@_kind("shard")
def check_seq_ranges(ranges: list[tuple[int, int, str]]) -> None:
    """No sequence in two shards: (first seq_id, last seq_id, path) of each shard checked."""
    ranges = sorted(ranges)
    for (_, last, a), (first, _, b) in zip(ranges, ranges[1:]):
        _require(first > last, f"{a} and {b}: seq_id ranges overlap (a duplicate sequence?)")


# --- the plan: what to check, from the manifests ----------------------------------------------


@dataclass
class ValidationPlan:
    """What a validation reads, decided from the manifests (whose own checks it runs)."""

    path: str
    sample: float
    index_directory: str | None = None  # as given to `plan_validation`
    index: IndexFacts | None = None  # the index whose chunk files are checked by the rules
    shards: ShardsFacts | None = None
    faiss_index: FaissFacts | None = None
    chunks: ChunkFiles | None = None  # the chunk database read (the index's, or the shards')
    shard_entries: list = field(default_factory=list)  # shards checked
    sampled_chunk_files: list = field(default_factory=list)
    unsampled_chunk_files: list = field(default_factory=list)  # hashed unless a shard references one
    embedding_files: list = field(default_factory=list)  # positions in index.embeddings
    probes_per_file: int = INDEX_PROBES
    listed_files: list = field(default_factory=list)  # (directory, entry) checked by hash only
    lines: list = field(default_factory=list)  # what a passing validation prints

    @property
    def complete(self) -> bool:
        return self.sample >= 1


def _sample_note(sample: float, parts: list[str], listed: int) -> str:
    if sample >= 1:
        return ""
    return f" (a sample: {', '.join(parts)}; sizes and sha256 of all {listed} files)"


def _plan_index(plan: ValidationPlan, directory: str) -> None:
    manifest = fileio.committed_manifest(directory, IndexManifest, error=_manifest_problem)
    chunks = ChunkFiles(directory, manifest)
    _require(
        chunks.num_chunks == manifest.num_chunks,
        f"{directory}: {chunks.num_chunks} chunk rows, manifest says {manifest.num_chunks}",
        "manifest",
    )
    embeddings = in_file_order(manifest.files, "embeddings")
    embedded = int(sum(entry.rows for entry in embeddings))
    _require(
        embedded == manifest.num_chunks,
        f"{directory}: {embedded} embeddings for {manifest.num_chunks} chunks",
        "manifest",
    )
    plan.chunks = chunks
    starts = tuple(int(s) for s in np.cumsum([0] + [e.rows for e in embeddings]))
    plan.index = IndexFacts(
        directory,
        manifest.chunk_tokens,
        manifest.pad_id,
        manifest.num_documents,
        chunks,
        tuple(embeddings),
        starts,
        manifest.dim,
    )
    plan.faiss_index = FaissFacts.of(directory, manifest, manifest.num_chunks)
    chosen = {entry.path for entry in sampled(chunks.entries, plan.sample)}
    plan.sampled_chunk_files = [i for i, entry in enumerate(chunks.entries) if entry.path in chosen]
    plan.unsampled_chunk_files = [i for i, entry in enumerate(chunks.entries) if entry.path not in chosen]
    chosen = {entry.path for entry in sampled(embeddings, plan.sample)}
    plan.embedding_files = [i for i, entry in enumerate(embeddings) if entry.path in chosen]
    plan.probes_per_file = max(1, INDEX_PROBES // max(1, len(plan.embedding_files)))
    read = {entry.path for entry in chunks.entries} | chosen  # chunk files: see check_chunk_file
    plan.listed_files += [(directory, entry) for entry in manifest.files if entry.path not in read]
    note = _sample_note(
        plan.sample,
        [
            f"{len(plan.sampled_chunk_files)} of {len(chunks.entries)} chunk files "
            "(and any a sampled shard references)",
            f"{len(plan.embedding_files)} of {len(embeddings)} embedding files",
        ],
        len(manifest.files),
    )
    plan.lines.append(
        f"OK index {directory}{note}: {manifest.num_chunks} chunks from {manifest.num_documents} "
        f"documents, {manifest.index_factory}, {manifest.recall_at_k.summary()}"
    )


def _check_shard_totals(directory: str, manifest: ShardsManifest, chunks_per_sequence: int) -> None:
    """The manifest's totals against the sums of its shard entries (which `check_shard` holds
    each shard to)."""
    rows = sum(entry.rows for entry in manifest.shards)
    _require(
        rows == manifest.num_sequences,
        f"{directory}: {rows} rows in the shards, manifest says {manifest.num_sequences}",
        "manifest",
    )
    counts = [entry.neighbour_slots_filled for entry in manifest.shards]
    if manifest.neighbour_fill is None or None in counts:
        return
    filled, slots = sum(counts), rows * chunks_per_sequence * manifest.neighbours
    _require(
        abs(manifest.neighbour_fill - (filled / slots if slots else 1.0)) < 1e-9,
        f"{directory}: neighbour_fill {manifest.neighbour_fill} disagrees with the shards ({filled}/{slots})",
        "manifest",
    )


def _plan_shards(plan: ValidationPlan, directory: str, index_directory: str) -> None:
    manifest = fileio.committed_manifest(directory, ShardsManifest, error=_manifest_problem)
    index_path = fileio.join(index_directory, MANIFEST_FILE)
    index_bytes = fileio.read_bytes(index_path) if fileio.exists(index_path) else None
    index_manifest = read_manifest(index_bytes, index_path, IndexManifest, error=_manifest_problem)
    _require(
        fileio.sha256_bytes(index_bytes) == manifest.index_manifest_sha256,
        f"{directory}: built against a different index than {index_directory}",
        "manifest",
    )
    m = manifest.chunk_tokens
    _require(manifest.neighbour_tokens == 2 * m, f"{directory}: neighbour_tokens != 2 x chunk_tokens", "manifest")
    plan.chunks = plan.chunks or ChunkFiles(index_directory, index_manifest)
    plan.shards = ShardsFacts(
        directory,
        manifest.sequence_tokens,
        m,
        manifest.neighbours,
        manifest.pad_id,
        manifest.training_corpus == "same",
        tuple((key, str(getattr(manifest, key))) for key in SHARD_METADATA_KEYS),
        plan.chunks,
    )
    _check_shard_totals(directory, manifest, plan.shards.chunks_per_sequence)
    plan.shard_entries = sampled(manifest.shards, plan.sample)
    checked = {entry.path for entry in plan.shard_entries}
    plan.listed_files += [(directory, entry) for entry in manifest.shards if entry.path not in checked]
    L, k = plan.shards.chunks_per_sequence, manifest.neighbours
    rows = sum(entry.rows for entry in plan.shard_entries)
    counts = [entry.neighbour_slots_filled for entry in plan.shard_entries]
    filled = "" if None in counts else f"{sum(counts)}/{rows * L * k} neighbour slots filled, "
    total = len(manifest.shards)
    if plan.complete:
        head = f"OK shards {directory}: {rows} sequences in {total} shards"
    else:
        head = (
            f"OK shards {directory} (a sample: {len(plan.shard_entries)} of {total} shards and the chunk "
            f"files they reference; sizes and sha256 of all {total} shards): {rows} sequences in the sample"
        )
    plan.lines.append(
        f"{head}, {filled}no same-document neighbour, neighbour tokens equal the chunk "
        f"database; {manifest.neighbour_summary()}"
    )


def _plan_vector_index(plan: ValidationPlan, directory: str) -> None:
    manifest = fileio.committed_manifest(directory, VectorIndexManifest, error=_manifest_problem)
    plan.listed_files += [(directory, entry) for entry in manifest.files]
    plan.faiss_index = FaissFacts.of(directory, manifest, manifest.num_vectors)
    plan.lines.append(
        f"OK vector index {directory}: {manifest.num_vectors} vectors, {manifest.index_factory}, "
        f"{manifest.recall_at_k.measure} = {manifest.recall_at_k.value:.3f} at depth {manifest.nprobe}"
    )


def plan_validation(path: str, sample: float = 1.0, index_directory: str | None = None) -> ValidationPlan:
    """The plan for an index dir, a shards dir (its index: `index_directory`, by default the
    `index` beside it), or an output dir holding both; `sample` in (0, 1]."""
    if not 0 < sample <= 1:
        raise ValueError(f"sample {sample}: must be in (0, 1]")
    plan = ValidationPlan(path, sample, index_directory)
    manifest_path = fileio.join(path, MANIFEST_FILE)
    if fileio.exists(manifest_path):
        raw = fileio.committed_manifest(path, error=_manifest_problem)
        if "shards" in raw:
            index_directory = index_directory or posixpath.join(posixpath.dirname(path.rstrip("/")), "index")
            _plan_shards(plan, path, index_directory)
        elif "inputs" in raw:
            _plan_vector_index(plan, path)
        else:
            _plan_index(plan, path)
        return plan
    index, shards = fileio.join(path, "index"), fileio.join(path, "shards")
    found = [d for d in (index, shards) if fileio.exists(fileio.join(d, MANIFEST_FILE))]
    _require(found, f"{path}: no manifest.json here, nor in {path}/index or {path}/shards", "manifest")
    if index in found:
        _plan_index(plan, index)
    if shards in found:
        _plan_shards(plan, shards, index)
    return plan


# --- in-process ---------------------------------------------------------------------------------


class _References:
    """Per chunk file, on local disk: the reference blocks of every shard checked, appended
    (refs, their tokens [r, 2m], the doc ids), read back in blocks of REFERENCE_BLOCK."""

    def __init__(self, root: str, width: int):
        self.root, self.width, self.docs_written = root, width, {}

    def _path(self, number: int, kind: str) -> str:
        return os.path.join(self.root, f"{number}.{kind}")

    def add(self, number: int, block: ReferenceBlock) -> None:
        refs = block.refs.copy()
        refs["docs_start"] += self.docs_written.get(number, 0)
        for kind, array in (("refs", refs), ("values", block.values), ("docs", block.docs)):
            with open(self._path(number, kind), "ab") as f:
                f.write(np.ascontiguousarray(array).tobytes())
        self.docs_written[number] = self.docs_written.get(number, 0) + len(block.docs)

    def __contains__(self, number: int) -> bool:
        return number in self.docs_written

    def files(self) -> list[int]:
        return sorted(self.docs_written)

    def blocks(self, number: int):
        refs = np.memmap(self._path(number, "refs"), REFERENCE, "r")
        values = np.memmap(self._path(number, "values"), np.int32, "r").reshape(-1, self.width)
        docs = np.memmap(self._path(number, "docs"), np.int64, "r")
        for begin in range(0, len(refs), REFERENCE_BLOCK):
            yield ReferenceBlock(
                np.array(refs[begin : begin + REFERENCE_BLOCK]), np.array(values[begin : begin + REFERENCE_BLOCK]), docs
            )


def check_in_process(plan: ValidationPlan) -> list[str]:
    """Run the plan in this process, one unit at a time (references on local disk); raises
    ValidationFailed at the first problem, else returns the plan's lines."""
    for directory, entry in plan.listed_files:
        check_listed_file(directory, entry)
    with tempfile.TemporaryDirectory(prefix="ratrain-validate-") as scratch:
        references = _References(scratch, 2 * plan.shards.chunk_tokens if plan.shards else 0)
        ranges = []
        for entry in plan.shard_entries:
            result = check_shard(plan.shards, entry)
            for number, block in result.references.items():
                references.add(number, block)
            ranges.append((result.first_seq, result.last_seq, result.path))
        check_seq_ranges(ranges)
        summaries, chosen = [], set(plan.sampled_chunk_files)
        for number in sorted(chosen | set(plan.unsampled_chunk_files) | set(references.files())):
            blocks = references.blocks(number) if number in references else None
            summaries += check_chunk_file(plan.chunks, number, blocks, plan.index, number in chosen)
    if plan.index is not None:
        check_chunk_boundaries(plan.index, [s.ends for s in summaries])
        starts = np.concatenate([s.doc_starts for s in summaries]) if summaries else np.zeros(0, np.int64)
        check_document_runs(plan.index, len(starts), len(np.unique(starts)), len(summaries))
    probes = [check_embedding_file(plan.index, position, plan.probes_per_file) for position in plan.embedding_files]
    if plan.faiss_index is not None:
        check_faiss_index(plan.faiss_index, probes)
    return list(plan.lines)


def validate_index(directory: str) -> str:
    return check_in_process(plan_validation(directory))[0]


def validate_shards(directory: str, index_directory: str | None = None) -> str:
    return check_in_process(plan_validation(directory, index_directory=index_directory))[0]


def validate_path(path: str, sample: float = 1.0) -> list[str]:
    """Validate an index dir, a shards dir, or an output dir holding both, in this process."""
    return check_in_process(plan_validation(path, sample))


# --- problems, as a Beam job gathers them ------------------------------------------------------


@dataclass
class Problems:
    """Problems counted by kind, keeping the PROBLEMS_KEPT first of each in sorted order (the
    same report however the work was split)."""

    counts: dict = field(default_factory=dict)
    kept: dict = field(default_factory=dict)

    def add(self, kind: str, message: str) -> Problems:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        self.kept[kind] = sorted(self.kept.get(kind, []) + [message])[:PROBLEMS_KEPT]
        return self

    def merge(self, other: Problems) -> Problems:
        for kind, count in other.counts.items():
            self.counts[kind] = self.counts.get(kind, 0) + count
            self.kept[kind] = sorted(self.kept.get(kind, []) + other.kept[kind])[:PROBLEMS_KEPT]
        return self

    def verdict(self, path: str, passed_lines: list[str]) -> Verdict:
        return Verdict(not self.counts, tuple(self.report(path) if self.counts else passed_lines))

    def report(self, path: str) -> list[str]:
        """'FAILED path: 3 problems (2 reference, 1 file)' and one line per problem kept."""
        total = sum(self.counts.values())
        kinds = ", ".join(f"{count} {kind}" for kind, count in sorted(self.counts.items()))
        lines = [f"FAILED {path}: {total} problem{'s' if total != 1 else ''} ({kinds})"]
        for kind in sorted(self.counts):
            lines += [f"  {kind}: {message}" for message in self.kept[kind]]
            if self.counts[kind] > len(self.kept[kind]):
                lines.append(f"  {kind}: ... and {self.counts[kind] - len(self.kept[kind])} more")
        return lines


@dataclass(frozen=True)
class Verdict:
    passed: bool
    lines: tuple  # the plan's lines, or the report of the problems found
