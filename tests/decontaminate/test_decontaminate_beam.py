"""`Decontaminate` on real text: the sample corpus against planted evaluation documents (exact
copies, copies with words changed, halves, unrelated text). What it removes must be exactly
the documents whose exact 13-gram Jaccard with an evaluation document reaches the threshold."""

import apache_beam as beam
import pytest
from apache_beam.testing.util import assert_that, equal_to

from benchmarks.synthetic import words_replaced
from pipeline.corpus.records import NEAR_DUPLICATE, Document, doc_id_for
from pipeline.decontaminate.beam import Decontaminate
from pipeline.decontaminate.minhash import jaccard, shingles
from schemas.config import DecontaminationConfig
from tests.helpers import local_pipeline, sample_documents

pytestmark = pytest.mark.beam

CFG = DecontaminationConfig()


def document(identity: str, text: str, source: str, position: int) -> Document:
    return Document(doc_id_for(identity), identity, text, source, position)


def planted() -> tuple[list[Document], list[Document]]:
    """(corpus, evaluation): 60 sample documents; evaluation documents made from 10 of them
    (copies, 1%, 5% and 15% of words changed, first halves) and 4 documents not in the corpus."""
    texts = [d["text"] for d in sample_documents(64)]
    corpus = [document(f"doc-{i}", t, "corpus.jsonl", i) for i, t in enumerate(texts[:60])]
    made = [
        texts[0],
        texts[1],
        words_replaced(texts[2], 0.01, 2),
        words_replaced(texts[3], 0.01, 3),
        words_replaced(texts[4], 0.05, 4),
        words_replaced(texts[5], 0.15, 5),
        " ".join(texts[6].split()[: len(texts[6].split()) // 2]),
        " ".join(texts[7].split()[: len(texts[7].split()) * 9 // 10]),
        *texts[60:64],
    ]
    evaluation = [document(f"eval-{i}", t, "eval.jsonl", i) for i, t in enumerate(made)]
    return corpus, evaluation


def test_removes_exactly_the_documents_at_or_above_the_threshold_with_their_jaccard():
    corpus, evaluation = planted()
    sets = [shingles(e.text, CFG.ngram) for e in evaluation]
    best = {d.doc_id: max(jaccard(shingles(d.text, CFG.ngram), s) for s in sets) for d in corpus}
    expected = {doc_id for doc_id, j in best.items() if j >= CFG.threshold}
    assert 4 <= len(expected) < 10  # the copies and the 1%-changed ones; not the 15%-changed or the halves

    def check_kept(kept):
        assert sorted(d.doc_id for d in kept) == sorted(d.doc_id for d in corpus if d.doc_id not in expected)

    def check_removed(rejected):
        assert {r.reason for r in rejected} == {NEAR_DUPLICATE}
        records = {dict(r.details)["doc_id"]: dict(r.details) for r in rejected}
        assert set(records) == expected
        for doc_id, record in records.items():
            assert record["jaccard"] == pytest.approx(best[doc_id], abs=1e-4)
            assert record["evaluation_id"].startswith("eval-")

    with local_pipeline() as p:
        docs = p | "Corpus" >> beam.Create(corpus)
        evals = p | "Evaluation" >> beam.Create(evaluation)
        kept, rejected = (docs, evals) | Decontaminate(CFG, same_id_fails=True)
        assert_that(kept, check_kept, label="Kept")
        assert_that(rejected, check_removed, label="Removed")


def test_a_document_in_both_corpora_by_id_fails_naming_it():
    corpus, evaluation = planted()

    with pytest.raises(Exception, match=r"document 'doc-3' \(corpus.jsonl:3\) is in the evaluation corpus too"):
        with local_pipeline() as p:
            docs = p | "Corpus" >> beam.Create(corpus)
            evals = p | "Evaluation" >> beam.Create([*evaluation, corpus[3]])
            _ = (docs, evals) | Decontaminate(CFG, same_id_fails=True)


def test_nothing_in_common_keeps_every_document():
    corpus, _ = planted()
    unrelated = [document("eval-x", "an evaluation text that shares nothing " * 5, "eval.jsonl", 0)]
    with local_pipeline() as p:
        docs, evals = p | "Corpus" >> beam.Create(corpus), p | "Evaluation" >> beam.Create(unrelated)
        kept, rejected = (docs, evals) | Decontaminate(CFG, same_id_fails=True)
        assert_that(kept | beam.Map(lambda d: d.doc_id), equal_to([d.doc_id for d in corpus]), label="All")
        assert_that(rejected, equal_to([]), label="None")
