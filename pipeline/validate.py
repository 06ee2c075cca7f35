"""`validate`: check an index or shard directory end to end against DESIGN §4-5.

Every check reads the committed files themselves (never the pipeline's memory), one file at a
time, so memory stays bounded however large the directories are:

- index: chunk files in chunk-id order (continuations checked across file boundaries),
  embedding files, then the faiss index against a sample of the embeddings;
- shards: each shard once; every neighbour (and, for `training_corpus: same`, every chunk of
  the sequence itself) becomes a reference filed on local disk under the chunk file that
  holds its chunk; then each chunk file is read once and its references are checked in
  blocks: tokens equal the chunk database, no neighbour from the sequence's documents.
"""
from __future__ import annotations

import hashlib
import json
import os
import posixpath
import tempfile

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from pipeline import fileio
from pipeline.chunkdb import ChunkFileRanges, in_file_order
from pipeline.index import load_index
from schemas.arrow import SHARD_METADATA_KEYS, check_schema_version, tensor_column_to_numpy
from schemas.manifest import FileEntry, IndexManifest, ShardsManifest, VectorIndexManifest

NORM_TOLERANCE = 1e-3
INDEX_PROBES = 64        # embeddings searched for themselves in the faiss index
REFERENCE_BLOCK = 65536  # references checked at a time against a chunk file


class ValidationFailed(ValueError):
    """The directory breaks a contract; the message names the file and the problem."""


def _require(condition, message: str) -> None:
    if not condition:
        raise ValidationFailed(message)


def _manifest(directory: str) -> tuple[dict, bytes]:
    path = fileio.join(directory, fileio.MANIFEST)
    _require(fileio.exists(path), f"{path}: missing (the stage never committed)")
    data = fileio.read_bytes(path)
    return json.loads(data), data


def _read_checked(directory: str, entry: FileEntry) -> bytes:
    """A listed file's bytes, after checking its size and sha256 against the manifest."""
    path = fileio.join(directory, entry.path)
    _require(fileio.exists(path), f"{path}: listed in the manifest but missing")
    data = fileio.read_bytes(path)
    _require(len(data) == entry.bytes, f"{path}: {len(data)} bytes, manifest says {entry.bytes}")
    _require(fileio.sha256_bytes(data) == entry.sha256, f"{path}: sha256 differs from the manifest")
    return data


def _check_streamed(directory: str, entry: FileEntry) -> None:
    """Size and sha256 of a listed file, read block by block (for the large faiss files)."""
    path = fileio.join(directory, entry.path)
    _require(fileio.exists(path), f"{path}: listed in the manifest but missing")
    digest, size = hashlib.sha256(), 0
    with fileio.open_read(path) as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
            size += len(block)
    _require(size == entry.bytes, f"{path}: {size} bytes, manifest says {entry.bytes}")
    _require(digest.hexdigest() == entry.sha256, f"{path}: sha256 differs from the manifest")


def _parquet(directory: str, entry: FileEntry) -> pa.Table:
    table = pq.read_table(pa.BufferReader(_read_checked(directory, entry)))
    _require(table.num_rows == entry.rows, f"{directory}/{entry.path}: {table.num_rows} rows, "
             f"manifest says {entry.rows}")
    return table


class ChunkFiles:
    """The chunk files of an index directory, in chunk-id order: file f holds the dense ids
    starts[f] ... starts[f + 1] - 1 (checked by `validate_index`)."""

    def __init__(self, directory: str, manifest: IndexManifest):
        self.directory = directory
        self.entries = in_file_order(manifest.files, "chunks")
        _require(self.entries, f"{directory}: manifest lists no chunk files")
        self.ranges = ChunkFileRanges.from_entries(directory, self.entries)
        self.starts = np.asarray(self.ranges.starts)

    def file_of(self, chunk_ids: np.ndarray) -> np.ndarray:
        return self.ranges.files_of(chunk_ids)

    def read(self, number: int) -> dict:
        table = _parquet(self.directory, self.entries[number])
        return {"ids": table["chunk_id"].to_numpy(), "docs": table["doc_id"].to_numpy(),
                "positions": table["position"].to_numpy(),
                "tokens": tensor_column_to_numpy(table["tokens"]),
                "continuations": tensor_column_to_numpy(table["continuation"])}


