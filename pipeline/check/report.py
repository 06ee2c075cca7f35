"""`report`: one self-contained HTML page, `report.html`, on an output, index or shards directory.

What the manifests record (settings, counters, neighbour fill and recall, the overlap audit,
the index's recall at each search depth the tuning measured, each job's wall time), the
distribution of neighbour scores by rank read from the shards, rejected records by reason with
examples, sample sequences with their decoded neighbours (`inspect`), and the scores of
checkpoints that `ratrain-eval --json` wrote, when given (`--eval`). Figures are inline
PNGs drawn with matplotlib (the `report` extra); the page fetches nothing when opened.

The `gather_*` and summary functions read and compute; `render` turns a `Report` into HTML.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow.compute as pc
from pydantic import ValidationError

from pipeline.check.inspect import inspect_shards
from pipeline.check.plan import sampled
from pipeline.common import fileio
from pipeline.shards.rows import overlap_ranges
from schemas.arrow import read_shard, shard_column
from schemas.evaluation import Evaluation, read_evaluation
from schemas.file_table import entry_columns
from schemas.manifest import MANIFEST_FILE, IndexManifest, ShardsManifest, VectorIndexManifest

SAMPLE_CHUNKS = 3  # chunks shown per sample sequence
REPORT_FILE = "report.html"
SCORE_SAMPLE_SEQUENCES = 20_000  # shards are sampled (by name hash) down to about this many sequences
SCORE_EDGES = np.linspace(-1.0, 1.0, 401)  # cosine of unit vectors, in bins 0.005 wide
SAMPLE_SEQUENCES = 3
EXAMPLES_PER_REASON = 3
EXCERPT_CHARS = 160


class ReportError(ValueError):
    """A directory the report cannot be written for."""


@dataclass(frozen=True)
class Sources:
    """The committed directories a report covers, and the rejected-record files that belong to
    them (`<output>/rejected/<stage>-NNNNN.jsonl`)."""

    path: str
    index: str | None
    shards: str | None
    rejected: str
    rejected_stages: tuple[str, ...]


def find_sources(path: str) -> Sources:
    """An output directory (index/ and/or shards/ with manifests), an index or a shards
    directory; else a ReportError."""
    path = path.rstrip("/")
    if fileio.exists(fileio.join(path, MANIFEST_FILE)):
        raw = fileio.committed_manifest(path)
        rejected = fileio.join(posixpath.dirname(path) or ".", "rejected")
        if "shards" in raw:
            return Sources(path, None, path, rejected, ("build-shards",))
        return Sources(path, path, None, rejected, ("build-index",))
    index, shards = (fileio.join(path, name) for name in ("index", "shards"))
    found = {d: fileio.exists(fileio.join(d, MANIFEST_FILE)) for d in (index, shards)}
    if not any(found.values()):
        raise ReportError(
            f"{path}: not an output, index or shards directory (no manifest.json here, nor in {index} or {shards})"
        )
    return Sources(
        path,
        index if found[index] else None,
        shards if found[shards] else None,
        fileio.join(path, "rejected"),
        ("build-index", "build-shards"),
    )


def read_index_manifest(directory: str) -> IndexManifest | VectorIndexManifest:
    """The manifest of a pipeline's index, or of one built by `ratrain-pipeline index`."""
    return fileio.committed_summary(directory, lambda raw: VectorIndexManifest if "inputs" in raw else IndexManifest)


def read_shards_manifest(directory: str) -> ShardsManifest:
    """The summary: the report reads its entries' columns (`ShardFiles`, `gather_scores`)."""
    return fileio.committed_summary(directory, ShardsManifest)


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
        table = entry_columns(manifest, directory, ["bytes", "neighbour_slots_filled"], fileio.open_read)
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


@dataclass(frozen=True)
class ScoreSample:
    """Histograms of the filled slots' scores by neighbour rank, over a sample of the shards."""

    edges: np.ndarray  # [bins + 1]
    counts: np.ndarray  # [k, bins]
    sums: np.ndarray  # [k]: for exact means
    shards_read: int
    shards_total: int
    sequences: int

    def quantile(self, rank: int, q: float) -> float:
        """The q-quantile of rank's scores, to a bin's width (its bin's upper edge)."""
        cumulative = np.cumsum(self.counts[rank])
        return float(self.edges[1:][np.searchsorted(cumulative, q * cumulative[-1])])


