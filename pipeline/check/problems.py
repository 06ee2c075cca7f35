"""What a failed check raises (`ValidationFailed`, with its kind), and reading a listed file
after checking its size and sha256 against the manifest.
"""

from __future__ import annotations

import functools

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.common import fileio
from schemas.arrow import (
    SchemaVersionError,
)
from schemas.manifest import (
    FileEntry,
)


class ValidationFailed(ValueError):
    """The directory breaks a contract; the message names the file and the problem. `kind`
    names the check that found it (a Beam job reports problems counted by kind)."""

    def __init__(self, message: str, kind: str | None = None):
        super().__init__(message)
        self.kind = kind


def require(condition, message: str, kind: str | None = None) -> None:
    if not condition:
        raise ValidationFailed(message, kind)


def of_kind(kind: str):
    """Problems a check raises are of this kind unless a step inside it named another."""

    def wrap(check):
        @functools.wraps(check)
        def run(*args, **kwargs):
            try:
                return check(*args, **kwargs)
            except ValidationFailed as problem:
                problem.kind = problem.kind or kind
                raise
            except SchemaVersionError as err:  # a problem of the data like any other
                raise ValidationFailed(str(err), kind) from None

        return run

    return wrap


def manifest_problem(message: str) -> ValidationFailed:
    """What a missing, non-JSON or invalid manifest raises here (`read_manifest`'s `error`)."""
    return ValidationFailed(message, "manifest")


def read_checked(directory: str, entry: FileEntry) -> bytes:
    """A listed file's bytes, after checking its size and sha256 against the manifest."""
    path = fileio.join(directory, entry.path)
    require(fileio.exists(path), f"{path}: listed in the manifest but missing", "file")
    data = fileio.read_bytes(path)
    require(len(data) == entry.bytes, f"{path}: {len(data)} bytes, manifest says {entry.bytes}", "file")
    require(fileio.sha256_bytes(data) == entry.sha256, f"{path}: sha256 differs from the manifest", "file")
    return data


@of_kind("file")
def check_listed_file(directory: str, entry: FileEntry) -> None:
    """Size and sha256 of a listed file, read block by block (never held whole)."""
    path = fileio.join(directory, entry.path)
    require(fileio.exists(path), f"{path}: listed in the manifest but missing")
    digest, size = fileio.sha256_file(path)
    require(size == entry.bytes, f"{path}: {size} bytes, manifest says {entry.bytes}")
    require(digest == entry.sha256, f"{path}: sha256 differs from the manifest")


@of_kind("file")
def check_listed_sizes(directory: str, entries: list[FileEntry]) -> None:
    """The sizes of listed files (`fileio.sizes`: no file read); one problem naming every file
    missing or of another size (the first ten)."""
    sizes = fileio.sizes(directory, [e.path for e in entries])
    wrong = [
        f"{fileio.join(directory, e.path)}: "
        + (
            f"{sizes[e.path]} bytes, manifest says {e.bytes}"
            if e.path in sizes
            else "listed in the manifest but missing"
        )
        for e in entries
        if sizes.get(e.path) != e.bytes
    ]
    more = f" (and {len(wrong) - 10} more files)" if len(wrong) > 10 else ""
    require(not wrong, "; ".join(wrong[:10]) + more)


def checked_parquet(directory: str, entry: FileEntry) -> pa.Table:
    table = pq.read_table(pa.BufferReader(read_checked(directory, entry)))
    require(
        table.num_rows == entry.rows,
        f"{directory}/{entry.path}: {table.num_rows} rows, manifest says {entry.rows}",
        "file",
    )
    return table
