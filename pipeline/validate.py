"""`validate`: check an index or shard directory end to end against DESIGN §4-5.

Every check reads the committed files themselves (never the pipeline's memory): manifests,
sizes and hashes, chunk ids and continuations, embeddings, the faiss index, and for shards
every neighbour against the chunk database.
"""
from __future__ import annotations

import json
import posixpath

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from pipeline import fileio
from pipeline.index import load_index
from schemas.arrow import SHARD_METADATA_KEYS, check_schema_version, tensor_column_to_numpy
from schemas.manifest import IndexManifest, ShardsManifest, VectorIndexManifest

NORM_TOLERANCE = 1e-3


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


def _check_files(directory: str, entries) -> None:
    for entry in entries:
        path = fileio.join(directory, entry.path)
        _require(fileio.exists(path), f"{path}: listed in the manifest but missing")
        data = fileio.read_bytes(path)
        _require(len(data) == entry.bytes, f"{path}: {len(data)} bytes, manifest says {entry.bytes}")
        _require(fileio.sha256_bytes(data) == entry.sha256, f"{path}: sha256 differs from the manifest")


class ChunkDatabase:
    """The chunk rows of an index directory as sorted numpy arrays."""

    def __init__(self, directory: str, manifest: IndexManifest):
        tables = [pq.read_table(pa.BufferReader(fileio.read_bytes(fileio.join(directory, f.path))))
                  for f in manifest.files if f.path.startswith("chunks/")]
        _require(tables, f"{directory}: manifest lists no chunk files")
        table = pa.concat_tables(tables)
        order = np.argsort(table["chunk_id"].to_numpy(), kind="stable")
        self.ids = table["chunk_id"].to_numpy()[order]
        self.docs = table["doc_id"].to_numpy()[order]
        self.positions = table["position"].to_numpy()[order]
        self.tokens = tensor_column_to_numpy(table["tokens"])[order]
        self.continuations = tensor_column_to_numpy(table["continuation"])[order]

    def values(self, ids: np.ndarray) -> np.ndarray:
        """chunk + continuation [.., 2m] of dense chunk ids."""
        return np.concatenate([self.tokens[ids], self.continuations[ids]], axis=-1)


def validate_index(directory: str) -> str:
    raw, _ = _manifest(directory)
    check_schema_version(raw.get("schema_version"), fileio.join(directory, fileio.MANIFEST))
    manifest = IndexManifest.model_validate(raw)
    _check_files(directory, manifest.files)
    db = ChunkDatabase(directory, manifest)
    n, m, pad = len(db.ids), manifest.chunk_tokens, manifest.pad_id
    _require(n == manifest.num_chunks, f"{directory}: {n} chunk rows, manifest says {manifest.num_chunks}")
    _require(np.array_equal(db.ids, np.arange(n)), f"{directory}: chunk ids are not dense 0..{n - 1}")
    _require(db.tokens.shape[1] == m, f"{directory}: chunks hold {db.tokens.shape[1]} tokens, not {m}")
    _require(not (db.tokens == pad).all(axis=1).any(), f"{directory}: a chunk holds only padding")
    same_doc_next = np.zeros(n, dtype=bool)
    same_doc_next[:-1] = (db.docs[1:] == db.docs[:-1]) & (db.positions[1:] == db.positions[:-1] + 1)
    expected = np.full_like(db.continuations, pad)
    expected[:-1][same_doc_next[:-1]] = db.tokens[1:][same_doc_next[:-1]]
    bad = np.flatnonzero((db.continuations != expected).any(axis=1))
    _require(len(bad) == 0, f"{directory}: chunk {bad[:1]} continuation is not the next chunk of "
             "its document (or padding at its end)")
    starts = np.flatnonzero(db.positions == 0)
    _require(len(starts) == manifest.num_documents and len(np.unique(db.docs)) == len(starts),
             f"{directory}: documents are not contiguous runs of chunks starting at position 0")

    embeddings = pa.concat_tables(
        [pq.read_table(pa.BufferReader(fileio.read_bytes(fileio.join(directory, f.path))))
         for f in manifest.files if f.path.startswith("embeddings/")])
    emb_ids = np.sort(embeddings["chunk_id"].to_numpy())
    _require(np.array_equal(emb_ids, db.ids), f"{directory}: embeddings do not cover the chunks one to one")
    vectors = tensor_column_to_numpy(embeddings["embedding"])
    _require(vectors.shape[1] == manifest.dim, f"{directory}: embeddings have dim {vectors.shape[1]}")
    norms = np.linalg.norm(vectors, axis=1)
    _require(np.isfinite(vectors).all() and (np.abs(norms - 1) < NORM_TOLERANCE).all(),
             f"{directory}: embeddings are not finite unit vectors")

    index = load_index(fileio.join(directory, "faiss", "index.faiss"), manifest.nprobe)
    _require(index.ntotal == n and index.d == manifest.dim,
             f"{directory}: faiss index holds {index.ntotal} x {index.d}, expected {n} x {manifest.dim}")
    sample = np.linspace(0, n - 1, min(n, 64)).astype(np.int64)
    by_id = np.argsort(embeddings["chunk_id"].to_numpy())
    _, found = index.search(np.ascontiguousarray(vectors[by_id][sample], dtype=np.float32), 10)
    _require(((found >= 0) & (found < n) | (found == -1)).all(), f"{directory}: index returns unknown ids")
    self_hits = np.mean([sid in row for sid, row in zip(sample, found)])
    _require(self_hits >= 0.5, f"{directory}: only {self_hits:.0%} of indexed vectors find themselves")
    return (f"OK index {directory}: {n} chunks from {manifest.num_documents} documents, "
            f"{manifest.index_factory}, {manifest.recall_at_k.measure} = {manifest.recall_at_k.value:.3f}")


