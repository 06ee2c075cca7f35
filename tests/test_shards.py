import subprocess
import sys
from pathlib import Path

import apache_beam as beam
import faiss
import numpy as np
import pyarrow as pa
import pytest
from apache_beam.testing.util import assert_that, equal_to

from pipeline.chunks.chunk_files import ChunkFileRanges
from pipeline.chunks.chunking import chunk_document
from pipeline.common.writers import chunks_table, parquet_bytes
from pipeline.index.train import build_index
from pipeline.retrieve.beam import DocumentSpans, PackSequences, RetrieveNeighbours
from pipeline.retrieve.search import CANDIDATE, Retrieval, select_distinct, token_key
from pipeline.retrieve.sequences import document_spans, merge_ranges, pack_sequence, widest_span
from pipeline.shards.rows import chunk_overlap, overlap_bucket, overlap_histogram
from pipeline.shards.write import WriteShards, neighbour_arrays
from schemas.arrow import SCHEMA_VERSION, read_shard_table, shard_column
from schemas.manifest import FileEntry
from tests.helpers import local_pipeline

M, L, K, PAD = 4, 2, 2, 0


def test_pack_sequence_adds_the_next_token_and_its_document():
    chunks = list(chunk_document(7, np.arange(1, 9, dtype=np.int32), 0, M, PAD))
    seq = pack_sequence(0, chunks, next_token=42, next_doc=8, pad_id=PAD)
    assert seq.tokens.tolist() == list(range(1, 9)) + [42]
    assert seq.doc_ids == (7, 8)
    assert pack_sequence(0, chunks, None, None, PAD).tokens[-1] == PAD


def candidates(*rows):
    """CANDIDATE rows from (j, rank, score, chunk_id[, token_key]) tuples."""
    return np.array(
        [
            (0, j, rank, chunk, score, key)
            for j, rank, score, chunk, key in (row + (0,) * (5 - len(row)) for row in rows)
        ],
        CANDIDATE,
    )


def test_neighbour_arrays_pad_the_slots_without_a_neighbour():
    picks = [(0, 0, 11, 0.5), (0, 1, 12, 0.25)]
    values = [p + (np.full(2 * M, p[2], np.int32),) for p in picks]
    tokens, ids, scores = neighbour_arrays(values, L, K, M, PAD)
    assert ids.tolist() == [[11, 12], [-1, -1]]
    assert scores.tolist() == [[0.5, 0.25], [0, 0]]
    assert (tokens[0, 0] == 11).all() and (tokens[1] == PAD).all()


def test_select_distinct_skips_candidates_repeating_a_kept_neighbour():
    same, other = token_key(np.array([5, 6, 7, 8])), token_key(np.array([5, 6, 7, 9]))
    assert same == token_key(np.array([5, 6, 7, 8], dtype=np.int64)) and same != other
    found = candidates(
        (0, 2, 0.25, 12, other),
        (0, 1, 0.5, 11, same),
        (0, 0, 1.0, 10, same),  # any order
        (1, 0, 0.75, 13, same),
    )
    picks, dropped = select_distinct(found, K)
    assert picks == [(0, 0, 10, 1.0), (0, 1, 12, 0.25), (1, 0, 13, 0.75)] and dropped == 1


def test_document_spans_and_ranges():
    ids = np.array([7, 3, 4, 5, 6, 8])  # any order; doc 20 continues past this batch
    docs = np.array([20, 10, 10, 20, 20, 20])
    assert document_spans(ids, docs) == [(10, (3, 5)), (20, (5, 9))]
    assert widest_span([(5, 9), (9, 12), (7, 8)]) == (5, 12)
    assert merge_ranges([(9, 12), (0, 3), (3, 5), (10, 11), (20, 21)]) == [(0, 5), (9, 12), (20, 21)]
    assert merge_ranges([]) == []


def _longest_common_run(a, b, pad):
    """The obvious quadratic definition, to check the vectorised one against."""
    best = 0
    for i in range(len(a)):
        for j in range(len(b)):
            run = 0
            while i + run < len(a) and j + run < len(b) and a[i + run] == b[j + run] != pad:
                run += 1
            best = max(best, run)
    return best


