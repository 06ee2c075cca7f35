"""The units of a validation plan, made from one row group of a manifest's file table at a time
(`units_of`): what a worker checks, never all of a manifest's entries at once. A unit is a
`ShardEntry` (a shard), a `ChunkFileUnit`, an `EmbeddingFileUnit`, a `ListedFile` (checked by
size and sha256) or `ListedSizes` (a row group's files checked by size).
"""

from __future__ import annotations

from collections.abc import Iterator

from pipeline.check.facts import ChunkFileUnit, EmbeddingFileUnit, EntryGroup, ListedFile, ListedSizes
from pipeline.check.plan import ValidationPlan
from pipeline.check.problems import manifest_problem
from pipeline.chunks.chunk_files import EMBEDDINGS_DIR
from pipeline.common import fileio


def units_of(plan: ValidationPlan, group: EntryGroup) -> Iterator:
    """The units of one row group of entries (see `EntryGroup` for the roles)."""
    manifest = plan.manifests[group.directory]
    listed = []
    for entry in fileio.entry_group(manifest, group.directory, group.group, error=manifest_problem):
        if group.role == "shards" and plan.samples["shards"].chooses(entry.path):
            yield entry
        elif group.role in ("index", "chunks") and entry.path.startswith("chunks/"):
            assert plan.chunks is not None  # planned with the index
            sampled = plan.samples["chunks"].chooses(entry.path) if group.role == "index" else plan.complete
            yield ChunkFileUnit(plan.chunks.chunks.position_of(entry.path), entry, sampled)
            if group.role == "index" and not sampled:
                listed.append(entry)
        elif group.role == "chunks":
            continue  # the other files of an index not validated here
        elif group.role == "index" and entry.path.startswith(f"{EMBEDDINGS_DIR}/"):
            embeddings = plan.chunks.embeddings if plan.chunks is not None else None
            assert embeddings is not None  # planned with the index, which lists this file
            if plan.samples["embeddings"].chooses(entry.path):
                position = embeddings.position_of(entry.path)
                yield EmbeddingFileUnit(position, entry, embeddings.start(position))
            else:
                listed.append(entry)
        else:
            listed.append(entry)
    if plan.hashed:
        yield from (ListedFile(group.directory, entry) for entry in listed)
    elif listed:
        yield ListedSizes(group.directory, tuple(listed))


def units(plan: ValidationPlan, kind: type | tuple[type, ...]) -> Iterator:
    """The plan's units of this kind, row group after row group (each read again per kind)."""
    for group in plan.entry_groups:
        yield from (unit for unit in units_of(plan, group) if isinstance(unit, kind))
