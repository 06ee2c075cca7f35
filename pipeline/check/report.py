"""`report`: one self-contained HTML page, `report.html`, on an output, index or shards directory.

What the manifests record (settings, counters, neighbour fill and recall, the overlap audit,
the index's recall at each search depth the tuning measured, each job's wall time), the
distribution of neighbour scores by rank read from the shards, rejected records by reason with
examples, sample sequences with their decoded neighbours (`inspect`), and the scores of
checkpoints that `ratrain-eval --json` wrote, when given (`--eval`). Figures are inline
PNGs drawn with matplotlib (the `report` extra); the page fetches nothing when opened.

`gather` reads (the directories and manifests through `pipeline.check.report_sources`, the
scores and rejected records through `pipeline.check.report_samples`) and the summary functions
compute; `render` turns a `Report` into HTML.
"""

from __future__ import annotations

import posixpath
from collections.abc import Sequence
from dataclasses import dataclass

import pyarrow.compute as pc
from pydantic import ValidationError

from pipeline.check.inspect import inspect_shards
from pipeline.check.report_samples import RejectedReason, ScoreSample, gather_rejected, gather_scores
from pipeline.check.report_sources import ReportError, find_sources, read_index_manifest, read_shards_manifest
from pipeline.common import fileio
from pipeline.shards.rows import overlap_ranges
from schemas.evaluation import Evaluation, read_evaluation
from schemas.file_table import entry_columns
from schemas.manifest import IndexManifest, ShardsManifest, VectorIndexManifest

SAMPLE_CHUNKS = 3  # chunks shown per sample sequence
REPORT_FILE = "report.html"
SAMPLE_SEQUENCES = 3


