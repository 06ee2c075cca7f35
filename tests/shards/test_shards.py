"""The shards stage: neighbour arrays, the r(C) overlap audit, and `WriteShards` (sorted, split,
schema version 3); the row types import no Beam, faiss or torch."""

import dataclasses
import pickle
import subprocess
import sys

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pytest
from apache_beam.testing.util import assert_that, equal_to

from pipeline.retrieve.search import PICK
from pipeline.shards.rows import (
    RowBatch,
    Sequence,
    SequenceBatch,
    ShardRow,
    chunk_overlap,
    neighbour_arrays,
    overlap_bucket,
    overlap_histogram,
    overlap_tally,
    sequences_neighbour_arrays,
)
from pipeline.shards.write import WriteShards
from schemas.arrow import SCHEMA_VERSION, read_shard_table, shard_column
from tests.helpers import REPO, local_pipeline

M, L, K, PAD = 4, 2, 2, 0


@pytest.mark.unit
def test_neighbour_arrays_pad_the_slots_without_a_neighbour():
    picks = np.array([(0, 0, 1, 12, 0.25), (0, 0, 0, 11, 0.5)], PICK)  # any order
    values = np.repeat(picks["chunk_id"][:, None], 2 * M, axis=1).astype(np.int32)
    tokens, ids, scores = neighbour_arrays(picks, values, chunks_per_seq=L, k=K, m=M, pad_id=PAD)
    assert ids.tolist() == [[11, 12], [-1, -1]]
    assert scores.tolist() == [[0.5, 0.25], [0, 0]]
    assert (tokens[0, 0] == 11).all() and (tokens[1] == PAD).all()


@pytest.mark.unit
def test_many_sequences_neighbour_arrays_are_each_sequence_alone():
    picks = np.array([(7, 1, 0, 31, 0.5), (5, 0, 1, 12, 0.25), (7, 0, 0, 21, 0.75), (5, 0, 0, 11, 0.5)], PICK)
    values = np.repeat(picks["chunk_id"][:, None], 2 * M, axis=1).astype(np.int32)
    seq_ids = np.array([5, 6, 7])
    row = np.searchsorted(seq_ids, picks["seq_id"])
    together = sequences_neighbour_arrays(row, len(seq_ids), picks, values, chunks_per_seq=L, k=K, m=M, pad_id=PAD)
    for at, seq_id in enumerate(seq_ids):
        alone = neighbour_arrays(
            picks[picks["seq_id"] == seq_id],
            values[picks["seq_id"] == seq_id],
            chunks_per_seq=L,
            k=K,
            m=M,
            pad_id=PAD,
        )
        for many, one in zip(together, alone, strict=True):
            assert many.dtype == one.dtype and np.array_equal(many[at], one)
    assert together[1][1].tolist() == [[-1, -1], [-1, -1]]  # sequence 6 has no neighbour


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


@pytest.mark.unit
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


@pytest.mark.unit
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


@pytest.mark.unit
def test_overlap_tally_of_a_batch_counts_each_chunk_in_its_bucket():
    """Rows audited together count what each chunk's own r(C) bucket says."""
    m, rng = 8, np.random.default_rng(6)
    rows = []
    for seq_id in range(5):
        tokens = rng.integers(1, 4, 3 * m + 1).astype(np.int32)
        neighbours = rng.integers(0, 4, (3, 2, 2 * m)).astype(np.int32)
        neighbours[seq_id % 3, 0, :m] = tokens[(seq_id % 3) * m : (seq_id % 3 + 1) * m]  # one whole copy
        rows.append(
            ShardRow(
                seq_id=seq_id,
                tokens=tokens,
                neighbours=neighbours,
                neighbour_ids=np.zeros((3, 2), np.int64),
                neighbour_scores=np.zeros((3, 2)),
                doc_ids=(0,),
            )
        )
    expected: dict[str, int] = {}
    for row in rows:
        for ratio in chunk_overlap(row.tokens[: 3 * m].reshape(3, m), row.neighbours, 0):
            key = "overlap_r_le_" + overlap_bucket(ratio)
            expected[key] = expected.get(key, 0) + 1
    assert dict(overlap_tally(RowBatch(rows), m, 0)) == expected and expected["overlap_r_le_1.0"] == 5


