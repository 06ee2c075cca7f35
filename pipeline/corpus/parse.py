"""Read corpora (JSONL, Parquet, plain text; plain or gzip) into documents.

Files are read as streams, record by record, so a worker's memory does not grow with a file's
size; a line or a text file longer than the config's bounds is read past a block at a time,
never held, and becomes a `too_long` record (`max_record_bytes`, `max_document_bytes`); an
uncompressed JSONL or Parquet file larger than `SPLIT_BYTES` is cut into ranges that several
workers parse (`FileRange`). Pure functions turn one range into `Document`s or
`Rejected` records; `ReadCorpus` only lists, splits and fans out. A record that cannot be used is
never dropped silently: it becomes a `Rejected` with its source, position and reason.
"""

from __future__ import annotations

import json
import posixpath
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from apache_beam.io.filesystems import FileSystems

from pipeline.common.rejected import EXCERPT_CHARS, Rejected, excerpt
from pipeline.corpus.lines import ByteStream, LongLine, lines_in_range, open_input, read_past
from pipeline.corpus.records import Document, FileRange, Record, doc_id_for
from schemas.stage_config import CorpusConfig

SPLIT_BYTES = 64 << 20  # an uncompressed JSONL or Parquet file larger than this is read in ranges
PARQUET_BATCH_ROWS = 1024  # rows decoded at a time: bounds memory for long documents
TOO_LONG = "too_long"


def glob_base(pattern: str) -> str:
    """The directory part of a glob before its first wildcard: identities are relative to it,
    so moving a corpus does not change its doc ids."""
    head = re.split(r"[*?\[]", pattern, maxsplit=1)[0]
    return head if head.endswith("/") else posixpath.dirname(head) + "/"


def too_long(source: str, position: int, size: int, *, limit: str, cfg: CorpusConfig, raw) -> Rejected:
    """A record or document over one of the corpus's bounds (`limit`: which), with its size."""
    bound = getattr(cfg, limit)
    return Rejected(
        source, position, TOO_LONG, excerpt(raw), details=(("bytes", size), ("limit", limit), ("limit_bytes", bound))
    )


def _document(text, identity: str, source: str, position: int, *, raw, cfg: CorpusConfig) -> Record:
    if not isinstance(text, str):
        reason = "missing_text" if text is None else "text_not_a_string"
        return Rejected(source, position, reason, excerpt(raw))
    if len(text) > cfg.max_document_bytes // 4:  # a str's UTF-8 is at most 4 bytes a character
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > cfg.max_document_bytes:
            return too_long(source, position, size, limit="max_document_bytes", cfg=cfg, raw=text[:EXCERPT_CHARS])
    if not text.strip():
        return Rejected(source, position, "empty_text", excerpt(raw))
    return Document(doc_id_for(identity), identity, text, source, position)


def _identity(record: dict, id_field: str | None, relative: str, position: int) -> str | None:
    if id_field is None:
        return f"{relative}:{position}"
    value = record.get(id_field)
    if value is None or isinstance(value, (dict, list)):
        return None
    return str(value)


def _fields(record: dict, cfg: CorpusConfig, source: str, relative: str, *, position: int, raw) -> Record:
    """One parsed JSON object or Parquet row -> its Document, or why it is refused. An empty or
    blank id is refused: every such record would share one doc id (one group, one worker)."""
    identity = _identity(record, cfg.id_field, relative, position)
    if identity is None:
        return Rejected(source, position, "missing_id", excerpt(raw))
    if not identity.strip():
        return Rejected(source, position, "empty_id", excerpt(raw))
    return _document(record.get(cfg.text_field), identity, source, position, raw=raw, cfg=cfg)


def parse_jsonl(
    lines: Iterable[bytes | LongLine], cfg: CorpusConfig, source: str, relative: str, first_line: int = 1
) -> Iterator[Record]:
    """One JSON object per line (lines end in \\n); `first_line` numbers the first one."""
    for number, line in enumerate(lines, start=first_line):
        if isinstance(line, LongLine):
            yield too_long(source, number, line.size, limit="max_record_bytes", cfg=cfg, raw=line.excerpt)
            continue
        line = line.rstrip(b"\r\n")
        if not line.strip():
            continue
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError:
            yield Rejected(source, number, "invalid_utf8", excerpt(line[:EXCERPT_CHARS]))
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError:
            yield Rejected(source, number, "malformed_json", excerpt(text))
            continue
        if not isinstance(record, dict):
            yield Rejected(source, number, "not_an_object", excerpt(text))
            continue
        yield _fields(record, cfg, source, relative, position=number, raw=text)


