"""File access through Beam `FileSystems` (local paths and gs://) and the commit protocol.

A stage writes into a staging directory beside its final one and is committed by moving the
files into place and writing manifest.json last (docs/design.md §8): a killed run never leaves a
directory that looks complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
import uuid
from collections.abc import Iterator
from typing import TypeVar

import pyarrow.compute as pc
from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems
from pydantic import BaseModel

from schemas.file_table import (
    entry_column_batches,
    entry_columns,
    entry_fields,
    whole_manifest,
)
from schemas.file_table import entry_group as _table_entry_group
from schemas.file_table import entry_group_columns as _table_entry_group_columns
from schemas.file_table import entry_groups as _table_entry_groups
from schemas.manifest import COMMIT_MANIFEST, MANIFEST_FILE, ManifestError, chosen_manifest, read_manifest

Model = TypeVar("Model", bound=BaseModel)


def use_anonymous_gcs_for_emulator() -> None:
    """With STORAGE_EMULATOR_HOST set (a local GCS emulator), Beam's GCS client goes anonymous
    at once: otherwise it retries Google default credentials for ~25 s before doing so. Beam
    offers no option for this (`--no_auth` is not read by gcsio), so its credentials cache is
    seeded with "none"; every process that touches gs:// imports this module."""
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        from apache_beam.internal.gcp import auth

        with auth._Credentials._credentials_lock:
            auth._Credentials._credentials_init, auth._Credentials._credentials = True, None


use_anonymous_gcs_for_emulator()


def join(base: str, *parts: str) -> str:
    return FileSystems.join(base, *parts)


def exists(path: str) -> bool:
    return FileSystems.exists(path)


def open_read(path: str):
    """A seekable binary reader (local or gs://)."""
    return FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED)


def read_bytes(path: str) -> bytes:
    with FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as f:
        return f.read()


def open_write(path: str):
    """A binary writer (local or gs://); the file appears complete when it is closed."""
    return FileSystems.create(path, compression_type=CompressionTypes.UNCOMPRESSED)


def write_bytes(path: str, data: bytes) -> None:
    with open_write(path) as f:
        f.write(data)


def write_json_atomic(path: str, obj) -> None:
    """Write JSON to a temporary name, then rename it: readers see all of it or nothing."""
    write_bytes_atomic(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def write_bytes_atomic(path: str, data: bytes, temporary: str | None = None) -> None:
    """Write to a temporary name (`temporary`, default a random one), then rename it: readers
    see all of it or nothing."""
    tmp = temporary or f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    write_bytes(tmp, data)
    FileSystems.rename([tmp], [path])


def read_json(path: str):
    return json.loads(read_bytes(path))


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str, digest=None) -> tuple[str, int]:
    """Stream a file (local or gs://) through sha256 a block at a time, never holding it whole:
    (hex digest, bytes read). `digest`: a hashlib object to feed instead (one hash over several
    files); the hex digest returned is then its running one."""
    digest, size = digest if digest is not None else hashlib.sha256(), 0
    with open_read(path) as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
            size += len(block)
    return digest.hexdigest(), size


def commits(directory: str) -> list[tuple[int, str]]:
    """(number, path) of every commit manifest in `directory` (`manifest-NNNNNN.json`), oldest
    first: one listing of that name's prefix."""
    found = FileSystems.match([join(directory, "manifest-*.json")])[0].metadata_list
    numbered = [(COMMIT_MANIFEST.fullmatch(posixpath.basename(m.path)), m.path) for m in found]
    return sorted((int(match.group(1)), path) for match, path in numbered if match)


def current_manifest(directory: str, number: int | None = None, *, look_again: bool = True) -> tuple[str, bytes] | None:
    """(path, bytes) of the manifest of the directory's current commit, its newest (or of
    commit `number`; `schemas.manifest.chosen_manifest`), found with one listing. None: nothing
    committed (or no such commit). `look_again`: the newest replaced or deleted between the
    listing and the read is looked for again, once."""
    found = FileSystems.match([join(directory, "manifest*.json")])[0].metadata_list
    chosen = chosen_manifest([posixpath.basename(m.path) for m in found], number)
    if chosen is None:
        return None
    path = join(directory, chosen[1])
    try:
        return path, read_bytes(path)
    except OSError:
        if number is not None:
            return None
        if not look_again:
            raise
        return current_manifest(directory, look_again=False)


