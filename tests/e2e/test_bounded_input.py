"""Records far over the corpus's bounds (a 1 GB JSONL line, a gzip file of one 2 GB line, a
500 MB text document) are each one rejected record with its size; the run completes, and no
process of it holds more than 2 GB at its peak."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import read_rejected, sample_documents, small_config, write_config, write_jsonl

pytestmark = pytest.mark.e2e

CLI = str(Path(sys.executable).parent / "ratrain-pipeline")
PEAK_RSS_LIMIT = 2 << 30
BLOCK = b"a long line of one record " * (1 << 15)  # 832 KiB written at a time

# The run in a process of its own: its peak RSS is the largest of its processes' (ru_maxrss of
# the children it waited for), whatever ran before in the test process.
PEAK_RSS_OF_RUN = """
import resource, subprocess, sys
subprocess.run(sys.argv[1:], check=True)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
"""


def write_long(f, head: bytes, size: int, tail: bytes) -> int:
    """`head`, filler up to `size` bytes, `tail`, a block at a time: the bytes written."""
    f.write(head)
    written = len(head)
    while written < size:
        block = BLOCK[: size - written]
        f.write(block)
        written += len(block)
    f.write(tail)
    return written + len(tail)


def test_oversized_records_are_rejected_with_their_size_and_the_run_stays_bounded(tmp_path):
    corpus, books = tmp_path / "corpus", tmp_path / "books"
    corpus.mkdir()
    books.mkdir()
    documents = sample_documents(12)  # the good records beside the oversized ones
    write_jsonl(corpus / "good.jsonl", documents)
    with open(corpus / "huge.jsonl", "wb") as f:  # one record of 1 GB on one line
        huge = write_long(f, b'{"id": "huge", "text": "', 1 << 30, b'"}\n') - 1
    with gzip.open(corpus / "huge-line.jsonl.gz", "wb", compresslevel=1) as f:  # 2 GB once decompressed
        gzipped = write_long(f, b'{"id": "gz", "text": "', 2 << 30, b'"}')
    for i, document in enumerate(documents):
        (books / f"book-{i:02d}.txt").write_text(document["text"])
    with open(books / "book-huge.txt", "wb") as f:  # one document of 500 MB
        book = write_long(f, b"Chapter one. ", 500 << 20, b"The end.")
    config = small_config(
        tmp_path / "out",
        str(corpus / "*"),
        training_corpus={"paths": [str(books / "*.txt")], "format": "text"},
    )
    write_config(tmp_path / "config.yaml", config)

    peak = subprocess.run(
        [sys.executable, "-c", PEAK_RSS_OF_RUN, CLI, "run", "--config", str(tmp_path / "config.yaml")],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()[-1]

    too_long = {
        (Path(r["source"]).name, r["bytes"], r["limit"])
        for stage in ("build-index", "build-shards")
        for r in read_rejected(tmp_path / "out", stage)
        if r["reason"] == "too_long"
    }
    assert too_long == {
        ("huge.jsonl", huge, "max_record_bytes"),
        ("huge-line.jsonl.gz", gzipped, "max_record_bytes"),
        ("book-huge.txt", book, "max_document_bytes"),
    }
    index = json.loads((tmp_path / "out" / "index" / "manifest.json").read_text())
    assert index["counters"]["rejected_too_long"] == 2 and index["counters"]["documents_read"] == len(documents)
    shards = json.loads((tmp_path / "out" / "shards" / "manifest.json").read_text())
    assert shards["counters"]["rejected_too_long"] == 1
    assert int(peak) <= PEAK_RSS_LIMIT, f"peak RSS {int(peak) >> 20} MiB"