def _check_chunk_file(directory: str, number: int, rows: dict, start: int, previous: dict | None,
                      m: int, pad: int) -> np.ndarray:
    """One chunk file against the rules, given the last row of the file before it; returns
    the doc ids of the documents that start in it."""
    path = f"{directory}/chunks file {number}"
    ids, docs, positions, tokens = rows["ids"], rows["docs"], rows["positions"], rows["tokens"]
    _require(np.array_equal(ids, np.arange(start, start + len(ids))),
             f"{path}: chunk ids are not the dense run {start}..{start + len(ids) - 1}")
    _require(tokens.shape[1] == m, f"{path}: chunks hold {tokens.shape[1]} tokens, not {m}")
    _require(not (tokens == pad).all(axis=1).any(), f"{path}: a chunk holds only padding")
    # each row with the one before it (the previous file's last row for the first)
    prev_docs = np.concatenate([[previous["docs"]] if previous else [-1], docs[:-1]])
    prev_positions = np.concatenate([[previous["positions"]] if previous else [-1], positions[:-1]])
    same_doc = docs == prev_docs
    _require(np.array_equal(positions, np.where(same_doc, prev_positions + 1, 0)),
             f"{path}: documents are not runs of chunks at positions 0, 1, 2, ...")
    # a continuation is the next chunk of its document, or padding at its end
    continuations = rows["continuations"]
    expected = np.full_like(continuations, pad)
    expected[:-1][same_doc[1:]] = tokens[1:][same_doc[1:]]
    bad = np.flatnonzero((continuations[:-1] != expected[:-1]).any(axis=1))
    if previous is not None:
        _require(np.array_equal(previous["continuation"], tokens[0] if same_doc[0] else np.full(m, pad)),
                 f"{path}: chunk {start - 1} continuation is not the next chunk of its document "
                 "(or padding at its end)")
    _require(len(bad) == 0, f"{path}: chunk {start + (bad[0] if len(bad) else 0)} continuation is "
             "not the next chunk of its document (or padding at its end)")
    return docs[positions == 0]


def validate_index(directory: str) -> str:
    raw, _ = _manifest(directory)
    check_schema_version(raw.get("schema_version"), fileio.join(directory, fileio.MANIFEST))
    manifest = IndexManifest.model_validate(raw)
    m, pad = manifest.chunk_tokens, manifest.pad_id
    chunk_files = ChunkFiles(directory, manifest)
    n = int(chunk_files.starts[-1])
    _require(n == manifest.num_chunks, f"{directory}: {n} chunk rows, manifest says {manifest.num_chunks}")
    previous, starts = None, []
    for number in range(len(chunk_files.entries)):
        rows = chunk_files.read(number)
        starts.append(_check_chunk_file(directory, number, rows, int(chunk_files.starts[number]),
                                        previous, m, pad))
        previous = {key: rows[key][-1] for key in ("docs", "positions")}
        previous["continuation"] = rows["continuations"][-1]
    _require(previous is None or (previous["continuation"] == pad).all(),
             f"{directory}: the last chunk's continuation is not padding")
    starts = np.concatenate(starts)  # one int64 per document
    _require(len(starts) == manifest.num_documents and len(np.unique(starts)) == len(starts),
             f"{directory}: {len(starts)} document runs for {manifest.num_documents} documents "
             "(a document split into several runs?)")

    probes = np.linspace(0, n - 1, min(n, INDEX_PROBES)).astype(np.int64)
    probe_vectors = np.zeros((len(probes), manifest.dim), np.float32)
    covered = 0
    for entry in in_file_order(manifest.files, "embeddings"):
        table = _parquet(directory, entry)
        ids = table["chunk_id"].to_numpy()
        _require(np.array_equal(ids, np.arange(covered, covered + len(ids))),
                 f"{directory}/{entry.path}: embeddings do not cover the chunks one to one, in order")
        vectors = tensor_column_to_numpy(table["embedding"])
        _require(vectors.shape[1] == manifest.dim, f"{directory}/{entry.path}: dim {vectors.shape[1]}")
        norms = np.linalg.norm(vectors, axis=1)
        _require(np.isfinite(vectors).all() and (np.abs(norms - 1) < NORM_TOLERANCE).all(),
                 f"{directory}/{entry.path}: embeddings are not finite unit vectors")
        here = (probes >= covered) & (probes < covered + len(ids))
        probe_vectors[here] = vectors[probes[here] - covered]
        covered += len(ids)
    _require(covered == n, f"{directory}: {covered} embeddings for {n} chunks")

    for entry in manifest.files:
        if not entry.path.startswith(("chunks/", "embeddings/")):
            _check_streamed(directory, entry)
    index = load_index(fileio.join(directory, "faiss", "index.faiss"), manifest.nprobe)
    _require(index.ntotal == n and index.d == manifest.dim,
             f"{directory}: faiss index holds {index.ntotal} x {index.d}, expected {n} x {manifest.dim}")
    _, found = index.search(probe_vectors, 10)
    _require(((found >= 0) & (found < n) | (found == -1)).all(), f"{directory}: index returns unknown ids")
    self_hits = np.mean([sid in row for sid, row in zip(probes, found)])
    _require(self_hits >= 0.5, f"{directory}: only {self_hits:.0%} of indexed vectors find themselves")
    return (f"OK index {directory}: {n} chunks from {manifest.num_documents} documents, "
            f"{manifest.index_factory}, {manifest.recall_at_k.measure} = {manifest.recall_at_k.value:.3f}")


