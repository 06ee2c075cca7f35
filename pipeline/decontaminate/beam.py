"""Decontamination: documents that are near-duplicates of an evaluation document removed, with
a `rejected/` record each, as `ReadCorpus` keeps them (`Decontaminate`, its `Screen`).

Every evaluation document sends its id to one shuffle key per LSH band of its MinHash
signature, and so does every parsed corpus document for the band keys an evaluation document
may have (a 2 MiB bit filter of the evaluation band keys, a side input: the shuffle carries
the candidates and not the corpus); a band key that holds an evaluation document makes a
candidate pair of it with each corpus document there. No process holds the signatures: a band
group holds ids. The corpus documents in a candidate pair (a sorted id array, a side input: 8
bytes each) are parsed again from the file ranges, joined by id with their candidate evaluation
documents' shingles and judged by their exact Jaccard; the verdicts (those removed, a side
input) are applied where `ReadCorpus` keeps the first copy of each doc id. So no document is
held for the candidates: the documents pass from that step straight to the next stage.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Literal

import apache_beam as beam
import numpy as np

from pipeline.common.rejected import NEAR_DUPLICATE, Rejected, excerpt
from pipeline.corpus.parse import parse_range
from pipeline.corpus.read import ReadCorpus
from pipeline.corpus.records import DocRef, Document
from pipeline.decontaminate.minhash import LshBands, Signer, jaccard, shingles
from schemas.config import PipelineConfig
from schemas.stage_config import CorpusConfig, DecontaminationConfig


@dataclass(frozen=True)
class BandMember:
    """A document in an LSH band's shuffle group."""

    doc_id: int
    evaluation: bool


class BandMemberCoder(beam.coders.Coder):
    """A BandMember in 9 bytes: the band shuffle carries one per document and band, and its
    pickle (Beam's fallback) takes 99."""

    _FORMAT = struct.Struct("<q?")

    def encode(self, value: BandMember) -> bytes:
        return self._FORMAT.pack(value.doc_id, value.evaluation)

    def decode(self, encoded: bytes) -> BandMember:
        return BandMember(*self._FORMAT.unpack(encoded))

    def is_deterministic(self) -> bool:
        return True


beam.coders.registry.register_coder(BandMember, BandMemberCoder)


@dataclass(frozen=True)
class EvaluationShingles:
    """An evaluation document's shingles and LSH band keys, sent to each corpus document id it
    is a candidate with."""

    doc_id: int
    identity: str
    shingles: np.ndarray  # sorted distinct uint64
    band_keys: frozenset[int]


EVALUATION_BAND_BITS = 1 << 24  # the evaluation band filter's size: 2 MiB, whatever the corpora's


def _band_filter(keys: list[int]) -> np.ndarray:
    """The evaluation documents' band keys as a bit array (a one-hash Bloom filter): a corpus
    band key whose bit is clear is in no evaluation document's band, so it can make no pair
    and is not shuffled. A set bit lets through a key of another document at the share of
    bits set (21 per evaluation document: 0.03% with 240 of them, 1.3% with 10,000)."""
    bits = np.zeros(EVALUATION_BAND_BITS, bool)
    bits[np.asarray(keys, np.uint64) % np.uint64(EVALUATION_BAND_BITS)] = True
    return np.packbits(bits, bitorder="little")


def _may_hold(band_filter: np.ndarray, key: int) -> bool:
    at = key % EVALUATION_BAND_BITS
    return bool(band_filter[at >> 3] >> (at & 7) & 1)


class _BandKeys(beam.DoFn):
    """A document -> (band key, BandMember) per LSH band of its signature (none without words);
    given the evaluation band filter, only the keys it may hold."""

    def __init__(self, cfg: DecontaminationConfig, bands: LshBands, evaluation: bool):
        self.cfg, self.bands, self.evaluation = cfg, bands, evaluation

    @classmethod
    def of(cls, cfg: DecontaminationConfig, bands: LshBands, evaluation: bool, *band_filter) -> beam.ParDo:
        """The ParDo, typed so that its members travel in BandMemberCoder's encoding."""
        return beam.ParDo(cls(cfg, bands, evaluation), *band_filter).with_output_types(tuple[int, BandMember])

    def setup(self):
        self.signer = Signer(self.cfg.num_perm, self.cfg.seed)

    def process(self, doc: Document, band_filter: np.ndarray | None = None):
        found = shingles(doc.text, self.cfg.ngram)
        if len(found):
            member = BandMember(doc.doc_id, self.evaluation)
            for key in self.bands.keys(self.signer.signature(found)):
                if band_filter is None or _may_hold(band_filter, key):
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


def _holds(sorted_ids: np.ndarray, doc_id: int) -> bool:
    at = int(np.searchsorted(sorted_ids, doc_id))
    return at < len(sorted_ids) and int(sorted_ids[at]) == doc_id


class _ParseCandidates(beam.DoFn):
    """A file range -> (doc id, Document) for each of its documents in a candidate pair, every
    copy of a doc id (which copy is kept is decided later). Its rejected records are not
    repeated: the first parse reports them."""

    def __init__(self, cfg: CorpusConfig):
        self.cfg = cfg

    def process(self, file_range, candidates: np.ndarray):
        for record in parse_range(file_range, self.cfg):
            if isinstance(record, Document) and _holds(candidates, record.doc_id):
                yield record.doc_id, record


