"""Writes that happen only if the object is as the writer last saw it: create one where none is
(`create_exclusive`), replace or delete one that has not changed since it was read
(`read_versioned`, `replace_if_unchanged`, `delete_if_unchanged`). What a lease (and any
write-once file) needs from a file system, local or gs://.

Local files: a create is a hard link of a complete temporary file to the name (link refuses
an existing name, atomically); a replace or delete holds an exclusive `flock` of the file's
directory while it compares the file's identity (inode and modification time) with the one
read. gs://: the same requests with Cloud Storage preconditions (`if_generation_match`),
through the client Beam's GCS file system uses.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import uuid
from collections.abc import Iterator

Version = tuple[int, int]  # local: (inode, mtime in ns); gs://: (generation, 0)


def create_exclusive(path: str, data: bytes) -> bool:
    """Write `data` to `path` unless something is there: True when this call created it
    (readers see it whole or not at all), False when it was there already."""
    if path.startswith("gs://"):
        return _gcs_write(path, data, generation=0)
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    temporary = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex[:12]}")
    with open(temporary, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(temporary, path)
        return True
    except FileExistsError:
        return False
    finally:
        os.unlink(temporary)


def read_versioned(path: str) -> tuple[bytes, Version] | None:
    """The object's bytes and the version they are (None: nothing there)."""
    if path.startswith("gs://"):
        from google.api_core.exceptions import NotFound, PreconditionFailed

        blob = _gcs_blob(path)
        while True:
            try:
                blob.reload()
                return blob.download_as_bytes(if_generation_match=blob.generation), (blob.generation, 0)
            except NotFound:
                return None
            except PreconditionFailed:  # replaced between the two requests: read the new one
                continue
    try:
        with open(path, "rb") as f:
            status = os.fstat(f.fileno())
            return f.read(), (status.st_ino, status.st_mtime_ns)
    except FileNotFoundError:
        return None


def replace_if_unchanged(path: str, data: bytes, version: Version) -> bool:
    """Replace the object at `path` with `data` if it is still `version`: True if replaced."""
    if path.startswith("gs://"):
        return _gcs_write(path, data, generation=version[0])
    with _locked(path):
        if _local_version(path) != version:
            return False
        temporary = f"{path}.{uuid.uuid4().hex[:12]}"
        with open(temporary, "wb") as f:
            f.write(data)
        os.replace(temporary, path)
        return True


def delete_if_unchanged(path: str, version: Version) -> bool:
    """Delete the object at `path` if it is still `version`: True if deleted."""
    if path.startswith("gs://"):
        from google.api_core.exceptions import NotFound, PreconditionFailed

        try:
            _gcs_blob(path).delete(if_generation_match=version[0])
            return True
        except (NotFound, PreconditionFailed):
            return False
    with _locked(path):
        if _local_version(path) != version:
            return False
        os.unlink(path)
        return True


def _local_version(path: str) -> Version | None:
    try:
        status = os.stat(path)
    except FileNotFoundError:
        return None
    return status.st_ino, status.st_mtime_ns


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    """An exclusive flock on the file's directory (a lock on the file itself would not outlive
    the replace, which makes a new file; a sidecar lock file would be left behind)."""
    directory = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        fcntl.flock(directory, fcntl.LOCK_EX)
        yield
    finally:
        os.close(directory)  # releases the lock


def _gcs_blob(path: str):
    from apache_beam.io.gcp.gcsio import GcsIO, parse_gcs_path

    bucket, name = parse_gcs_path(path)
    return GcsIO().client.bucket(bucket).blob(name)


def _gcs_write(path: str, data: bytes, *, generation: int) -> bool:
    """Upload unless the object's generation is no longer `generation` (0: unless it exists)."""
    from google.api_core.exceptions import PreconditionFailed

    try:
        _gcs_blob(path).upload_from_string(data, if_generation_match=generation)
        return True
    except PreconditionFailed:
        return False
