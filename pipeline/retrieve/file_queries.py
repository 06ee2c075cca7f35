"""Query embeddings where the training chunks are the database's: read from its embedding
files where they are searched, a file at a time, so no query embedding is shuffled to its
search batch.
"""

from __future__ import annotations

import numpy as np

from pipeline.common.arrays import groups
from pipeline.retrieve.search import QueryBlock
from pipeline.shards.rows import SequenceBatch


class FileQueries:
    """Query embeddings where the training chunks are the database's: a block of chunk ids'
    rows read from the embedding files (`read_embeddings`), the last file read kept, so a
    process holds one file's embeddings at a time (a block across a file's edge reads the
    next file whole, after letting go of the last)."""

    def __init__(self, chunk_files):
        self.chunk_files, self.number, self.vectors = chunk_files, -1, np.zeros((0, 0), np.float32)

    def block(self, chunk_ids: np.ndarray) -> QueryBlock:
        if len(chunk_ids):  # an error naming an id the database does not hold
            self.chunk_files.file_of(int(chunk_ids.min()))
            self.chunk_files.file_of(int(chunk_ids.max()))
        vectors = np.zeros((0, 0), np.float32)
        for number, at in groups(self.chunk_files.files_of(chunk_ids)):
            if number != self.number:
                self.vectors, self.number = np.zeros((0, 0), np.float32), -1  # one file held at a time
                self.vectors, self.number = self.chunk_files.read_embeddings(number), number
            if not vectors.size:
                vectors = np.empty((len(chunk_ids), self.vectors.shape[1]), np.float32)
            vectors[at] = self.vectors[chunk_ids[at] - self.chunk_files.start(number)]
        return QueryBlock(chunk_ids, vectors)


def file_batches(keyed):
    """(embedding file, the (search batch, value) pairs of the batches whose first chunk it
    holds, by name) -> (search batch, its join), in batch order."""
    _, grouped = keyed
    batches: dict[int, dict[str, list]] = {}
    names = ("sequences", "excluded", "searched_chunks")
    for name in names:
        for batch, value in grouped.get(name, ()):
            batches.setdefault(batch, {name: [] for name in names})[name].append(value)
    for batch in sorted(batches):
        yield batch, batches.pop(batch)


def with_file_queries(keyed, chunk_files, chunks_per_seq: int):
    """(embedding file, its batches: `file_batches`) -> each batch as a join with its query
    embeddings gives it: its sequences' chunks' rows read from the embedding files
    (`FileQueries`: a file read once for its batches, plus the next one for a batch across
    its edge)."""
    queries = FileQueries(chunk_files)
    for batch, joined in file_batches(keyed):
        seq_ids = np.array(sorted(s.seq_id for s in SequenceBatch.merged(joined["sequences"])), np.int64)
        chunk_ids = (seq_ids[:, None] * chunks_per_seq + np.arange(chunks_per_seq)).ravel()
        yield batch, {**joined, "embeddings": [queries.block(chunk_ids)]}
