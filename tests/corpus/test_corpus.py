import gzip
import io
import json
import subprocess
import sys

import apache_beam as beam
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from apache_beam.pipeline import PipelineVisitor
from apache_beam.testing.util import assert_that, equal_to

from pipeline.common.rejected import Rejected
from pipeline.corpus.lines import count_lines
from pipeline.corpus.parse import (
    glob_base,
    match_corpus,
    number_ranges,
    parse_file,
    parse_jsonl,
    parse_range,
    split_file,
)
from pipeline.corpus.read import ReadCorpus
from pipeline.corpus.records import Document, doc_id_for
from schemas.stage_config import CorpusConfig
from tests.helpers import REPO, local_pipeline


def cfg(path, **kw):
    return CorpusConfig(paths=[str(path)], **kw)


@pytest.mark.unit
def test_doc_id_is_stable_and_int64():
    assert doc_id_for("library/re") == doc_id_for("library/re")
    assert doc_id_for("library/re") != doc_id_for("library/re2")
    assert 0 <= doc_id_for("x") < 2**63


@pytest.mark.unit
def test_jsonl_every_bad_record_is_rejected_with_its_reason():
    lines = [
        json.dumps({"id": "a", "text": "good text"}).encode(),
        b"{not json",
        b"[1, 2]",
        json.dumps({"id": "b"}).encode(),
        json.dumps({"id": "c", "text": 7}).encode(),
        json.dumps({"id": "d", "text": "   "}).encode(),
        b'{"id": "e", "text": "\xff\xfe"}',
        json.dumps({"text": "no id"}).encode(),
    ]
    records = list(parse_jsonl(io.BytesIO(b"\n".join(lines)), CorpusConfig(paths=["x"], id_field="id"), "f", "f"))
    assert isinstance(records[0], Document) and records[0].text == "good text"
    assert [r.reason for r in records[1:]] == [
        "malformed_json",
        "not_an_object",
        "missing_text",
        "text_not_a_string",
        "empty_text",
        "invalid_utf8",
        "missing_id",
    ]
    assert [r.position for r in records] == list(range(1, 9))


@pytest.mark.unit
def test_an_empty_or_blank_id_is_rejected_as_empty_id(tmp_path):
    """Every record with an empty id would share one doc id, so one group: each is refused."""
    lines = [json.dumps({"id": i, "text": "some text"}).encode() for i in ("", "  \t", " x ", 0)]
    jsonl = list(parse_jsonl(io.BytesIO(b"\n".join(lines)), CorpusConfig(paths=["x"], id_field="id"), "f", "f"))
    assert [r.reason if isinstance(r, Rejected) else r.identity for r in jsonl] == ["empty_id", "empty_id", " x ", "0"]
    pq.write_table(pa.table({"id": ["", "p", " "], "text": ["a", "b", "c"]}), tmp_path / "t.parquet")
    rows = parse_file(str(tmp_path / "t.parquet"), str(tmp_path) + "/", cfg(tmp_path, format="parquet", id_field="id"))
    assert [(r.position, r.reason if isinstance(r, Rejected) else r.identity) for r in rows] == [
        (0, "empty_id"),
        (1, "p"),
        (2, "empty_id"),
    ]


@pytest.mark.unit
def test_identity_without_id_field_is_relative_path_and_line(tmp_path):
    (tmp_path / "sub").mkdir()
    path = tmp_path / "sub" / "c.jsonl"
    path.write_text('{"text": "one"}\n{"text": "two"}\n')
    pattern = str(tmp_path / "**.jsonl")
    assert glob_base(pattern) == str(tmp_path) + "/"
    docs = list(parse_file(str(path), glob_base(pattern), cfg(pattern)))
    assert [d.identity for d in docs] == ["sub/c.jsonl:1", "sub/c.jsonl:2"]


@pytest.mark.unit
def test_gzip_parquet_and_text_formats(tmp_path):
    gz = tmp_path / "a.jsonl.gz"
    gz.write_bytes(gzip.compress(b'{"id": "g", "text": "zipped"}\n'))
    assert [d.text for d in parse_file(str(gz), str(tmp_path) + "/", cfg(gz, id_field="id"))] == ["zipped"]

    pq.write_table(pa.table({"doc": ["p1", "p2"], "body": ["first", "second"]}), tmp_path / "t.parquet")
    docs = list(
        parse_file(
            str(tmp_path / "t.parquet"),
            str(tmp_path) + "/",
            cfg(tmp_path, format="parquet", text_field="body", id_field="doc"),
        )
    )
    assert [(d.identity, d.text, d.position) for d in docs] == [("p1", "first", 0), ("p2", "second", 1)]

    (tmp_path / "page.txt").write_text("a whole file")
    (doc,) = parse_file(str(tmp_path / "page.txt"), str(tmp_path) + "/", cfg(tmp_path, format="text"))
    assert doc.identity == "page.txt" and doc.text == "a whole file"


