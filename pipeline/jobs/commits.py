"""A directory's numbered commits (docs/design.md §8): each commit writes its manifest once, as
`manifest-NNNNNN.json`, with a put-if-absent; the newest is current. What an older commit lists
stays in place, never overwritten (a file the new commit writes under a name an older commit
lists gets the new commit's number: `schemas.manifest.versioned`), until the new commit is
complete; then `finish` copies the current manifest to `manifest.json` (for people and
outside tools) and deletes what only older commits list, their file tables and manifests. It
is idempotent, so a commit that died after its put is finished by a retry or by the next job
on the directory.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow.compute as pc
from pydantic import BaseModel

from pipeline.common import conditional, fileio
from pipeline.common.errors import StageError
from schemas.manifest import (
    MANIFEST_FILE,
    IndexManifest,
    ManifestError,
    ShardsManifest,
    VectorIndexManifest,
    commit_manifest,
    read_manifest,
)

#: The newest commits a finished commit keeps: the previous one stays readable until its
#: successor is complete, and no longer (an outside check that globs a directory sees one commit).
KEPT_COMMITS = 1


def _parsed(path: str, data: bytes, model: type[BaseModel]):
    try:
        return read_manifest(data, path, model)
    except ValueError as err:
        raise StageError(
            f"cannot read {path} to commit beside it ({err}): move the directory away, build again"
        ) from None


def _listing(directory: str, path: str, model: type[BaseModel]):
    """The commit manifest at `path` and its file table's row groups (1 for inline entries), the
    table checked against it, streamed."""
    manifest = _parsed(path, fileio.read_bytes(path), model)
    return manifest, fileio.entry_groups(manifest, directory)


def listed_paths_of(directory: str, path: str, model: type[BaseModel]) -> Iterator[list[str]]:
    """The paths the commit manifest at `path` lists, a row group of its file table at a time,
    the table itself last."""
    manifest, _ = _listing(directory, path, model)
    for table in fileio.entry_batches(manifest, directory, ["path"]):
        yield table["path"].to_pylist()
    if (table := getattr(manifest, "file_table", None)) is not None:
        yield [table.path]


class _CommitListing:
    """{path: sha256} of one commit, looked up without holding it: inline entries (at most
    INLINE_FILE_ENTRIES) as they are; a file table's row groups known by their lowest and
    highest path, the one that may hold a path read when asked for, the last one kept."""

    def __init__(self, directory: str, path: str, model: type[BaseModel]):
        manifest, groups = _listing(directory, path, model)
        self._manifest, self._directory = manifest, directory
        table = getattr(manifest, "file_table", None)
        self._ranges: list[tuple[str, str]] = []
        if table is None:
            self._inline = dict(fileio.entry_paths_and_sha256(manifest, directory))
            return
        self._inline = {table.path: table.sha256}
        for group in range(groups):  # a row group at a time
            paths = fileio.entry_group_columns(manifest, directory, group, ["path"])["path"]
            self._ranges.append((pc.min(paths).as_py() or "", pc.max(paths).as_py() or ""))
        self._held: tuple[int, dict[str, str]] | None = None

    def sha256_of(self, path: str) -> str | None:
        if path in self._inline:
            return self._inline[path]
        for group, (low, high) in enumerate(self._ranges):
            if low <= path <= high:
                found = self._group(group).get(path)
                if found is not None:
                    return found
        return None

    def _group(self, group: int) -> dict[str, str]:
        if self._held is None or self._held[0] != group:
            self._held = None  # the one held goes before the next is read
            entries = fileio.entry_group_columns(self._manifest, self._directory, group, ["path", "sha256"])
            self._held = (group, dict(zip(entries["path"].to_pylist(), entries["sha256"].to_pylist())))
        return self._held[1]


class ListedFiles:
    """What the commits `numbered` of a directory list: `sha256_of(path)` as the newest commit
    listing it says, or None. Nothing per file is held but a row group of one commit's table
    (and inline entries): a commit of 10^6 files looks its names up in paths' order, reading
    each row group of an earlier table about once."""

    def __init__(self, directory: str, numbered: list[tuple[int, str]], model: type[BaseModel]):
        self._listings = [_CommitListing(directory, path, model) for _, path in reversed(numbered)]

    def sha256_of(self, path: str, *, after_newest: bool = False) -> str | None:
        for listing in self._listings[1:] if after_newest else self._listings:
            if (found := listing.sha256_of(path)) is not None:
                return found
        return None

    def newest_and_any(self, path: str) -> tuple[str | None, str | None]:
        """(sha256 the newest commit lists the path with, that of the newest listing it): what
        the newest commit lists stays in place (`finish` deletes only what no kept commit
        lists), where an older commit's file may be gone already. Each commit looked at once."""
        newest = self._listings[0].sha256_of(path) if self._listings else None
        return newest, newest if newest is not None else self.sha256_of(path, after_newest=True)


def numbered_commits(directory: str) -> list[tuple[int, str]]:
    """(number, manifest path) of the directory's commits, oldest first. An output from before
    commits were numbered has its manifest.json kept as commit 0 first (once), so that what it
    lists is kept like any older commit's."""
    numbered = fileio.commits(directory)
    legacy = fileio.join(directory, MANIFEST_FILE)
    if not numbered and fileio.exists(legacy):
        conditional.create_exclusive(fileio.join(directory, commit_manifest(0)), fileio.read_bytes(legacy))
        numbered = fileio.commits(directory)
    return numbered