def validate_vector_index(directory: str) -> str:
    """A stand-alone `index` output: manifest, file hashes, and the index itself."""
    raw, _ = _manifest(directory)
    check_schema_version(raw.get("schema_version"), fileio.join(directory, fileio.MANIFEST))
    manifest = VectorIndexManifest.model_validate(raw)
    _check_files(directory, manifest.files)
    index = load_index(fileio.join(directory, "faiss", "index.faiss"), manifest.nprobe)
    _require(index.ntotal == manifest.num_vectors and index.d == manifest.dim,
             f"{directory}: faiss index holds {index.ntotal} x {index.d}, manifest says "
             f"{manifest.num_vectors} x {manifest.dim}")
    return (f"OK vector index {directory}: {manifest.num_vectors} vectors, {manifest.index_factory}, "
            f"{manifest.recall_at_k.measure} = {manifest.recall_at_k.value:.3f} at depth {manifest.nprobe}")


def validate_shards(directory: str, index_directory: str | None = None) -> str:
    raw, _ = _manifest(directory)
    check_schema_version(raw.get("schema_version"), fileio.join(directory, fileio.MANIFEST))
    manifest = ShardsManifest.model_validate(raw)
    index_directory = index_directory or posixpath.join(posixpath.dirname(directory.rstrip("/")), "index")
    index_raw, index_bytes = _manifest(index_directory)
    _require(fileio.sha256_bytes(index_bytes) == manifest.index_manifest_sha256,
             f"{directory}: built against a different index than {index_directory}")
    db = ChunkDatabase(index_directory, IndexManifest.model_validate(index_raw))
    n, m, k, pad = manifest.sequence_tokens, manifest.chunk_tokens, manifest.neighbours, manifest.pad_id
    L = n // m
    _require(manifest.neighbour_tokens == 2 * m, f"{directory}: neighbour_tokens != 2 x chunk_tokens")
    _check_files(directory, manifest.shards)
    seen, rows_total, filled, slots = set(), 0, 0, 0
    for entry in manifest.shards:
        path = fileio.join(directory, entry.path)
        table = ipc.open_file(pa.BufferReader(fileio.read_bytes(path))).read_all()
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
        _require(not seen.intersection(seq_ids.tolist()) and len(set(seq_ids.tolist())) == len(seq_ids),
                 f"{path}: duplicate seq_id")
        seen.update(seq_ids.tolist())
        present = ids >= 0
        _require((ids < len(db.ids)).all(), f"{path}: neighbour_ids point outside the chunk database")
        _require((neighbours[~present] == pad).all() and (scores[~present] == 0).all(),
                 f"{path}: an absent neighbour (id -1) is not padding")
        safe = np.where(present, ids, 0)
        mismatch = present & (neighbours != db.values(safe)).any(axis=-1)
        if mismatch.any():
            raise ValidationFailed(f"{path}: neighbour tokens differ from the chunk database "
                                   f"(seq {seq_ids[np.argwhere(mismatch)[0][0]]})")
        neighbour_docs = db.docs[safe]
        for row, doc_ids in enumerate(table["doc_ids"].to_pylist()):
            leaks = present[row] & np.isin(neighbour_docs[row], doc_ids)
            if leaks.any():
                raise ValidationFailed(f"{path}: seq {seq_ids[row]} has a neighbour from its own "
                                       f"document {neighbour_docs[row][leaks][0]}")
            if manifest.training_corpus == "same":
                chunk_ids = seq_ids[row] * L + np.arange(L)
                _require(np.array_equal(tokens[row, :n], db.tokens[chunk_ids].reshape(-1)),
                         f"{path}: seq {seq_ids[row]} tokens differ from its chunks")
                _require(set(db.docs[chunk_ids].tolist()) <= set(doc_ids),
                         f"{path}: seq {seq_ids[row]} doc_ids miss a document it holds")
        rows_total += table.num_rows
        filled += int(present.sum())
        slots += present.size
    _require(rows_total == manifest.num_sequences,
             f"{directory}: {rows_total} rows, manifest says {manifest.num_sequences}")
    return (f"OK shards {directory}: {rows_total} sequences in {len(manifest.shards)} shards, "
            f"{filled}/{slots} neighbour slots filled, no same-document neighbour, "
            "neighbour tokens equal the chunk database")


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
