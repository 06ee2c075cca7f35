"""Shingles, exact Jaccard, MinHash signatures and LSH bands on real text (the sample corpus)."""

import json
from pathlib import Path

import numpy as np
import pytest
from datasketch import MinHash

from benchmarks.synthetic import words_replaced
from pipeline.decontaminate.minhash import (
    SHINGLE_BLOCK,
    LshBands,
    Signer,
    estimated_jaccard,
    jaccard,
    shingles,
    standard_error,
    words,
)

pytestmark = pytest.mark.unit

CORPUS = Path(__file__).resolve().parents[2] / "examples" / "corpus"
N = 13


def sample_texts(count: int) -> list[str]:
    texts = []
    for path in sorted(CORPUS.glob("*.jsonl")):
        texts += [json.loads(line)["text"] for line in path.read_text().splitlines() if line.strip()]
    return [t for t in texts if len(words(t)) > 4 * N][:count]


def ngram_set(text: str, n: int) -> set[tuple[str, ...]]:
    """The reference: word n-grams as Python tuples."""
    w = words(text)
    return {tuple(w[i : i + n]) for i in range(len(w) - n + 1)} if len(w) >= n else {tuple(w)}


def test_words_ignore_case_punctuation_spacing_and_compatibility_forms():
    assert words("Hello,  WORLD!\nﬁle") == ["hello", "world", "file"]
    assert np.array_equal(shingles("A b, c. D", 2), shingles("a B c d", 2))


def test_a_text_shorter_than_n_words_is_one_shingle_and_word_order_counts():
    assert len(shingles("three short words", N)) == 1
    assert len(shingles("... !", N)) == 0
    assert not np.array_equal(shingles("alpha beta", 2), shingles("beta alpha", 2))


def test_exact_jaccard_equals_jaccard_of_the_ngram_sets_on_real_text():
    texts = sample_texts(12)
    pairs = [(t, words_replaced(t, share, i)) for i, t in enumerate(texts) for share in (0.0, 0.01, 0.05)]
    pairs += [(t, " ".join(t.split()[: len(t.split()) // 2])) for t in texts]  # cut in half
    pairs += list(zip(texts, texts[1:]))  # unrelated
    for a, b in pairs:
        sa, sb = ngram_set(a, N), ngram_set(b, N)
        assert jaccard(shingles(a, N), shingles(b, N)) == pytest.approx(len(sa & sb) / len(sa | sb), abs=1e-12)


def test_signatures_are_datasketch_minhash_of_the_shingles_whatever_the_blocks():
    text = " ".join(sample_texts(40))  # more shingles than one block holds
    hashes = shingles(text, N)
    assert len(hashes) > SHINGLE_BLOCK
    reference = MinHash(num_perm=64, seed=7, scheme="affine64", hashfunc=int)
    reference.update_batch(hashes.tolist())
    assert np.array_equal(Signer(64, 7).signature(hashes), reference.hashvalues)
    assert not np.array_equal(Signer(64, 8).signature(hashes), reference.hashvalues)


def test_estimated_jaccard_is_within_four_standard_errors_of_the_exact_one():
    signer = Signer(256, 1)
    texts = sample_texts(10)
    for i, text in enumerate(texts):
        for share in (0.0, 0.01, 0.03):
            a, b = shingles(text, N), shingles(words_replaced(text, share, i), N)
            exact = jaccard(a, b)
            estimate = estimated_jaccard(signer.signature(a), signer.signature(b))
            assert abs(estimate - exact) <= 4 * standard_error(exact, 256) + 1e-9


def test_bands_make_a_pair_at_the_threshold_a_candidate_with_the_recall_asked():
    bands = LshBands.for_threshold(0.8, 128, 0.99)
    assert bands.bands * bands.rows <= 128
    assert bands.candidate_probability(0.8) >= 0.99
    fewer = LshBands(128 // (bands.rows + 1), bands.rows + 1)  # one row more per band: below the recall
    assert fewer.candidate_probability(0.8) < 0.99
    assert bands.candidate_probability(0.3) < 0.05


def test_band_keys_differ_only_in_the_band_a_value_changed():
    bands = LshBands(4, 3)
    signature = np.arange(12, dtype=np.uint64)
    other = signature.copy()
    other[7] += 1  # band 2 (values 6, 7, 8)
    keys, changed_keys = bands.keys(signature), bands.keys(other)
    assert [a == b for a, b in zip(keys, changed_keys)] == [True, True, False, True]
    same_values_other_band = LshBands(4, 3).keys(np.tile(signature[:3], 4))
    assert len(set(same_values_other_band)) == 4  # a band's number is part of its key