def _schema_problem(schema: pa.Schema, cfg: CorpusConfig) -> str | None:
    """Why a Parquet file's schema cannot give documents, or None: a missing text or id column,
    or a text column that does not hold strings."""
    missing = [f for f in (cfg.text_field, cfg.id_field) if f and f not in schema.names]
    if missing:
        return f"missing column(s) {missing}; has {schema.names}"
    text_type = schema.field(cfg.text_field).type
    if pa.types.is_dictionary(text_type):
        text_type = text_type.value_type
    if not (pa.types.is_string(text_type) or pa.types.is_large_string(text_type) or pa.types.is_string_view(text_type)):
        return f"column {cfg.text_field!r} is {text_type}, not string"
    return None


def _plain_text(batch: pa.RecordBatch, cfg: CorpusConfig) -> pa.RecordBatch:
    """The batch with its text column as plain strings (a dictionary or string view decoded),
    which Arrow's string kernels take."""
    column = batch.schema.get_field_index(cfg.text_field)
    texts = batch.column(column)
    if pa.types.is_string(texts.type) or pa.types.is_large_string(texts.type):
        return batch
    return batch.set_column(column, cfg.text_field, texts.cast(pa.large_string()))


def _long_texts(batch: pa.RecordBatch, cfg: CorpusConfig) -> set[int]:
    """The rows of a Parquet batch whose text is over `max_document_bytes` (UTF-8)."""
    sizes = pc.binary_length(batch.column(cfg.text_field))
    return set(np.flatnonzero(pc.fill_null(pc.greater(sizes, cfg.max_document_bytes), False)).tolist())


def parse_parquet(
    parquet: pq.ParquetFile,
    cfg: CorpusConfig,
    source: str,
    relative: str,
    *,
    row_groups: range | None = None,
    first_row: int = 0,
) -> Iterator[Record]:
    """One row per document; positions are row numbers of the file, starting at 0."""
    problem = _schema_problem(parquet.schema_arrow, cfg)
    if problem:  # the whole file is refused (by its first range only): say how many rows that is
        if row_groups is None or row_groups.start == 0:
            yield Rejected(
                source, -1, "wrong_schema", f"{problem}; rows in file: {parquet.metadata.num_rows}"[:EXCERPT_CHARS]
            )
        return
    columns = [c for c in (cfg.text_field, cfg.id_field) if c]
    row = first_row
    for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=columns, row_groups=row_groups):
        batch = _plain_text(batch, cfg)
        long = _long_texts(batch, cfg)
        if long:  # refused before they become Python strings
            texts = batch.column(cfg.text_field)
            sizes = pc.binary_length(texts).to_pylist()
            starts = pc.utf8_slice_codeunits(pc.take(texts, sorted(long)), 0, EXCERPT_CHARS).to_pylist()
            excerpts = dict(zip(sorted(long), starts))
            column = batch.schema.get_field_index(cfg.text_field)
            mask = pa.array([i in long for i in range(batch.num_rows)])
            batch = batch.set_column(column, cfg.text_field, pc.if_else(mask, pa.scalar(None, texts.type), texts))
        for i, record in enumerate(batch.to_pylist()):
            if i in long:
                yield too_long(source, row, sizes[i], limit="max_document_bytes", cfg=cfg, raw=excerpts[i])
            else:
                yield _fields(record, cfg, source, relative, position=row, raw=record)
            row += 1


def parse_text(f: ByteStream, cfg: CorpusConfig, source: str, relative: str) -> Iterator[Record]:
    """A whole file is one document; its identity is its relative path. A file (decompressed)
    over `max_document_bytes` is read past, not held."""
    data = f.read(cfg.max_document_bytes + 1)
    if len(data) > cfg.max_document_bytes:
        size = len(data) + read_past(f)
        start = data[:EXCERPT_CHARS].decode("utf-8", "replace")
        yield too_long(source, 0, size, limit="max_document_bytes", cfg=cfg, raw=start)
        return
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        yield Rejected(source, 0, "invalid_utf8", excerpt(data[:EXCERPT_CHARS]))
        return
    yield _document(text, relative, source, 0, raw=text, cfg=cfg)


def _records(r: FileRange, cfg: CorpusConfig, f: ByteStream) -> Iterator[Record]:
    before, relative = r.records_before, cfg.path_identity(r.relative)
    if before is None:  # a bug, not a bad file: RuntimeError is not caught as unreadable_file
        raise RuntimeError(f"{r.path} [{r.start}, {r.end}): parsed before the records before it were counted")
    if cfg.format == "jsonl":
        skipped, lines = lines_in_range(f, r.start, r.end, cfg.max_record_bytes)
        yield from parse_jsonl(lines, cfg, r.path, relative, before + 1 + skipped)
    elif cfg.format == "parquet":
        parquet = pq.ParquetFile(f)
        groups = None if r.end is None else range(r.start, r.end)
        yield from parse_parquet(parquet, cfg, r.path, relative, row_groups=groups, first_row=before)
    else:
        yield from parse_text(f, cfg, r.path, relative)