def kept_commit_of(directory: str, sha256: str) -> tuple[str, bytes] | None:
    """(path, bytes) of the commit manifest in `directory` whose sha256 this is: the current
    one, or an older one while it is kept (what a reader that started from it pins). None:
    no such commit is kept."""
    found = current_manifest(directory)
    if found is not None and sha256_bytes(found[1]) == sha256:
        return found
    for _, path in reversed(commits(directory)):  # the kept commits, from one listing
        try:
            data = read_bytes(path)
        except OSError:  # deleted as no longer kept since the listing
            continue
        if sha256_bytes(data) == sha256:
            return path, data
    return None


def no_commit(directory: str, number: int) -> str:
    """What a reader asked for commit `number` of `directory`, which is not there, says."""
    kept = ", ".join(str(n) for n, _ in commits(directory))
    if not kept:
        return f"{directory}: no commit {number}, no commits here (an output's are in its index/ and shards/)"
    return f"{directory}: no commit {number} (commits kept: {kept})"


def manifest_sha256(directory: str) -> str | None:
    """The sha256 of the current commit's manifest (None: nothing committed): a job that read a
    committed stage checks it again before it relies on what it read."""
    found = current_manifest(directory)
    return sha256_bytes(found[1]) if found is not None else None


def committed_manifest(directory: str, model=None, *, number: int | None = None, error=ManifestError):
    """The manifest of a committed directory (local or gs://), of its current commit or of
    commit `number`, parsed and checked by `schemas.manifest.read_manifest` (`model`, `error`:
    as there), with its file entries (`whole`)."""
    manifest = committed_summary(directory, model, number=number, error=error)
    return manifest if model is None else whole(manifest, directory, error=error)


def committed(directory: str, model: type[Model]) -> Model | None:
    """The committed manifest of `directory` (its fields, `committed_summary`: entries only where
    they are inline; a file table's are read where needed, a row group at a time), or None: none
    there, or an older or foreign one (which nothing can be reused from)."""
    try:
        return committed_summary(directory, model)
    except ValueError:
        return None


def committed_summary(directory: str, model=None, *, number: int | None = None, error=ManifestError):
    """`committed_manifest` without reading a file table: a manifest whose entries are in one
    lists none inline, so read them with `entry_paths_and_rows`, never from the model."""
    found = current_manifest(directory, number)
    if found is None and number is not None:
        raise error(no_commit(directory, number))
    path, data = found if found is not None else (join(directory, MANIFEST_FILE), None)
    return read_manifest(data, path, model, error=error)


def entry_paths_and_rows(manifest, directory: str, prefix: str | None = None) -> tuple[list[str], list[int]]:
    """(paths, rows) of the manifest's entries (those under `prefix/`), in manifest order, from
    the two columns alone (`schemas.file_table.entry_columns`): no object per entry."""
    table = under(entry_columns(manifest, directory, ["path", "rows"], open_file=open_read), prefix)
    return table["path"].to_pylist(), table["rows"].to_pylist()


def entry_batches(
    manifest, directory: str, columns: list[str], prefix: str | tuple[str, ...] | None = None
) -> Iterator:
    """These columns of the manifest's entries (those under `prefix/`), in manifest order, as
    Arrow tables a row group of its file table at a time (`schemas.file_table.entry_column_batches`):
    never all at once, and no Python object per entry."""
    for table in entry_column_batches(manifest, directory, columns, open_file=open_read):
        yield under(table, prefix)


def listed_paths(manifest, directory: str, prefix: str) -> Iterator[str]:
    """The paths (relative to `directory`) of the manifest's entries under `prefix/`, in manifest
    order, a row group of its file table at a time."""
    for table in entry_batches(manifest, directory, ["path"], prefix):
        yield from table["path"].to_pylist()


def entry_groups(manifest, directory: str, *, error=ManifestError) -> int:
    """How many row groups of entries the manifest's file table holds (1 for inline entries), the
    table checked against the manifest (`schemas.file_table.entry_groups`)."""
    return _table_entry_groups(manifest, directory, open_file=open_read, error=error)


def entry_group(manifest, directory: str, group: int, *, error=ManifestError) -> list:
    """The entries of one row group of the manifest's file table (`schemas.file_table.entry_group`)."""
    return _table_entry_group(manifest, directory, group, open_file=open_read, error=error)


def entry_group_columns(manifest, directory: str, group: int, columns: list[str], *, error=ManifestError):
    """These columns of one row group of the manifest's file table, as Arrow (no object per entry)."""
    return _table_entry_group_columns(manifest, directory, group, columns, open_file=open_read, error=error)


def entry_paths_and_sha256(manifest, directory: str, prefix: str | None = None) -> list[tuple[str, str]]:
    """(path, sha256) of the manifest's entries (those under `prefix/`), from those two columns
    alone, the file table checked against the manifest first (what files are checked against)."""
    table = under(entry_columns(manifest, directory, ["path", "sha256"], open_file=open_read, hashed=True), prefix)
    return list(zip(table["path"].to_pylist(), table["sha256"].to_pylist()))


