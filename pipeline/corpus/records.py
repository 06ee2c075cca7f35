"""The records reading produces: `Document`, `DocRef` (where one was read), `FileRange` (the part
of one input file a worker parses); a `Record` is a document or a rejected record
(`pipeline.common.rejected`).
"""

from __future__ import annotations

import hashlib
import posixpath
from dataclasses import dataclass

from pipeline.common.rejected import Rejected

METRICS_NAMESPACE = "ratrain"


@dataclass(frozen=True)
class Document:
    doc_id: int  # stable 64-bit id derived from `identity`
    identity: str  # id_field value, or "<relative path>:<line>"
    text: str
    source: str
    position: int  # line (jsonl), row (parquet) or 0 (text)


@dataclass(frozen=True, order=True)
class DocRef:
    """Where a document was read: all that deciding which copy of a doc id is kept needs (the
    first by source, then position), and the key its text is joined back by."""

    source: str
    position: int

    @classmethod
    def of(cls, doc: Document) -> DocRef:
        return cls(doc.source, doc.position)

    @property
    def key(self) -> tuple[str, int]:
        """A shuffle key for the document: primitives, which Beam encodes as they are."""
        return self.source, self.position


Record = Document | Rejected


@dataclass(frozen=True)
class FileRange:
    """The part of one input file that one worker parses.

    JSONL: bytes [start, end); a line belongs to the range that holds its first byte.
    Parquet: row groups [start, end). end None: to the end of the file.
    records_before: lines (JSONL) or rows (Parquet) of the file before `start`, which number the
    range's records as if the file were read whole; None until they are counted."""

    path: str
    base: str
    start: int = 0
    end: int | None = None
    records_before: int | None = 0

    @property
    def relative(self) -> str:
        return posixpath.relpath(self.path, self.base) if self.path.startswith(self.base) else self.path


def doc_id_for(identity: str) -> int:
    """Stable non-negative 64-bit id (fits int64) of a document identity."""
    digest = hashlib.blake2b(identity.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") & 0x7FFF_FFFF_FFFF_FFFF