def test_chunk_overlap_is_the_longest_common_token_run_over_m():
    m = 8
    chunks = np.array(
        [
            [1, 2, 3, 4, 5, 6, 7, 8],  # shares 1..4 (4) with n0, 6..8 (3) with n1
            [9, 9, 9, 9, 9, 9, 9, 9],  # all of it with n0's continuation
            [1, 2, 3, 4, 0, 0, 0, 0],
        ]
    )  # 1..4, padding never counts
    neighbours = np.zeros((3, 2, 2 * m), np.int32)
    neighbours[0, 0, 3:7] = [1, 2, 3, 4]
    neighbours[0, 1, :5] = [6, 7, 8, 1, 1]
    neighbours[1, 0, m:] = 9
    neighbours[2, 1, 2:12] = [1, 2, 3, 4, 0, 0, 0, 0, 0, 0]
    assert chunk_overlap(chunks, neighbours, pad_id=0).tolist() == [4 / m, 1.0, 4 / m]
    rng = np.random.default_rng(5)
    chunks, neighbours = rng.integers(0, 4, (6, m)), rng.integers(0, 4, (6, 3, 2 * m))
    expected = [max(_longest_common_run(c, n, 0) for n in ns) / m for c, ns in zip(chunks, neighbours)]
    assert chunk_overlap(chunks, neighbours, pad_id=0).tolist() == expected


def test_overlap_buckets_and_histogram():
    assert [overlap_bucket(r) for r in (0, 0.01, 0.125, 0.2, 0.5, 0.9, 1.0)] == [
        "0.0",
        "0.125",
        "0.125",
        "0.25",
        "0.5",
        "1.0",
        "1.0",
    ]
    counters = {"overlap_r_le_0.0": 3, "overlap_r_le_1.0": 1, "sequences": 2}
    assert overlap_histogram(counters) == {"0.0": 3, "0.125": 0, "0.25": 0, "0.5": 0, "0.75": 0, "1.0": 1}
    assert counters == {"sequences": 2}


@pytest.mark.parametrize(
    "imports",
    [
        "import pipeline.shards.rows",
        "from pipeline.shards.rows import chunk_overlap",  # what inspect (and so report) takes from it
        "import tests.trainer_fixtures",  # the trainer tests' shards and overlap audit
    ],
)
def test_row_types_and_the_overlap_audit_import_neither_beam_nor_faiss_nor_torch(imports):
    code = f"import sys; {imports}; print([m for m in ('apache_beam', 'faiss', 'torch') if m in sys.modules])"
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert result.stdout.strip() == "[]"


def _database():
    """3 documents of 4 chunks each; chunk c's vector is close to c's doc-mates and to the
    chunk at the same position in the other documents."""
    chunks, rng = [], np.random.default_rng(0)
    for doc in range(3):
        tokens = rng.integers(1, 1000, 4 * M).astype(np.int32)
        chunks += list(chunk_document(100 + doc, tokens, doc * 4, M, PAD))
    base = rng.normal(size=(4, 16))
    vectors = np.stack([base[c.position] + 0.05 * (c.doc_id - 100) * rng.normal(size=16) for c in chunks]).astype(
        np.float32
    )
    faiss.normalize_L2(vectors)
    return chunks, vectors


def write_chunk_files(directory, chunks, rows_per_file=5) -> ChunkFileRanges:
    """The chunk database as the index stage writes it: `chunks/chunks-NNNNN.parquet`, file
    NNNNN holding ids NNNNN·rows_per_file ... (several files, so lookups cross them)."""
    (directory / "chunks").mkdir(parents=True)
    entries = []
    for number, begin in enumerate(range(0, len(chunks), rows_per_file)):
        part = chunks[begin : begin + rows_per_file]
        path = f"chunks/chunks-{number:05d}.parquet"
        (directory / path).write_bytes(parquet_bytes(chunks_table(part, M)))
        entries.append(FileEntry(path=path, rows=len(part), bytes=0, sha256=""))
    return ChunkFileRanges.from_entries(str(directory), entries)


def test_chunk_file_ranges_locate_ids_and_check_what_they_read(tmp_path):
    chunks, _ = _database()  # 12 chunks -> files of 5, 5 and 2
    files = write_chunk_files(tmp_path, chunks)
    assert [files.file_of(c) for c in (0, 4, 5, 9, 10, 11)] == [0, 0, 1, 1, 2, 2]
    assert files.files_of(np.array([0, 5, 11])).tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="chunk id 12 is not in the chunk database"):
        files.file_of(12)
    rows = files.read(1, ["doc_id", "tokens"])
    assert rows["doc_id"].tolist() == [c.doc_id for c in chunks[5:10]]
    assert rows["tokens"].tolist() == [c.tokens.tolist() for c in chunks[5:10]]
    lying = ChunkFileRanges(files.directory, files.paths, (0, 4, 10, 12))  # manifest rows disagree
    with pytest.raises(ValueError, match="does not hold the chunk ids 4..9"):
        lying.read(1, ["doc_id"])


