"""`ReadCorpus`: the corpus as `Document`s and `Rejected` records, in Beam: files listed and split
into ranges (`SplitFiles`), parsed, duplicate document ids kept once (the first by position).
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
from pipeline.corpus.records import METRICS_NAMESPACE, Document, FileRange, Rejected
from schemas.config import CorpusConfig


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


def _keep_first(keyed) -> Iterator[Document | beam.pvalue.TaggedOutput[Literal["rejected"], Rejected]]:
    """Of documents sharing a doc id, keep the first by (source, position); reject the rest.
    (Beam reads a tagged output's type only with its tag as a Literal: _ParseRange.REJECTED.)"""
    _, docs = keyed
    first, *rest = sorted(docs, key=lambda d: (d.source, d.position))
    yield first
    for dup in rest:
        Metrics.counter(METRICS_NAMESPACE, "rejected_duplicate_id").inc()
        yield beam.pvalue.TaggedOutput(
            _ParseRange.REJECTED,
            Rejected(
                dup.source,
                dup.position,
                "duplicate_id",
                f"id {dup.identity!r} first seen at {first.source}:{first.position}",
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
    """Files matched by a CorpusConfig -> (documents, rejected); doc ids are unique."""

    def __init__(self, cfg: CorpusConfig, match: bool = True, split_bytes: int = SPLIT_BYTES):
        super().__init__()
        self.cfg = cfg
        self.split_bytes = split_bytes
        if match:  # at construction: a glob that matches nothing fails early (a dry run lists no files)
            check_globs_match(cfg)

    def expand(self, pbegin):
        # the files are listed inside the job, so the job graph holds the globs, not the files
        parsed = (
            pbegin
            | "Globs" >> beam.Create(list(enumerate(self.cfg.paths)))
            | "ListFiles" >> beam.FlatMap(match_pattern)
            | "FirstGlobPerFile" >> beam.CombinePerKey(first_glob)
            | "FileSizes" >> beam.MapTuple(lambda path, match: (path, match[1], match[2]))
            | "SpreadFiles" >> beam.Reshuffle()
            | "SplitFiles" >> SplitFiles(self.cfg, self.split_bytes)
            | "SpreadRanges" >> beam.Reshuffle()
            | "ParseRanges" >> beam.ParDo(_ParseRange(self.cfg)).with_outputs(_ParseRange.REJECTED, main="documents")
        )
        unique = (
            parsed.documents
            | "KeyByDocId" >> beam.Map(lambda d: (d.doc_id, d))
            | "GroupByDocId" >> beam.GroupByKey()
            | "DropDuplicateIds" >> beam.FlatMap(_keep_first).with_outputs(_ParseRange.REJECTED, main="documents")
        )
        rejected = (parsed.rejected, unique.rejected) | "MergeRejected" >> beam.Flatten()
        return unique.documents, rejected
