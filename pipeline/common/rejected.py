"""Rejected records, which every stage may produce: `Rejected` (with its reason and an excerpt of
what was refused), where each is written (`WriteRejected`, `rejected_file_of`), and the
rejected-share rule a commit refuses on (docs/design.md §10).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import apache_beam as beam

from pipeline.common.names import file_name
from pipeline.common.writers import write_file

EXCERPT_CHARS = 200


@dataclass(frozen=True)
class Rejected:
    source: str
    position: int
    reason: str
    excerpt: str
    details: tuple[tuple[str, object], ...] = ()  # (key, JSON value) pairs a reason adds

    def to_json(self) -> dict:
        record = {"source": self.source, "position": self.position, "reason": self.reason, "excerpt": self.excerpt}
        return {**record, **dict(self.details)}


def excerpt(value) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text[:EXCERPT_CHARS]


def rejected_share(counters: dict[str, int]) -> tuple[int, int]:
    """(records rejected, input records) of a job, from its counters."""
    rejected = sum(v for k, v in counters.items() if k.startswith("rejected_"))
    refused_unread = rejected - sum(counters.get(k, 0) for k in AFTER_PARSING)
    return rejected, counters.get("documents_read", 0) + refused_unread


NEAR_DUPLICATE = "near_duplicate_of_evaluation"  # the reason decontamination removes a document for
# reasons a parsed document is refused before it is chunked (the read counts it as read)
REFUSED_AFTER_PARSING = ("duplicate_id", NEAR_DUPLICATE)
# the counters of every document already read when refused: those, and one with no tokens
AFTER_PARSING = tuple(f"rejected_{reason}" for reason in ("duplicate_id", "no_tokens", NEAR_DUPLICATE))


def rejected_jsonl(records: list[Rejected]) -> bytes:
    ordered = sorted(records, key=lambda r: (r.source, r.position, r.reason))
    return "".join(json.dumps(r.to_json(), ensure_ascii=False) + "\n" for r in ordered).encode()


REJECTED_FILES = 256  # rejected records spread over this many files
REJECTED_BLOCK = 65_536  # positions of one source that go to the same file


def rejected_file_of(record: Rejected) -> int:
    """The file a rejected record goes to: a stable hash of its source file, plus one for each
    block of `REJECTED_BLOCK` positions, modulo `REJECTED_FILES`. A source's rejects stay in
    few files, and one bad input file of millions of records spreads over up to all of them
    (consecutive blocks, consecutive files) instead of gathering on one worker."""
    digest = hashlib.blake2b(record.source.encode(), digest_size=8).digest()
    block = max(record.position, 0) // REJECTED_BLOCK  # a whole-file reject (-1) is in block 0
    return (int.from_bytes(digest, "little") + block) % REJECTED_FILES


class WriteRejected(beam.PTransform):
    """Rejected records -> `<directory>/<name>-NNNNN.jsonl`, NNNNN chosen by `rejected_file_of`,
    each sorted by (source, position, reason); written by whichever workers hold them."""

    def __init__(self, directory: str, name: str):
        super().__init__()
        self.directory, self.name = directory, name

    def expand(self, rejected):
        def write(group):
            number, records = group
            records = list(records)
            return write_file(
                self.directory,
                file_name(self.name, number, "jsonl"),
                rejected_jsonl(records),
                len(records),
                self.directory,
            )

        return (
            rejected
            | "KeyByRejectedFile" >> beam.Map(lambda r: (rejected_file_of(r), r))
            | "GroupRejected" >> beam.GroupByKey()
            | "WriteRejectedFile" >> beam.Map(write)
        )
