import apache_beam as beam
import numpy as np
import pytest
from apache_beam.testing.util import assert_that

from pipeline.chunks.deleted import DELETE_REQUESTED, REPLACED, DeletedDocument, DeletedFiles, deleted_table
from pipeline.common.writers import embeddings_table, parquet_bytes
from pipeline.index import exact
from pipeline.index.exact import exact_scores_of, exact_top, merge_top
from pipeline.index.recall import recall_of, recall_with_ties
from pipeline.retrieve.beam import ReadQueryBlocks
from pipeline.retrieve.recall import ExactTruth, MeasureNeighbourRecall, Probe, SmallestProbes, scan_batch
from pipeline.shards.rows import NeighbourIds, RowBatch, ShardRow
from schemas.measures import TIE_TOLERANCE
from tests.helpers import local_pipeline

L, K, D = 2, 3, 16


def _vectors(n=300, seed=0):
    v = np.random.default_rng(seed).normal(size=(n, D)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def _exact(vectors, query, excluded, k=K):
    scores = vectors @ query
    for start, end in excluded:
        scores[start:end] = -np.inf
    return np.argsort(-scores, kind="stable")[:k], scores


@pytest.mark.unit
def test_recall_counts_ties_and_empty_slots():
    exact = np.array([[0.9, 0.8], [0.7, -np.inf]], np.float32)  # the second query has one chunk to offer
    ours = np.array(
        [
            [0.9, 0.8 - TIE_TOLERANCE / 2],  # a near-tie of the 2nd best: right
            [np.nan, np.nan],
        ]
    )  # empty where one existed: a miss
    assert recall_with_ties(exact, ours) == (2, 3)
    ours[0, 1] = 0.8 - 2 * TIE_TOLERANCE
    assert recall_with_ties(exact, ours) == (1, 3)


@pytest.mark.unit
def test_scans_of_parts_merge_to_the_exact_answer():
    vectors = _vectors()
    ids = np.arange(len(vectors))
    probes = [Probe(0, 0, j, vectors[j], ((0, 10), (50, 60))) for j in range(4)]
    whole = scan_batch(ids, vectors, probes, K)
    shuffled = np.random.default_rng(1).permutation(len(ids))  # parts in any row order
    a, b = shuffled[:120], shuffled[120:]
    top = merge_top(*(scan_batch(ids[p], vectors[p], probes, K) for p in (a, b)), K)
    assert np.array_equal(top[1], whole[1]) and np.allclose(top[0], whole[0])
    for j in range(4):
        expected, _ = _exact(vectors, vectors[j], probes[j].excluded)
        assert whole[1][j].tolist() == expected.tolist()
    assert exact_top(np.zeros((2, 0), np.float32), np.zeros(0, np.int64), K)[1].tolist() == [[-1] * K] * 2


@pytest.mark.unit
def test_an_exact_search_over_no_vectors_leaves_every_slot_empty_and_merges():
    """A record batch whose documents were all deleted: nothing found, and merging it with
    another batch's answer changes nothing."""
    vectors = _vectors()
    ids = np.arange(len(vectors))
    none = exact.exact_nearest_other(ids[:3], vectors[:3], ids[:0], vectors[:0])
    assert none[1].tolist() == [[-1] * exact.TRUTH_DEPTH] * 3 and np.isneginf(none[0]).all()
    some = exact.exact_nearest_other(ids[:3], vectors[:3], ids, vectors)
    assert (some[1] >= 0).all()
    merged = exact.merge_nearest(some, none)
    assert np.array_equal(merged[1], some[1]) and np.array_equal(merged[0], some[0])
    outside = exact.exact_nearest_outside(vectors[:3], [(), (), ()], ids[:0], vectors[:0], 5)
    assert outside[1].tolist() == [[-1] * 5] * 3


@pytest.mark.unit
@pytest.mark.parametrize("block", [7, 64, 10_000])
def test_the_exact_scan_in_blocks_gives_the_answer_of_one_product(monkeypatch, block):
    """Blocks smaller than the rows, ranges across block edges, rows out of order, fewer
    reachable rows than the depth: the same as scoring every row at once."""
    monkeypatch.setattr(exact, "EXACT_BLOCK", block)
    vectors = _vectors()
    shuffled = np.random.default_rng(2).permutation(len(vectors))
    queries = vectors[:5]
    excluded = [((0, 10), (60, 75)), (), ((5, 295),), ((0, 300),), ((100, 101),)]
    scores, ids = exact.exact_nearest_outside(queries, excluded, shuffled, vectors[shuffled], 8)
    for row, ranges in enumerate(excluded):
        expected, all_scores = _exact(vectors, queries[row], ranges, 8)
        reachable = np.isfinite(all_scores[expected])
        assert ids[row].tolist() == np.where(reachable, expected, -1).tolist()
        np.testing.assert_allclose(scores[row][reachable], all_scores[expected][reachable], atol=1e-6)


@pytest.mark.unit
def test_our_neighbours_are_scored_from_the_truth_lists():
    truth = (np.array([[0.9, 0.8, 0.7, 0.6]], np.float32), np.array([[5, 3, 8, 1]]))
    ours = exact_scores_of(truth, np.array([[3, 9, -1]]))  # in the list, beyond it, empty
    assert ours[0, 0] == np.float32(0.8) and ours[0, 1] == -np.inf and np.isnan(ours[0, 2])
    assert recall_of(truth, np.array([[5, 8]])) == 0.5  # 8 is 3rd, below the 2nd best
    assert recall_of(truth, np.array([[3, 5]])) == 1.0  # the best two, in any order


@pytest.mark.unit
def test_the_sample_does_not_depend_on_how_probes_are_batched():
    probes = [Probe(key, key, 0, None, ()) for key in (9, 3, 7, 1, 5, 8)]
    fn = SmallestProbes(3)
    one = fn.extract_output(fn.add_input(fn.create_accumulator(), probes))
    split = fn.extract_output(
        fn.merge_accumulators(
            [fn.add_input(fn.create_accumulator(), probes[:2]), fn.add_input(fn.create_accumulator(), probes[2:])]
        )
    )
    assert [p[0] for p in one] == [p[0] for p in split] == [1, 3, 5]


@pytest.mark.beam
def test_the_sample_chosen_by_key_gets_its_queries_from_files_or_blocks(tmp_path):
    """The probes are chosen without their queries; then only theirs are read, from the
    database's embedding files or out of the training chunks' blocks, and one that does not
    arrive fails the job."""
    from pipeline.chunks.chunking import chunk_document
    from pipeline.retrieve.search import LOST_DATA, QueryBlock
    from pipeline.retrieve.search_beam import ProbeQueries
    from tests.helpers import write_chunk_files

    vectors = _vectors(40)
    chunks = list(chunk_document(1, np.arange(1, 161, dtype=np.int32), 0, 4, 0))
    files = write_chunk_files(tmp_path, chunks, rows_per_file=16, row_group_rows=3, vectors=vectors)
    sample = [Probe(key, seq_id, j, None, ()) for key, (seq_id, j) in enumerate([(19, 1), (0, 0), (8, 1), (8, 0)])]
    wanted = [vectors[s * L + j] for _, s, j, _, _ in sample]
    blocks = [QueryBlock(np.arange(b, min(b + 7, 40))[::-1], vectors[b : b + 7][::-1]) for b in range(0, 40, 7)]

    def check(got):
        assert [p[:3] for p in got[0]] == [p[:3] for p in sample]
        assert all(np.array_equal(p.query, q) for p, q in zip(got[0], wanted))

    with local_pipeline() as p:
        chosen = p | "Sample" >> beam.Create([sample])
        assert_that(chosen | "FromFiles" >> ProbeQueries(L, files), check, label="files")
        in_blocks = p | "Blocks" >> beam.Create(blocks)
        assert_that(chosen | "FromBlocks" >> ProbeQueries(L, in_blocks), check, label="blocks")
    with pytest.raises(Exception, match=LOST_DATA), local_pipeline() as p:
        _ = (p | beam.Create([sample])) | ProbeQueries(L, p | "Blocks" >> beam.Create(blocks[1:]))


@pytest.mark.beam
def test_measure_neighbour_recall_against_exact_search(tmp_path):
    """Sequences s = chunks 2s, 2s+1 exclude their own pair; even sequences carry the exact
    neighbours, odd ones the exact ones shifted by one (one of three right)."""
    vectors = _vectors()
    (tmp_path / "embeddings").mkdir()
    for number, start in enumerate(range(0, len(vectors), 128)):
        rows = [(i, vectors[i]) for i in range(start, min(start + 128, len(vectors)))]
        (tmp_path / "embeddings" / f"embeddings-{number:05d}.parquet").write_bytes(
            parquet_bytes(embeddings_table(rows))
        )
    sequences = 20
    probes, shard_rows = [], []
    for s in range(sequences):
        own = ((2 * s, 2 * s + 2),)
        ids = np.zeros((L, K), np.int64)
        for j in range(L):
            query = vectors[2 * s + j]
            probes.append(Probe(s * L + j, s, j, query, own))
            best, _ = _exact(vectors, query, own, K + 1)
            ids[j] = best[:K] if s % 2 == 0 else best[1:]
        shard_rows.append(
            ShardRow(
                seq_id=s,
                tokens=np.zeros(5, np.int32),
                neighbours=np.zeros((L, K, 4), np.int32),
                neighbour_ids=ids,
                neighbour_scores=np.zeros((L, K), np.float32),
                doc_ids=(s,),
            )
        )
    sampled = sorted(probes, key=lambda p: p[:3])[:30]  # keys are the chunk ids here

    def check(results):
        (result,) = results
        assert result["sample_size"] == 30 and result["slots"] == 30 * K
        assert result["tolerance"] == TIE_TOLERANCE
        expected = sum(K if p.seq_id % 2 == 0 else K - 1 for p in sampled)
        assert abs(result["value"] - expected / (30 * K)) < 1e-9

    with local_pipeline() as p:
        sample = p | "Probes" >> beam.Create([probes[:15], probes[15:]]) | beam.CombineGlobally(SmallestProbes(30))
        database = p | ReadQueryBlocks(str(tmp_path / "embeddings" / "*.parquet"))
        truth = (sample, database) | ExactTruth(100)
        blocks = [NeighbourIds.of(RowBatch(part)) for part in (shard_rows[:7], shard_rows[7:])]
        ids = p | "Rows" >> beam.Create(blocks)
        result = (sample, truth, ids) | MeasureNeighbourRecall(K)
        assert_that(result, check)


@pytest.mark.beam
def test_query_blocks_leave_out_deleted_documents(tmp_path):
    """The database the exact check scans: every embedding row of the files but the deleted
    documents' chunks, each once, with its own vector."""
    vectors = _vectors(n=200)
    (tmp_path / "embeddings").mkdir()
    for number, start in enumerate(range(0, len(vectors), 64)):
        rows = [(i, vectors[i]) for i in range(start, min(start + 64, len(vectors)))]
        (tmp_path / "embeddings" / f"embeddings-{number:05d}.parquet").write_bytes(
            parquet_bytes(embeddings_table(rows))
        )
    deleted_path = tmp_path / "deleted" / "deleted-00001.parquet"  # as a commit lists it: read by each process
    deleted_path.parent.mkdir()
    documents = [DeletedDocument(7, 60, 10, DELETE_REQUESTED), DeletedDocument(9, 150, 1, REPLACED)]
    deleted_path.write_bytes(parquet_bytes(deleted_table(documents)))
    deleted = DeletedFiles((str(deleted_path),))
    kept = [i for i in range(len(vectors)) if not (60 <= i < 70 or i == 150)]

    def check(blocks):
        ids = np.concatenate([b.chunk_ids for b in blocks])
        assert sorted(ids.tolist()) == kept
        for block in blocks:
            np.testing.assert_array_equal(block.vectors, vectors[block.chunk_ids])

    with local_pipeline() as p:
        blocks = p | ReadQueryBlocks(str(tmp_path / "embeddings" / "*.parquet"), deleted)
        assert_that(blocks, check)
