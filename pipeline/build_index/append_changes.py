"""What a generation appended to an index changes, in Beam's steps: which indexed documents go
(`document_runs`: each document's chunk-id run; `replacing`: a new document replacing the one
of its id; `deletions`: a `DeletedDocument` per document replaced, asked for, or no longer in
its file), and the faiss files changed on the one worker that holds the index (`rewrite_index`:
deleted vectors removed, new ones added, a `Changed`). `change_index`
(`pipeline.build_index.append`) wires them.
"""

from __future__ import annotations

from dataclasses import dataclass

import apache_beam as beam
import numpy as np

from pipeline.chunks.chunk_files import ChunkFileRanges, CommittedChunkFiles, CommittedIndexManifest
from pipeline.chunks.deleted import (
    DELETE_REQUESTED,
    NOT_IN_ITS_FILE,
    REPLACED,
    DeletedDocument,
    DeletedRanges,
)
from pipeline.common import fileio
from pipeline.common.arrays import widest_span
from pipeline.common.names import file_name, file_number
from pipeline.index.append import (
    MergedSearch,
    NewVectorRecall,
    add_in_file_order,
    cut_slice,
    new_vector_recall,
    new_vectors_by_slice,
    remove_deleted,
    sampled_vectors,
)
from pipeline.index.files import (
    INDEX_FILE,
    LIST_OWNERS_FILE,
    QUANTIZER_FILE,
    read_index,
    read_owners,
    write_index,
    write_owners,
)
from pipeline.index.routing import add_list_blocks
from pipeline.index.search import set_search_depth
from pipeline.index.slices import vectors_per_slice
from schemas.manifest import FileEntry, IndexManifest, by_name

RUN, DELETE = "run", "delete"  # CoGroupByKey tags: a document's chunk-id run; a request to delete it
REPLACED_TAG, NOT_FOUND = "replaced", "not_found"
DELETE_REQUESTS_FILE = "delete-requests.int64"  # in the job's staging, never committed


@dataclass(frozen=True)
class DeleteRequests:
    """The doc ids a change deletes by `--delete`, sorted, as raw int64 in a file of the job's
    staging: its graph carries the path and sha256, however many ids (10^5 of them in the graph
    itself took 2.3 MB). `staged` writes it before the job is built (a dry run writes nothing)."""

    path: str
    sha256: str
    count: int

    @classmethod
    def staged(cls, doc_ids: set[int], staging: str, *, write: bool) -> DeleteRequests:
        data = np.array(sorted(doc_ids), dtype=np.int64).tobytes()
        path = fileio.join(staging, DELETE_REQUESTS_FILE)
        if write and doc_ids:
            fileio.write_bytes(path, data)
        return cls(path, fileio.sha256_bytes(data), len(doc_ids))

    def doc_ids(self) -> list[int]:
        if not self.count:
            return []
        data = fileio.read_bytes(self.path)
        if fileio.sha256_bytes(data) != self.sha256:
            raise RuntimeError(f"{self.path}: the delete requests changed after the job was built")
        return np.frombuffer(data, dtype=np.int64).tolist()


def document_runs(ranges: ChunkFileRanges | CommittedChunkFiles, number: int, deleted: DeletedRanges):
    """(doc id, (first chunk id, end)) of each document with chunks in chunk file `number`,
    but those already deleted (a document's run may go on in the next file: `widest_span`
    joins the parts)."""
    columns = ranges.read(number, ["chunk_id", "doc_id"])
    ids, docs = columns["chunk_id"], columns["doc_id"]
    kept = ~deleted.contains(ids)
    ids, docs = ids[kept], docs[kept]
    if not len(ids):
        return
    starts = np.flatnonzero(np.r_[True, docs[1:] != docs[:-1]])
    ends = np.r_[starts[1:], len(ids)]
    for a, b in zip(starts.tolist(), ends.tolist()):
        yield int(docs[a]), (int(ids[a]), int(ids[b - 1]) + 1)


def replacing(keyed):
    """A new document joined with its id's run in the index -> the document, and its id
    (tagged REPLACED_TAG) when the index holds a document of that id: the new text replaces it."""
    doc_id, joined = keyed
    docs = list(joined["document"])
    if not docs:
        return
    yield from docs
    if list(joined[RUN]):
        yield beam.pvalue.TaggedOutput(REPLACED_TAG, doc_id)


def deletions(keyed):
    """A doc id joined with its run in the index and the requests to delete it -> a
    DeletedDocument (the reason: replaced, else asked for, else its file changed or went); a
    request by `--delete` for an id the index does not hold -> NOT_FOUND."""
    doc_id, joined = keyed
    reasons = set(joined[DELETE])
    if not reasons:
        return
    runs = list(joined[RUN])
    if not runs:
        if DELETE_REQUESTED in reasons:
            yield beam.pvalue.TaggedOutput(NOT_FOUND, doc_id)
        return
    first, end = widest_span(runs)
    reason = next(r for r in (REPLACED, DELETE_REQUESTED, NOT_IN_ITS_FILE) if r in reasons)
    yield DeletedDocument(doc_id, first, end - first, reason)