def retrieve(p, chunks, vectors, index_path, chunk_files, dedupe=False, candidates=8):
    """RetrieveNeighbours as build-shards wires it: document spans read from the chunk files."""
    sequences = p | "Chunks" >> beam.Create(chunks) | PackSequences(L, PAD)
    queries = p | "Queries" >> beam.Create([(i, vectors[i]) for i in range(len(chunks))])
    spans = p | DocumentSpans(f"{chunk_files.directory}/chunks/*.parquet")
    spec = Retrieval((index_path,), None, chunk_files, L, M, K, candidates, PAD, dedupe)
    rows = ((sequences, queries, spans) | RetrieveNeighbours(spec)).rows
    return rows


def test_retrieve_neighbours_excludes_the_sequence_documents(tmp_path):
    chunks, vectors = _database()
    index_path = str(tmp_path / "index.faiss")
    faiss.write_index(build_index(np.arange(len(chunks), dtype=np.int64), vectors, "Flat"), index_path)
    chunk_files = write_chunk_files(tmp_path / "index", chunks)
    by_id = {c.chunk_id: c for c in chunks}

    def check(rows):
        assert sorted(r.seq_id for r in rows) == list(range(6))
        for row in rows:
            own = set(row.doc_ids)
            assert row.neighbour_ids.shape == (L, K) and (row.neighbour_ids >= 0).all()
            for j in range(L):
                query = row.seq_id * L + j
                for q, nid in enumerate(row.neighbour_ids[j]):
                    neighbour = by_id[int(nid)]
                    assert neighbour.doc_id not in own
                    if q == 0:  # the best is the same position in a document it does not hold
                        assert neighbour.position == by_id[query].position
                    assert row.neighbours[j, q].tolist() == (
                        neighbour.tokens.tolist() + neighbour.continuation.tolist()
                    )
            assert (
                row.tokens[:-1].tolist()
                == np.concatenate([by_id[row.seq_id * L + j].tokens for j in range(L)]).tolist()
            )

    with local_pipeline() as p:
        assert_that(retrieve(p, chunks, vectors, index_path, chunk_files), check)


def test_write_shards_is_sorted_and_split_by_seq_id(tmp_path):
    from pipeline.shards.rows import ShardRow

    rows = [
        ShardRow(
            s,
            np.full(L * M + 1, s, np.int32),
            np.full((L, K, 2 * M), s, np.int32),
            np.full((L, K), s, np.int64),
            np.full((L, K), 0.5, np.float32),
            (s,),
        )
        for s in (4, 0, 3, 1, 2)
    ]
    with local_pipeline() as p:
        entries = p | beam.Create(rows) | WriteShards(str(tmp_path), shard_rows=2, pad_id=PAD)
        assert_that(
            entries | beam.Map(lambda e: (e["path"], e["rows"])),
            equal_to([("shard-00000.arrow", 2), ("shard-00001.arrow", 2), ("shard-00002.arrow", 1)]),
        )
    table = read_shard_table(pa.memory_map(str(tmp_path / "shard-00001.arrow")))
    assert table["seq_id"].to_pylist() == [2, 3]
    assert shard_column(table, "neighbours").shape == (2, L, K, 2 * M)
    assert table.schema.metadata[b"schema_version"] == str(SCHEMA_VERSION).encode() == b"2"


def test_retrieve_neighbours_dedupe_skips_repeated_tokens(tmp_path):
    """Documents 101 and 102 are copies; both are the nearest to document 100 (sequence 3, the
    last). With dedupe the second neighbour of each of its chunks comes from document 103."""
    rng = np.random.default_rng(1)
    copy = rng.integers(1, 1000, 2 * M).astype(np.int32)
    texts = {101: copy, 102: copy, 103: rng.integers(1, 1000, 2 * M), 100: rng.integers(1, 1000, 2 * M)}
    chunks = []
    for doc, tokens in texts.items():
        chunks += list(chunk_document(doc, np.asarray(tokens, np.int32), len(chunks), M, PAD))
    base = rng.normal(size=(2, 16))
    spread = {100: 0.0, 101: 0.1, 102: 0.12, 103: 0.5}
    vectors = np.stack([base[c.position] + spread[c.doc_id] * rng.normal(size=16) for c in chunks])
    vectors = vectors.astype(np.float32) / np.linalg.norm(vectors, axis=1, keepdims=True)
    index_path = str(tmp_path / "index.faiss")
    faiss.write_index(build_index(np.arange(len(chunks), dtype=np.int64), vectors, "Flat"), index_path)
    chunk_files = write_chunk_files(tmp_path / "index", chunks, rows_per_file=3)
    docs = {c.chunk_id: c.doc_id for c in chunks}

    def second_neighbour_docs(dedupe):
        def check(rows):
            (row,) = [r for r in rows if r.seq_id == 3]
            assert [docs[i] for i in row.neighbour_ids[:, 1]] == ([103, 103] if dedupe else [102, 102])
            assert [docs[i] for i in row.neighbour_ids[:, 0]] == [101, 101]

        return check

    for dedupe in (False, True):
        with local_pipeline() as p:
            assert_that(retrieve(p, chunks, vectors, index_path, chunk_files, dedupe), second_neighbour_docs(dedupe))


