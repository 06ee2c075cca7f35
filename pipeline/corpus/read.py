"""`ReadCorpus`: the corpus as `Document`s and `Rejected` records, in Beam: files listed and split
into ranges (`SplitFiles`), parsed, duplicate document ids kept once (the first by source and
position, decided on where the copies were read, without their texts).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Final, Literal

import apache_beam as beam
from apache_beam.metrics import Metrics

from pipeline.corpus.parse import (
    SPLIT_BYTES,
    check_globs_match,
    count_lines,
    first_glob,
    match_pattern,
    number_ranges,
    parse_range,
    split_file,
)
from pipeline.corpus.records import METRICS_NAMESPACE, DocRef, Document, FileRange, Rejected
from schemas.config import CorpusConfig
from schemas.manifest import InputFile


class _ParseRange(beam.DoFn):
    REJECTED: Final = "rejected"

    def __init__(self, cfg: CorpusConfig):
        self.cfg = cfg
        self.documents = Metrics.counter(METRICS_NAMESPACE, "documents_read")

    def process(self, file_range: FileRange):
        for record in parse_range(file_range, self.cfg):
            if isinstance(record, Rejected):
                Metrics.counter(METRICS_NAMESPACE, f"rejected_{record.reason}").inc()
                yield beam.pvalue.TaggedOutput(self.REJECTED, record)
            else:
                self.documents.inc()
                yield record


def _later_copies(keyed) -> Iterator[tuple[tuple[str, int], DocRef]]:
    """Where the copies of one doc id were read -> (copy's key, first copy) for every copy but the
    first by (source, position). Two passes over the group and no list of it: the group holds
    no text, and a runner that pages a large group holds one ref of it at a time."""
    _, refs = keyed
    first = min(refs)
    for ref in refs:
        if ref != first:
            yield ref.key, first


def _keep_first(keyed) -> Iterator[Document | beam.pvalue.TaggedOutput[Literal["rejected"], Rejected]]:
    """A document joined with the first copy of its doc id, when it is not that copy -> the
    document, or its rejection naming the first copy.
    (Beam reads a tagged output's type only with its tag as a Literal: _ParseRange.REJECTED.)"""
    _, joined = keyed
    (doc,) = joined["document"]
    first = list(joined["first_copy"])
    if not first:
        yield doc
        return
    Metrics.counter(METRICS_NAMESPACE, "rejected_duplicate_id").inc()
    yield beam.pvalue.TaggedOutput(
        _ParseRange.REJECTED,
        Rejected(
            doc.source,
            doc.position,
            "duplicate_id",
            f"id {doc.identity!r} first seen at {first[0].source}:{first[0].position}",
        ),
    )


class SplitFiles(beam.PTransform):
    """(path, base, size) of input files -> the FileRanges to parse, each numbered: the line
    ends of a split JSONL file are counted range by range (in parallel) and summed per file."""

    def __init__(self, cfg: CorpusConfig, split_bytes: int = SPLIT_BYTES):
        super().__init__()
        self.cfg = cfg
        self.split_bytes = split_bytes

    def expand(self, files):
        ranges = (
            files
            | "Split" >> beam.FlatMap(lambda file, cfg, most: split_file(*file, cfg, most), self.cfg, self.split_bytes)
            | "ByNumbering" >> beam.Partition(lambda r, _: int(r.records_before is None), 2)
        )
        numbered = (
            ranges[1]
            | "SpreadCounts" >> beam.Reshuffle()
            | "CountLines" >> beam.Map(lambda r: (r.path, (r, count_lines(r.path, r.start, r.end))))
            | "GroupByFile" >> beam.GroupByKey()
            | "NumberRanges" >> beam.FlatMap(number_ranges)
        )
        return (ranges[0], numbered) | "AllRanges" >> beam.Flatten()


class ReadCorpus(beam.PTransform):
    """Files matched by a CorpusConfig (of them, `only` these paths) -> (documents, rejected,
    the files read as `InputFile`s); doc ids are unique. `only` keeps the globs' bases, so
    documents get the identities they would get in a read of all the files."""

    def __init__(
        self,
        cfg: CorpusConfig,
        match: bool = True,
        split_bytes: int = SPLIT_BYTES,
        only: frozenset[str] | None = None,
    ):
        super().__init__()
        self.cfg = cfg
        self.split_bytes = split_bytes
        self.only = only
        if match:  # at construction: a glob that matches nothing fails early (a dry run lists no files)
            check_globs_match(cfg)

    def expand(self, pbegin):
        # the files are listed inside the job, so the job graph holds the globs, not the files
        only = self.only
        files = (
            pbegin
            | "Globs" >> beam.Create(list(enumerate(self.cfg.paths)))
            | "ListFiles" >> beam.FlatMap(match_pattern)
            | "FirstGlobPerFile" >> beam.CombinePerKey(first_glob)
            | "OnlyThese" >> beam.Filter(lambda listed: only is None or listed[0] in only)
            | "FileSizes" >> beam.MapTuple(lambda path, match: (path, match[1], match[2]))
        )
        parsed = (
            files
            | "SpreadFiles" >> beam.Reshuffle()
            | "SplitFiles" >> SplitFiles(self.cfg, self.split_bytes)
            | "SpreadRanges" >> beam.Reshuffle()
            | "ParseRanges" >> beam.ParDo(_ParseRange(self.cfg)).with_outputs(_ParseRange.REJECTED, main="documents")
        )
        # only (source, position) is grouped by doc id; the texts are joined back one by one
        first_copies = (
            parsed.documents
            | "RefByDocId" >> beam.Map(lambda d: (d.doc_id, DocRef.of(d)))
            | "GroupByDocId" >> beam.GroupByKey()
            | "LaterCopies" >> beam.FlatMap(_later_copies)
        )
        unique = (
            {
                "document": parsed.documents | "DocumentByRef" >> beam.Map(lambda d: (DocRef.of(d).key, d)),
                "first_copy": first_copies,
            }
            | "JoinFirstCopies" >> beam.CoGroupByKey()
            | "DropDuplicateIds" >> beam.FlatMap(_keep_first).with_outputs(_ParseRange.REJECTED, main="documents")
        )
        rejected = (parsed.rejected, unique.rejected) | "MergeRejected" >> beam.Flatten()
        read = files | "FilesRead" >> beam.MapTuple(lambda path, _base, size: InputFile(path=path, bytes=size))
        return unique.documents, rejected, read
