"""Where a report reads: the committed index and shards directories it covers (`find_sources`),
the rejected-record files that belong to them, and their manifests.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass

from pipeline.common import fileio
from schemas.manifest import IndexManifest, ShardsManifest, VectorIndexManifest


class ReportError(ValueError):
    """A directory the report cannot be written for."""


@dataclass(frozen=True)
class Sources:
    """The committed directories a report covers, and the rejected-record files that belong to
    them (`<output>/rejected/<stage>-NNNNN.jsonl`)."""

    path: str
    index: str | None
    shards: str | None
    rejected: str
    rejected_stages: tuple[str, ...]


def find_sources(path: str) -> Sources:
    """An output directory (index/ and/or shards/ with manifests), an index or a shards
    directory; else a ReportError."""
    path = path.rstrip("/")
    if fileio.current_manifest(path) is not None:
        raw = fileio.committed_manifest(path)
        rejected = fileio.join(posixpath.dirname(path) or ".", "rejected")
        if "shards" in raw:
            return Sources(path, None, path, rejected, ("build-shards",))
        return Sources(path, path, None, rejected, ("build-index",))
    index, shards = (fileio.join(path, name) for name in ("index", "shards"))
    found = {d: fileio.current_manifest(d) is not None for d in (index, shards)}
    if not any(found.values()):
        raise ReportError(
            f"{path}: not an output, index or shards directory (no manifest.json here, nor in {index} or {shards})"
        )
    return Sources(
        path,
        index if found[index] else None,
        shards if found[shards] else None,
        fileio.join(path, "rejected"),
        ("build-index", "build-shards"),
    )


def read_index_manifest(directory: str) -> IndexManifest | VectorIndexManifest:
    """The manifest of a pipeline's index, or of one built by `ratrain-pipeline index`."""
    return fileio.committed_summary(directory, lambda raw: VectorIndexManifest if "inputs" in raw else IndexManifest)


def read_shards_manifest(directory: str) -> ShardsManifest:
    """The summary: the report reads its entries' columns (`ShardFiles`, `gather_scores`)."""
    return fileio.committed_summary(directory, ShardsManifest)