class _EvaluationEntries(beam.DoFn):
    """An evaluation document -> (its doc id, EvaluationShingles) (none without words)."""

    def __init__(self, cfg: DecontaminationConfig, bands: LshBands):
        self.cfg, self.bands = cfg, bands

    def setup(self):
        self.signer = Signer(self.cfg.num_perm, self.cfg.seed)

    def process(self, doc: Document):
        found = shingles(doc.text, self.cfg.ngram)
        if len(found):
            keys = frozenset(self.bands.keys(self.signer.signature(found)))
            yield doc.doc_id, EvaluationShingles(doc.doc_id, doc.identity, found, keys)


def _to_corpus_documents(keyed):
    """(evaluation doc id, its shingles and the corpus documents it is a candidate with) ->
    (corpus doc id, EvaluationShingles) per such document."""
    _, grouped = keyed
    for evaluation in grouped["evaluation"]:
        for doc_id in grouped["doc_id"]:
            yield doc_id, evaluation


@dataclass(frozen=True)
class Verdict:
    """A copy of a document found a near-duplicate: where it was read, and why."""

    ref: tuple[str, int]  # DocRef.key
    jaccard: float
    evaluation_id: str


class _Verify(beam.DoFn):
    """(doc id, its copies and the evaluation documents paired with the id) -> a Verdict for
    each copy whose most similar candidate evaluation document is at exact Jaccard >=
    threshold. A copy's candidates are the evaluation ids one of whose documents shares an LSH
    band with it: those it was paired with by its own signature, whatever the other copies'."""

    def __init__(self, cfg: DecontaminationConfig, bands: LshBands):
        self.cfg, self.bands = cfg, bands

    def setup(self):
        self.signer = Signer(self.cfg.num_perm, self.cfg.seed)

    def process(self, keyed):
        _, grouped = keyed
        evaluations = list(grouped["evaluation"])
        for doc in grouped["document"]:
            own = shingles(doc.text, self.cfg.ngram)
            if not len(own):
                continue
            keys = set(self.bands.keys(self.signer.signature(own)))
            paired = {e.doc_id for e in evaluations if keys & e.band_keys}
            best, near = max(
                ((jaccard(own, e.shingles), e.identity) for e in evaluations if e.doc_id in paired), default=(0.0, "")
            )
            if best >= self.cfg.threshold:
                yield Verdict(DocRef.of(doc).key, round(best, 4), near)


def _verdicts_by_ref(verdicts: list[Verdict]) -> dict[tuple[str, int], Verdict]:
    return {v.ref: v for v in verdicts}