@pytest.mark.unit
def test_unreadable_files_become_rejected_records(tmp_path):
    (tmp_path / "bad.jsonl.gz").write_bytes(b"not gzip at all" * 10)
    (tmp_path / "bad.parquet").write_bytes(b"garbage, not parquet")
    pq.write_table(pa.table({"other": ["x"]}), tmp_path / "wrong.parquet")
    base = str(tmp_path) + "/"
    (gz,) = parse_file(str(tmp_path / "bad.jsonl.gz"), base, cfg(tmp_path))
    (garbage,) = parse_file(str(tmp_path / "bad.parquet"), base, cfg(tmp_path, format="parquet"))
    (wrong,) = parse_file(str(tmp_path / "wrong.parquet"), base, cfg(tmp_path, format="parquet"))
    assert (gz.reason, garbage.reason, wrong.reason) == ("unreadable_file", "unreadable_file", "wrong_schema")
    assert gz.position == garbage.position == -1  # nothing of these files was read


@pytest.mark.unit
def test_a_truncated_gzip_keeps_the_lines_before_the_cut_and_rejects_the_rest(tmp_path):
    lines = [json.dumps({"id": f"d{i}", "text": f"document {i} " + "x" * (i % 97)}) for i in range(5000)]
    whole = gzip.compress("\n".join(lines).encode() + b"\n")
    (tmp_path / "cut.jsonl.gz").write_bytes(whole[: len(whole) // 2])
    *docs, cut = parse_file(str(tmp_path / "cut.jsonl.gz"), str(tmp_path) + "/", cfg(tmp_path, id_field="id"))
    assert 0 < len(docs) < len(lines)
    assert [d.text for d in docs] == [json.loads(line)["text"] for line in lines[: len(docs)]]
    assert (cut.reason, cut.position) == ("unreadable_file", len(docs) + 1)
    assert cut.excerpt.startswith("EOFError")


def jsonl_with_awkward_lines(path, count=400):
    """Lines of very different lengths (some longer than a split), blank lines, CRLF ends and bad
    records, so that range boundaries fall everywhere."""
    lines = []
    for i in range(count):
        text = f"document {i} " + "word " * ((i * 37) % 300)
        lines.append(json.dumps({"text": text}).encode() + (b"\r\n" if i % 5 == 0 else b"\n"))
        if i % 17 == 0:
            lines.append(b"\n")
        if i % 23 == 0:
            lines.append(b"{broken\n")
    path.write_bytes(b"".join(lines))
    return path


def parse_in_ranges(path, base, corpus, split_bytes):
    """What the workers of ReadCorpus parse: the file's ranges, numbered as SplitFiles does."""
    ranges = split_file(str(path), base, path.stat().st_size, corpus, split_bytes)
    uncounted = [r for r in ranges if r.records_before is None]
    if uncounted:
        ranges = list(number_ranges((str(path), [(r, count_lines(r.path, r.start, r.end)) for r in uncounted])))
    return ranges, [record for r in ranges for record in parse_range(r, corpus)]


@pytest.mark.parametrize("split_bytes", [1000, 4096, 777_777])
@pytest.mark.unit
def test_jsonl_read_in_byte_ranges_equals_the_file_read_whole(tmp_path, split_bytes):
    path = jsonl_with_awkward_lines(tmp_path / "c.jsonl")
    base = str(tmp_path) + "/"
    whole = list(parse_file(str(path), base, cfg(path)))
    ranges, records = parse_in_ranges(path, base, cfg(path), split_bytes)
    assert len(ranges) == -(-path.stat().st_size // split_bytes)
    assert records == whole
    assert len([r for r in whole if isinstance(r, Rejected)]) == 18  # the broken lines, numbered as read whole


@pytest.mark.unit
def test_parquet_read_in_row_group_ranges_equals_the_file_read_whole(tmp_path):
    texts = [f"row {i} " + "word " * ((i * 13) % 200) for i in range(3000)]
    texts[1234] = None
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"text": texts}), path, row_group_size=100)
    base = str(tmp_path) + "/"
    corpus = cfg(path, format="parquet")
    whole = list(parse_file(str(path), base, corpus))
    ranges, records = parse_in_ranges(path, base, corpus, 50_000)
    assert len(ranges) > 5 and [r.start for r in ranges[1:]] == [r.end for r in ranges[:-1]]
    assert records == whole and len(whole) == 3000


@pytest.mark.beam
def test_read_corpus_splits_large_files_and_reads_the_same_documents(tmp_path):
    jsonl_with_awkward_lines(tmp_path / "a.jsonl")
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress((tmp_path / "a.jsonl").read_bytes()))  # not split
    corpus = cfg(tmp_path / "*.jsonl*")
    expected = [parse_file(f.path, f.base, corpus) for f in match_corpus(corpus)]
    expected = sorted(
        (r.source, r.position, r.identity if isinstance(r, Document) else r.reason)
        for records in expected
        for r in records
    )
    with local_pipeline() as p:
        documents, rejected, _ = p | ReadCorpus(corpus, split_bytes=2048)
        keys = (
            (documents | "DocKeys" >> beam.Map(lambda d: (d.source, d.position, d.identity))),
            (rejected | "RejectedKeys" >> beam.Map(lambda r: (r.source, r.position, r.reason))),
        )
        assert_that(keys | beam.Flatten(), equal_to(expected))


