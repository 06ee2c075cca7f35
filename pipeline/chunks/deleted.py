"""Documents deleted from an index: their chunk-id ranges, written per generation as
`deleted/deleted-GGGGG.parquet` (columns doc_id, first_chunk_id, num_chunks, reason) and read
back here, the one reader. Their vectors are removed from the faiss index, so no search returns
them; their rows stay in the chunk files (chunk ids are never reused), and what reads the chunk
database (exact search, validate, sequences of `training_corpus: same`) leaves them out.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from pipeline.common.arrays import ranges_of

DELETED_DIR = "deleted"
# why a document was deleted: asked for; an appended document has its id; its corpus file changed
# or went, and no longer holds it
DELETE_REQUESTED, REPLACED, NOT_IN_ITS_FILE = "delete_requested", "replaced", "not_in_its_file"


@dataclass(frozen=True)
class DeletedDocument:
    doc_id: int
    first_chunk_id: int
    num_chunks: int
    reason: str  # DELETE_REQUESTED, REPLACED or NOT_IN_ITS_FILE


@dataclass(frozen=True)
class DeletedRanges:
    """The chunk-id ranges of deleted documents, sorted by first chunk id."""

    starts: np.ndarray  # int64 [documents]
    ends: np.ndarray  # int64 [documents], exclusive
    doc_ids: np.ndarray  # int64 [documents]

    @classmethod
    def none(cls) -> DeletedRanges:
        empty = np.zeros(0, np.int64)
        return cls(empty, empty, empty)

    @classmethod
    def of(cls, documents) -> DeletedRanges:
        """From DeletedDocuments, in any order."""
        docs = list(documents)
        starts = np.array([d.first_chunk_id for d in docs], np.int64)
        order = np.argsort(starts, kind="stable")
        return cls(
            starts[order],
            starts[order] + np.array([d.num_chunks for d in docs], np.int64)[order],
            np.array([d.doc_id for d in docs], np.int64)[order],
        )

    @classmethod
    def concatenate(cls, parts: list[DeletedRanges]) -> DeletedRanges:
        if not parts:
            return cls.none()
        starts = np.concatenate([p.starts for p in parts])
        order = np.argsort(starts, kind="stable")
        return cls(
            starts[order],
            np.concatenate([p.ends for p in parts])[order],
            np.concatenate([p.doc_ids for p in parts])[order],
        )

    def __len__(self) -> int:
        return len(self.starts)

    @property
    def num_chunks(self) -> int:
        return int((self.ends - self.starts).sum())

    def chunk_ids(self) -> np.ndarray:
        """Every deleted chunk id, ascending."""
        return ranges_of(self.starts, self.ends - self.starts)

    def contains(self, chunk_ids: np.ndarray) -> np.ndarray:
        """Per chunk id: whether a deleted document holds it (bool, the ids' shape)."""
        ids = np.asarray(chunk_ids, np.int64)
        at = np.searchsorted(self.starts, ids, side="right") - 1
        inside = at >= 0
        inside[inside] &= ids[inside] < self.ends[at[inside]]
        return inside


def deleted_table(documents: list[DeletedDocument]) -> pa.Table:
    docs = sorted(documents, key=lambda d: d.first_chunk_id)
    return pa.table(
        {
            "doc_id": pa.array([d.doc_id for d in docs], pa.int64()),
            "first_chunk_id": pa.array([d.first_chunk_id for d in docs], pa.int64()),
            "num_chunks": pa.array([d.num_chunks for d in docs], pa.int64()),
            "reason": pa.array([d.reason for d in docs], pa.string()),
        }
    )


def read_deleted(paths: list[str]) -> DeletedRanges:
    """The deleted documents listed in these files (any Beam filesystem path)."""
    import pyarrow.parquet as pq

    from pipeline.common import fileio

    parts = []
    for path in paths:
        with fileio.open_read(path) as f:
            table = pq.read_table(f, columns=["doc_id", "first_chunk_id", "num_chunks"])
        starts = table["first_chunk_id"].to_numpy()
        parts.append(DeletedRanges(starts, starts + table["num_chunks"].to_numpy(), table["doc_id"].to_numpy()))
    return DeletedRanges.concatenate(parts)


@dataclass(frozen=True)
class DeletedFiles:
    """A committed index's deleted-document files, named by their paths alone: what a job graph
    carries (24 bytes a deleted document otherwise, in every step given them); each process
    reads them once, when a step first asks (`ranges`)."""

    paths: tuple[str, ...]

    def ranges(self) -> DeletedRanges:
        return _read_once(self.paths)

    def __bool__(self) -> bool:
        return bool(self.paths)


@functools.lru_cache(maxsize=2)
def _read_once(paths: tuple[str, ...]) -> DeletedRanges:
    return read_deleted(list(paths))


def deleted_files(directory: str, entries) -> list[str]:
    """The deleted-document files an index manifest lists (entries with .path), as full paths."""
    from pipeline.common import fileio

    return [fileio.join(directory, e.path) for e in entries if e.path.startswith(f"{DELETED_DIR}/")]
