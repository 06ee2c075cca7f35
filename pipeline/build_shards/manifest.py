"""The one place build-shards' manifest is made, from the data written, and the warnings it
raises: what makes the shards worse than they look.
"""

from __future__ import annotations

from pipeline.build_shards.blend import source_shares
from pipeline.build_shards.refresh import RefreshSummary
from pipeline.index.recall import PLATEAU_GAIN
from pipeline.retrieve.blend import BlendPlan
from pipeline.shards.rows import overlap_histogram
from schemas.config import PipelineConfig
from schemas.manifest import CREATED_BY, ShardsManifest
from schemas.measures import NeighbourRecall, SearchDepth, ShardsRefresh

MIN_FILL = 0.99  # below this share of filled neighbour slots, the stage warns


def refreshes_of(
    refreshed: RefreshSummary | None = None, rewritten=(), kept: int = 0, *, tallies
) -> list[ShardsRefresh]:
    """The manifest's refreshes: none after a full build, else the refreshed shards' and this
    one (the runs of shard numbers written, `RewrittenRuns`, and the count of shards kept)."""
    if refreshed is None:
        return []
    removed = dict(tallies).get("shards_removed", 0)
    return [*refreshed.earlier, refreshed.record(list(rewritten), kept, removed)]


def shards_manifest(
    totals,
    *,
    refreshes: list[ShardsRefresh],
    tallies,
    recall,
    search_depth: SearchDepth,
    precision,
    cfg: PipelineConfig,
    index_sha: str,
    index_generation: int | None,
    threads,
    pad_id: int,
    plan: BlendPlan | None,
) -> ShardsManifest:
    """The shards' manifest; their entries go to the commit as pieces (`totals`: their sums,
    `EntryTotals`; shards are beside the manifest, folder "")."""
    shard_totals = totals.get("", {})
    L, k = cfg.chunks_per_sequence, cfg.neighbours
    num_sequences = shard_totals.get("rows", 0)
    slots = num_sequences * L * k
    counters = dict(tallies)
    # a blend's rows repeat or skip sequences: its sources' sequences are what took chunks
    in_sequences = num_sequences * L if plan is None else sum(s.sequences for s in plan.sources) * L
    counters["chunks_not_in_a_sequence"] = counters.pop("training_chunks", 0) - in_sequences
    sources = [] if plan is None else source_shares(plan, counters)
    return ShardsManifest(
        config_hash=cfg.shards_hash(),
        index_manifest_sha256=index_sha,
        index_generation=index_generation,
        training_corpus="same" if cfg.training_corpus == "same" else "blend" if cfg.blended else "separate",
        encoder_threads=threads,
        embedding_precision=precision,
        sequence_tokens=cfg.sequence_tokens,
        chunk_tokens=cfg.chunk_tokens,
        neighbours=k,
        neighbour_tokens=2 * cfg.chunk_tokens,
        pad_id=pad_id,
        num_sequences=num_sequences,
        shards=[],
        neighbour_fill=shard_totals.get("neighbour_slots_filled", 0) / slots if slots else 1.0,
        neighbour_recall=None if recall is None else NeighbourRecall(**recall),
        search_depth=search_depth if search_depth.curve else None,
        overlap=overlap_histogram(counters),
        refreshes=refreshes,
        sources=sources,
        counters=dict(sorted(counters.items())),
        created_by=CREATED_BY,
    )


def neighbour_warnings(manifest: ShardsManifest, cfg: PipelineConfig) -> list[str]:
    """What makes the shards worse than they look, with the cause."""
    warnings = []
    fill = manifest.neighbour_fill
    if fill is not None and fill < MIN_FILL:
        slots = manifest.num_sequences * manifest.sequence_tokens // manifest.chunk_tokens * manifest.neighbours
        empty = slots - sum(entry.neighbour_slots_filled or 0 for entry in manifest.shards)
        if cfg.dedupe_neighbours and manifest.counters.get("candidates_dropped_duplicate_tokens", 0):
            cause = (
                f"after dropping repeated tokens fewer than k of the {cfg.neighbour_candidates} "
                "candidates were left (raise neighbour_candidates)"
            )
        else:
            cause = (
                "the chunk database holds fewer than k chunks outside a sequence's own "
                "documents for these chunks (a database of few, long documents)"
            )
        warnings.append(
            f"only {fill:.1%} of neighbour slots are filled ({empty:,} empty): {cause}; "
            "a RETRO model sees these slots as padding"
        )
    recall, depth, target = manifest.neighbour_recall, manifest.search_depth, cfg.index.target_recall
    if recall is not None and recall.value < target:
        if depth is not None and depth.recall_below_target == "warn":
            cause = f"recall_below_target: warn kept the index's search depth {depth.depth} ('deepen' tunes it)"
        elif depth is not None and depth.plateau:
            cause = (
                f"two doublings of the search depth beyond {depth.depth} gained less than {PLATEAU_GAIN} (the index's "
                "codes limit recall, not the depth: a larger index.memory_budget or another index.type)"
            )
        elif depth is not None and depth.curve and depth.curve[-1].recall >= target:
            cause = (
                f"the search depth {depth.depth} reached {depth.curve[-1].recall:.3f} on the tuning sample, "
                "which this check's sample misses (a larger neighbour_recall_sample tunes on more chunks)"
            )
        else:
            cause = "the index misses near neighbours even at its deepest search (raise index.memory_budget)"
        warnings.append(f"neighbour recall {recall.value:.3f} against exact search is below {target}: {cause}")
    return warnings


def neighbour_summary(manifest: ShardsManifest) -> str:
    """'neighbour fill 1.000, neighbour recall 0.990 against exact search on 200 sampled
    chunks' (the stage's log, validate, inspect)."""
    text = "neighbour fill " + ("not recorded" if manifest.neighbour_fill is None else f"{manifest.neighbour_fill:.3f}")
    if manifest.neighbour_recall is not None:
        text += (
            f", neighbour recall {manifest.neighbour_recall.value:.3f} against exact search on "
            f"{manifest.neighbour_recall.sample_size} sampled chunks"
        )
    depth = manifest.search_depth
    if depth is not None and depth.depth is not None:
        deeper = "" if depth.depth == depth.index_depth else f", deeper than the index's {depth.index_depth}"
        text += f", searched at depth {depth.depth}{deeper}"
    return text
