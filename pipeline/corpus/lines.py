"""Byte streams of corpus files: opened (gunzipped as read), cut into lines whose first byte
lies in a byte range, each line bounded (a longer one read past a block at a time, never held:
`LongLine`), and line ends counted.
"""

from __future__ import annotations

import contextlib
import gzip
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems

from pipeline.common.rejected import EXCERPT_CHARS

READ_BLOCK_BYTES = 1 << 20  # read size when counting the lines before a range, or reading past a long line


class ByteStream(Protocol):
    """What readers use of an input file: a Beam channel or, for a .gz file, a GzipFile (which
    typing.BinaryIO, a nominal type, does not cover)."""

    def read(self, size: int = -1, /) -> bytes: ...
    def readline(self, size: int = -1, /) -> bytes: ...
    def seek(self, offset: int, whence: int = 0, /) -> int: ...
    def __iter__(self) -> Iterator[bytes]: ...


@contextlib.contextmanager
def open_input(path: str) -> Iterator[ByteStream]:
    """A stream of the file's bytes, gunzipped as they are read when its name ends in .gz."""
    with FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as raw:
        if not path.endswith(".gz"):
            yield raw
            return
        with gzip.GzipFile(fileobj=raw, mode="rb") as unzipped:
            yield unzipped


@dataclass(frozen=True)
class LongLine:
    """A line over the bound, read past: its bytes read (`read`, line end included), its size
    without the line end, and an excerpt of its start."""

    read: int
    size: int
    excerpt: str


def read_past(f: ByteStream) -> int:
    """Read on to the end of the stream a block at a time, holding none of it: the bytes read."""
    read = 0
    while block := f.read(READ_BLOCK_BYTES):
        read += len(block)
    return read


def read_past_line(f: ByteStream) -> tuple[int, bool]:
    """Read on to the end of the line a block at a time, holding none of it: (the bytes read,
    line end included; whether there was a line end, not the end of the stream)."""
    read = 0
    while block := f.readline(READ_BLOCK_BYTES):
        read += len(block)
        if block.endswith(b"\n"):
            return read, True
    return read, False


def bounded_line(f: ByteStream, max_bytes: int) -> bytes | LongLine:
    """The next line (b"" at the end), or a `LongLine` when it holds more than `max_bytes`
    bytes before its line end: read past, never held whole."""
    line = f.readline(max_bytes + 1)
    if len(line) <= max_bytes or line.endswith(b"\n"):
        return line
    rest, ended = read_past_line(f)
    read = len(line) + rest
    return LongLine(read, read - ended, line[:EXCERPT_CHARS].decode("utf-8", "replace"))


def lines_in_range(
    f: ByteStream, start: int, end: int | None, max_bytes: int
) -> tuple[bool, Iterator[bytes | LongLine]]:
    """(whether a line that began before `start` was skipped, the lines whose first byte lies in
    [start, end), a `LongLine` for each over `max_bytes`). A stream that cannot seek is read from
    its start (start must be 0)."""
    skipped = False
    if start > 0:
        f.seek(start - 1)
        if f.read(1) != b"\n":
            start += read_past_line(f)[0]
            skipped = True

    def lines():
        offset = start
        while end is None or offset < end:
            line = bounded_line(f, max_bytes)
            if not line:
                return
            yield line
            offset += line.read if isinstance(line, LongLine) else len(line)

    return skipped, lines()


def count_lines(path: str, start: int, end: int) -> int:
    """The number of line ends in bytes [start, end) of an uncompressed file."""
    count = 0
    with open_input(path) as f:
        f.seek(start)
        remaining = end - start
        while remaining > 0:
            block = f.read(min(READ_BLOCK_BYTES, remaining))
            if not block:
                break
            count += block.count(b"\n")
            remaining -= len(block)
    return count
