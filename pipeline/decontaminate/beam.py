"""`Decontaminate`: documents that are near-duplicates of an evaluation document removed, with
a `rejected/` record each.

Every document (of the corpus and of the evaluation set) sends its id to one shuffle key per
LSH band of its MinHash signature; a band key that holds an evaluation document makes a
candidate pair of it with each corpus document there. No process holds the signatures: a
band group holds ids. The corpus documents in a candidate pair (a sorted id array, a side
input: 8 bytes each) are joined by id with their candidate evaluation documents' shingles and
kept or removed by their exact Jaccard; the others pass through unshuffled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import apache_beam as beam
import numpy as np

from pipeline.corpus.read import ReadCorpus
from pipeline.corpus.records import NEAR_DUPLICATE, Document, Rejected, _excerpt
from pipeline.decontaminate.minhash import LshBands, Signer, jaccard, shingles
from schemas.config import CorpusConfig, DecontaminationConfig, PipelineConfig

REJECTED = "rejected"  # tagged output: Rejected records
CANDIDATE = "candidate"  # tagged output: documents in a candidate pair


@dataclass(frozen=True)
class BandMember:
    """A document in an LSH band's shuffle group."""

    doc_id: int
    evaluation: bool


@dataclass(frozen=True)
class EvaluationShingles:
    """An evaluation document's shingles, sent to each corpus document it is a candidate with."""

    identity: str
    shingles: np.ndarray  # sorted distinct uint64


class _BandKeys(beam.DoFn):
    """A document -> (band key, BandMember) per LSH band of its signature (none without words)."""

    def __init__(self, cfg: DecontaminationConfig, bands: LshBands, evaluation: bool):
        self.cfg, self.bands, self.evaluation = cfg, bands, evaluation

    def setup(self):
        self.signer = Signer(self.cfg.num_perm, self.cfg.seed)

    def process(self, doc: Document):
        found = shingles(doc.text, self.cfg.ngram)
        if len(found):
            member = BandMember(doc.doc_id, self.evaluation)
            for key in self.bands.keys(self.signer.signature(found)):
                yield key, member


def candidate_pairs(keyed):
    """(band key, its members) -> (corpus doc id, evaluation doc id) for each pair across the
    two sides; only a band's ids are held."""
    _, members = keyed
    corpus, evaluation = [], []
    for member in members:
        (evaluation if member.evaluation else corpus).append(member.doc_id)
    for doc_id in corpus if evaluation else ():
        for evaluation_id in evaluation:
            yield doc_id, evaluation_id


def _sorted_ids(ids) -> np.ndarray:
    return np.unique(np.fromiter(ids, np.int64))


class _SplitCandidates(beam.DoFn):
    """Documents -> those in a candidate pair (tagged CANDIDATE) and the rest (main). With
    `evaluation_ids`, a document whose id an evaluation document has fails the job."""

    def process(self, doc: Document, candidates: np.ndarray, evaluation_ids: np.ndarray | None):
        if evaluation_ids is not None and _holds(evaluation_ids, doc.doc_id):
            raise ValueError(
                f"document {doc.identity!r} ({doc.source}:{doc.position}) is in the evaluation corpus too "
                "(the same id): remove it from one of them"
            )
        yield beam.pvalue.TaggedOutput(CANDIDATE, doc) if _holds(candidates, doc.doc_id) else doc


def _holds(sorted_ids: np.ndarray, doc_id: int) -> bool:
    at = int(np.searchsorted(sorted_ids, doc_id))
    return at < len(sorted_ids) and int(sorted_ids[at]) == doc_id


def _to_corpus_documents(keyed):
    """(evaluation doc id, its shingles and the corpus documents it is a candidate with) ->
    (corpus doc id, EvaluationShingles) per such document."""
    _, grouped = keyed
    for evaluation in grouped["evaluation"]:
        for doc_id in grouped["doc_id"]:
            yield doc_id, evaluation


def verify(keyed, ngram: int, threshold: float):
    """(doc id, the document and its candidate evaluation documents) -> the document, or a
    Rejected record naming the most similar evaluation document at exact Jaccard >= threshold."""
    _, grouped = keyed
    for doc in grouped["document"]:
        own = shingles(doc.text, ngram)
        best, near = max(((jaccard(own, e.shingles), e.identity) for e in grouped["evaluation"]), default=(0.0, ""))
        if best < threshold:
            yield doc
            continue
        details = (("doc_id", doc.doc_id), ("jaccard", round(best, 4)), ("evaluation_id", near))
        yield beam.pvalue.TaggedOutput(
            REJECTED, Rejected(doc.source, doc.position, NEAR_DUPLICATE, _excerpt(doc.text), details)
        )


