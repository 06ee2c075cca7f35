"""Decontamination (`ReadCorpusKeptClean`, `Decontaminate` screening `ReadCorpus`) on real
text: the sample corpus against planted evaluation documents (exact copies, copies with words
changed, halves, unrelated text). What it removes must be exactly the documents whose exact
13-gram Jaccard with an evaluation document reaches the threshold."""

from pathlib import Path

import apache_beam as beam
import pytest
from apache_beam.testing.util import assert_that, equal_to

from benchmarks.synthetic import words_replaced
from pipeline.common.rejected import NEAR_DUPLICATE
from pipeline.corpus.records import Document, doc_id_for
from pipeline.decontaminate.beam import ReadCorpusKeptClean
from pipeline.decontaminate.minhash import jaccard, shingles
from schemas.config import config_from_dict
from schemas.stage_config import DecontaminationConfig
from tests.helpers import local_pipeline, sample_documents, write_jsonl

pytestmark = pytest.mark.beam

CFG = DecontaminationConfig()


def document(identity: str, text: str, source: str, position: int) -> Document:
    return Document(doc_id_for(identity), identity, text, source, position)


def read_kept_clean(p, tmp_path: Path, corpus: list[Document], evaluation: list[Document]):
    """The corpus and evaluation documents written in order as corpus.jsonl and eval.jsonl
    (read back at line position + 1) and read back decontaminated -> (documents kept, rejected
    records)."""
    for name, docs in (("corpus.jsonl", corpus), ("eval.jsonl", evaluation)):
        write_jsonl(tmp_path / name, [{"id": d.identity, "text": d.text} for d in docs])
    cfg = config_from_dict(
        {
            "output": str(tmp_path / "out"),
            "retrieval_corpus": {"paths": [str(tmp_path / "corpus.jsonl")], "id_field": "id"},
            "evaluation_corpus": {"paths": [str(tmp_path / "eval.jsonl")], "id_field": "id"},
        }
    )
    read = p | ReadCorpusKeptClean(cfg, "retrieval")
    return read.documents, read.rejected


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


def test_removes_exactly_the_documents_at_or_above_the_threshold_with_their_jaccard(tmp_path):
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
        kept, rejected = read_kept_clean(p, tmp_path, corpus, evaluation)
        assert_that(kept, check_kept, label="Kept")
        assert_that(rejected, check_removed, label="Removed")


def test_a_document_in_both_corpora_by_id_fails_naming_it(tmp_path):
    corpus, evaluation = planted()
    also = document("doc-3", corpus[3].text, "eval.jsonl", len(evaluation))

    with pytest.raises(Exception, match=r"document 'doc-3' \(\S+/corpus.jsonl:4\) is in the evaluation corpus too"):
        with local_pipeline() as p:
            _ = read_kept_clean(p, tmp_path, corpus, [*evaluation, also])


def test_nothing_in_common_keeps_every_document(tmp_path):
    corpus, _ = planted()
    unrelated = [document("eval-x", "an evaluation text that shares nothing " * 5, "eval.jsonl", 0)]
    with local_pipeline() as p:
        kept, rejected = read_kept_clean(p, tmp_path, corpus, unrelated)
        assert_that(kept | beam.Map(lambda d: d.doc_id), equal_to([d.doc_id for d in corpus]), label="All")
        assert_that(rejected, equal_to([]), label="None")


def test_a_doc_id_read_twice_is_judged_by_the_copy_kept(tmp_path):
    """Later copies of a doc id are rejected as duplicates only, whatever their text: doc-10's
    later copy is a copy of an evaluation document and doc-10 stays; doc-0's later copy is not,
    and doc-0 (a copy of one) is removed all the same."""
    corpus, evaluation = planted()
    assert evaluation[0].text == corpus[0].text
    later = [
        document("doc-10", corpus[0].text, "corpus.jsonl", 60),
        document("doc-0", corpus[10].text, "corpus.jsonl", 61),
    ]
    sets = [shingles(e.text, CFG.ngram) for e in evaluation]
    expected = {d.doc_id for d in corpus if max(jaccard(shingles(d.text, CFG.ngram), s) for s in sets) >= CFG.threshold}
    assert doc_id_for("doc-0") in expected and doc_id_for("doc-10") not in expected

    def check_rejected(rejected):
        assert sorted((r.position, r.reason) for r in rejected if r.reason == "duplicate_id") == [
            (61, "duplicate_id"),
            (62, "duplicate_id"),
        ]
        assert {dict(r.details)["doc_id"] for r in rejected if r.reason == NEAR_DUPLICATE} == expected
        assert all(r.position <= 60 for r in rejected if r.reason == NEAR_DUPLICATE)

    with local_pipeline() as p:
        kept, rejected = read_kept_clean(p, tmp_path, [*corpus, *later], evaluation)
        kept_ids = sorted(d.doc_id for d in corpus if d.doc_id not in expected)
        assert_that(kept | beam.Map(lambda d: d.doc_id), equal_to(kept_ids), label="Kept")
        assert_that(rejected, check_rejected, label="Rejected")
