"""The retrieve stage: packing sequences, their documents' chunk-id spans, distinct neighbours,
and `RetrieveNeighbours` as build-shards wires it (own documents excluded, dedupe, batches,
a shuffle that loses data)."""

import dataclasses
import pickle

import apache_beam as beam
import faiss
import numpy as np
import pytest
from apache_beam.testing.util import assert_that, equal_to

import pipeline.retrieve.beam as retrieve_beam
import pipeline.retrieve.search_beam as search_beam
from pipeline.chunks.chunk_files import TrainingChunks
from pipeline.chunks.chunking import chunk_document
from pipeline.common.arrays import merge_ranges, widest_span
from pipeline.index.train import build_index
from pipeline.retrieve.beam import (
    LOST_DATA,
    DocumentSpans,
    PackSequences,
    RetrieveNeighbours,
    SpansOfTrainingChunks,
)
from pipeline.retrieve.file_queries import FileQueries
from pipeline.retrieve.file_tokens import token_key
from pipeline.retrieve.routed import BatchQueries, RoutedBatch, SliceFound, SliceQueries, merge_round
from pipeline.retrieve.search import (
    CANDIDATE,
    PICK,
    SEQUENCES_PER_SEARCH,
    NeighbourBlock,
    QueryBlock,
    Records,
    Retrieval,
    batch_queries,
    select_distinct,
)
from pipeline.retrieve.sequences import batch_parts, document_spans, pack_batch, pack_sequence
from pipeline.shards.rows import Sequence, SequenceBatch
from tests.helpers import local_pipeline, write_chunk_files, write_list_slices

M, L, K, PAD = 4, 2, 2, 0


@pytest.mark.unit
def test_pack_sequence_adds_the_next_token_and_its_document():
    rows = TrainingChunks.of_chunks(list(chunk_document(7, np.arange(1, 9, dtype=np.int32), 0, M, PAD)))
    seq = pack_sequence(0, rows.tokens, rows.doc_id, next_token=42, next_doc=8, pad_id=PAD)
    assert seq.tokens.tolist() == list(range(1, 9)) + [42]
    assert seq.doc_ids == (7, 8)
    assert pack_sequence(0, rows.tokens, rows.doc_id, next_token=None, next_doc=None, pad_id=PAD).tokens[-1] == PAD


@pytest.mark.unit
def test_packing_by_batches_of_any_blocks_gives_each_sequence_its_chunks_and_the_next_token():
    """Chunk rows in blocks cut anywhere, keyed to batches of 3 sequences and packed per
    batch: every whole sequence made once, its target the next chunk's first token (pad after
    the last chunk), the database's tail too short for a sequence left out."""
    rng = np.random.default_rng(3)
    chunks = []
    for doc in range(12):
        tokens = rng.integers(1, 99, int(rng.integers(1, 4)) * M).astype(np.int32)
        chunks += chunk_document(doc, tokens, len(chunks), M, PAD)
    rows = TrainingChunks.of_chunks(chunks)
    cuts = np.sort(rng.choice(np.arange(1, len(chunks)), 4, replace=False))
    parts: dict[int, list] = {}
    for block in np.split(rng.permutation(len(chunks)), cuts):  # blocks in no order
        for batch, part in batch_parts(rows.take(block), L, 3):
            parts.setdefault(batch, []).append(part)
    packed = [s for batch in sorted(parts) for s in pack_batch(batch, parts[batch], L, 3, PAD)]
    whole = len(chunks) // L
    assert [s.seq_id for s in packed] == list(range(whole))
    for s in packed:
        mine = chunks[s.seq_id * L : (s.seq_id + 1) * L]
        after = chunks[(s.seq_id + 1) * L] if (s.seq_id + 1) * L < len(chunks) else None
        assert s.tokens[:-1].tolist() == np.concatenate([c.tokens for c in mine]).tolist()
        assert s.tokens[-1] == (after.tokens[0] if after else PAD)
        assert s.doc_ids == tuple(sorted({c.doc_id for c in mine} | ({after.doc_id} if after else set())))


