"""`WriteShards`: rows into `shard-NNNNN.arrow` training shards, deterministic by seq id."""

from __future__ import annotations

import apache_beam as beam
import numpy as np

from pipeline.common.writers import WriteGroupedFiles
from pipeline.shards.rows import ShardRow, rows_per_source
from schemas.arrow import shard_ipc_bytes, shard_table
from schemas.manifest import ShardEntry
from schemas.shard_columns import columns_of


def rows_to_ipc(rows: list[ShardRow], pad_id: int, sources: tuple[str, ...] = ("training",)) -> bytes:
    """One shard's rows (at least one) -> its file, each column taken from the rows as the spec
    (`schemas/shard_columns.py`) says; `sources`: the names a row's source indexes."""
    return shard_ipc_bytes(shard_table(columns_of(rows), dims=rows[0].dims, pad_id=pad_id, sources=sources))


class WriteShards(beam.PTransform):
    """RowBatches, each all of one shard's rows (`RetrieveNeighbours` with the same
    `shard_rows`), -> `shard-NNNNN.arrow`, shard NNNNN holding seq ids NNNNN·rows … (sorted),
    written where they are: the rows cross no shuffle. A batch holding rows of two shards is
    an error. `sources`: the names a row's source indexes; `blend`: a blend's, whose entries
    count each shard's rows per source (what a reader selecting sources needs before it opens
    the shard)."""

    def __init__(
        self,
        directory: str,
        shard_rows: int,
        pad_id: int,
        *,
        sources: tuple[str, ...] = ("training",),
        blend: bool = False,
    ):
        super().__init__()
        self.directory, self.shard_rows, self.pad_id = directory, shard_rows, pad_id
        self.sources, self.blend = sources, blend

    def expand(self, rows):
        pad_id, sources, blend = self.pad_id, self.sources, self.blend
        return rows | "WriteShardFiles" >> WriteGroupedFiles(
            self.directory,
            relative_to=self.directory,
            prefix="shard",
            extension="arrow",
            key=lambda r: r.seq_id,
            rows_per_file=self.shard_rows,
            to_bytes=lambda rs: rows_to_ipc(rs, pad_id, sources),
            facts=lambda rs: {
                "neighbour_slots_filled": sum(int((r.neighbour_ids >= 0).sum()) for r in rs),
                "source_rows": rows_per_source(np.array([r.source for r in rs]), len(sources)) if blend else None,
            },
            entry=ShardEntry,
            rows_of=lambda batch: batch.rows,
            grouped=True,
        )