def validate_vector_index(directory: str) -> str:
    """A stand-alone `index` output: manifest, file hashes, and the index itself."""
    raw, _ = _manifest(directory)
    check_schema_version(raw.get("schema_version"), fileio.join(directory, fileio.MANIFEST))
    manifest = VectorIndexManifest.model_validate(raw)
    for entry in manifest.files:
        _check_streamed(directory, entry)
    index = load_index(fileio.join(directory, "faiss", "index.faiss"), manifest.nprobe)
    _require(index.ntotal == manifest.num_vectors and index.d == manifest.dim,
             f"{directory}: faiss index holds {index.ntotal} x {index.d}, manifest says "
             f"{manifest.num_vectors} x {manifest.dim}")
    return (f"OK vector index {directory}: {manifest.num_vectors} vectors, {manifest.index_factory}, "
            f"{manifest.recall_at_k.measure} = {manifest.recall_at_k.value:.3f} at depth {manifest.nprobe}")


REFERENCE = np.dtype([("chunk_id", "<i8"), ("seq_id", "<i8"), ("own", "?"),
                      ("docs_start", "<i8"), ("docs_count", "<i4")])


class _References:
    """Per chunk file, on local disk: references (which chunk, which sequence, neighbour or the
    sequence's own chunk, where its doc ids are), their tokens [2m], and the doc ids."""

    def __init__(self, root: str, width: int):
        self.root, self.width, self.docs_written = root, width, {}

    def _path(self, number: int, kind: str) -> str:
        return os.path.join(self.root, f"{number}.{kind}")

    def add(self, number: int, refs: np.ndarray, values: np.ndarray, docs: np.ndarray) -> None:
        refs = refs.copy()
        refs["docs_start"] += self.docs_written.get(number, 0)
        for kind, array in (("refs", refs), ("values", values.astype(np.int32)), ("docs", docs)):
            with open(self._path(number, kind), "ab") as f:
                f.write(np.ascontiguousarray(array).tobytes())
        self.docs_written[number] = self.docs_written.get(number, 0) + len(docs)

    def files(self) -> list[int]:
        return sorted(self.docs_written)

    def blocks(self, number: int):
        """(refs, values [r, 2m], docs) in blocks of REFERENCE_BLOCK references."""
        refs = np.memmap(self._path(number, "refs"), REFERENCE, "r")
        values = np.memmap(self._path(number, "values"), np.int32, "r").reshape(-1, self.width)
        docs = np.memmap(self._path(number, "docs"), np.int64, "r")
        for begin in range(0, len(refs), REFERENCE_BLOCK):
            yield (np.array(refs[begin:begin + REFERENCE_BLOCK]),
                   np.array(values[begin:begin + REFERENCE_BLOCK]), docs)


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The indexes starts[r] ... starts[r] + counts[r] - 1 of every r, concatenated."""
    within = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(starts, counts) + within


def _contains(docs: np.ndarray, starts: np.ndarray, counts: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """Per reference r: is wanted[r] among docs[starts[r] : starts[r] + counts[r]]?"""
    owner = np.repeat(np.arange(len(starts)), counts)
    hits = np.asarray(docs[_ranges(starts, counts)]) == wanted[owner]
    return np.bincount(owner, weights=hits, minlength=len(starts)) > 0


def _file_references(table: pa.Table, chunk_files: ChunkFiles, references: _References,
                     present: np.ndarray, ids: np.ndarray, neighbours: np.ndarray,
                     tokens: np.ndarray, same_corpus: bool, m: int, pad: int) -> None:
    """File a shard's references under the chunk files holding their chunks."""
    seq_ids = table["seq_id"].to_numpy()
    doc_lists = table["doc_ids"].combine_chunks()
    doc_offsets = doc_lists.offsets.to_numpy()
    doc_values = doc_lists.values.to_numpy()
    rows_n, L, k = ids.shape
    row, j, slot = np.nonzero(present)
    chunk_id, value, own = ids[row, j, slot], neighbours[row, j, slot], np.zeros(len(row), bool)
    if same_corpus:  # sequence s holds chunks s·L ... s·L + L - 1
        own_row, own_j = np.divmod(np.arange(rows_n * L), L)
        own_value = np.full((len(own_row), 2 * m), pad, np.int32)
        own_value[:, :m] = tokens[:, :L * m].reshape(-1, m)  # row-major: (own_row, own_j)
        row, chunk_id = np.concatenate([row, own_row]), np.concatenate([chunk_id, seq_ids[own_row] * L + own_j])
        value, own = np.concatenate([value, own_value]), np.concatenate([own, np.ones(len(own_row), bool)])
    numbers = chunk_files.file_of(chunk_id)
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
        references.add(int(number), refs, value[here], docs.astype(np.int64))


