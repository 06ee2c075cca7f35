"""`ReadCorpus`: the corpus as `Document`s and `Rejected` records, in Beam: files listed and split
into ranges (`SplitFiles`), parsed, duplicate document ids kept once (the first by source and
position, decided on where the copies were read, without their texts), and optionally screened
(`Screen`: decontamination) in the same step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Final, Literal, Protocol

import apache_beam as beam
from apache_beam.metrics import Metrics

from pipeline.common.rejected import Rejected
from pipeline.corpus.lines import count_lines
from pipeline.corpus.parse import (
    SPLIT_BYTES,
    ListedFile,
    check_globs_match,
    first_glob,
    match_pattern,
    number_ranges,
    parse_range,
    split_file,
)
from pipeline.corpus.records import METRICS_NAMESPACE, DocRef, Document, FileRange
from schemas.manifest import InputFile
from schemas.stage_config import CorpusConfig


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


class Screen(Protocol):
    """A rule over the documents kept, decided from the whole corpus (decontamination's).
    `ReadCorpus` hands `side_inputs` its file ranges and every parsed document, and applies
    `rejection` where it keeps the first copy of each doc id: the documents then wait for
    nothing but the shuffle that keeps them once, and are not held a second time for the rule."""

    def side_inputs(self, ranges: beam.PCollection, parsed: beam.PCollection) -> tuple[beam.pvalue.AsSideInput, ...]:
        """What `rejection` is given after the document (built once per `ReadCorpus`)."""
        ...

    @staticmethod
    def rejection(doc: Document, *side_inputs) -> Rejected | None:
        """The document's rejection, or None to keep it (a plain function: it runs on the workers)."""
        ...


def _keep_first(
    keyed, rejection: Callable[..., Rejected | None] | None = None, *side_inputs
) -> Iterator[Document | beam.pvalue.TaggedOutput[Literal["rejected"], Rejected]]:
    """A document joined with the first copy of its doc id, when it is not that copy -> the
    document (or the screen's rejection of it), or its rejection naming the first copy.
    (Beam reads a tagged output's type only with its tag as a Literal: _ParseRange.REJECTED.)"""
    _, joined = keyed
    (doc,) = joined["document"]
    first = list(joined["first_copy"])
    if not first:
        refused = rejection(doc, *side_inputs) if rejection is not None else None
        if refused is None:
            yield doc
        else:
            Metrics.counter(METRICS_NAMESPACE, f"rejected_{refused.reason}").inc()
            yield beam.pvalue.TaggedOutput(_ParseRange.REJECTED, refused)
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
    """ListedFiles -> the FileRanges to parse, each numbered: the line
    ends of a split JSONL file are counted range by range (in parallel) and summed per file."""

    def __init__(self, cfg: CorpusConfig, split_bytes: int = SPLIT_BYTES):
        super().__init__()
        self.cfg = cfg
        self.split_bytes = split_bytes

    def expand(self, files):
        ranges = (
            files
            | "Split"
            >> beam.FlatMap(
                lambda file, cfg, most: split_file(file.path, file.base, file.size, cfg, most),
                self.cfg,
                self.split_bytes,
            )
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
    documents get the identities they would get in a read of all the files. With a `screen`,
    the documents it rejects are among the rejected instead."""

    def __init__(
        self,
        cfg: CorpusConfig,
        match: bool = True,
        split_bytes: int = SPLIT_BYTES,
        screen: Screen | None = None,
        only: frozenset[str] | None = None,
    ):
        super().__init__()
        self.cfg = cfg
        self.split_bytes = split_bytes
        self.screen = screen
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
            | "OnlyThese" >> beam.Filter(lambda keyed: only is None or keyed[0] in only)
            | "Listed" >> beam.MapTuple(ListedFile.of)
        )
        ranges = (
            files
            | "SpreadFiles" >> beam.Reshuffle()
            | "SplitFiles" >> SplitFiles(self.cfg, self.split_bytes)
            | "SpreadRanges" >> beam.Reshuffle()
        )
        parsed = ranges | "ParseRanges" >> beam.ParDo(_ParseRange(self.cfg)).with_outputs(
            _ParseRange.REJECTED, main="documents"
        )
        rejection, side_inputs = None, ()
        if self.screen is not None:
            rejection, side_inputs = self.screen.rejection, self.screen.side_inputs(ranges, parsed.documents)
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
            | "DropDuplicateIds"
            >> beam.FlatMap(_keep_first, rejection, *side_inputs).with_outputs(_ParseRange.REJECTED, main="documents")
        )
        rejected = (parsed.rejected, unique.rejected) | "MergeRejected" >> beam.Flatten()
        read = files | "FilesRead" >> beam.Map(InputFile.listed)
        return unique.documents, rejected, read
