"""Which indexed documents a generation appended to an index deletes, in Beam's steps
(`document_runs`: each document's chunk-id run; `replacing`: a new document replacing the one
of its id; `deletions`: a `DeletedDocument` per document replaced, asked for, or no longer in
its file). `change_index` (`pipeline.build_index.append`) wires them, and the faiss files'
change (`pipeline.build_index.change_faiss`).
"""

from __future__ import annotations

from dataclasses import dataclass

import apache_beam as beam
import numpy as np

from pipeline.chunks.chunk_files import ChunkFileRanges
from pipeline.chunks.committed import CommittedChunkFiles
from pipeline.chunks.deleted import (
    DELETE_REQUESTED,
    NOT_IN_ITS_FILE,
    REPLACED,
    DeletedDocument,
    DeletedRanges,
)
from pipeline.common import fileio
from pipeline.common.arrays import widest_span

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
