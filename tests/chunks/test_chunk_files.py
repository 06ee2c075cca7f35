"""`ChunkFileRanges`: which chunk file holds a chunk id, and the one reader of chunk rows, which
checks that a file holds the ids the manifest says."""

import dataclasses

import numpy as np
import pytest

from pipeline.chunks.chunk_files import ChunkFileRanges
from pipeline.chunks.chunking import chunk_document
from tests.helpers import write_chunk_files

pytestmark = pytest.mark.unit

M, PAD = 4, 0


def test_chunk_file_ranges_locate_ids_and_check_what_they_read(tmp_path):
    rng = np.random.default_rng(0)
    chunks = []  # 3 documents of 4 chunks -> files of 5, 5 and 2
    for doc in range(3):
        chunks += list(chunk_document(100 + doc, rng.integers(1, 1000, 4 * M).astype(np.int32), doc * 4, M, PAD))
    files = write_chunk_files(tmp_path, chunks)
    assert [files.file_of(c) for c in (0, 4, 5, 9, 10, 11)] == [0, 0, 1, 1, 2, 2]
    assert files.files_of(np.array([0, 5, 11])).tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="chunk id 12 is not in the chunk database"):
        files.file_of(12)
    rows = files.read(1, ["doc_id", "tokens"])
    assert rows["doc_id"].tolist() == [c.doc_id for c in chunks[5:10]]
    assert rows["tokens"].tolist() == [c.tokens.tolist() for c in chunks[5:10]]
    lying = ChunkFileRanges.from_paths(files.directory, list(files.chunks.paths()), [4, 6, 2])  # manifest rows disagree
    with pytest.raises(ValueError, match="does not hold the chunk ids 4..9"):
        lying.read(1, ["doc_id"])


def test_a_range_of_chunk_ids_reads_only_its_row_groups_across_files(tmp_path):
    rng = np.random.default_rng(1)
    chunks = list(chunk_document(7, rng.integers(1, 1000, 40 * M).astype(np.int32), 0, M, PAD))
    files = write_chunk_files(tmp_path, chunks, rows_per_file=16, row_group_rows=3)
    tokens = np.stack([c.tokens for c in chunks])
    for first, end in ((5, 35), (7, 8), (0, 40), (16, 32), (15, 17)):
        assert np.array_equal(files.read_tokens(first, end), tokens[first:end]), (first, end)
    # manifest rows disagree
    lying = ChunkFileRanges.from_paths(files.directory, list(files.chunks.paths()), [14, 16, 10])
    with pytest.raises(ValueError, match="does not hold the chunk ids 14..19"):
        lying.read_tokens(10, 20)


def test_chosen_embeddings_read_only_their_row_groups(tmp_path):
    """The probe sample's queries: scattered ids, any order, a repeat, across files."""
    rng = np.random.default_rng(3)
    chunks = list(chunk_document(7, rng.integers(1, 1000, 40 * M).astype(np.int32), 0, M, PAD))
    vectors = rng.standard_normal((40, 8)).astype(np.float32)
    files = write_chunk_files(tmp_path, chunks, rows_per_file=16, row_group_rows=3, vectors=vectors)
    for ids in ([39, 0, 17, 5, 17], [16], [2, 3, 4], list(range(40))[::-1]):
        assert np.array_equal(files.read_embedding_rows(np.array(ids)), vectors[ids]), ids
    assert files.read_embedding_rows(np.zeros(0, np.int64)).shape[0] == 0
    with pytest.raises(ValueError, match="chunk id 40 is not in the chunk database"):
        files.read_embedding_rows(np.array([3, 40]))
    lying = ChunkFileRanges.from_paths(files.directory, list(files.chunks.paths()), [14, 16, 10])
    with pytest.raises(ValueError, match="does not hold the chunk ids"):
        lying.read_embedding_rows(np.array([20]))


