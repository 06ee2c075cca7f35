"""Where a report reads: the committed index and shards directories it covers (`find_sources`),
the rejected-record files that belong to them, and their manifests.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass

from pipeline.common import fileio
from schemas.manifest import IndexManifest, ShardsManifest, VectorIndexManifest, commit_number


class ReportError(ValueError):
    """A directory the report cannot be written for."""


@dataclass(frozen=True, kw_only=True)
class Sources:
    """The committed directories a report covers, the commit of each it reads (pinned when found,
    so each manifest is read from one commit whatever is committed meanwhile), and the
    rejected-record files that belong to them (`<output>/rejected/<stage>-NNNNN.jsonl`)."""

    path: str
    index: str | None
    shards: str | None
    rejected: str
    rejected_stages: tuple[str, ...]
    index_commit: int | None = None
    shards_commit: int | None = None


def _commit(directory: str) -> int | None:
    """The current commit of `directory`; None: nothing committed there."""
    found = fileio.current_manifest(directory)
    return None if found is None else commit_number(found[0])


def find_sources(path: str) -> Sources:
    """An output directory (index/ and/or shards/ with manifests), an index or a shards
    directory; else a ReportError."""
    path = path.rstrip("/")
    number = _commit(path)
    if number is not None:
        raw = fileio.committed_manifest(path, number=number)
        rejected = fileio.join(posixpath.dirname(path) or ".", "rejected")
        if "shards" in raw:
            return Sources(
                path=path,
                index=None,
                shards=path,
                rejected=rejected,
                rejected_stages=("build-shards",),
                shards_commit=number,
            )
        return Sources(
            path=path, index=path, shards=None, rejected=rejected, rejected_stages=("build-index",), index_commit=number
        )
    index, shards = (fileio.join(path, name) for name in ("index", "shards"))
    index_commit, shards_commit = _commit(index), _commit(shards)
    if index_commit is None and shards_commit is None:
        raise ReportError(
            f"{path}: not an output, index or shards directory (no manifest here, nor in {index} or {shards})"
        )
    return Sources(
        path=path,
        index=None if index_commit is None else index,
        shards=None if shards_commit is None else shards,
        rejected=fileio.join(path, "rejected"),
        rejected_stages=("build-index", "build-shards"),
        index_commit=index_commit,
        shards_commit=shards_commit,
    )


def read_index_manifest(directory: str, number: int | None = None) -> IndexManifest | VectorIndexManifest:
    """The manifest of a pipeline's index, or of one built by `ratrain-pipeline index` (its
    current commit, or commit `number`)."""
    return fileio.committed_summary(
        directory, lambda raw: VectorIndexManifest if "inputs" in raw else IndexManifest, number=number
    )


def read_shards_manifest(directory: str, number: int | None = None) -> ShardsManifest:
    """The summary: the report reads its entries' columns (`ShardFiles`, `gather_scores`)."""
    return fileio.committed_summary(directory, ShardsManifest, number=number)