def candidates(*rows):
    """CANDIDATE rows from (seq_id, j, rank, score, chunk_id, token_key) tuples."""
    return np.array([(seq, j, rank, chunk, score, key) for seq, j, rank, score, chunk, key in rows], CANDIDATE)


@pytest.mark.unit
def test_select_distinct_skips_candidates_repeating_a_kept_neighbour():
    same, other = token_key(np.array([5, 6, 7, 8])), token_key(np.array([5, 6, 7, 9]))
    assert same == token_key(np.array([5, 6, 7, 8], dtype=np.int64)) and same != other
    found = candidates(
        (5, 0, 2, 0.25, 12, other),
        (5, 0, 1, 0.5, 11, same),
        (4, 0, 0, 0.5, 14, same),  # another sequence keeps its own
        (5, 0, 0, 1.0, 10, same),  # any order
        (5, 1, 0, 0.75, 13, same),
    )
    picks, dropped = select_distinct(found, K)
    assert picks.tolist() == [(4, 0, 0, 14, 0.5), (5, 0, 0, 10, 1.0), (5, 0, 1, 12, 0.25), (5, 1, 0, 13, 0.75)]
    assert dropped == 1


@pytest.mark.unit
def test_candidate_tokens_sends_each_block_on_before_reading_the_next(tmp_path):
    """A chunk file's candidates come as blocks (one per search batch); each is given its token
    keys and sent on, keyed by its batch, before the next is read: no step holds all of a file's."""
    chunks = _database()[0]
    files = write_chunk_files(tmp_path, chunks)  # file 1 holds chunk ids 5 ... 9

    def block(seq_ids, chunk_ids):
        hits = np.zeros(len(seq_ids), CANDIDATE)
        hits["seq_id"], hits["chunk_id"], hits["rank"] = seq_ids, chunk_ids, np.arange(len(seq_ids))
        return hits

    blocks, taken = [block([3, 2, 3], [5, 9, 5]), block([140, 140], [9, 6])], []

    def arriving():
        for b in blocks:
            taken.append(b)
            yield Records(b)

    sent = retrieve_beam._CandidateTokens(files).process((1, arriving()))
    first = next(sent)
    assert len(taken) == 1
    got = [(batch, records.rows) for batch, records in [first, *sent]]
    assert [(batch, hits["chunk_id"].tolist()) for batch, hits in got] == [(0, [5, 9, 5]), (2, [9, 6])]
    for batch, hits in got:
        assert (hits["seq_id"] // SEQUENCES_PER_SEARCH == batch).all()
        assert hits["token_key"].tolist() == [token_key(chunks[c].tokens) for c in hits["chunk_id"]]
    assert all((b["token_key"] == 0).all() for b in blocks)  # the blocks received are left as they came


@pytest.mark.unit
def test_a_block_of_one_hit_crosses_a_shuffle_in_little_more_than_its_bytes():
    """With many chunk files a block per (search batch, chunk file) holds a hit or two: its
    encoding must not carry numpy's record-type description (~330 B) each time."""
    from apache_beam.coders import coders

    coder = coders.FastPrimitivesCoder()
    for dtype in (CANDIDATE, PICK):
        hits = np.zeros(1, dtype)
        hits["seq_id"], hits["chunk_id"] = 7, 123
        encoded = coder.encode((5, Records(hits)))
        assert len(encoded) <= dtype.itemsize + 100, (dtype, len(encoded))
        _, back = coder.decode(encoded)
        assert back.rows.dtype == dtype and back.rows.tobytes() == hits.tobytes()
        assert back.rows.flags.writeable
    # neighbour tokens: 2 bytes an id where every id fits (the default encoder's vocabulary does), else 4
    for tokens, width in (([0, 7, 30_521, 65_535], 2), ([0, 7, 65_536, 3], 4), ([-1, 7, 30_521, 3], 4)):
        values = np.array(tokens * 32, np.int32).reshape(1, 128)
        block = NeighbourBlock(np.zeros(1, PICK), values)
        encoded = coder.encode((5, block))
        assert PICK.itemsize + 128 * width <= len(encoded) <= PICK.itemsize + 128 * width + 120, (width, len(encoded))
        back = coder.decode(encoded)[1]
        assert back.picks.tobytes() == block.picks.tobytes() and np.array_equal(back.values, values)
        assert back.values.dtype == np.int32 and back.values.flags.writeable


@pytest.mark.unit
def test_document_spans_and_ranges():
    ids = np.array([7, 3, 4, 5, 6, 8])  # any order; doc 20 continues past this batch
    docs = np.array([20, 10, 10, 20, 20, 20])
    assert document_spans(ids, docs) == [(10, (3, 5)), (20, (5, 9))]
    assert document_spans(ids[:0], docs[:0]) == []
    assert widest_span([(5, 9), (9, 12), (7, 8)]) == (5, 12)
    assert merge_ranges([(9, 12), (0, 3), (3, 5), (10, 11), (20, 21)]) == [(0, 5), (9, 12), (20, 21)]
    assert merge_ranges([]) == []


@pytest.mark.beam
def test_spans_of_training_chunks_are_the_spans_read_from_the_chunk_files(tmp_path):
    """Documents cut across blocks and files: the spans from the training chunks' blocks
    (training_corpus: same) equal those DocumentSpans reads from the chunk files."""
    chunks, _ = _database()
    chunk_files = write_chunk_files(tmp_path / "index", chunks)  # 5 rows a file: documents cross files
    blocks = [TrainingChunks.of_chunks(chunks[begin : begin + 3]) for begin in range(0, len(chunks), 3)]
    expected = [(100, (0, 4)), (101, (4, 8)), (102, (8, 12))]
    with local_pipeline() as p:
        from_blocks = p | "Blocks" >> beam.Create(blocks) | "FromBlocks" >> SpansOfTrainingChunks()
        read = p | "Read" >> DocumentSpans(f"{chunk_files.directory}/chunks/*.parquet")
        assert_that(from_blocks, equal_to(expected), label="FromBlocksAreExpected")
        assert_that(read, equal_to(expected), label="ReadAreExpected")


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


def retrieve(
    p,
    chunks,
    vectors,
    index_path,
    chunk_files,
    dedupe=False,
    candidates=8,
    queries_from_files=False,
    shard_rows=SEQUENCES_PER_SEARCH,
    each_row=True,
):
    """RetrieveNeighbours as build-shards wires it: document spans read from the chunk files;
    the queries given as blocks (a separate training corpus) or, `queries_from_files`, read
    by the search from the embedding files (the training chunks are the database's). -> its
    rows (`each_row`) or its RowBatches."""
    sequences = p | "Chunks" >> beam.Create([TrainingChunks.of_chunks(chunks)]) | PackSequences(L, PAD)
    spans = p | DocumentSpans(f"{chunk_files.directory}/chunks/*.parquet")
    spec = Retrieval(
        index_path=index_path,
        depth=None,
        chunk_files=chunk_files,
        chunks_per_seq=L,
        chunk_tokens=M,
        neighbours=K,
        candidates=candidates,
        pad_id=PAD,
        dedupe=dedupe,
    )
    if queries_from_files:
        batches = ((sequences, spans) | RetrieveNeighbours(spec, shard_rows)).rows
    else:
        queries = p | "Queries" >> beam.Create(
            [QueryBlock(np.array([i]), vectors[i : i + 1]) for i in range(len(chunks))]
        )
        batches = ((sequences, queries, spans) | RetrieveNeighbours(spec, shard_rows)).rows
    return batches | "EachRow" >> beam.FlatMap(lambda batch: batch.rows) if each_row else batches


@pytest.mark.beam
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


@pytest.mark.beam
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


@pytest.mark.beam
def test_a_search_batch_with_only_leftover_chunks_is_skipped(tmp_path):
    """64 whole sequences fill search batch 0 exactly; the one chunk after them (too few for a
    sequence) still has an embedding, keyed to batch 1, which therefore holds no sequence."""

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


@pytest.mark.unit
def test_file_queries_read_rows_across_file_edges_and_refuse_files_that_disagree(tmp_path):
    chunks, vectors = _database()
    chunk_files = write_chunk_files(tmp_path / "index", chunks, vectors=vectors)  # 5 rows a file
    queries = FileQueries(chunk_files)
    ids = np.array([3, 4, 5, 6, 11])  # three files
    block = queries.block(ids)
    assert block.chunk_ids.tolist() == ids.tolist() and np.array_equal(block.vectors, vectors[ids])
    with pytest.raises(ValueError, match="12 chunks"):
        queries.block(np.array([11, 12]))
    other = write_chunk_files(tmp_path / "other", chunks[:5] + chunks[6:], vectors=vectors)  # file 1 off by one
    with pytest.raises(ValueError, match="does not hold the chunk ids 5..9"):
        FileQueries(other).block(np.array([5]))


@pytest.mark.beam
@pytest.mark.parametrize("shard_rows", [SEQUENCES_PER_SEARCH, 100])
def test_the_search_reading_queries_from_the_embedding_files_finds_what_it_finds_given_them(tmp_path, shard_rows):
    """300 chunks in files of 7 rows: search batches (128 chunks) start inside files and cross
    their edges; read from the files, grouped by file, the queries give the same neighbours.
    The rows come a shard at a time, also where shards (of 100) and search batches (of 64)
    cross."""
    rng = np.random.default_rng(3)
    chunks = []
    for doc in range(60):
        chunks += list(chunk_document(doc, rng.integers(1, 1000, 5 * M).astype(np.int32), len(chunks), M, PAD))
    vectors = rng.normal(size=(len(chunks), 16)).astype(np.float32)
    faiss.normalize_L2(vectors)
    index_path = str(tmp_path / "index.faiss")
    faiss.write_index(build_index(np.arange(len(chunks), dtype=np.int64), vectors, "Flat"), index_path)
    chunk_files = write_chunk_files(tmp_path / "index", chunks, rows_per_file=7, vectors=vectors)
    found, shards = {}, {}
    for from_files in (False, True):
        _ROWS.clear()
        with local_pipeline() as p:
            batches = retrieve(
                p,
                chunks,
                vectors,
                index_path,
                chunk_files,
                queries_from_files=from_files,
                shard_rows=shard_rows,
                each_row=False,
            )
            shard_ids = batches | "ShardIds" >> beam.Map(lambda batch: [[row.seq_id for row in batch.rows]])
            _ = shard_ids | "CollectShardIds" >> beam.FlatMap(_collect)
            _ = batches | beam.Map(lambda batch: batch.rows) | "CollectRows" >> beam.FlatMap(_collect)
        found[from_files] = {row.seq_id: row for row in _ROWS if not isinstance(row, list)}
        shards[from_files] = sorted(sorted(ids) for ids in _ROWS if isinstance(ids, list))
    sequences = len(chunks) // L
    assert sorted(found[True]) == sorted(found[False]) == list(range(sequences))
    assert sequences > 2 * SEQUENCES_PER_SEARCH  # several search batches
    by_shard = [list(range(begin, min(begin + shard_rows, sequences))) for begin in range(0, sequences, shard_rows)]
    assert shards[True] == shards[False] == by_shard  # one RowBatch per shard, all of its rows
    for seq_id, row in found[True].items():
        assert np.array_equal(row.neighbour_ids, found[False][seq_id].neighbour_ids)
        assert np.array_equal(row.neighbours, found[False][seq_id].neighbours)


@pytest.mark.beam
@pytest.mark.parametrize(
    "what, lost, message",
    [
        ("search hits", "an element", r"sequence 3: \d+ search hits arrived, \[\d+\] were sent"),
        ("neighbours", "the count", r"sequence 3: \d+ neighbours arrived, no count were sent"),
    ],
    ids=["a search hit lost", "a neighbours count lost"],
)
def test_a_shuffle_that_loses_data_fails_the_stage_naming_the_sequence(tmp_path, monkeypatch, what, lost, message):
    """Each sequence counts what it sends through the search-hits shuffle (with dedupe) and the
    neighbours shuffle; when fewer elements arrive, or the count itself goes missing,
    RetrieveNeighbours fails rather than write a row with silently padded neighbours."""
    chunks, vectors = _database()
    index_path = str(tmp_path / "index.faiss")
    faiss.write_index(build_index(np.arange(len(chunks), dtype=np.int64), vectors, "Flat"), index_path)
    chunk_files = write_chunk_files(tmp_path / "index", chunks)
    # A local runner never drops a shuffled element, and no public hook makes it: the loss is
    # injected at the private check in pipeline/retrieve/beam.py that compares what arrived
    # with what was sent, by handing it one element (or the count) fewer for sequence 3.
    arrived = retrieve_beam._arrived

    def lose(seq_id, stage, received, sent):
        if seq_id == 3 and stage == what:
            received, sent = (received - 1, sent) if lost == "an element" else (received, [])
        arrived(seq_id, stage, received, sent)

    monkeypatch.setattr(retrieve_beam, "_arrived", lose)
    with pytest.raises(Exception, match=f"{message}: {LOST_DATA}"):
        with local_pipeline() as p:
            retrieve(p, chunks, vectors, index_path, chunk_files, dedupe=True)


@pytest.mark.unit
def test_a_sequence_whose_documents_did_not_all_answer_fails_rather_than_search_without_their_ranges():
    L, d = 2, 4
    sequence = Sequence(3, np.zeros(9, np.int32), (10, 11, 12))  # documents 10, 11, 12
    grouped = {
        "sequences": [SequenceBatch([sequence])],
        "embeddings": [QueryBlock(3 * L + np.arange(L), np.ones((L, d), np.float32))],
        "excluded": [(10, (100, 120)), (11, None)],  # 11 is not in the database; 12's range is lost
    }
    with pytest.raises(RuntimeError, match=f"sequence 3: 2 of its 3 documents' chunk-id ranges arrived: {LOST_DATA}"):
        list(batch_queries(grouped, L))
    grouped["excluded"].append((12, (120, 130)))
    ((_, queries, ranges),) = batch_queries(grouped, L)
    assert queries.shape == (L, d) and ranges == [(100, 130)]  # None excludes nothing
    grouped["embeddings"] = [QueryBlock(np.array([3 * L]), np.ones((1, d), np.float32))]  # chunk 7's is lost
    lost = f"sequence 3: the embeddings of its chunks 6..7 did not all arrive: {LOST_DATA}"
    with pytest.raises(RuntimeError, match=lost):
        list(batch_queries(grouped, L))


def _routed_batch(rows: int, width: int, sent: tuple[int, ...]) -> RoutedBatch:
    queries = BatchQueries(7, np.array([3]), np.zeros((rows, 4), np.float32), [()], np.arange(rows))
    empty = np.full((rows, width), np.finfo(np.float32).min, np.float32)
    return RoutedBatch(
        queries=queries, depth=1, rows=np.arange(rows), sent=sent, scores=empty, ids=np.full((rows, width), -1)
    )


@pytest.mark.unit
def test_a_routed_round_missing_a_slices_answer_fails_rather_than_merge_what_arrived():
    def found(index_slice, ids, scores):
        return SliceFound(7, index_slice, np.array([0]), np.array([scores], np.float32), np.array([ids]))

    state, answers = _routed_batch(1, 2, (0, 1, 2)), [found(0, [5, -1], [0.5, 0]), found(2, [70, 71], [0.9, 0.5])]
    with pytest.raises(RuntimeError, match=rf"search batch 7: index slices \[0, 2\] of \[0, 1, 2\].*{LOST_DATA}"):
        merge_round(state, answers, 2, 64, L)
    merged, deeper = merge_round(state, [*answers, found(1, [40, -1], [0.7, 0])], 2, 64, L)
    assert merged.ids.tolist() == [[70, 40]] and not deeper  # as one index ranks them
    assert state.ids.tolist() == [[-1, -1]]  # what came in stays as it came


@pytest.mark.unit
def test_a_routed_round_sends_short_queries_deeper_until_every_list():
    state = _routed_batch(2, 2, (0,))
    hits = SliceFound(
        7, 0, np.array([0, 1]), np.array([[0.9, 0.8], [0.7, 0.0]], np.float32), np.array([[1, 2], [3, -1]])
    )
    merged, deeper = merge_round(state, [hits], 2, 64, L)
    assert deeper and merged.depth == 2 and merged.rows.tolist() == [1] and merged.deeper == {1}
    merged, deeper = merge_round(_routed_batch(2, 2, (0,)).__class__(**{**merged.__dict__, "depth": 64}), [], 2, 64, L)
    assert not deeper  # at every list, a short query stays short: the index holds no more


_ROWS: list = []  # rows the in-process runner made, collected in place (`_collect` travels by name)


def _collect(rows) -> None:
    _ROWS.extend(rows)


@pytest.mark.beam
def test_routed_search_over_list_slices_finds_one_indexs_neighbours_and_sends_no_tokens(tmp_path, monkeypatch):
    """The same sequences searched in one index file and in 3 slices by lists (nprobe 1, so
    excluding a sequence's own documents sends queries deeper in routed rounds): the same
    neighbours. What reaches the slices is only SliceQueries: vectors, lists, ranges."""
    chunks, vectors = _database()
    chunk_files = write_chunk_files(tmp_path / "index", chunks)
    index = faiss.index_factory(vectors.shape[1], "IVF4,Flat", faiss.METRIC_INNER_PRODUCT)
    index.train(vectors)  # few points for 4 lists: enough to route by
    index.add_with_ids(vectors, np.arange(len(vectors), dtype=np.int64))
    one = str(tmp_path / "index.faiss")
    faiss.write_index(index, one)
    routing = write_list_slices(tmp_path, index, 3)
    received = []
    search = search_beam.SearchRouted.process

    def recording(self, keyed):
        received.extend(keyed[1])
        yield from search(self, keyed)

    monkeypatch.setattr(search_beam.SearchRouted, "process", recording)

    def neighbours_of(spec):
        _ROWS.clear()
        with local_pipeline() as p:
            sequences = p | "Chunks" >> beam.Create([TrainingChunks.of_chunks(chunks)]) | PackSequences(L, PAD)
            queries = p | "Queries" >> beam.Create([QueryBlock(np.arange(len(chunks)), vectors)])
            spans = p | DocumentSpans(f"{chunk_files.directory}/chunks/*.parquet")
            batches = ((sequences, queries, spans) | RetrieveNeighbours(spec, SEQUENCES_PER_SEARCH)).rows
            _ = batches | beam.Map(lambda batch: batch.rows) | beam.FlatMap(_collect)
        return {row.seq_id: row.neighbour_ids.tolist() for row in _ROWS}

    spec = Retrieval(
        index_path=one,
        depth=1,
        chunk_files=chunk_files,
        chunks_per_seq=L,
        chunk_tokens=M,
        neighbours=K,
        candidates=8,
        pad_id=PAD,
    )
    want = neighbours_of(spec)
    got = neighbours_of(dataclasses.replace(spec, index_path=None, routing=routing))
    assert got == want and len(got) == 6 and all(i >= 0 for row in got.values() for j in row for i in j)
    rounds = {(sent.batch, tuple(sent.rows.tolist()), sent.index_slice) for sent in received}
    assert len(received) > 1 and len(rounds) == len(received)  # each row goes to a slice once a round
    for sent in received:
        assert isinstance(sent, SliceQueries) and sent.queries.dtype == np.float32
        assert b"tokens" not in pickle.dumps(sent) and b"Sequence" not in pickle.dumps(sent)