def _check_references(chunk_files: ChunkFiles, references: _References, m: int) -> None:
    for number in references.files():
        chunks = chunk_files.read(number)
        start = int(chunk_files.starts[number])
        path = fileio.join(chunk_files.directory, chunk_files.entries[number].path)
        for refs, values, docs in references.blocks(number):
            local = refs["chunk_id"] - start
            expected = np.concatenate([chunks["tokens"][local], chunks["continuations"][local]], axis=1)
            own = refs["own"]
            wrong = np.where(own, (values[:, :m] != expected[:, :m]).any(axis=1),
                             (values != expected).any(axis=1))
            if wrong.any():
                first = np.flatnonzero(wrong)[0]
                what = "tokens differ from its chunks" if own[first] else "neighbour tokens differ from the chunk database"
                raise ValidationFailed(f"seq {refs['seq_id'][first]}: {what} (chunk {refs['chunk_id'][first]}, {path})")
            chunk_docs = chunks["docs"][local]
            inside = _contains(docs, refs["docs_start"], refs["docs_count"], chunk_docs)
            leak = ~own & inside
            if leak.any():
                first = np.flatnonzero(leak)[0]
                raise ValidationFailed(f"seq {refs['seq_id'][first]} has a neighbour from its own "
                                       f"document {chunk_docs[first]} (chunk {refs['chunk_id'][first]})")
            missing = own & ~inside
            if missing.any():
                first = np.flatnonzero(missing)[0]
                raise ValidationFailed(f"seq {refs['seq_id'][first]}: doc_ids miss document "
                                       f"{chunk_docs[first]}, which it holds")