def test_sequences_packed_from_first_tokens_get_the_tokens_packing_them_whole_gives(tmp_path):
    """build-shards over its own chunks shuffles each chunk's first token only and reads the
    rest where the rows are assembled: the rows are the same, and a chunk file changed since
    packing is caught."""
    from pipeline.chunks.chunk_files import TrainingChunks
    from pipeline.retrieve.sequences import pack_batch, with_tokens

    rng = np.random.default_rng(2)
    chunks = []
    for doc in range(5):
        chunks += list(chunk_document(doc, rng.integers(1, 1000, 9 * M).astype(np.int32), len(chunks), M, PAD))
    files = write_chunk_files(tmp_path, chunks, rows_per_file=8, row_group_rows=3)
    whole = TrainingChunks.of_chunks(chunks)
    L, per_batch = 4, 3
    batches = range(len(chunks) // (L * per_batch) + 1)
    packed = [s for b in batches for s in pack_batch(b, [whole], L, per_batch, PAD)]
    from_heads = [s for b in batches for s in pack_batch(b, [whole.heads()], L, per_batch, PAD)]
    assert len(packed) == len(from_heads) == len(chunks) // L - (len(chunks) % L == 0)
    assert all(len(s.tokens) == L + 1 for s in from_heads)
    filled = with_tokens(from_heads, files, L)
    assert [(s.seq_id, s.tokens.tolist(), s.doc_ids) for s in filled] == [
        (s.seq_id, s.tokens.tolist(), s.doc_ids) for s in packed
    ]
    changed = list(chunks)
    changed[5] = dataclasses.replace(chunks[5], tokens=chunks[5].tokens + 1)
    rewritten = write_chunk_files(tmp_path / "changed", changed, rows_per_file=8)
    with pytest.raises(ValueError, match="sequence 1: its chunks' tokens changed"):
        with_tokens(from_heads, rewritten, L)


def test_committed_chunk_files_read_the_ranges_from_the_file_table(tmp_path):
    """A job carries the chunk database as its index directory alone; the ranges come from the
    manifest's file table (6,000 chunk files: more entries than stay inline)."""
    from benchmarks.scale_sim import CHUNK_FILE_ROWS, config, index_manifest, write_manifest
    from pipeline.chunks.committed import CommittedChunkFiles
    from pipeline.common import fileio

    chunks = 6_000 * CHUNK_FILE_ROWS - 7
    write_manifest(tmp_path, index_manifest(chunks, config(tmp_path)))
    assert (tmp_path / "files.parquet").exists()
    sha = fileio.sha256_bytes((tmp_path / "manifest.json").read_bytes())
    files = CommittedChunkFiles(str(tmp_path), chunks, sha)
    ids = np.array([0, CHUNK_FILE_ROWS - 1, CHUNK_FILE_ROWS, chunks - 1])
    assert files.files_of(ids).tolist() == [0, 0, 1, 5_999]
    assert files.file_of(chunks - 1) == 5_999 and files.num_chunks == chunks
    assert len(files.ranges.chunks) == 2  # full files, then the last: no entry per file
    with pytest.raises(ValueError, match="no longer kept"):
        CommittedChunkFiles(str(tmp_path), chunks, "0" * 64).file_of(0)
    # a later commit: a process that read the first keeps reading it while it is kept, and
    # refuses once it is not (where it loads an index file after it, to search another commit's)
    manifest = (tmp_path / "manifest.json").read_bytes()
    (tmp_path / "manifest-000001.json").write_bytes(manifest)
    (tmp_path / "manifest-000002.json").write_bytes(manifest + b"\n")
    files.check_kept()
    assert CommittedChunkFiles(str(tmp_path), chunks, sha).file_of(chunks - 1) == 5_999
    (tmp_path / "manifest-000001.json").unlink()
    assert files.file_of(0) == 0  # lookups use the ranges read
    with pytest.raises(ValueError, match="no longer kept"):
        files.check_kept()