class Decontaminate:
    """A `Screen` for `ReadCorpus`: a document kept whose exact Jaccard with an evaluation
    document is >= the threshold is rejected (reason near_duplicate_of_evaluation, with the
    exact Jaccard and the evaluation document's identity). `same_id_fails`: a document whose id
    an evaluation document has fails the job (set when both corpora take ids from an id field)."""

    def __init__(
        self, cfg: DecontaminationConfig, corpus: CorpusConfig, evaluation: beam.PCollection, same_id_fails: bool
    ):
        self.cfg, self.corpus, self.evaluation, self.same_id_fails = cfg, corpus, evaluation, same_id_fails
        self.bands = LshBands.for_threshold(cfg.threshold, cfg.num_perm, cfg.candidate_recall)

    def side_inputs(self, ranges, parsed):
        cfg, evaluation = self.cfg, self.evaluation
        evaluation_keys = evaluation | "EvaluationBandKeys" >> _BandKeys.of(cfg, self.bands, evaluation=True)
        band_filter = (
            evaluation_keys
            | "EvaluationBands" >> beam.Map(lambda keyed: keyed[0])
            | "AllEvaluationBands" >> beam.combiners.ToList()
            | "BandFilter" >> beam.Map(_band_filter)
        )
        corpus_keys = parsed | "CorpusBandKeys" >> _BandKeys.of(
            cfg, self.bands, False, beam.pvalue.AsSingleton(band_filter)
        )
        pairs = (
            (corpus_keys, evaluation_keys)
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
        candidates = ranges | "ParseCandidates" >> beam.ParDo(
            _ParseCandidates(self.corpus), beam.pvalue.AsSingleton(candidate_ids)
        )
        evaluation_shingles = (
            {
                "evaluation": evaluation | "EvaluationShingles" >> beam.ParDo(_EvaluationEntries(cfg, self.bands)),
                "doc_id": pairs | "ByEvaluationId" >> beam.Map(lambda pair: (pair[1], pair[0])),
            }
            | "JoinEvaluationShingles" >> beam.CoGroupByKey()
            | "ToCorpusDocuments" >> beam.FlatMap(_to_corpus_documents)
        )
        verdicts = (
            {"document": candidates, "evaluation": evaluation_shingles}
            | "JoinCandidates" >> beam.CoGroupByKey()
            | "ExactJaccard" >> beam.ParDo(_Verify(cfg, self.bands))
            | "AllVerdicts" >> beam.combiners.ToList()
            | "ByRef" >> beam.Map(_verdicts_by_ref)
        )
        if self.same_id_fails:
            evaluation_ids = (
                evaluation
                | "EvaluationIds" >> beam.Map(lambda d: d.doc_id)
                | "AllEvaluationIds" >> beam.combiners.ToList()
                | "EvaluationIdArray" >> beam.Map(_sorted_ids)
            )
        else:
            evaluation_ids = parsed.pipeline | "NoIdCheck" >> beam.Create([None])
        return beam.pvalue.AsSingleton(verdicts), beam.pvalue.AsSingleton(evaluation_ids)

    @staticmethod
    def rejection(
        doc: Document, verdicts: dict[tuple[str, int], Verdict], evaluation_ids: np.ndarray | None
    ) -> Rejected | None:
        if evaluation_ids is not None and _holds(evaluation_ids, doc.doc_id):
            raise ValueError(
                f"document {doc.identity!r} ({doc.source}:{doc.position}) is in the evaluation corpus too "
                "(the same id): remove it from one of them"
            )
        verdict = verdicts.get(DocRef.of(doc).key)
        if verdict is None:
            return None
        details = (("doc_id", doc.doc_id), ("jaccard", verdict.jaccard), ("evaluation_id", verdict.evaluation_id))
        return Rejected(doc.source, doc.position, NEAR_DUPLICATE, excerpt(doc.text), details)


class ReadEvaluation(beam.PTransform):
    """The config's evaluation corpora -> (their documents, tallies): their unreadable records
    counted by reason as `evaluation_rejected_<reason>`, not written (they are not the
    corpus's), and their documents counted as `evaluation_documents`."""

    def __init__(self, cfg: PipelineConfig, match: bool = True):
        super().__init__()
        self.readers = [ReadCorpus(c, match=match) for c in cfg.evaluation_corpus]

    def expand(self, pbegin):
        read = [pbegin | f"ReadEvaluation{i}" >> r for i, r in enumerate(self.readers)]
        evaluation = [docs for docs, _, _ in read] | "EvaluationDocuments" >> beam.Flatten()
        unreadable = [rejected for _, rejected, _ in read] | "EvaluationRejected" >> beam.Flatten()
        tallies = (
            evaluation | "TallyEvaluation" >> beam.Map(lambda _: ("evaluation_documents", 1)),
            unreadable | "TallyEvaluationRejected" >> beam.Map(lambda r: (f"evaluation_rejected_{r.reason}", 1)),
        ) | "EvaluationTallies" >> beam.Flatten()
        return evaluation, tallies


@dataclass
class CorpusRead:
    """What `ReadCorpusKeptClean` gives."""

    documents: beam.PCollection  # Documents kept (ids unique), without the evaluation corpus's near-duplicates
    rejected: beam.PCollection  # Rejected records, near-duplicates included
    tallies: beam.PCollection  # (name, count) pairs of the evaluation corpus
    files: beam.PCollection  # the corpus files read, as InputFile


class ReadCorpusKeptClean(beam.PTransform):
    """The config's retrieval or training corpus read, and decontaminated when the config
    says so (`PipelineConfig.decontaminates`) -> CorpusRead. A document whose id an
    evaluation document has fails the job when both take ids from an id field.

    `source`: a blend's source, read in place of the training corpus; `evaluation`: the
    evaluation corpora as `ReadEvaluation` read them, shared by a blend's sources (their
    tallies are counted where they were read, not here)."""

    def __init__(
        self,
        cfg: PipelineConfig,
        which: Literal["retrieval", "training"],
        match: bool = True,
        only: frozenset[str] | None = None,
        *,
        source: CorpusConfig | None = None,
        evaluation: tuple | None = None,
    ):
        super().__init__()
        self.cfg, self.match, self.only, self.shared = cfg, match, only, evaluation
        self.corpus = source or (cfg.retrieval_corpus if which == "retrieval" else cfg.training())
        self.evaluation = ReadEvaluation(cfg, match) if cfg.decontaminates(which) and evaluation is None else None

    def expand(self, pbegin):
        if self.evaluation is None and self.shared is None:
            documents, rejected, files = pbegin | "Read" >> ReadCorpus(self.corpus, match=self.match, only=self.only)
            return CorpusRead(documents, rejected, pbegin.pipeline | "NoEvaluation" >> beam.Create([]), files)
        if self.shared is not None:
            evaluation, tallies = self.shared[0], pbegin.pipeline | "EvaluationCountedElsewhere" >> beam.Create([])
        else:
            evaluation, tallies = pbegin | "KeepOutEvaluation" >> self.evaluation
        same_id_fails = self.corpus.id_field is not None and all(c.id_field for c in self.cfg.evaluation_corpus)
        screen = Decontaminate(self.cfg.decontamination, self.corpus, evaluation, same_id_fails)
        documents, rejected, files = pbegin | "Read" >> ReadCorpus(
            self.corpus, match=self.match, screen=screen, only=self.only
        )
        return CorpusRead(documents, rejected, tallies, files)
