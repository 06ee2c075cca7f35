import gzip
import json

import apache_beam as beam
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from apache_beam.testing.util import assert_that, equal_to

from pipeline.corpus import (Document, ReadCorpus, doc_id_for, glob_base, match_corpus,
                             parse_file, parse_jsonl)
from schemas.config import CorpusConfig
from tests.conftest import local_pipeline


def cfg(path, **kw):
    return CorpusConfig(paths=[str(path)], **kw)


def test_doc_id_is_stable_and_int64():
    assert doc_id_for("library/re") == doc_id_for("library/re")
    assert doc_id_for("library/re") != doc_id_for("library/re2")
    assert 0 <= doc_id_for("x") < 2**63


def test_jsonl_every_bad_record_is_rejected_with_its_reason():
    lines = [json.dumps({"id": "a", "text": "good text"}).encode(), b"{not json",
             b"[1, 2]", json.dumps({"id": "b"}).encode(), json.dumps({"id": "c", "text": 7}).encode(),
             json.dumps({"id": "d", "text": "   "}).encode(), b'{"id": "e", "text": "\xff\xfe"}',
             json.dumps({"text": "no id"}).encode()]
    records = list(parse_jsonl(b"\n".join(lines), CorpusConfig(paths=["x"], id_field="id"), "f", "f"))
    assert isinstance(records[0], Document) and records[0].text == "good text"
    assert [r.reason for r in records[1:]] == ["malformed_json", "not_an_object", "missing_text",
                                              "text_not_a_string", "empty_text", "invalid_utf8",
                                              "missing_id"]
    assert [r.position for r in records] == list(range(1, 9))


def test_identity_without_id_field_is_relative_path_and_line(tmp_path):
    (tmp_path / "sub").mkdir()
    path = tmp_path / "sub" / "c.jsonl"
    path.write_text('{"text": "one"}\n{"text": "two"}\n')
    pattern = str(tmp_path / "**.jsonl")
    assert glob_base(pattern) == str(tmp_path) + "/"
    docs = list(parse_file(str(path), glob_base(pattern), cfg(pattern)))
    assert [d.identity for d in docs] == ["sub/c.jsonl:1", "sub/c.jsonl:2"]


def test_gzip_parquet_and_text_formats(tmp_path):
    gz = tmp_path / "a.jsonl.gz"
    gz.write_bytes(gzip.compress(b'{"id": "g", "text": "zipped"}\n'))
    assert [d.text for d in parse_file(str(gz), str(tmp_path) + "/", cfg(gz, id_field="id"))] == ["zipped"]

    pq.write_table(pa.table({"doc": ["p1", "p2"], "body": ["first", "second"]}), tmp_path / "t.parquet")
    docs = list(parse_file(str(tmp_path / "t.parquet"), str(tmp_path) + "/",
                           cfg(tmp_path, format="parquet", text_field="body", id_field="doc")))
    assert [(d.identity, d.text, d.position) for d in docs] == [("p1", "first", 0), ("p2", "second", 1)]

    (tmp_path / "page.txt").write_text("a whole file")
    (doc,) = parse_file(str(tmp_path / "page.txt"), str(tmp_path) + "/", cfg(tmp_path, format="text"))
    assert doc.identity == "page.txt" and doc.text == "a whole file"


def test_unreadable_files_become_rejected_records(tmp_path):
    (tmp_path / "bad.jsonl.gz").write_bytes(gzip.compress(b'{"text": "x"}\n' * 50)[:30])
    (tmp_path / "bad.parquet").write_bytes(b"garbage, not parquet")
    pq.write_table(pa.table({"other": ["x"]}), tmp_path / "wrong.parquet")
    base = str(tmp_path) + "/"
    (gz,) = parse_file(str(tmp_path / "bad.jsonl.gz"), base, cfg(tmp_path))
    (garbage,) = parse_file(str(tmp_path / "bad.parquet"), base, cfg(tmp_path, format="parquet"))
    (wrong,) = parse_file(str(tmp_path / "wrong.parquet"), base, cfg(tmp_path, format="parquet"))
    assert (gz.reason, garbage.reason, wrong.reason) == ("unreadable_file", "unreadable_file", "wrong_schema")


def test_glob_matching_nothing_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="matches no file"):
        match_corpus(cfg(tmp_path / "*.jsonl"))


def test_read_corpus_keeps_one_of_duplicate_ids(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"id": "x", "text": "first"}\n{"id": "y", "text": "other"}\n')
    (tmp_path / "b.jsonl").write_text('{"id": "x", "text": "second"}\n{"id": "z"}\n')
    with local_pipeline() as p:
        documents, rejected = p | ReadCorpus(cfg(tmp_path / "*.jsonl", id_field="id"))
        assert_that(documents | "Texts" >> beam.Map(lambda d: (d.identity, d.text)),
                    equal_to([("x", "first"), ("y", "other")]), label="KeptDocuments")
        assert_that(rejected | "Reasons" >> beam.Map(lambda r: (r.source.rsplit("/", 1)[1], r.position, r.reason)),
                    equal_to([("b.jsonl", 1, "duplicate_id"), ("b.jsonl", 2, "missing_text")]),
                    label="RejectedRecords")