def put(directory: str, number: int, data: bytes) -> bool:
    """Write commit `number`'s manifest once: True if this call wrote it (False: it was there)."""
    return conditional.create_exclusive(fileio.join(directory, commit_manifest(number)), data)


def job_of(data: bytes) -> str | None:
    """The job that wrote a commit manifest (its timings' `job`)."""
    timings = json.loads(data).get("timings") or {}
    return timings.get("job")


def finish(directory: str, model: type[BaseModel], keep: int = KEPT_COMMITS) -> None:
    """After a commit's put: `manifest.json` made a copy of the current manifest, then what
    only commits older than the newest `keep` list deleted, then their manifests. Run again
    at any point, it ends in the same state."""
    numbered = fileio.commits(directory)
    if not numbered:
        return
    _, current = numbered[-1]
    data = fileio.read_bytes(current)
    copy = fileio.join(directory, MANIFEST_FILE)
    if not fileio.exists(copy) or fileio.read_bytes(copy) != data:
        fileio.write_bytes_atomic(copy, data, temporary=f"{copy}.tmp-copy")  # one name: a killed write's is reused
    kept, expired = numbered[-keep:], numbered[:-keep]
    if not expired:
        return
    still_listed = ListedFiles(directory, kept, model)
    for _, path in expired:
        try:  # a row group at a time, the expired commit's file table last
            for paths in listed_paths_of(directory, path, model):
                gone = [p for p in paths if still_listed.sha256_of(p) is None]
                fileio.delete_existing(sorted(fileio.join(directory, p) for p in gone))
        except ManifestError:  # its file table went already: a cleanup that died before this manifest
            pass
        fileio.delete_existing([path])  # last: until then, a retry finds what to delete


def manifest_model(raw: dict) -> type[BaseModel]:
    """The model of a committed manifest, from its JSON: shards, a vector index (`index`) or an index."""
    if "shards" in raw:
        return ShardsManifest
    return VectorIndexManifest if "inputs" in raw else IndexManifest


def finish_output(output: str, keep: int) -> None:
    """`finish` the output's index/ and shards/ (a commit that died after its put, in a directory
    this run may reuse without a job on it); the caller holds the output's lease."""
    for directory in (fileio.join(output, "index"), fileio.join(output, "shards")):
        numbered = fileio.commits(directory)
        if numbered:
            finish(directory, manifest_model(json.loads(fileio.read_bytes(numbered[-1][1]))), keep)
    fileio.delete_tree(fileio.join(output, ".staging"))  # a killed job's: no other job writes here now


@dataclass(frozen=True)
class Collected:
    """What `gc` left in one committed directory."""

    directory: str
    commits: int  # kept
    orphans: list[str]  # files no kept commit lists (deleted with `orphans`)


def _orphans(directory: str, model: type[BaseModel]) -> list[str]:
    """Files in `directory` that no commit lists, of the kind commits write (in a folder where
    they list files, with an extension they list, not hidden): what a commit that died before
    its put moved into place, where the next commit of other settings wrote other names. The
    lease, staging, rejected records and anything else kept beside them are not its."""
    numbered = fileio.commits(directory)
    folders: set[str] = set()
    extensions: set[str] = set()
    for _, manifest in numbered:
        for paths in listed_paths_of(directory, manifest, model):
            folders.update(posixpath.dirname(p) for p in paths)
            extensions.update(posixpath.splitext(p)[1] for p in paths)
    listed = ListedFiles(directory, numbered, model)
    start = len(directory.rstrip("/")) + 1
    return [
        path
        for path in fileio.list_files(directory)
        if listed.sha256_of(relative := path[start:]) is None
        and posixpath.dirname(relative) in folders
        and posixpath.splitext(relative)[1] in extensions
        and not posixpath.basename(relative).startswith(".")
    ]


def collect(path: str, keep: int, *, orphans: bool = False) -> list[Collected]:
    """`gc`: in `path` (an output, or one committed directory of it), each committed directory's
    commits but the newest `keep` deleted with what only they list, under the output's lease;
    the files no kept commit lists found, and deleted with `orphans`."""
    from pipeline.jobs.lease import ATTACHED_SECONDS, Lease

    found = [d for d in (path, fileio.join(path, "index"), fileio.join(path, "shards")) if fileio.commits(d)]
    if not found:
        raise StageError(f"{path}: no numbered commits here, nor in its index/ or shards/")
    done = []
    for directory in found:
        _, current = fileio.commits(directory)[-1]
        model = manifest_model(json.loads(fileio.read_bytes(current)))
        own_output = directory == path and model is VectorIndexManifest  # the `index` command's output
        output = directory if own_output else posixpath.dirname(directory.rstrip("/"))
        with Lease.take(output, "gc", seconds=ATTACHED_SECONDS):  # no commit under way: its files are no orphans
            finish(directory, model, keep)
            unlisted = _orphans(directory, model)
            if orphans:
                fileio.delete_existing(unlisted)
        done.append(Collected(directory, len(fileio.commits(directory)), unlisted))
    return done
