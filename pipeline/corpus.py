"""Read corpora (JSONL, Parquet, plain text; plain or gzip) into documents.

Pure functions turn one file's bytes into `Document`s or `Rejected` records; `ReadCorpus`
only matches the globs and fans the files out. A record that cannot be used is never dropped
silently: it becomes a `Rejected` with its source, position and reason.
"""
from __future__ import annotations

import gzip
import hashlib
import io
import json
import posixpath
import re
from dataclasses import dataclass
from typing import Iterator, Union

import apache_beam as beam
import pyarrow as pa
import pyarrow.parquet as pq
from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems
from apache_beam.metrics import Metrics

from schemas.config import CorpusConfig

METRICS_NAMESPACE = "ratrain"
EXCERPT_CHARS = 200


@dataclass(frozen=True)
class Document:
    doc_id: int          # stable 64-bit id derived from `identity`
    identity: str        # id_field value, or "<relative path>:<line>"
    text: str
    source: str
    position: int        # line (jsonl), row (parquet) or 0 (text)


@dataclass(frozen=True)
class Rejected:
    source: str
    position: int
    reason: str
    excerpt: str

    def to_json(self) -> dict:
        return {"source": self.source, "position": self.position, "reason": self.reason,
                "excerpt": self.excerpt}


Record = Union[Document, Rejected]