def validate_shards(directory: str, index_directory: str | None = None) -> str:
    raw, _ = _manifest(directory)
    check_schema_version(raw.get("schema_version"), fileio.join(directory, fileio.MANIFEST))
    manifest = ShardsManifest.model_validate(raw)
    index_directory = index_directory or posixpath.join(posixpath.dirname(directory.rstrip("/")), "index")
    index_raw, index_bytes = _manifest(index_directory)
    _require(fileio.sha256_bytes(index_bytes) == manifest.index_manifest_sha256,
             f"{directory}: built against a different index than {index_directory}")
    chunk_files = ChunkFiles(index_directory, IndexManifest.model_validate(index_raw))
    n, m, k, pad = manifest.sequence_tokens, manifest.chunk_tokens, manifest.neighbours, manifest.pad_id
    L = n // m
    _require(manifest.neighbour_tokens == 2 * m, f"{directory}: neighbour_tokens != 2 x chunk_tokens")
    seq_ranges, rows_total, filled, slots = [], 0, 0, 0
    with tempfile.TemporaryDirectory(prefix="ratrain-validate-") as scratch:
        references = _References(scratch, 2 * m)
        for entry in manifest.shards:
            path = fileio.join(directory, entry.path)
            table = ipc.open_file(pa.BufferReader(_read_checked(directory, entry))).read_all()
            meta = {key.decode(): value.decode() for key, value in (table.schema.metadata or {}).items()}
            check_schema_version(meta.get("schema_version"), path)
            for key in SHARD_METADATA_KEYS[1:]:
                _require(meta.get(key) == str(getattr(manifest, key)),
                         f"{path}: metadata {key}={meta.get(key)} disagrees with the manifest")
            _require(table.num_rows == entry.rows, f"{path}: {table.num_rows} rows, manifest says {entry.rows}")
            seq_ids = table["seq_id"].to_numpy()
            tokens = tensor_column_to_numpy(table["tokens"])
            neighbours = tensor_column_to_numpy(table["neighbours"])
            ids = tensor_column_to_numpy(table["neighbour_ids"])
            scores = tensor_column_to_numpy(table["neighbour_scores"])
            _require(tokens.shape[1:] == (n + 1,) and neighbours.shape[1:] == (L, k, 2 * m)
                     and ids.shape[1:] == (L, k), f"{path}: column shapes disagree with n={n} m={m} k={k}")
            _require(len(seq_ids) > 0 and (np.diff(seq_ids) > 0).all(), f"{path}: seq_ids are not sorted and unique")
            seq_ranges.append((int(seq_ids[0]), int(seq_ids[-1]), path))
            present = ids >= 0
            _require((ids < chunk_files.starts[-1]).all() and (present | (ids == -1)).all(),
                     f"{path}: neighbour_ids point outside the chunk database")
            _require((neighbours[~present] == pad).all() and (scores[~present] == 0).all(),
                     f"{path}: an absent neighbour (id -1) is not padding")
            _file_references(table, chunk_files, references, present, ids, neighbours, tokens,
                             manifest.training_corpus == "same", m, pad)
            _require(entry.neighbour_slots_filled in (None, int(present.sum())),
                     f"{path}: {int(present.sum())} neighbour slots filled, manifest says "
                     f"{entry.neighbour_slots_filled}")
            rows_total += table.num_rows
            filled += int(present.sum())
            slots += present.size
        seq_ranges.sort()
        for (_, last, a), (first, _, b) in zip(seq_ranges, seq_ranges[1:]):
            _require(first > last, f"{a} and {b}: seq_id ranges overlap (a duplicate sequence?)")
        _check_references(chunk_files, references, m)
    _require(rows_total == manifest.num_sequences,
             f"{directory}: {rows_total} rows, manifest says {manifest.num_sequences}")
    _require(manifest.neighbour_fill is None or abs(manifest.neighbour_fill - (filled / slots if slots else 1.0)) < 1e-9,
             f"{directory}: neighbour_fill {manifest.neighbour_fill} disagrees with the shards "
             f"({filled}/{slots})")
    return (f"OK shards {directory}: {rows_total} sequences in {len(manifest.shards)} shards, "
            f"{filled}/{slots} neighbour slots filled, no same-document neighbour, "
            f"neighbour tokens equal the chunk database; {manifest.neighbour_summary()}")


def validate_path(path: str) -> list[str]:
    """Validate an index dir, a shards dir, or an output dir holding both."""
    manifest_path = fileio.join(path, fileio.MANIFEST)
    if fileio.exists(manifest_path):
        raw = fileio.read_json(manifest_path)
        if "shards" in raw:
            return [validate_shards(path)]
        return [validate_vector_index(path) if "inputs" in raw else validate_index(path)]
    parts = [(fileio.join(path, name), check) for name, check in
             (("index", validate_index), ("shards", validate_shards))]
    found = [(d, check) for d, check in parts if fileio.exists(fileio.join(d, fileio.MANIFEST))]
    _require(found, f"{path}: no manifest.json here, nor in {path}/index or {path}/shards")
    return [check(d) for d, check in found]
