import apache_beam as beam
import numpy as np
import pytest
from apache_beam.testing.util import assert_that

from pipeline.chunks.chunking import chunk_document, load_tokenizer, tokenize_batch
from pipeline.common.models import resolve_tokenizer
from pipeline.embed.beam import BATCHES_PER_GROUP, EmbedChunks
from pipeline.embed.encoder import (
    Tokenized,
    arithmetic,
    chunk_texts,
    encode_texts,
    length_batches,
    load_encoder,
    model_inputs,
    resolve_precision,
    torch_threads,
)
from pipeline.embed.precision import PrecisionTooLow, agreement_upper_bound, check_precision, top2_agreement
from schemas.stage_config import EmbeddingConfig
from tests.helpers import local_pipeline, sample_documents, suite_precision

CFG = EmbeddingConfig(batch_size=8, precision=suite_precision())  # the suite's precision


def _chunks(count_docs=3, m=32, tokens_of=lambda doc_id, m: m * 5):
    """Chunks of the first sample documents, each document cut to `tokens_of(doc_id, m)` tokens."""
    tokenizer = load_tokenizer(resolve_tokenizer(None))
    docs = sample_documents(count_docs)
    chunks, next_id = [], 0
    for doc_id, tokens in enumerate(tokenize_batch(tokenizer, [d["text"] for d in docs])):
        chunks += list(chunk_document(doc_id, tokens[: tokens_of(doc_id, m)], next_id, m, 0))
        next_id = len(chunks)
    return tokenizer, chunks


@pytest.mark.beam
def test_embed_chunks_equals_the_encoder_on_the_same_groups():
    """In the suite's precision: the stage groups chunks by id range (batch_size *
    BATCHES_PER_GROUP ids) and each group gives the bits `encode_texts` gives it on the same
    thread count; the stage's precision check on its chunks passes (its confidence bound)."""
    cfg = CFG.model_copy(update={"batch_size": 2})  # groups of 64 chunks: one and a part
    # three chunks a document, the last of 1-31 tokens: batches by token count are not id pairs
    tokenizer, chunks = _chunks(count_docs=25, tokens_of=lambda doc_id, m: 2 * m + 1 + 13 * doc_id % (m - 1))
    group = cfg.batch_size * BATCHES_PER_GROUP
    assert group < len(chunks) < 2 * group
    model = load_encoder(cfg)
    texts = chunk_texts(tokenizer, chunks)
    precision = resolve_precision(cfg.precision, cfg.device)
    with torch_threads(1):  # the stage's one thread
        expected = np.concatenate(
            [encode_texts(model, texts[i : i + group], cfg.batch_size, precision) for i in range(0, len(texts), group)]
        )

    def check(groups):
        groups = sorted(groups, key=lambda g: g.chunk_ids[0])
        assert [len(g) for g in groups] == [group, len(chunks) - group]  # an element a group
        assert np.concatenate([g.chunk_ids for g in groups]).tolist() == [c.chunk_id for c in chunks]
        got = np.concatenate([g.vectors for g in groups])
        assert got.dtype == np.float32 and got.shape == (len(chunks), 384)
        np.testing.assert_array_equal(got, expected)
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)

    def checked(reports):
        (report,) = reports
        assert report["precision"] == precision and report["sample_size"] == len(chunks)  # all, < 256
        assert report["agreement_upper_bound"] >= cfg.min_agreement and report["min_cosine"] > 0.99
        assert report["top2_agreement"] >= 0.9

    with local_pipeline() as p:
        embeddings, report = p | beam.Create(chunks) | EmbedChunks(cfg, resolve_tokenizer(None), 1)
        assert_that(embeddings, check)
        assert_that(report, checked, label="CheckReport")


@pytest.mark.unit
def test_length_batches_hold_similar_token_counts_longest_first():
    counts = np.array([3, 5, 5, 1, 4, 5, 2])
    batches = length_batches(counts, 2)
    assert [b.tolist() for b in batches] == [[1, 2], [4, 5], [0, 6], [3]]  # 5 5 | 5 4 | 3 2 | 1
    assert [b.tolist() for b in length_batches(counts, 7)] == [list(range(7))]


@pytest.mark.e2e  # the real encoder
def test_encode_texts_is_sentence_transformers_encode_on_each_of_its_batches():
    """What the stage adds to SentenceTransformer.encode is the batching: every text's bits are
    encode's on the batch `length_batches` puts it in, in the suite's precision."""
    tokenizer, chunks = _chunks(count_docs=4)
    texts = chunk_texts(tokenizer, chunks)
    texts[3] = texts[3][:20]  # a short text among chunks of equal token counts
    model = load_encoder(CFG)
    precision = resolve_precision(CFG.precision, CFG.device)
    counts = Tokenized.of(model, texts).counts
    assert counts[3] < counts.max() and counts.max() <= model.max_seq_length
    with torch_threads(1):
        got = encode_texts(model, texts, 8, precision)
        batches = length_batches(counts, 8)
        assert len(batches) > 1 and 3 in batches[-1]  # the short text waits for the last batch
        with arithmetic(precision, CFG.device):
            for batch in batches:
                expected = model.encode(
                    [texts[i] for i in batch], batch_size=8, normalize_embeddings=True, convert_to_tensor=True
                )
                np.testing.assert_array_equal(got[batch], expected.float().numpy())
    assert encode_texts(model, [], 8).shape == (0, got.shape[1])
    assert load_encoder(CFG) is model  # loaded once per process: the stage and its check share it