def human_bytes(count: int) -> str:
    if count < 1024:
        return f"{count:,} B"
    size = count / 1024
    for unit in ("KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def index_summary(manifest: IndexManifest | VectorIndexManifest) -> list[tuple[str, str]]:
    recall = manifest.recall_at_k
    rows = [
        ("created by", manifest.created_by),
        ("config hash", manifest.config_hash[:16]),
        ("schema version", str(manifest.schema_version)),
    ]
    if isinstance(manifest, IndexManifest):
        precision = manifest.embedding_precision
        rows += [
            ("documents", f"{manifest.num_documents:,}"),
            ("chunks", f"{manifest.num_chunks:,}"),
            ("tokens", f"{manifest.counters.get('tokens', 0):,}"),
            ("chunk tokens (m)", str(manifest.chunk_tokens)),
            ("embedding model", manifest.embedding_model.name),
            ("tokenizer", manifest.tokenizer.name),
            ("embedding precision", "not recorded" if precision is None else precision.summary()),
            ("encoder threads", "—" if manifest.encoder_threads is None else str(manifest.encoder_threads)),
        ]
    else:
        rows += [("vectors", f"{manifest.num_vectors:,}"), ("embedding files", str(len(manifest.inputs)))]
    rows += [
        ("index", f"{manifest.index_factory} ({manifest.metric}, dim {manifest.dim})"),
        ("search depth", "exact (no depth)" if manifest.nprobe is None else str(manifest.nprobe)),
        (
            recall.measure,
            f"{recall.value:.3f} on {recall.sample_size:,} queries"
            + ("" if recall.target is None else f" (target {recall.target})"),
        ),
        ("index size", f"{human_bytes(manifest.index_bytes)} (memory budget {human_bytes(manifest.memory_budget)})"),
        ("training vectors", f"{manifest.training_vectors:,}"),
    ]
    if "IVF" in manifest.index_factory:  # only an IVF index has lists to train
        clustering = {"flat": "one k-means", "two_level": "two-level k-means"}
        rows.append(("IVF list training", clustering.get(manifest.clustering, manifest.clustering)))
    rows.append(("queries / s", "—" if manifest.queries_per_second is None else f"{manifest.queries_per_second:,.0f}"))
    return rows


@dataclass(frozen=True)
class ShardFiles:
    """What the report shows of a shards manifest's entries, from their columns (no object per
    entry: 10^6 of them at 3e10 chunks)."""

    count: int
    bytes: int
    filled: int | None  # neighbour slots filled over every shard (None: a shard without its count)

    @classmethod
    def read(cls, directory: str, manifest: ShardsManifest) -> ShardFiles:
        table = entry_columns(manifest, directory, ["bytes", "neighbour_slots_filled"], open_file=fileio.open_read)
        filled = table["neighbour_slots_filled"]
        return cls(
            table.num_rows,
            int(pc.sum(table["bytes"]).as_py() or 0),
            None if filled.null_count else int(pc.sum(filled).as_py() or 0),
        )


def shards_summary(manifest: ShardsManifest, files: ShardFiles) -> list[tuple[str, str]]:
    return [
        ("created by", manifest.created_by),
        ("config hash", manifest.config_hash[:16]),
        ("schema version", str(manifest.schema_version)),
        ("sequences", f"{manifest.num_sequences:,}"),
        ("shards", f"{files.count} ({human_bytes(files.bytes)})"),
        ("sequence tokens (n)", str(manifest.sequence_tokens)),
        ("chunk tokens (m)", str(manifest.chunk_tokens)),
        ("neighbours (k)", str(manifest.neighbours)),
        ("neighbour tokens", str(manifest.neighbour_tokens)),
        ("training corpus", manifest.training_corpus),
    ]


SOURCE_COLUMNS = (
    "source",
    "share asked",
    "share got",
    "documents",
    "sequences",
    "rows",
    "repeats",
    "left out",
    "tokens",
)


def source_rows(manifest: ShardsManifest) -> list[tuple[str, ...]]:
    """A blend's sources: the share asked and got, what each held and what the shards took."""
    return [
        (
            s.name,
            f"{s.weight:.3f}",
            f"{s.share:.3f}",
            f"{s.documents:,}",
            f"{s.sequences_available:,}",
            f"{s.sequences:,}",
            f"{s.repeats:,}",
            f"{s.left_out:,}",
            f"{s.tokens:,}",
        )
        for s in manifest.sources
    ]


def neighbour_quality(manifest: ShardsManifest, files: ShardFiles) -> list[tuple[str, str]]:
    """Fill (share of neighbour slots holding a neighbour) and recall against exact search."""
    slots = manifest.num_sequences * (manifest.sequence_tokens // manifest.chunk_tokens) * manifest.neighbours
    filled = files.filled
    if manifest.neighbour_fill is None:
        fill = "not recorded"
    elif filled is None:  # a shard without its count
        fill = f"{manifest.neighbour_fill:.4f} of {slots:,} slots"
    else:
        fill = f"{manifest.neighbour_fill:.4f} ({filled:,} of {slots:,} slots; {slots - filled:,} empty)"
    recall, depth = manifest.neighbour_recall, manifest.search_depth
    searched = []
    if depth is not None and depth.depth is not None:
        measured = ", ".join(f"{p.recall:.3f} at {p.depth}" for p in depth.curve)
        searched = [
            (
                "search depth",
                f"{depth.depth} (the index's {depth.index_depth}; neighbour recall {measured}; "
                f"recall_below_target: {depth.recall_below_target})",
            )
        ]
    return [
        ("neighbour fill", fill),
        (
            "neighbour recall",
            "not measured (neighbour_recall_sample 0)"
            if recall is None
            else f"{recall.value:.3f} on {recall.sample_size} sampled chunks ({recall.slots} slots, "
            f"tolerance {recall.tolerance})",
        ),
        *searched,
    ]


def overlap_bars(overlap: dict[str, int]) -> list[tuple[str, int]]:
    """The overlap audit as (r(C) range, training chunks): each threshold counts the chunks with
    r(C) at most it and above the threshold before."""
    ordered = sorted(overlap.items(), key=lambda item: float(item[0]))
    return list(zip(overlap_ranges([threshold for threshold, _ in ordered]), [count for _, count in ordered]))


def timing_rows(
    manifests: Sequence[tuple[str, IndexManifest | VectorIndexManifest | ShardsManifest]],
) -> list[tuple[str, str, str, str, str]]:
    """(job, started, wall time, records, records / s) per (directory kind, manifest); 'not
    recorded' for a manifest written before timings were recorded."""
    rows = []
    for kind, manifest in manifests:
        t = manifest.timings
        if t is None:
            rows.append((kind, "not recorded", "not recorded", "—", "—"))
            continue
        rate = "—" if t.records_per_second is None else f"{t.records_per_second:,.1f} {t.records}/s"
        rows.append(
            (
                t.stage,
                t.started,
                f"{t.wall_seconds:,.1f} s",
                f"{manifest.counters.get(t.records, 0):,} {t.records}",
                rate,
            )
        )
    return rows


GENERATION_COLUMNS = ("generation", "corpus files", "chunk ids", "documents", "deleted", "new vectors' recall", "job")


def generation_rows(manifest: IndexManifest) -> list[tuple[str, ...]]:
    """One row per generation of an index (empty for a manifest without them): what it read,
    added and deleted, how well the trained lists found its new vectors, when its job ran."""
    rows: list[tuple[str, ...]] = []
    for g in manifest.generations:
        timings = g.timings if g.timings is not None else manifest.timings
        last = g.first_chunk_id + g.num_chunks - 1
        rows.append(
            (
                str(g.number),
                f"{len(g.inputs):,}",
                f"{g.first_chunk_id:,} … {last:,}" if g.num_chunks else "none",
                f"{g.num_documents:,}",
                f"{g.deleted_documents:,} ({g.deleted_chunks:,} chunks)" if g.deleted_documents else "0",
                "—" if g.new_vector_recall is None else f"{g.new_vector_recall:.3f}",
                "—" if timings is None else f"{timings.started}, {timings.wall_seconds:,.1f} s",
            )
        )
    return rows


@dataclass(frozen=True, kw_only=True)
class Report:
    path: str
    index: IndexManifest | VectorIndexManifest | None
    shards: ShardsManifest | None  # its summary: the entries are in `shard_files`
    shard_files: ShardFiles | None
    scores: ScoreSample | None
    rejected: list[RejectedReason]
    samples: list[str]  # `inspect`'s lines
    samples_note: str  # why there are none, when there are none
    evaluations: tuple[Evaluation, ...] = ()  # `ratrain-eval --json` files, in the order given


def read_evaluations(paths: Sequence[str]) -> tuple[Evaluation, ...]:
    """The scores `ratrain-eval --json` wrote (local or gs://); a ReportError names a file that is
    missing or not such scores."""
    evaluations = []
    for path in paths:
        if not fileio.exists(path):
            raise ReportError(f"{path}: no such evaluation file")
        try:
            evaluations.append(read_evaluation(fileio.read_bytes(path)))
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(part) for part in first["loc"])
            raise ReportError(f"{path}: not the JSON of ratrain-eval ({where}: {first['msg']})") from None
    return tuple(evaluations)


def gather(path: str, evaluations: Sequence[str] = ()) -> Report:
    sources = find_sources(path)
    index = None if sources.index is None else read_index_manifest(sources.index, sources.index_commit)
    shards = None if sources.shards is None else read_shards_manifest(sources.shards, sources.shards_commit)
    counters: dict[str, int] = {}
    for manifest in (index, shards):
        for name, value in ({} if manifest is None else manifest.counters).items():
            counters[name] = counters.get(name, 0) + value
    samples, note, scores, shard_files = [], "", None, None
    if sources.shards is not None and shards is not None:  # shards is read iff sources.shards is set
        shard_files = ShardFiles.read(sources.shards, shards)
        beside = posixpath.join(posixpath.dirname(sources.shards.rstrip("/")), "index")
        if fileio.current_manifest(beside) is not None:
            samples = inspect_shards(sources.shards, SAMPLE_SEQUENCES, SAMPLE_CHUNKS, sources.shards_commit)
        else:
            note = f"No index beside the shards ({beside}) to decode their tokens with."
        scores = gather_scores(sources.shards, shards)
    return Report(
        path=sources.path,
        index=index,
        shards=shards,
        shard_files=shard_files,
        scores=scores,
        rejected=gather_rejected(sources, counters),
        samples=samples,
        samples_note=note,
        evaluations=read_evaluations(evaluations),
    )
