"""Numbered files are ordered by their number, past five digits too."""

import pytest

from pipeline.chunks.chunk_files import ChunkFileRanges
from pipeline.common.names import file_name, file_number
from pipeline.index.files import LIST_OWNERS_FILE, QUANTIZER_FILE, searched_files
from schemas.manifest import FileEntry

pytestmark = pytest.mark.unit
FILES = 100_010  # past 99,999: chunks-100000.parquet sorts before chunks-99999.parquet as text


def test_file_numbers_read_back_whatever_their_width():
    names = [file_name("embeddings", n, "parquet") for n in (0, 7, 99_999, 100_000, 100_009)]
    assert names[3] == "embeddings-100000.parquet" and names[3] < names[2]  # as text, out of order
    assert [file_number(f"out/index/embeddings/{name}") for name in names] == [0, 7, 99_999, 100_000, 100_009]
    assert file_number("out/index/faiss/sample/embeddings-100001") == 100_001  # a sample prefix
    assert file_number("out/index/faiss/index.faiss") == -1


def test_100010_chunk_files_keep_chunk_id_order():
    entries = [
        FileEntry(path=f"chunks/{file_name('chunks', n, 'parquet')}", rows=2, bytes=1, sha256="") for n in range(FILES)
    ]
    ranges = ChunkFileRanges.from_entries("out/index", entries[::-1])  # manifest order does not matter
    assert ranges.chunks.path(100_000) == "chunks/chunks-100000.parquet" and ranges.start(100_000) == 200_000
    assert ranges.file_of(200_001) == 100_000 and ranges.file_of(199_999) == 99_999


def test_100010_index_slices_are_searched_in_number_order_without_their_routing_files():
    names = [f"faiss/{file_name('slice', n, 'faiss')}" for n in range(FILES)]
    listed = [*names[::-1], f"faiss/{QUANTIZER_FILE}", f"faiss/{LIST_OWNERS_FILE}"]  # manifest order does not matter
    assert searched_files(listed) == names
    assert searched_files(["faiss/index.faiss"]) == ["faiss/index.faiss"]