@pytest.mark.e2e  # the real encoder's tokenizer
@pytest.mark.parametrize("side", ["right", "left"])
def test_a_tokenized_batch_is_its_texts_tokenized_alone(side):
    """One tokenizer pass serves every batch: a batch's rows, cut to the columns its texts use,
    are what tokenizing those texts alone gives, whichever side the tokenizer pads."""
    texts = ["a short one", "a text of a few more words than that", "mid length text here", "x"]
    model = load_encoder(CFG)
    before = model.tokenizer.padding_side
    model.tokenizer.padding_side = side
    try:
        tokenized = Tokenized.of(model, texts)
        for rows in ([0, 3], [2], [3, 2, 0], [0, 1, 2, 3]):
            alone = model_inputs(model, [texts[i] for i in rows])
            got = tokenized.batch(np.array(rows))
            assert set(got) == set(alone)
            for name, value in alone.items():  # tensors, and a string or two (e.g. the modality)
                same = got[name].tolist() == value.tolist() if hasattr(value, "tolist") else got[name] == value
                assert same, (rows, name)
        assert tokenized.counts.tolist() == [int(m.sum()) for m in model_inputs(model, texts)["attention_mask"]]
    finally:
        model.tokenizer.padding_side = before


@pytest.mark.unit
def test_chunk_texts_drop_padding():
    tokenizer, chunks = _chunks(1)
    last = chunks[-1]
    padded = last.__class__(
        last.chunk_id,
        last.doc_id,
        last.position,
        np.concatenate([last.tokens[:3], np.zeros(29, np.int32)]),
        last.continuation,
    )
    (text,) = chunk_texts(tokenizer, [padded])
    assert "[PAD]" not in text and text == tokenizer.decode(last.tokens[:3].tolist())


@pytest.mark.unit
def test_torch_threads_applies_a_count_and_restores_the_processes():
    import torch

    before = torch.get_num_threads()
    with torch_threads(before + 1):
        assert torch.get_num_threads() == before + 1
    assert torch.get_num_threads() == before
    with torch_threads(None):
        assert torch.get_num_threads() == before


@pytest.mark.unit
def test_top2_agreement_counts_equal_and_tied_neighbours():
    rng = np.random.default_rng(0)

    def unit(x):
        return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)

    base = rng.normal(size=(12, 8))
    base[3] = base[2]  # chunks 2 and 3 are duplicates
    base = unit(base)
    assert top2_agreement(base, base) == (24, 24)  # 12 chunks, 2 slots each
    rounded = unit(base + rng.normal(scale=1e-5, size=base.shape))  # reorders the tie, nothing else
    assert top2_agreement(base, rounded) == (24, 24)
    agreeing, slots = top2_agreement(base, base[rng.permutation(len(base))])  # neighbours moved
    assert slots == 24 and agreeing < 12


@pytest.mark.unit
def test_agreement_bound_fails_a_sample_only_when_it_is_sure():
    # one near-tie swapped in the 30 slots of 15 chunks: not evidence against 0.98
    assert agreement_upper_bound(29, 30) >= 0.98 and agreement_upper_bound(28, 30) >= 0.98
    assert agreement_upper_bound(26, 30) < 0.98  # 4 of 30 is
    # the 512 slots of the default 256-chunk sample: fails from 0.96 measured
    assert agreement_upper_bound(497, 512) >= 0.98 > agreement_upper_bound(490, 512)
    assert agreement_upper_bound(512, 512) == 1.0 and agreement_upper_bound(0, 0) == 1.0
    # more slots at the same share: a tighter bound, towards the share itself
    bounds = [agreement_upper_bound(95 * n, 100 * n) for n in (1, 10, 100, 1000)]
    assert bounds == sorted(bounds, reverse=True) and 0.95 < bounds[-1] < 0.952


@pytest.mark.e2e  # the real encoder: loading it takes seconds
def test_a_precision_that_moves_the_neighbours_fails_the_build():
    _, chunks = _chunks()
    model = load_encoder(CFG)
    texts = chunk_texts(load_tokenizer(resolve_tokenizer(None)), chunks)
    exact = encode_texts(model, texts, 8)
    scrambled = exact[np.random.default_rng(1).permutation(len(exact))]  # every neighbour moved
    sample = [(i, c) for i, c in enumerate(chunks)]
    cfg = CFG.model_copy(update={"precision": "bfloat16"})
    report = check_precision(sample, [(c.chunk_id, v) for c, v in zip(chunks, exact)], cfg, resolve_tokenizer(None), 1)
    assert report["precision"] == "bfloat16" and report["top2_agreement"] == 1.0 and report["min_cosine"] > 0.999
    with pytest.raises(PrecisionTooLow, match="set embedding.precision: float32"):
        check_precision(sample, [(c.chunk_id, v) for c, v in zip(chunks, scrambled)], cfg, resolve_tokenizer(None), 1)