def gather_scores(directory: str, manifest: ShardsManifest, max_sequences: int = SCORE_SAMPLE_SEQUENCES) -> ScoreSample:
    """Read the neighbour_ids and neighbour_scores columns (only those) of a sample of the
    shards, record batch by record batch: memory holds the histograms and one batch."""
    fraction = min(1.0, max_sequences / manifest.num_sequences) if manifest.num_sequences else 1.0
    paths = fileio.entry_paths_and_rows(manifest, directory)[0]
    chosen = sampled(paths, fraction, path_of=str)
    k = manifest.neighbours
    counts, sums, sequences = np.zeros((k, len(SCORE_EDGES) - 1), np.int64), np.zeros(k), 0
    for path in chosen:
        with fileio.open_read(fileio.join(directory, path)) as f:
            _, batches = read_shard(f, columns=["neighbour_ids", "neighbour_scores"])
            for batch in batches:
                ids = shard_column(batch, "neighbour_ids").reshape(-1, k)
                scores = shard_column(batch, "neighbour_scores").reshape(-1, k)
                sequences += batch.num_rows
                for rank in range(k):
                    present = np.clip(scores[ids[:, rank] >= 0, rank], SCORE_EDGES[0], SCORE_EDGES[-1])
                    counts[rank] += np.histogram(present, SCORE_EDGES)[0]
                    sums[rank] += float(present.sum(dtype=np.float64))
    return ScoreSample(SCORE_EDGES, counts, sums, len(chosen), len(paths), sequences)


def score_table(sample: ScoreSample) -> list[tuple[str, ...]]:
    """(rank, filled slots, mean, 10th percentile, median, 90th percentile) per rank."""
    rows: list[tuple[str, ...]] = []
    for rank, counts in enumerate(sample.counts):
        filled = int(counts.sum())
        if not filled:
            rows.append((str(rank), "0", "—", "—", "—", "—"))
            continue
        rows.append(
            (
                str(rank),
                f"{filled:,}",
                f"{sample.sums[rank] / filled:.3f}",
                *(f"{sample.quantile(rank, q):.3f}" for q in (0.1, 0.5, 0.9)),
            )
        )
    return rows


@dataclass(frozen=True)
class RejectedReason:
    reason: str
    count: int
    examples: tuple[dict, ...]


def gather_rejected(
    sources: Sources, counters: dict[str, int], examples: int = EXAMPLES_PER_REASON
) -> list[RejectedReason]:
    """Rejected records by reason: counts from the manifests' `rejected_<reason>` counters, a
    few examples from the rejected files of the stages covered (read only until each reason
    has its examples)."""
    counts = {
        name[len("rejected_") :]: value
        for name, value in sorted(counters.items())
        if name.startswith("rejected_") and value
    }
    found: dict[str, list[dict]] = {reason: [] for reason in counts}
    files = [
        p
        for p in fileio.list_files(sources.rejected)
        if posixpath.basename(p).startswith(tuple(f"{stage}-" for stage in sources.rejected_stages))
    ]

    def enough() -> bool:
        return all(len(kept) >= examples for kept in found.values())

    for path in files:
        with fileio.open_read(path) as f:
            for line in f:
                if enough():
                    break
                record = json.loads(line)
                kept = found.get(record["reason"])
                if kept is not None and len(kept) < examples:
                    kept.append(record)
    return [RejectedReason(reason, count, tuple(found[reason])) for reason, count in counts.items()]


@dataclass(frozen=True)
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
    index = None if sources.index is None else read_index_manifest(sources.index)
    shards = None if sources.shards is None else read_shards_manifest(sources.shards)
    counters: dict[str, int] = {}
    for manifest in (index, shards):
        for name, value in ({} if manifest is None else manifest.counters).items():
            counters[name] = counters.get(name, 0) + value
    samples, note, scores, shard_files = [], "", None, None
    if sources.shards is not None and shards is not None:  # shards is read iff sources.shards is set
        shard_files = ShardFiles.read(sources.shards, shards)
        beside = posixpath.join(posixpath.dirname(sources.shards.rstrip("/")), "index")
        if fileio.exists(fileio.join(beside, MANIFEST_FILE)):
            samples = inspect_shards(sources.shards, SAMPLE_SEQUENCES, SAMPLE_CHUNKS)
        else:
            note = f"No index beside the shards ({beside}) to decode their tokens with."
        scores = gather_scores(sources.shards, shards)
    return Report(
        sources.path,
        index,
        shards,
        shard_files,
        scores,
        gather_rejected(sources, counters),
        samples,
        note,
        read_evaluations(evaluations),
    )