class Decontaminate(beam.PTransform):
    """(documents, evaluation documents) -> (documents kept, Rejected records of those removed:
    reason near_duplicate_of_evaluation, with the exact Jaccard and the evaluation document's
    identity). `same_id_fails`: a document whose id an evaluation document has fails the job
    (set when both corpora take ids from an id field)."""

    def __init__(self, cfg: DecontaminationConfig, same_id_fails: bool):
        super().__init__()
        self.cfg, self.same_id_fails = cfg, same_id_fails
        self.bands = LshBands.for_threshold(cfg.threshold, cfg.num_perm, cfg.candidate_recall)

    def expand(self, inputs):
        documents, evaluation = inputs
        cfg = self.cfg
        pairs = (
            (
                documents | "CorpusBandKeys" >> beam.ParDo(_BandKeys(cfg, self.bands, evaluation=False)),
                evaluation | "EvaluationBandKeys" >> beam.ParDo(_BandKeys(cfg, self.bands, evaluation=True)),
            )
            | "AllBandKeys" >> beam.Flatten()
            | "GroupByBand" >> beam.GroupByKey()
            | "CandidatePairs" >> beam.FlatMap(candidate_pairs)
            | "DistinctPairs" >> beam.Distinct()
        )
        candidate_ids = (
            pairs
            | "CandidateIds" >> beam.Map(lambda pair: pair[0])
            | "SortedCandidateIds" >> beam.CombineGlobally(beam.combiners.ToListCombineFn())
            | "AsArray" >> beam.Map(_sorted_ids)
        )
        if self.same_id_fails:
            evaluation_ids = (
                evaluation
                | "EvaluationIds" >> beam.Map(lambda d: d.doc_id)
                | "AllEvaluationIds" >> beam.combiners.ToList()
                | "EvaluationIdArray" >> beam.Map(_sorted_ids)
            )
        else:
            evaluation_ids = documents.pipeline | "NoIdCheck" >> beam.Create([None])
        split = documents | "SplitCandidates" >> beam.ParDo(
            _SplitCandidates(), beam.pvalue.AsSingleton(candidate_ids), beam.pvalue.AsSingleton(evaluation_ids)
        ).with_outputs(CANDIDATE, main="clear")
        evaluation_shingles = (
            {
                "evaluation": evaluation
                | "EvaluationShingles"
                >> beam.Map(lambda d: (d.doc_id, EvaluationShingles(d.identity, shingles(d.text, cfg.ngram)))),
                "doc_id": pairs | "ByEvaluationId" >> beam.Map(lambda pair: (pair[1], pair[0])),
            }
            | "JoinEvaluationShingles" >> beam.CoGroupByKey()
            | "ToCorpusDocuments" >> beam.FlatMap(_to_corpus_documents)
        )
        verified = (
            {
                "document": split[CANDIDATE] | "CandidateById" >> beam.Map(lambda d: (d.doc_id, d)),
                "evaluation": evaluation_shingles,
            }
            | "JoinCandidates" >> beam.CoGroupByKey()
            | "ExactJaccard" >> beam.FlatMap(verify, cfg.ngram, cfg.threshold).with_outputs(REJECTED, main="kept")
        )
        kept = (split.clear, verified.kept) | "KeptDocuments" >> beam.Flatten()
        return kept, verified[REJECTED]


class KeepOutEvaluation(beam.PTransform):
    """A corpus's documents -> (documents kept, Rejected near-duplicates, tallies): the
    config's evaluation corpora read (their unreadable records counted by reason as
    `evaluation_rejected_<reason>`, not written: they are not the corpus's) and `Decontaminate`
    applied. A document whose id an evaluation document has fails the job when both take ids
    from an id field."""

    def __init__(self, cfg: PipelineConfig, corpus: CorpusConfig, match: bool = True):
        super().__init__()
        self.cfg, self.corpus = cfg, corpus
        self.readers = [ReadCorpus(c, match=match) for c in cfg.evaluation_corpus]

    def expand(self, documents):
        read = [documents.pipeline | f"ReadEvaluation{i}" >> r for i, r in enumerate(self.readers)]
        evaluation = [docs for docs, _, _ in read] | "EvaluationDocuments" >> beam.Flatten()
        unreadable = [rejected for _, rejected, _ in read] | "EvaluationRejected" >> beam.Flatten()
        same_id_fails = self.corpus.id_field is not None and all(c.id_field for c in self.cfg.evaluation_corpus)
        kept, removed = (documents, evaluation) | "Decontaminate" >> Decontaminate(
            self.cfg.decontamination, same_id_fails
        )
        tallies = (
            evaluation | "TallyEvaluation" >> beam.Map(lambda _: ("evaluation_documents", 1)),
            unreadable | "TallyEvaluationRejected" >> beam.Map(lambda r: (f"evaluation_rejected_{r.reason}", 1)),
        ) | "EvaluationTallies" >> beam.Flatten()
        return kept, removed, tallies


@dataclass
class CorpusRead:
    """What `ReadCorpusKeptClean` gives."""

    read: beam.PCollection  # Documents as read (ids unique): what `documents_read` counts
    documents: beam.PCollection  # those kept: without the evaluation corpus's near-duplicates
    rejected: beam.PCollection  # Rejected records, near-duplicates included
    tallies: beam.PCollection  # (name, count) pairs of the evaluation corpus
    files: beam.PCollection  # the corpus files read, as InputFile


class ReadCorpusKeptClean(beam.PTransform):
    """The config's retrieval or training corpus read, and decontaminated when the config
    says so (`PipelineConfig.decontaminates`) -> CorpusRead."""

    def __init__(
        self,
        cfg: PipelineConfig,
        which: Literal["retrieval", "training"],
        match: bool = True,
        only: frozenset[str] | None = None,
    ):
        super().__init__()
        corpus = cfg.retrieval_corpus if which == "retrieval" else cfg.training()
        self.reader = ReadCorpus(corpus, match=match, only=only)
        self.keep_out = KeepOutEvaluation(cfg, corpus, match) if cfg.decontaminates(which) else None

    def expand(self, pbegin):
        read, rejected, files = pbegin | "Read" >> self.reader
        if self.keep_out is None:
            return CorpusRead(read, read, rejected, pbegin.pipeline | "NoEvaluation" >> beam.Create([]), files)
        documents, removed, tallies = read | "KeepOutEvaluation" >> self.keep_out
        kept_clean = (rejected, removed) | "WithNearDuplicates" >> beam.Flatten()
        return CorpusRead(read, documents, kept_clean, tallies, files)