@pytest.mark.unit
def test_glob_matching_nothing_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="matches no file"):
        match_corpus(cfg(tmp_path / "*.jsonl"))


def grouped_by(p, label: str):
    """The PCollection that the transform labelled `label` (the last part of its full label) reads."""

    class Find(PipelineVisitor):
        found: list = []

        def enter_composite_transform(self, node):
            self.visit_transform(node)

        def visit_transform(self, node):
            if node.full_label.rsplit("/", 1)[-1] == label:
                self.found.append(node.inputs[0])

    p.visit(finder := Find())
    (pcoll,) = finder.found
    return pcoll


@pytest.mark.beam
def test_read_corpus_keeps_one_of_duplicate_ids(tmp_path):
    """The first copy by (source, position) is kept; the doc-id group holds where each copy was
    read, none of their texts."""
    (tmp_path / "a.jsonl").write_text(
        '{"id": "y", "text": "other"}\n{"id": "x", "text": "first"}\n{"id": "x", "text": "third"}\n'
    )
    (tmp_path / "b.jsonl").write_text('{"id": "x", "text": "second"}\n{"id": "z"}\n')
    with local_pipeline() as p:
        documents, rejected, _ = p | ReadCorpus(cfg(tmp_path / "*.jsonl", id_field="id"))
        assert_that(
            documents | "Texts" >> beam.Map(lambda d: (d.identity, d.text)),
            equal_to([("x", "first"), ("y", "other")]),
            label="KeptDocuments",
        )
        assert_that(
            rejected
            | "Reasons"
            >> beam.Map(
                lambda r: (r.source.rsplit("/", 1)[1], r.position, r.reason, r.excerpt.replace(str(tmp_path), ""))
            ),
            equal_to(
                [
                    ("a.jsonl", 3, "duplicate_id", "id 'x' first seen at /a.jsonl:2"),
                    ("b.jsonl", 1, "duplicate_id", "id 'x' first seen at /a.jsonl:2"),
                    ("b.jsonl", 2, "missing_text", '{"id": "z"}'),
                ]
            ),
            label="RejectedRecords",
        )
        assert_that(
            grouped_by(p, "GroupByDocId") | "GroupedValues" >> beam.Map(lambda kv: type(kv[1]).__name__),
            equal_to(["DocRef"] * 4),
            label="NoTextsGrouped",
        )


PEAK_RSS_GROWTH = """
import resource, sys
from pipeline.corpus.parse import parse_file
from pipeline.corpus.records import Document
from schemas.stage_config import CorpusConfig

path, fmt = sys.argv[1], sys.argv[2]
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
documents = sum(isinstance(r, Document) for r in parse_file(path, "/", CorpusConfig(paths=[path], format=fmt)))
print(documents, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


def write_big_corpus(path, fmt, min_bytes):
    """About `min_bytes` of uncompressed text in one file, written a block at a time."""
    line = json.dumps({"text": "a line of a long crawl shard, " * 10}).encode() + b"\n"
    block_lines = 20_000
    blocks = -(-min_bytes // (len(line) * block_lines))
    if fmt == "parquet":
        text = json.loads(line)["text"]
        with pq.ParquetWriter(path, pa.schema([("text", pa.string())])) as writer:
            for _ in range(blocks):
                writer.write_table(pa.table({"text": [text] * block_lines}))
    else:
        with gzip.open(path, "wb", compresslevel=1) if str(path).endswith(".gz") else open(path, "wb") as f:
            for _ in range(blocks):
                f.write(line * block_lines)
    return blocks * block_lines


@pytest.mark.parametrize("name,fmt", [("big.jsonl.gz", "jsonl"), ("big.jsonl", "jsonl"), ("big.parquet", "parquet")])
@pytest.mark.e2e  # 3 × 256 MB written and parsed in a subprocess: too heavy for -m unit
def test_one_input_file_larger_than_a_worker_may_hold_is_read_in_bounded_memory(tmp_path, name, fmt):
    """A file of 256 MB of text is parsed while the process grows by less than a quarter of it
    (reading the file whole, as bytes or rows, takes more than the file)."""
    file_bytes = 256 << 20
    path = tmp_path / name
    rows = write_big_corpus(path, fmt, file_bytes)
    out = subprocess.run(
        [sys.executable, "-c", PEAK_RSS_GROWTH, str(path), fmt],
        check=True,
        capture_output=True,
        text=True,
        cwd=REPO,
    ).stdout
    documents, growth = map(int, out.split())
    assert documents == rows
    assert growth < file_bytes // 4, f"peak RSS grew by {growth >> 20} MB reading {file_bytes >> 20} MB"