@pytest.mark.unit
def test_batches_pickle_by_column_and_come_back_equal():
    rng = np.random.default_rng(2)
    sequences = [Sequence(i, rng.integers(0, 99, 9).astype(np.int32), (i, i + 1)) for i in (3, 4, 7)]
    rows = [
        ShardRow(
            seq_id=s.seq_id,
            tokens=s.tokens,
            neighbours=rng.integers(0, 99, (2, 2, 8), np.int32),
            neighbour_ids=np.arange(4).reshape(2, 2),
            neighbour_scores=rng.random((2, 2), np.float32),
            doc_ids=s.doc_ids,
        )
        for s in sequences
    ]
    pickled = pickle.loads(pickle.dumps(SequenceBatch(sequences), pickle.HIGHEST_PROTOCOL)).sequences
    pickled_rows = pickle.loads(pickle.dumps(RowBatch(rows), pickle.HIGHEST_PROTOCOL)).rows
    for got, want in [*zip(pickled, sequences, strict=True), *zip(pickled_rows, rows, strict=True)]:
        assert type(got) is type(want)
        for field in dataclasses.fields(want):
            value, back = getattr(want, field.name), getattr(got, field.name)
            if isinstance(value, np.ndarray):
                assert back.dtype == value.dtype and np.array_equal(back, value), field.name
            else:
                assert back == value and type(back) is type(value), field.name
    assert pickle.loads(pickle.dumps(SequenceBatch([]))) == SequenceBatch([])


@pytest.mark.unit
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
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert result.stdout.strip() == "[]"


@pytest.mark.beam
def test_write_shards_is_sorted_split_by_seq_id_and_counts_filled_slots(tmp_path):
    rows = [
        ShardRow(
            seq_id=s,
            tokens=np.full(L * M + 1, s, np.int32),
            neighbours=np.full((L, K, 2 * M), s, np.int32),
            neighbour_ids=np.full((L, K), -1 if s == 3 else s, np.int64),  # sequence 3: every slot empty
            neighbour_scores=np.full((L, K), 0.5, np.float32),
            doc_ids=(s,),
        )
        for s in (4, 0, 3, 1, 2)
    ]
    slots = L * K
    with local_pipeline() as p:
        entries = (
            p
            | beam.Create([RowBatch(rows[:1]), RowBatch([rows[2], rows[4]]), RowBatch([rows[1], rows[3]])])
            | WriteShards(str(tmp_path), shard_rows=2, pad_id=PAD, sources=("training",))
        )
        assert_that(
            entries | beam.Map(lambda e: (e.path, e.rows, e.neighbour_slots_filled)),
            equal_to(
                [("shard-00000.arrow", 2, 2 * slots), ("shard-00001.arrow", 2, slots), ("shard-00002.arrow", 1, slots)]
            ),
        )
    table = read_shard_table(pa.memory_map(str(tmp_path / "shard-00001.arrow")))
    assert table["seq_id"].to_pylist() == [2, 3]  # given as 3, 2
    assert shard_column(table, "neighbours").shape == (2, L, K, 2 * M)
    assert table.schema.metadata[b"schema_version"] == str(SCHEMA_VERSION).encode() == b"3"


@pytest.mark.beam
@pytest.mark.parametrize("names", [("only",), ("web", "code")])
def test_a_blends_shard_entries_count_their_rows_per_source_even_with_one_source(tmp_path, names):
    rows = [
        ShardRow(
            seq_id=s,
            tokens=np.full(L * M + 1, s, np.int32),
            neighbours=np.full((L, K, 2 * M), s, np.int32),
            neighbour_ids=np.full((L, K), s, np.int64),
            neighbour_scores=np.full((L, K), 0.5, np.float32),
            doc_ids=(s,),
            source=s % len(names),
        )
        for s in range(3)
    ]
    with local_pipeline() as p:
        entries = (
            p
            | beam.Create([RowBatch(rows)])
            | WriteShards(str(tmp_path), shard_rows=4, pad_id=PAD, sources=names, blend=True)
        )
        expected = [3] if len(names) == 1 else [2, 1]
        assert_that(entries | beam.Map(lambda e: e.source_rows), equal_to([expected]))
    table = read_shard_table(pa.memory_map(str(tmp_path / "shard-00000.arrow")))
    assert table["source"].to_pylist() == [names[s % len(names)] for s in range(3)]


@pytest.mark.beam
def test_write_shards_refuses_a_batch_holding_rows_of_two_shards(tmp_path):
    """Each batch is written as one file where it is: one holding rows of two shards would
    have one of them overwrite the other's file, so it fails the job."""
    rows = [
        ShardRow(
            seq_id=s,
            tokens=np.zeros(L * M + 1, np.int32),
            neighbours=np.zeros((L, K, 2 * M), np.int32),
            neighbour_ids=np.zeros((L, K), np.int64),
            neighbour_scores=np.zeros((L, K), np.float32),
            doc_ids=(s,),
        )
        for s in (1, 2)
    ]
    with pytest.raises(Exception, match=r"holds rows of files \[0, 1\]"):
        with local_pipeline() as p:
            _ = (
                p
                | beam.Create([RowBatch(rows)])
                | WriteShards(str(tmp_path), shard_rows=2, pad_id=PAD, sources=("training",))
            )