def doc_id_for(identity: str) -> int:
    """Stable non-negative 64-bit id (fits int64) of a document identity."""
    digest = hashlib.blake2b(identity.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") & 0x7FFF_FFFF_FFFF_FFFF


def glob_base(pattern: str) -> str:
    """The directory part of a glob before its first wildcard: identities are relative to it,
    so moving a corpus does not change its doc ids."""
    head = re.split(r"[*?\[]", pattern, maxsplit=1)[0]
    return head if head.endswith("/") else posixpath.dirname(head) + "/"


def _excerpt(value) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text[:EXCERPT_CHARS]


def _document(text, identity: str, source: str, position: int, raw) -> Record:
    if not isinstance(text, str):
        reason = "missing_text" if text is None else "text_not_a_string"
        return Rejected(source, position, reason, _excerpt(raw))
    if not text.strip():
        return Rejected(source, position, "empty_text", _excerpt(raw))
    return Document(doc_id_for(identity), identity, text, source, position)


def _identity(record: dict, id_field: str | None, relative: str, position: int) -> str | None:
    if id_field is None:
        return f"{relative}:{position}"
    value = record.get(id_field)
    if value is None or isinstance(value, (dict, list)):
        return None
    return str(value)


def parse_jsonl(data: bytes, cfg: CorpusConfig, source: str, relative: str) -> Iterator[Record]:
    """One JSON object per line; line numbers start at 1."""
    for number, line in enumerate(data.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError:
            yield Rejected(source, number, "invalid_utf8", _excerpt(line[:EXCERPT_CHARS]))
            continue
        except json.JSONDecodeError:
            yield Rejected(source, number, "malformed_json", _excerpt(line.decode("utf-8")))
            continue
        if not isinstance(record, dict):
            yield Rejected(source, number, "not_an_object", _excerpt(line.decode("utf-8")))
            continue
        identity = _identity(record, cfg.id_field, relative, number)
        if identity is None:
            yield Rejected(source, number, "missing_id", _excerpt(line.decode("utf-8")))
            continue
        yield _document(record.get(cfg.text_field), identity, source, number, line.decode("utf-8"))


def _schema_problem(schema: pa.Schema, cfg: CorpusConfig) -> str | None:
    """Why a Parquet file's schema cannot give documents, or None: a missing text or id column,
    or a text column that does not hold strings."""
    missing = [f for f in (cfg.text_field, cfg.id_field) if f and f not in schema.names]
    if missing:
        return f"missing column(s) {missing}; has {schema.names}"
    text_type = schema.field(cfg.text_field).type
    if pa.types.is_dictionary(text_type):
        text_type = text_type.value_type
    if not (pa.types.is_string(text_type) or pa.types.is_large_string(text_type)
            or pa.types.is_string_view(text_type)):
        return f"column {cfg.text_field!r} is {text_type}, not string"
    return None


def parse_parquet(data: bytes, cfg: CorpusConfig, source: str, relative: str) -> Iterator[Record]:
    """One row per document; positions are row numbers starting at 0."""
    parquet = pq.ParquetFile(io.BytesIO(data))
    problem = _schema_problem(parquet.schema_arrow, cfg)
    if problem:  # the whole file is refused: say how many rows that is
        yield Rejected(source, -1, "wrong_schema", f"{problem}; rows in file: {parquet.metadata.num_rows}"[:EXCERPT_CHARS])
        return
    columns = [c for c in (cfg.text_field, cfg.id_field) if c]
    row = 0
    for batch in parquet.iter_batches(columns=columns, batch_size=4096):
        for record in batch.to_pylist():
            identity = _identity(record, cfg.id_field, relative, row)
            if identity is None:
                yield Rejected(source, row, "missing_id", _excerpt(record))
            else:
                yield _document(record[cfg.text_field], identity, source, row, record)
            row += 1


def parse_text(data: bytes, cfg: CorpusConfig, source: str, relative: str) -> Iterator[Record]:
    """A whole file is one document; its identity is its relative path."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        yield Rejected(source, 0, "invalid_utf8", _excerpt(data[:EXCERPT_CHARS]))
        return
    yield _document(text, relative, source, 0, text)


PARSERS = {"jsonl": parse_jsonl, "parquet": parse_parquet, "text": parse_text}


def read_file_bytes(path: str) -> bytes:
    """The file's content, gunzipped when its name ends in .gz."""
    with FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as f:
        data = f.read()
    return gzip.decompress(data) if path.endswith(".gz") else data


def parse_file(path: str, base: str, cfg: CorpusConfig) -> Iterator[Record]:
    """Every record of one file; an unreadable file becomes one Rejected record."""
    relative = posixpath.relpath(path, base) if path.startswith(base) else path
    try:
        data = read_file_bytes(path)
        records = list(PARSERS[cfg.format](data, cfg, path, relative))
    except (OSError, EOFError, ValueError) as err:  # gzip, parquet and I/O errors
        yield Rejected(path, -1, "unreadable_file", f"{type(err).__name__}: {err}"[:EXCERPT_CHARS])
        return
    yield from records


def match_corpus(cfg: CorpusConfig) -> list[tuple[str, str]]:
    """(path, glob base) of every file the globs match, sorted; error if a glob matches nothing."""
    files = {}
    for pattern, result in zip(cfg.paths, FileSystems.match(cfg.paths)):
        paths = [m.path for m in result.metadata_list]
        if not paths:
            raise FileNotFoundError(f"input glob matches no file: {pattern}")
        for path in paths:
            files.setdefault(path, glob_base(pattern))
    return sorted(files.items())


AFTER_PARSING = ("rejected_duplicate_id", "rejected_no_tokens")  # of documents already read


def rejected_share(counters: dict[str, int]) -> tuple[int, int]:
    """(records rejected, input records) of a job, from its counters."""
    rejected = sum(v for k, v in counters.items() if k.startswith("rejected_"))
    refused_unread = rejected - sum(counters.get(k, 0) for k in AFTER_PARSING)
    return rejected, counters.get("documents_read", 0) + refused_unread


class _ParseFile(beam.DoFn):
    REJECTED = "rejected"

    def __init__(self, cfg: CorpusConfig):
        self.cfg = cfg
        self.documents = Metrics.counter(METRICS_NAMESPACE, "documents_read")

    def process(self, file):
        path, base = file
        for record in parse_file(path, base, self.cfg):
            if isinstance(record, Rejected):
                Metrics.counter(METRICS_NAMESPACE, f"rejected_{record.reason}").inc()
                yield beam.pvalue.TaggedOutput(self.REJECTED, record)
            else:
                self.documents.inc()
                yield record


def _keep_first(keyed) -> Iterator[Record]:
    """Of documents sharing a doc id, keep the first by (source, position); reject the rest."""
    _, docs = keyed
    first, *rest = sorted(docs, key=lambda d: (d.source, d.position))
    yield first
    for dup in rest:
        Metrics.counter(METRICS_NAMESPACE, "rejected_duplicate_id").inc()
        yield beam.pvalue.TaggedOutput(
            _ParseFile.REJECTED,
            Rejected(dup.source, dup.position, "duplicate_id",
                     f"id {dup.identity!r} first seen at {first.source}:{first.position}"))


class ReadCorpus(beam.PTransform):
    """Files matched by a CorpusConfig -> (documents, rejected); doc ids are unique."""

    def __init__(self, cfg: CorpusConfig, match: bool = True):
        super().__init__()
        self.cfg = cfg
        # at construction: a glob that matches nothing fails early (a dry run lists no files)
        self.files = match_corpus(cfg) if match else [(p, glob_base(p)) for p in cfg.paths]

    def expand(self, pbegin):
        parsed = (pbegin
                  | "ListFiles" >> beam.Create(self.files)
                  | "SpreadFiles" >> beam.Reshuffle()
                  | "ParseFiles" >> beam.ParDo(_ParseFile(self.cfg)).with_outputs(
                      _ParseFile.REJECTED, main="documents"))
        unique = (parsed.documents
                  | "KeyByDocId" >> beam.Map(lambda d: (d.doc_id, d))
                  | "GroupByDocId" >> beam.GroupByKey()
                  | "DropDuplicateIds" >> beam.FlatMap(_keep_first).with_outputs(
                      _ParseFile.REJECTED, main="documents"))
        rejected = ((parsed.rejected, unique.rejected)
                    | "MergeRejected" >> beam.Flatten())
        return unique.documents, rejected