def entries_under(manifest, directory: str, prefix: str) -> list[dict]:
    """The manifest's entries under `prefix/` as dicts of every column, chosen in Arrow a row
    group at a time: an object for those alone, never a column of every entry. The file table
    is checked against the manifest first, streamed (these are what files are checked against)."""
    entry_groups(manifest, directory)
    fields = entry_fields(manifest)
    return [entry for table in entry_batches(manifest, directory, fields, prefix) for entry in table.to_pylist()]


def under(table, prefix: str | tuple[str, ...] | None):
    """The file table's rows under `prefix/` (or under any of several; all with None), chosen
    before any becomes a Python object: a caller after the faiss files of a table listing 10^6
    files makes a few."""
    if prefix is None:
        return table
    prefixes = (prefix,) if isinstance(prefix, str) else prefix
    pattern = "^(?:" + "|".join(re.escape(p) for p in prefixes) + ")/"
    return table.filter(pc.match_substring_regex(table["path"], pattern))


def whole(manifest, directory: str, *, error=ManifestError):
    """A manifest read from `directory` with every file entry inline, read from its file table
    where it has one (`schemas.file_table.whole_manifest`, through Beam's file systems)."""
    return whole_manifest(manifest, directory, open_read, error)


def list_metadata(directory: str) -> list:
    """Beam's FileMetadata (path, size_in_bytes) of every file below `directory` (recursively),
    from one listing; [] when there is none (an object store has no directories, only names
    under a prefix)."""
    pattern = join(directory, "**") if "://" in directory else directory.rstrip("/") + "/**"
    return FileSystems.match([pattern])[0].metadata_list


_LISTING_DIGITS = 3  # a size check lists the names sharing all but a file number's last three digits


def _listing_prefix(path: str) -> str:
    """Where a listing finds `path`: its name up to its number's last three digits (at most
    1,000 numbered files a width share it), or the whole name for one without a number."""
    found = re.search(r"\d+(?=(?:\.[\w.]+)?$)", path, re.ASCII)
    cut = found.end() - _LISTING_DIGITS if found and found.end() - found.start() > _LISTING_DIGITS else len(path)
    return path[:cut]


def _listing_pattern(prefix: str) -> str:
    """The glob that lists the names starting with `prefix`: `prefix*`, or where the prefix holds
    a glob character, everything below the folder before it (`*` does not cross "/")."""
    head = re.split(r"[*?[\]]", prefix)[0]
    return f"{prefix}*" if head == prefix else f"{head[: head.rfind('/') + 1]}**"


def sizes(directory: str, paths: list[str]) -> dict[str, int]:
    """The size of each of these files under `directory` that exists (a missing one is absent):
    on local disk one stat each; in an object store one listing per name prefix
    (`_listing_prefix`), so no listing returns more than ~1,000 names however many files the
    directory holds."""
    found: dict[str, int] = {}
    if "://" not in directory:
        for path in paths:
            try:
                found[path] = os.stat(join(directory, path)).st_size
            except (FileNotFoundError, NotADirectoryError):
                pass
        return found
    wanted = set(paths)
    start = len(directory.rstrip("/")) + 1
    for pattern in sorted({_listing_pattern(_listing_prefix(path)) for path in paths}):
        for metadata in FileSystems.match([join(directory, pattern)])[0].metadata_list:
            if metadata.path[start:] in wanted:
                found[metadata.path[start:]] = metadata.size_in_bytes
    return found


def list_files(directory: str) -> list[str]:
    """Every file below `directory` (recursively), sorted."""
    return sorted(m.path for m in list_metadata(directory))


def delete_existing(paths: list[str]) -> None:
    """Delete those of `paths` that exist (FileSystems.delete fails on a missing one): a
    deletion run again after it died half-way finishes it."""
    there = [path for path in paths if exists(path)]
    if there:
        FileSystems.delete(there)


def delete_tree(directory: str) -> None:
    files = list_files(directory)
    if files:
        FileSystems.delete(files)
    if "://" not in directory and exists(directory):  # local directories outlive their files
        FileSystems.delete([directory])


def ensure_parent(path: str) -> None:
    """Create the local parent directory of `path` (object stores have no directories)."""
    parent = posixpath.dirname(path)
    if "://" not in path and not exists(parent):
        FileSystems.mkdirs(parent)


def move(source: str, target: str) -> None:
    """Rename one file, replacing `target`."""
    if exists(target):
        FileSystems.delete([target])
    ensure_parent(target)
    FileSystems.rename([source], [target])