@dataclass(frozen=True)
class Changed:
    """What the one worker holding the index did to it."""

    files: list[FileEntry]  # the faiss files written anew (index.faiss, or the slices changed)
    vectors: int  # the index holds, after
    recall: NewVectorRecall
    removed: int  # vectors removed (deleted documents' chunks)


def rewrite_index(
    _,
    *,
    new_entries: list[FileEntry],
    deleted_now: list[DeletedDocument],
    committed: CommittedIndexManifest,
    directory,
    staging,
    sample,
) -> Changed:
    """One worker: the committed index read, the deleted documents' vectors removed, the new
    ones added in chunk-id order, written to staging; the new vectors' recall at the index's
    depth measured among the vectors left. An index in slices is changed a slice at a time."""
    previous = committed.read()
    new_paths = [fileio.join(staging, e.path) for e in sorted(new_entries, key=lambda e: file_number(e.path))]
    old_paths = [
        fileio.join(directory, e.path)
        for e in sorted(previous.files, key=lambda e: file_number(e.path))
        if e.path.startswith("embeddings/")
    ]
    now = DeletedRanges.of(deleted_now)
    deleted = DeletedRanges.concatenate([committed.deleted(), now])
    named = by_name(previous.files)
    if f"faiss/{QUANTIZER_FILE}" in named:
        return _change_slices(
            previous,
            directory=directory,
            staging=staging,
            new_paths=new_paths,
            old_paths=old_paths,
            now=now,
            deleted=deleted,
            sample=sample,
        )
    stored = named[f"faiss/{INDEX_FILE}"]
    index = read_index(fileio.join(directory, stored.path), sha256=stored.sha256)
    removed = remove_deleted(index, now)
    added = add_in_file_order(index, new_paths)
    query_ids, queries = sampled_vectors(new_paths, sample, added)
    if previous.nprobe is not None:
        set_search_depth(index, previous.nprobe)
    recall = new_vector_recall(index, query_ids, queries, old_paths + new_paths, deleted)
    size, sha256 = write_index(index, fileio.join(staging, "faiss", INDEX_FILE))
    entry = FileEntry(path=f"faiss/{INDEX_FILE}", rows=int(index.ntotal), bytes=size, sha256=sha256)
    return Changed([entry], int(index.ntotal), recall, removed)


def _change_slices(
    previous: IndexManifest, *, directory, staging, new_paths, old_paths, now: DeletedRanges, deleted, sample
) -> Changed:
    """The new vectors encoded once on the trained index (quantizer.faiss) and cut by list
    owner; then each slice in turn read, its deleted vectors removed and its new ones added,
    cut in two or more if it outgrew the slice size, written anew if it changed, and searched
    for the sampled new vectors at the index's depth, merged as the index build measures
    slices. The list owners are written anew when they changed."""
    named = by_name(previous.files)
    quantizer, owners = named[f"faiss/{QUANTIZER_FILE}"], named[f"faiss/{LIST_OWNERS_FILE}"]
    trained = read_index(fileio.join(directory, quantizer.path), sha256=quantizer.sha256)
    owners_before = read_owners(fileio.join(directory, owners.path))
    new = new_vectors_by_slice(trained, new_paths, owners_before)
    owner, blocks = new.owner, dict(new.blocks)
    fits = None
    if previous.slice_bytes is not None:
        fits = vectors_per_slice(previous.index_factory, previous.dim, previous.slice_bytes)
    query_ids, queries = sampled_vectors(new_paths, sample, new.added)
    merged = MergedSearch(queries)
    slices = sorted((e for e in previous.files if e.path.startswith("faiss/slice-")), key=lambda e: file_number(e.path))
    written, removed, vectors, next_number = [], 0, 0, len(slices)
    for number, entry in enumerate(slices):
        index_slice = read_index(fileio.join(directory, entry.path), sha256=entry.sha256)
        removed_here = remove_deleted(index_slice, now)
        removed += removed_here
        pieces = [(number, index_slice)]
        if removed_here or number in blocks:
            add_list_blocks(index_slice, [blocks.pop(number)] if number in blocks else [])
            if fits is not None and index_slice.ntotal > fits:
                pieces, owner = cut_slice(
                    index_slice, trained, owner=owner, number=number, first_new=next_number, fits=fits
                )
                next_number += len(pieces) - 1
            for piece_number, piece in pieces:
                path = f"faiss/{file_name('slice', piece_number, 'faiss')}"
                size, sha256 = write_index(piece, fileio.join(staging, path))
                written.append(FileEntry(path=path, rows=int(piece.ntotal), bytes=size, sha256=sha256))
        for _, piece in pieces:
            vectors += int(piece.ntotal)
            if previous.nprobe is not None:
                set_search_depth(piece, previous.nprobe)
            merged.add(piece)
        del index_slice, pieces
    if not np.array_equal(owner, owners_before):
        size, sha256 = write_owners(owner, fileio.join(staging, "faiss", LIST_OWNERS_FILE))
        written.append(FileEntry(path=f"faiss/{LIST_OWNERS_FILE}", rows=0, bytes=size, sha256=sha256))
    recall = new_vector_recall(merged, query_ids, queries, old_paths + new_paths, deleted)
    return Changed(written, vectors, recall, removed)