def parse_range(r: FileRange, cfg: CorpusConfig) -> Iterator[Record]:
    """Every record of one range, streamed. A file that cannot be read becomes one Rejected
    record: at position -1 when nothing of it was read, else at the position where reading
    broke off (the records before it are kept)."""
    position = -1
    try:
        with open_input(r.path) as f:
            for record in _records(r, cfg, f):
                position = record.position
                yield record
    except (OSError, EOFError, ValueError) as err:  # gzip, parquet and I/O errors
        at = -1 if position == -1 else position + 1
        yield Rejected(r.path, at, "unreadable_file", f"{type(err).__name__}: {err}"[:EXCERPT_CHARS])


def parse_file(path: str, base: str, cfg: CorpusConfig) -> Iterator[Record]:
    """Every record of one whole file."""
    return parse_range(FileRange(path, base), cfg)


def split_file(path: str, base: str, size: int, cfg: CorpusConfig, split_bytes: int = SPLIT_BYTES) -> list[FileRange]:
    """The ranges one file is read in: byte ranges of an uncompressed JSONL file (lines before
    each not yet counted), groups of row groups of about `split_bytes` of a Parquet file, else
    the whole file."""
    whole = [FileRange(path, base)]
    if size <= split_bytes or path.endswith(".gz") or cfg.format == "text":
        return whole
    if cfg.format == "jsonl":
        return [
            FileRange(path, base, start, min(start + split_bytes, size), None) for start in range(0, size, split_bytes)
        ]
    try:
        with open_input(path) as f:
            meta = pq.ParquetFile(f).metadata
    except (OSError, ValueError):
        return whole  # parse_range reports it
    sizes = np.array([meta.row_group(g).total_byte_size for g in range(meta.num_row_groups)])
    rows = np.array([meta.row_group(g).num_rows for g in range(meta.num_row_groups)])
    cut = np.flatnonzero(np.diff(np.cumsum(sizes) // split_bytes)) + 1  # first group of each range
    starts = [0, *cut.tolist()]
    ends = [*cut.tolist(), meta.num_row_groups]
    return [FileRange(path, base, s, e, int(rows[:s].sum())) for s, e in zip(starts, ends)]


def number_ranges(keyed: tuple[str, Iterable[tuple[FileRange, int]]]) -> Iterator[FileRange]:
    """The byte ranges of one JSONL file with their line ends counted -> the ranges with the
    lines before each (a prefix sum in file order)."""
    _, counted = keyed
    before = 0
    for r, lines in sorted(counted, key=lambda rc: rc[0].start):
        yield replace(r, records_before=before)
        before += lines


@dataclass(frozen=True, order=True)
class GlobMatch:
    """A file as one corpus glob lists it (ordered by glob number: the first glob's base wins)."""

    glob_number: int
    base: str  # the glob's base, which the file's document identities are relative to
    size: int  # bytes
    modified: float  # seconds since the epoch, as the filesystem gives it


@dataclass(frozen=True)
class ListedFile:
    """A corpus file to read: its path, the base of the first glob that matched it, and what
    the listing said of it."""

    path: str
    base: str
    size: int
    modified: float

    @classmethod
    def of(cls, path: str, match: GlobMatch) -> ListedFile:
        return cls(path, match.base, match.size, match.modified)


def match_pattern(numbered: tuple[int, str]) -> Iterator[tuple[str, GlobMatch]]:
    """(glob number, glob) -> (path, GlobMatch) of every file it matches; an error if it matches
    none. A file two globs match keeps the first glob's base (`first_glob`)."""
    number, pattern = numbered
    (result,) = FileSystems.match([pattern])
    if not result.metadata_list:
        raise FileNotFoundError(f"input glob matches no file: {pattern}")
    for meta in result.metadata_list:
        yield meta.path, GlobMatch(number, glob_base(pattern), meta.size_in_bytes, meta.last_updated_in_seconds)


def first_glob(matches: Iterable[GlobMatch]) -> GlobMatch:
    return min(matches)


def check_globs_match(cfg: CorpusConfig) -> None:
    """An error naming the first glob that matches no file (one listing call per glob, at most
    one file listed each)."""
    for pattern, result in zip(cfg.paths, FileSystems.match(cfg.paths, limits=[1] * len(cfg.paths))):
        if not result.metadata_list:
            raise FileNotFoundError(f"input glob matches no file: {pattern}")


def match_corpus(cfg: CorpusConfig) -> list[ListedFile]:
    """Every file the globs match, sorted by path; error if a glob matches nothing. In one
    process: a job lists its files inside the job (`ReadCorpus`)."""
    files: dict[str, list[GlobMatch]] = {}
    for numbered in enumerate(cfg.paths):
        for path, match in match_pattern(numbered):
            files.setdefault(path, []).append(match)
    return [ListedFile.of(path, first_glob(matches)) for path, matches in sorted(files.items())]
