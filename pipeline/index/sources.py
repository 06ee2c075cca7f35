"""Which corpus file each indexed document came from, so that a file that changed or went can
have its documents replaced or deleted: `sources/sources-gGGGGG-BB.parquet` per generation
(columns doc_id, source), one file per doc-id bucket BB, rows sorted by doc id. Read back here,
the one reader.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

SOURCES_DIR = "sources"
BUCKET_SHIFT = 57  # doc ids are 63-bit: a generation's sources in at most 64 files


def sources_prefix(generation: int) -> str:
    return f"{SOURCES_DIR}-g{generation:05d}"


def bucket_of_source(row: tuple[int, str]) -> int:
    """The file a (doc id, source) row goes to."""
    return row[0] >> BUCKET_SHIFT


def sources_table(rows: list[tuple[int, str]]) -> pa.Table:
    rows = sorted(rows)
    return pa.table(
        {
            "doc_id": pa.array([doc_id for doc_id, _ in rows], pa.int64()),
            "source": pa.array([source for _, source in rows], pa.string()),
        }
    )


def documents_of(path: str, sources: frozenset[str]):
    """(doc id, source) of the documents in one sources file that came from these `sources`."""
    import pyarrow.parquet as pq

    from pipeline.common import fileio

    with fileio.open_read(path) as f:
        table = pq.read_table(f)
    doc_ids, found = table["doc_id"].to_numpy(), table["source"].to_numpy(zero_copy_only=False)
    for at in np.flatnonzero(np.isin(found, list(sources))).tolist():
        yield int(doc_ids[at]), str(found[at])
