"""Records and documents over the corpus's bounds are rejected as too_long, with their size,
and read past without being held: the records around them are read as if they were not there."""

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.common.rejected import Rejected
from pipeline.corpus.lines import bounded_line
from pipeline.corpus.parse import parse_file
from pipeline.corpus.records import Document
from schemas.stage_config import CorpusConfig
from tests.corpus.test_corpus import parse_in_ranges

pytestmark = pytest.mark.unit


def cfg(path, **kw):
    return CorpusConfig(paths=[str(path)], id_field=None, **kw)


def record(text: str) -> bytes:
    return json.dumps({"text": text}).encode() + b"\n"


def summary(records):
    return [
        (r.position, "doc", r.text[:10]) if isinstance(r, Document) else (r.position, r.reason, dict(r.details))
        for r in records
    ]


class Reads:
    """A stream that records the largest single read asked of it."""

    def __init__(self, f):
        self.f, self.largest = f, 0

    def readline(self, size=-1):
        line = self.f.readline(size)
        self.largest = max(self.largest, len(line))
        return line


def test_a_line_over_the_bound_is_read_past_in_blocks_never_whole():
    import io

    long = b"x" * (5 << 20) + b"\n"
    stream = Reads(io.BytesIO(b"short\n" + long + b"after\n"))
    assert bounded_line(stream, 100) == b"short\n"
    skipped = bounded_line(stream, 100)
    assert (skipped.read, skipped.size, skipped.excerpt) == (len(long), len(long) - 1, "x" * 101)
    assert bounded_line(stream, 100) == b"after\n"
    assert bounded_line(stream, 100) == b""
    assert stream.largest <= 1 << 20  # one block of the skip at most


def test_a_jsonl_record_over_max_record_bytes_is_too_long_with_its_size(tmp_path):
    long = record("y" * 5000)
    path = tmp_path / "c.jsonl"
    path.write_bytes(record("first") + long + record("third") + record("z" * 900))
    corpus = cfg(path, max_record_bytes=1000, max_document_bytes=800)
    got = summary(parse_file(str(path), str(tmp_path) + "/", corpus))
    too_long_record = {"bytes": len(long) - 1, "limit": "max_record_bytes", "limit_bytes": 1000}
    too_long_text = {"bytes": 900, "limit": "max_document_bytes", "limit_bytes": 800}
    assert got == [
        (1, "doc", "first"),
        (2, "too_long", too_long_record),
        (3, "doc", "third"),
        (4, "too_long", too_long_text),
    ]


@pytest.mark.parametrize("split_bytes", [1000, 4096])
def test_ranges_that_start_inside_a_long_line_read_as_the_whole_file(tmp_path, split_bytes):
    lines = [record(f"doc {i} " + "w " * (i % 30)) for i in range(200)]
    lines[37] = record("long " * 3000)  # spans several ranges
    lines[150] = b"x" * 20_000 + b"\n"  # not even JSON: too long before it is parsed
    path = tmp_path / "c.jsonl"
    path.write_bytes(b"".join(lines))
    corpus = cfg(path, max_record_bytes=2000)
    base = str(tmp_path) + "/"
    whole = list(parse_file(str(path), base, corpus))
    _, records = parse_in_ranges(path, base, corpus, split_bytes)
    assert records == whole
    assert [(r.position, r.reason) for r in whole if isinstance(r, Rejected)] == [(38, "too_long"), (151, "too_long")]
    assert sum(isinstance(r, Document) for r in whole) == 198


@pytest.mark.parametrize("name", ["book.txt", "book.txt.gz"])
def test_a_text_file_over_max_document_bytes_is_too_long_with_its_decompressed_size(tmp_path, name):
    text = ("a sentence of a very long book. " * 200).encode()
    path = tmp_path / name
    path.write_bytes(gzip.compress(text) if name.endswith(".gz") else text)
    (tmp_path / "short.txt").write_text("a short book")
    base = str(tmp_path) + "/"
    (refused,) = parse_file(str(path), base, cfg(path, format="text", max_document_bytes=len(text) - 1))
    assert (refused.reason, dict(refused.details)["bytes"]) == ("too_long", len(text))
    assert refused.excerpt.startswith("a sentence of")
    (kept,) = parse_file(str(path), base, cfg(path, format="text", max_document_bytes=len(text)))
    assert isinstance(kept, Document) and len(kept.text) == len(text)


@pytest.mark.parametrize("dictionary", [False, True])
def test_a_parquet_text_over_max_document_bytes_is_too_long_and_its_neighbours_kept(tmp_path, dictionary):
    texts = ["short one", "é" * 600, None, "short two"]  # 1200 UTF-8 bytes in 600 characters
    column = pa.array(texts).dictionary_encode() if dictionary else pa.array(texts)
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"text": column}), path)
    got = summary(parse_file(str(path), str(tmp_path) + "/", cfg(path, format="parquet", max_document_bytes=1000)))
    assert got == [
        (0, "doc", "short one"),
        (1, "too_long", {"bytes": 1200, "limit": "max_document_bytes", "limit_bytes": 1000}),
        (2, "missing_text", {}),
        (3, "doc", "short two"),
    ]


def test_bounds_take_sizes_and_stay_out_of_the_hash_at_their_defaults():
    from schemas.config import config_from_dict

    base = {"output": "/o", "retrieval_corpus": {"paths": ["c/*.jsonl"]}}
    bounded = {"output": "/o", "retrieval_corpus": {"paths": ["c/*.jsonl"], "max_document_bytes": "1MiB"}}
    assert CorpusConfig(paths=["x"], max_record_bytes="2 MiB").max_record_bytes == 2 << 20
    assert config_from_dict(base).embed_hash() != config_from_dict(bounded).embed_hash()
    default = CorpusConfig.model_fields["max_document_bytes"].default
    same = {"output": "/o", "retrieval_corpus": {"paths": ["c/*.jsonl"], "max_document_bytes": default}}
    assert config_from_dict(base).embed_hash() == config_from_dict(same).embed_hash()
