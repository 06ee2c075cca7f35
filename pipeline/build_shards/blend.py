"""build-shards over a blend of training sources (`training_corpus` a list; docs/design.md §7,
"Blends"): each source read, decontaminated, chunked and packed on its own; the plan
(`pipeline.retrieve.blend.BlendPlan`) sized from what they packed; each drawn sequence placed at
its positions in the blend, and only drawn sequences' chunks embedded, once however often
they are drawn. What comes out is what a single training corpus gives `RetrieveNeighbours`:
SequenceBatches by search batch and QueryBlocks, under the blend's ids.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import apache_beam as beam
import numpy as np

from pipeline.build_index.files import documents_read_tally, rejected_tally
from pipeline.chunks.beam import ChunkDocuments
from pipeline.chunks.chunk_files import TrainingChunks
from pipeline.common.tally import counted
from pipeline.decontaminate.beam import ReadCorpusKeptClean, ReadEvaluation
from pipeline.jobs.job import Tokenization
from pipeline.retrieve.beam import PackSequences
from pipeline.retrieve.blend import BlendPlan, SourceSize
from pipeline.retrieve.search import QueryBlock, search_batch_of
from pipeline.shards.rows import SequenceBatch, input_tokens
from schemas.config import PipelineConfig
from schemas.measures import SourceShare

CHUNKS_PER_BLOCK = 1024  # a training corpus's chunks travel in blocks of up to this many


@dataclass(kw_only=True)
class BlendRead:
    """What `ReadBlend` gives."""

    sequences: beam.PCollection  # a SequenceBatch per search batch of the blend
    queries: beam.PCollection  # QueryBlocks under the blend's chunk ids (position · L + chunk)
    chunks: beam.PCollection  # TrainingChunks blocks of every source (what the counts count)
    rejected: beam.PCollection
    tallies: tuple  # (name, count) PCollections
    precision: beam.PCollection  # the embed stage's precision check
    plan: beam.PCollection  # one BlendPlan


def _size(keyed, pad_id: int):
    source, batch = keyed
    tokens = np.stack([s.tokens for s in batch.sequences])
    return source, np.array([len(batch.sequences), input_tokens(tokens, pad_id).sum()], np.int64)


def _plan(_, sizes: dict, *, sources, seed: int, chunks_per_seq: int) -> BlendPlan:
    counted_sizes = [sizes.get(i, np.zeros(2, np.int64)).tolist() for i in range(len(sources))]
    return BlendPlan.of(
        sources,
        [SourceSize(sequences=s, tokens=t) for s, t in counted_sizes],
        seed=seed,
        chunks_per_seq=chunks_per_seq,
    )


def _drawn(keyed, plan: BlendPlan):
    """(source, its SequenceBatch) -> (search batch, the SequenceBatch of its draws there) per
    search batch of the blend they land in."""
    source, batch = keyed
    by_batch: dict[int, list] = {}
    for sequence in plan.blended(source, batch.sequences):
        by_batch.setdefault(search_batch_of(sequence.seq_id), []).append(sequence)
    for number, sequences in by_batch.items():
        yield number, SequenceBatch(sequences)


def _embedded(keyed, plan: BlendPlan):
    """(source, a block of its Chunks) -> those of drawn sequences, under the ids they are embedded under."""
    source, chunks = keyed
    ids = plan.embedded_ids(source, np.array([c.chunk_id for c in chunks], np.int64))
    for chunk, chunk_id in zip(chunks, ids.tolist()):
        if chunk_id >= 0:
            yield replace(chunk, chunk_id=chunk_id)


class ReadBlend(beam.PTransform):
    """The config's training sources -> `BlendRead` (docs/design.md §7, "Blends")."""

    def __init__(self, cfg: PipelineConfig, tok: Tokenization, threads: int | None, match: bool = True):
        super().__init__()
        self.cfg, self.tok, self.threads, self.match = cfg, tok, threads, match

    def expand(self, pbegin):
        cfg, tok, L = self.cfg, self.tok, self.cfg.chunks_per_sequence
        sources = cfg.training_sources()
        evaluation = (
            pbegin | "KeepOutEvaluation" >> ReadEvaluation(cfg, self.match) if cfg.decontaminates("training") else None
        )
        packed, chunks, blocks, rejected = [], [], [], []
        tallies: list = [] if evaluation is None else [evaluation[1]]
        for number, source in enumerate(sources):
            name = f"[{source.name}]"
            corpus = pbegin | f"Read{name}" >> ReadCorpusKeptClean(
                cfg, "training", self.match, source=source, evaluation=evaluation
            )
            cut, unusable = corpus.documents | f"Chunk{name}" >> ChunkDocuments(tok.path, cfg.chunk_tokens, tok.pad_id)
            batches = cut | f"Batch{name}" >> beam.BatchElements(max_batch_size=CHUNKS_PER_BLOCK)
            training = batches | f"Blocks{name}" >> beam.Map(TrainingChunks.of_chunks)
            packed.append(
                training
                | f"Pack{name}" >> PackSequences(L, tok.pad_id)
                | f"Number{name}" >> beam.Map(lambda batch, n=number: (n, batch))
            )
            chunks.append(batches | f"NumberChunks{name}" >> beam.Map(lambda batch, n=number: (n, batch)))
            blocks.append(training)
            source_rejected = (corpus.rejected, unusable) | f"Rejected{name}" >> beam.Flatten()
            rejected.append(source_rejected)
            tallies += [
                *documents_read_tally(corpus.documents, source_rejected, name),
                counted(f"source/{number}/documents", corpus.documents, label=f"TallyDocuments{name}"),
                corpus.tallies,
            ]
        every_packed = packed | "EverySource" >> beam.Flatten()
        sizes = every_packed | "SourceSizes" >> beam.Map(_size, tok.pad_id) | "SumSizes" >> beam.CombinePerKey(sum)
        plan = (
            pbegin
            | "Once" >> beam.Create([None])
            | "PlanBlend"
            >> beam.Map(_plan, beam.pvalue.AsDict(sizes), sources=sources, seed=cfg.blend_seed, chunks_per_seq=L)
        )
        sequences = (
            every_packed
            | "Draw" >> beam.FlatMap(_drawn, beam.pvalue.AsSingleton(plan))
            | "GroupBySearchBatch" >> beam.GroupByKey()
            | "SearchBatches" >> beam.Map(lambda keyed: SequenceBatch(SequenceBatch.merged(keyed[1])))
        )
        from pipeline.embed.beam import EmbedChunks

        embedded, precision = (
            chunks
            | "EverySourcesChunks" >> beam.Flatten()
            | "DrawnChunks" >> beam.FlatMap(_embedded, beam.pvalue.AsSingleton(plan))
            | "EmbedDrawnChunks" >> EmbedChunks(cfg.embedding, tok.path, self.threads)
        )
        queries = embedded | "QueriesOfDraws" >> beam.Map(
            lambda group, plan: plan.queries(QueryBlock(group.chunk_ids, group.vectors)), beam.pvalue.AsSingleton(plan)
        )
        every_rejected = rejected | "EveryRejected" >> beam.Flatten()
        tallies.append(rejected_tally(every_rejected, "TallyRejected"))
        every_block = blocks | "EveryBlock" >> beam.Flatten()
        return BlendRead(
            sequences=sequences,
            queries=queries,
            chunks=every_block,
            rejected=every_rejected,
            tallies=tuple(tallies),
            precision=precision,
            plan=plan,
        )


def source_shares(plan: BlendPlan, counters: dict[str, int]) -> list[SourceShare]:
    """The manifest's sources: the plan's, with what the shards hold of each, counted in the rows
    written (`shards.rows.source_tally`), and its documents read; the `source/` counters are
    taken out of `counters`. RuntimeError where the rows of a source are not its draws."""
    counts = {name: counters.pop(name) for name in [n for n in counters if n.startswith("source/")]}
    total = sum(counts.get(f"source/{i}/tokens", 0) for i in range(len(plan.sources)))
    shares = []
    for number, source in enumerate(plan.sources):
        rows = counts.get(f"source/{number}/rows", 0)
        if rows != source.draws:
            raise RuntimeError(f"training source {source.name!r}: {rows} rows written, {source.draws} drawn")
        tokens = counts.get(f"source/{number}/tokens", 0)
        shares.append(
            SourceShare(
                name=source.name,
                weight=source.share,
                documents=counts.get(f"source/{number}/documents", 0),
                sequences_available=source.sequences,
                tokens_available=source.tokens,
                sequences=rows,
                repeats=source.repeats,
                left_out=source.left_out,
                tokens=tokens,
                share=tokens / total if total else 0.0,
            )
        )
    return shares
