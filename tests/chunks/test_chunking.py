import apache_beam as beam
import numpy as np
import pytest
from apache_beam.testing.util import assert_that, equal_to

from pipeline.chunks.beam import ChunkDocuments
from pipeline.chunks.chunking import (
    bucket_of,
    chunk_document,
    chunk_offsets,
    chunk_tokens,
    load_tokenizer,
    num_chunks,
    pad_id_of,
    tokenize_batch,
)
from pipeline.common.models import resolve_tokenizer
from pipeline.corpus.records import Document
from tests.helpers import local_pipeline

PAD = 0


@pytest.mark.unit
def test_chunk_tokens_pads_the_last_chunk():
    chunks = chunk_tokens(np.arange(1, 8, dtype=np.int32), 3, PAD)
    assert chunks.tolist() == [[1, 2, 3], [4, 5, 6], [7, 0, 0]]


@pytest.mark.unit
def test_continuation_is_the_next_chunk_of_the_same_document_only():
    chunks = list(chunk_document(doc_id=9, tokens=np.arange(1, 8, dtype=np.int32), first_chunk_id=100, m=3, pad_id=PAD))
    assert [c.chunk_id for c in chunks] == [100, 101, 102]
    assert [c.position for c in chunks] == [0, 1, 2]
    assert chunks[0].continuation.tolist() == chunks[1].tokens.tolist()
    assert chunks[1].continuation.tolist() == chunks[2].tokens.tolist()
    assert chunks[2].continuation.tolist() == [PAD] * 3  # never the next document's tokens


@pytest.mark.unit
def test_chunk_offsets_are_dense_in_doc_id_order():
    assert chunk_offsets([(30, 2), (10, 3), (20, 1)]) == {10: 0, 20: 3, 30: 4}


@pytest.mark.unit
def test_tokenizer_does_not_truncate_long_documents():
    tokenizer = load_tokenizer(resolve_tokenizer(None))
    (tokens,) = tokenize_batch(tokenizer, ["word " * 1000])
    assert len(tokens) == 1000 and pad_id_of(tokenizer) == 0


@pytest.mark.beam
def test_chunk_documents_gives_dense_stable_ids():
    docs = [
        Document(doc_id=5, identity="b", text="alpha beta gamma delta epsilon", source="s", position=1),
        Document(doc_id=3, identity="a", text="one two three", source="s", position=2),
        Document(doc_id=4, identity="c", text=" \u200b ", source="s", position=3),
    ]
    with local_pipeline() as p:
        chunks, rejected = p | beam.Create(docs) | ChunkDocuments(resolve_tokenizer(None), 2, PAD)
        # doc 3 (3 tokens -> 2 chunks) takes ids 0-1, doc 5 (5 tokens -> 3 chunks) ids 2-4
        assert_that(
            chunks | "Ids" >> beam.Map(lambda c: (c.chunk_id, c.doc_id, c.position)),
            equal_to([(0, 3, 0), (1, 3, 1), (2, 5, 0), (3, 5, 1), (4, 5, 2)]),
            label="Ids",
        )
        assert_that(rejected | "Reasons" >> beam.Map(lambda r: r.reason), equal_to(["no_tokens"]), label="Rejected")


@pytest.mark.beam
def test_appended_chunks_are_numbered_after_the_database():
    docs = [
        Document(doc_id=5, identity="b", text="alpha beta gamma", source="s", position=1),
        Document(doc_id=3, identity="a", text="one two", source="s", position=2),
    ]
    with local_pipeline() as p:
        chunks, _ = p | beam.Create(docs) | ChunkDocuments(resolve_tokenizer(None), 2, PAD, first_chunk_id=100)
        assert_that(
            chunks | "Ids" >> beam.Map(lambda c: (c.chunk_id, c.doc_id, c.position)),
            equal_to([(100, 3, 0), (101, 5, 0), (102, 5, 1)]),
        )


@pytest.mark.unit
def test_buckets_are_contiguous_doc_id_ranges_in_order():
    ids = sorted(np.random.default_rng(0).integers(0, 2**63, 1000, dtype=np.int64).tolist())
    buckets = [bucket_of(i, 4) for i in ids]
    assert buckets == sorted(buckets) and set(buckets) <= set(range(16))
    assert bucket_of(2**63 - 1) == 2**16 - 1 and bucket_of(0) == 0


@pytest.mark.beam
def test_bucketed_ids_equal_one_global_table_with_full_and_empty_buckets():
    """Many documents per bucket (2 bits: 4 buckets), one bucket left empty: the ids equal
    those one sorted table of every document gives."""
    rng = np.random.default_rng(1)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    ids = rng.integers(0, 2**61, 40).tolist() + rng.integers(2**62, 2**63, 40).tolist()  # bucket 1 empty
    docs = [
        Document(
            doc_id=int(d),
            identity=str(d),
            text=" ".join(rng.choice(words, int(rng.integers(1, 12)))),
            source="s",
            position=i,
        )
        for i, d in enumerate(ids)
    ]
    tokenizer = load_tokenizer(resolve_tokenizer(None))
    lengths = {d.doc_id: len(t) for d, t in zip(docs, tokenize_batch(tokenizer, [d.text for d in docs]))}
    offsets = chunk_offsets((d, num_chunks(n, 2)) for d, n in lengths.items())
    expected = sorted((offsets[d] + i, d, i) for d, n in lengths.items() for i in range(num_chunks(n, 2)))
    assert {bucket_of(d, 2) for d in lengths} == {0, 2, 3} and len(expected) > 100
    with local_pipeline() as p:
        chunks, _ = p | beam.Create(docs) | ChunkDocuments(resolve_tokenizer(None), 2, PAD, bucket_bits=2)
        assert_that(chunks | beam.Map(lambda c: (c.chunk_id, c.doc_id, c.position)), equal_to(expected))


@pytest.mark.unit
def test_a_long_text_is_tokenized_in_pieces_with_the_tokens_of_the_whole():
    import random

    from pipeline.chunks.chunking import text_pieces

    tokenizer = load_tokenizer(resolve_tokenizer(None))
    words = ["alpha", "Beta,", "gämma", "delta.", "\n\n", "neighbour", "chunk-ing", "日本語", "of", "x" * 40]
    rng = random.Random(0)
    cut_at_words = 0
    for _ in range(300):
        text = "".join(rng.choice(words) + rng.choice([" ", "", "\t", "  "]) for _ in range(rng.randint(0, 300)))
        size = rng.randint(3, 200)
        pieces = text_pieces(text, size)
        assert "".join(pieces) == text and all(len(p) <= size for p in pieces)
        if all(p[:1].isspace() for p in pieces[1:]):  # every cut where whitespace begins after a word
            cut_at_words += len(pieces) > 1
            got = [i for p in pieces for i in tokenizer.encode(p, add_special_tokens=False).ids]
            assert got == tokenizer.encode(text, add_special_tokens=False).ids
    assert cut_at_words > 100
    long = " ".join(rng.choice(words) for _ in range(40_000))  # several 64 Ki-character pieces
    (tokens,) = tokenize_batch(tokenizer, [long])
    assert tokens.tolist() == tokenizer.encode(long, add_special_tokens=False).ids
