"""`WriteShards`: rows into `shard-NNNNN.arrow` training shards, deterministic by seq id."""

from __future__ import annotations

import apache_beam as beam
import numpy as np

from pipeline.common.writers import WriteGroupedFiles
from pipeline.shards.rows import ShardRow
from schemas.arrow import shard_ipc_bytes, shard_table
from schemas.manifest import ShardEntry


def rows_to_ipc(rows: list[ShardRow], pad_id: int) -> bytes:
    table = shard_table(
        np.array([r.seq_id for r in rows], dtype=np.int64),
        np.stack([r.tokens for r in rows]),
        np.stack([r.neighbours for r in rows]),
        np.stack([r.neighbour_ids for r in rows]),
        np.stack([r.neighbour_scores for r in rows]),
        [r.doc_ids for r in rows],
        pad_id=pad_id,
    )
    return shard_ipc_bytes(table)


class WriteShards(beam.PTransform):
    """RowBatches, each all of one shard's rows (`RetrieveNeighbours` with the same
    `shard_rows`), -> `shard-NNNNN.arrow`, shard NNNNN holding seq ids NNNNN·rows … (sorted),
    written where they are: the rows cross no shuffle. A batch holding rows of two shards is
    an error."""

    def __init__(self, directory: str, shard_rows: int, pad_id: int):
        super().__init__()
        self.directory, self.shard_rows, self.pad_id = directory, shard_rows, pad_id

    def expand(self, rows):
        pad_id = self.pad_id
        return rows | "WriteShardFiles" >> WriteGroupedFiles(
            self.directory,
            self.directory,
            "shard",
            "arrow",
            key=lambda r: r.seq_id,
            rows_per_file=self.shard_rows,
            to_bytes=lambda rs: rows_to_ipc(rs, pad_id),
            facts=lambda rs: {"neighbour_slots_filled": sum(int((r.neighbour_ids >= 0).sum()) for r in rs)},
            entry=ShardEntry,
            rows_of=lambda batch: batch.rows,
            grouped=True,
        )