def test_a_search_batch_with_only_leftover_chunks_is_skipped(tmp_path):
    """64 whole sequences fill search batch 0 exactly; the one chunk after them (too few for a
    sequence) still has an embedding, keyed to batch 1, which therefore holds no sequence."""
    from pipeline.retrieve.search import SEQUENCES_PER_SEARCH

    rng = np.random.default_rng(2)
    whole = SEQUENCES_PER_SEARCH * L
    chunks = []
    for doc in range(whole // 4 + 1):  # documents of 4 chunks, then one of a single chunk
        length = 4 * M if len(chunks) < whole else M
        chunks += list(chunk_document(doc, rng.integers(1, 1000, length).astype(np.int32), len(chunks), M, PAD))
    assert len(chunks) == whole + 1
    vectors = rng.normal(size=(len(chunks), 16)).astype(np.float32)
    faiss.normalize_L2(vectors)
    index_path = str(tmp_path / "index.faiss")
    faiss.write_index(build_index(np.arange(len(chunks), dtype=np.int64), vectors, "Flat"), index_path)
    chunk_files = write_chunk_files(tmp_path / "index", chunks, rows_per_file=50)
    with local_pipeline() as p:
        rows = retrieve(p, chunks, vectors, index_path, chunk_files)
        assert_that(rows | beam.Map(lambda r: r.seq_id), equal_to(list(range(SEQUENCES_PER_SEARCH))))


def test_a_shuffle_that_loses_elements_fails_loudly():
    from pipeline.retrieve.beam import _arrived

    _arrived(7, "search hits", 256, [256])  # all arrived
    with pytest.raises(RuntimeError, match="sequence 7: 200 search hits arrived, \\[256\\] were sent"):
        _arrived(7, "search hits", 200, [256])
    with pytest.raises(RuntimeError, match="sequence 7: 0 neighbours arrived, no count were sent"):
        _arrived(7, "neighbours", 0, [])  # the count itself went missing


def test_shards_worse_than_they_look_get_a_warning_with_the_cause(tmp_path):
    from pipeline.jobs.shards_job import neighbour_warnings
    from schemas.config import config_from_dict
    from schemas.manifest import NeighbourRecall, ShardEntry, ShardsManifest
    from tests.helpers import small_config

    def manifest(filled, recall, counters=None):  # 10 sequences of L = 4 chunks, k = 2: 80 slots
        return ShardsManifest(
            config_hash="",
            index_manifest_sha256="",
            training_corpus="same",
            sequence_tokens=128,
            chunk_tokens=32,
            neighbours=2,
            neighbour_tokens=64,
            pad_id=0,
            num_sequences=10,
            shards=[ShardEntry(path="shard-00000.arrow", rows=10, bytes=0, sha256="", neighbour_slots_filled=filled)],
            neighbour_fill=filled / 80,
            counters=counters or {},
            created_by="",
            overlap={},
            neighbour_recall=NeighbourRecall(measure="", value=recall, sample_size=40, slots=80, tolerance=1e-3),
        )

    cfg = config_from_dict(small_config(tmp_path, "x"))
    assert neighbour_warnings(manifest(80, 1.0), cfg) == []
    (few,) = neighbour_warnings(manifest(60, 1.0), cfg)
    assert "75.0% of neighbour slots are filled (20 empty)" in few and "fewer than k chunks outside" in few
    deduped = config_from_dict(small_config(tmp_path, "x", dedupe_neighbours=True))
    (repeats,) = neighbour_warnings(manifest(60, 1.0, {"candidates_dropped_duplicate_tokens": 30}), deduped)
    assert "raise neighbour_candidates" in repeats
    (missed,) = neighbour_warnings(manifest(80, 0.9), cfg)
    assert "neighbour recall 0.900" in missed
