"""`report`: one self-contained HTML page, `report.html`, on an output, index or shards directory.

What the manifests record (settings, counters, neighbour fill and recall, the overlap audit,
the index's recall at each search depth the tuning measured, each job's wall time), the
distribution of neighbour scores by rank read from the shards, rejected records by reason with
examples, and sample sequences with their decoded neighbours (`inspect`). Figures are inline
PNGs drawn with matplotlib (the `report` extra); the page fetches nothing when opened.

The `gather_*` and summary functions read and compute; `render` turns a `Report` into HTML.
"""

from __future__ import annotations

import base64
import html
import io
import json
import posixpath
from dataclasses import dataclass

import numpy as np

from pipeline import fileio
from pipeline.faiss_index import PLATEAU_GAIN
from pipeline.inspect import inspect_shards
from pipeline.validate import sampled
from schemas.arrow import read_shard, shard_column
from schemas.manifest import MANIFEST_FILE, IndexManifest, SearchDepth, ShardsManifest, VectorIndexManifest

REPORT_FILE = "report.html"
SCORE_SAMPLE_SEQUENCES = 20_000  # shards are sampled (by name hash) down to about this many sequences
SCORE_EDGES = np.linspace(-1.0, 1.0, 401)  # cosine of unit vectors, in bins 0.005 wide
DRAWN_BINS = 40  # bins across the scores' range in the figure
SAMPLE_SEQUENCES = 3
SAMPLE_CHUNKS = 3  # chunks shown per sample sequence
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
    return fileio.committed_manifest(directory, lambda raw: VectorIndexManifest if "inputs" in raw else IndexManifest)


def read_shards_manifest(directory: str) -> ShardsManifest:
    return fileio.committed_manifest(directory, ShardsManifest)


# --- summaries of what the manifests record -------------------------------------------------


def human_bytes(count: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if count < 1024 or unit == "TiB":
            return f"{count:,} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024


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


def shards_summary(manifest: ShardsManifest) -> list[tuple[str, str]]:
    return [
        ("created by", manifest.created_by),
        ("config hash", manifest.config_hash[:16]),
        ("schema version", str(manifest.schema_version)),
        ("sequences", f"{manifest.num_sequences:,}"),
        ("shards", f"{len(manifest.shards)} ({human_bytes(sum(s.bytes for s in manifest.shards))})"),
        ("sequence tokens (n)", str(manifest.sequence_tokens)),
        ("chunk tokens (m)", str(manifest.chunk_tokens)),
        ("neighbours (k)", str(manifest.neighbours)),
        ("neighbour tokens", str(manifest.neighbour_tokens)),
        ("training corpus", manifest.training_corpus),
    ]


def neighbour_quality(manifest: ShardsManifest) -> list[tuple[str, str]]:
    """Fill (share of neighbour slots holding a neighbour) and recall against exact search."""
    slots = manifest.num_sequences * (manifest.sequence_tokens // manifest.chunk_tokens) * manifest.neighbours
    filled = [entry.neighbour_slots_filled for entry in manifest.shards]
    if manifest.neighbour_fill is None:
        fill = "not recorded"
    elif None in filled:
        fill = f"{manifest.neighbour_fill:.4f} of {slots:,} slots"
    else:
        fill = f"{manifest.neighbour_fill:.4f} ({sum(filled):,} of {slots:,} slots; {slots - sum(filled):,} empty)"
    recall, depth = manifest.neighbour_recall, manifest.search_depth
    searched = []
    if depth is not None and depth.depth is not None:
        measured = ", ".join(f"{p['recall']:.3f} at {p['depth']}" for p in depth.curve)
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
    bars, previous = [], None
    for threshold, count in sorted(overlap.items(), key=lambda item: float(item[0])):
        label = f"r ≤ {threshold}" if previous is None else f"({previous}, {threshold}]"
        bars.append((label, count))
        previous = threshold
    return bars


def timing_rows(manifests: list[tuple[str, object]]) -> list[tuple[str, str, str, str, str]]:
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


# --- neighbour scores from the shards -------------------------------------------------------


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
    entries = sampled(manifest.shards, fraction)
    k = manifest.neighbours
    counts, sums, sequences = np.zeros((k, len(SCORE_EDGES) - 1), np.int64), np.zeros(k), 0
    for entry in entries:
        with fileio.open_read(fileio.join(directory, entry.path)) as f:
            _, batches = read_shard(f, columns=["neighbour_ids", "neighbour_scores"])
            for batch in batches:
                ids = shard_column(batch, "neighbour_ids").reshape(-1, k)
                scores = shard_column(batch, "neighbour_scores").reshape(-1, k)
                sequences += batch.num_rows
                for rank in range(k):
                    present = np.clip(scores[ids[:, rank] >= 0, rank], SCORE_EDGES[0], SCORE_EDGES[-1])
                    counts[rank] += np.histogram(present, SCORE_EDGES)[0]
                    sums[rank] += float(present.sum(dtype=np.float64))
    return ScoreSample(SCORE_EDGES, counts, sums, len(entries), len(manifest.shards), sequences)


def score_table(sample: ScoreSample) -> list[tuple[str, ...]]:
    """(rank, filled slots, mean, 10th percentile, median, 90th percentile) per rank."""
    rows = []
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


# --- rejected records -----------------------------------------------------------------------


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


# --- the whole report -----------------------------------------------------------------------


@dataclass(frozen=True)
class Report:
    path: str
    index: IndexManifest | VectorIndexManifest | None
    shards: ShardsManifest | None
    scores: ScoreSample | None
    rejected: list[RejectedReason]
    samples: list[str]  # `inspect`'s lines
    samples_note: str  # why there are none, when there are none


def gather(path: str) -> Report:
    sources = find_sources(path)
    index = None if sources.index is None else read_index_manifest(sources.index)
    shards = None if sources.shards is None else read_shards_manifest(sources.shards)
    counters = {}
    for manifest in (index, shards):
        for name, value in ({} if manifest is None else manifest.counters).items():
            counters[name] = counters.get(name, 0) + value
    samples, note = [], ""
    if shards is not None:
        beside = posixpath.join(posixpath.dirname(sources.shards.rstrip("/")), "index")
        if fileio.exists(fileio.join(beside, MANIFEST_FILE)):
            samples = inspect_shards(sources.shards, SAMPLE_SEQUENCES, SAMPLE_CHUNKS)
        else:
            note = f"No index beside the shards ({beside}) to decode their tokens with."
    return Report(
        sources.path,
        index,
        shards,
        None if shards is None else gather_scores(sources.shards, shards),
        gather_rejected(sources, counters),
        samples,
        note,
    )


def write_report(path: str) -> str:
    """Gather, render and write `<path>/report.html`; its path."""
    report = gather(path)
    target = fileio.join(path.rstrip("/"), REPORT_FILE)
    fileio.write_bytes(target, render(report).encode("utf-8"))
    return target


# --- rendering --------------------------------------------------------------------------------


def _figure(width: float, height: float):
    """A matplotlib figure on the Agg canvas (no pyplot: no global figure state)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ModuleNotFoundError:
        raise ReportError(
            "the report draws its figures with matplotlib: pip install 'ratrain-pipeline[report]'"
        ) from None
    figure = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _img(figure, alt: str) -> str:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    data = base64.b64encode(buffer.getvalue()).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def overlap_figure(bars: list[tuple[str, int]]) -> str:
    figure = _figure(7.5, 3.2)
    ax = figure.subplots()
    labels, counts = zip(*bars)
    total = sum(counts) or 1
    drawn = ax.bar(range(len(bars)), counts, color="#4c72b0")
    ax.bar_label(drawn, [f"{c / total:.1%}" for c in counts], fontsize=8)
    ax.set_xticks(range(len(bars)), labels)
    ax.set_xlabel("chunk overlap r(C): longest common token run with its neighbours / m")
    ax.set_ylabel("training chunks")
    ax.margins(y=0.15)
    return _img(figure, "histogram of chunk overlap r(C)")


def scores_figure(sample: ScoreSample) -> str:
    figure = _figure(9.5, 3.4)
    dist, box = figure.subplots(1, 2, width_ratios=(3, 2))
    occupied = np.flatnonzero(sample.counts.sum(axis=0))
    # drawn in wider bins (the counts' bins merged) so that the occupied range spans ~DRAWN_BINS
    merge = max(1, -(-(occupied[-1] + 1 - occupied[0]) // DRAWN_BINS)) if len(occupied) else 1
    usable = (sample.counts.shape[1] // merge) * merge
    drawn = sample.counts[:, :usable].reshape(len(sample.counts), -1, merge).sum(axis=2)
    edges = sample.edges[: usable + 1 : merge]
    centres = (edges[:-1] + edges[1:]) / 2
    k = len(sample.counts)
    colours = [f"C{rank % 10}" for rank in range(k)]
    stats = []
    for rank, counts in enumerate(drawn):
        if not counts.sum():
            continue
        dist.plot(
            centres,
            counts / counts.sum(),
            drawstyle="steps-mid",
            color=colours[rank],
            label=f"rank {rank}",
            linewidth=1.2,
        )
        stats.append(
            {
                "label": str(rank),
                "whislo": sample.quantile(rank, 0.05),
                "q1": sample.quantile(rank, 0.25),
                "med": sample.quantile(rank, 0.5),
                "q3": sample.quantile(rank, 0.75),
                "whishi": sample.quantile(rank, 0.95),
                "mean": sample.sums[rank] / counts.sum(),
            }
        )
    if len(occupied):
        pad = edges[1] - edges[0]
        dist.set_xlim(sample.edges[occupied[0]] - pad, sample.edges[occupied[-1] + 1] + pad)
    dist.set_xlabel("neighbour score (cosine)")
    dist.set_ylabel("share of the rank's filled slots")
    dist.set_title(f"bins {edges[1] - edges[0]:.3g} wide", fontsize=9)
    dist.legend(fontsize=8, ncols=2 if k > 5 else 1)
    box.bxp(stats, showfliers=False, showmeans=True)
    box.set_xlabel("neighbour rank")
    box.set_ylabel("neighbour score (cosine)")
    box.set_title("box: quartiles, whiskers: 5th-95th percentile\n\u25b2 mean", fontsize=9)
    return _img(figure, "neighbour scores by rank")


def recall_curves(manifest, search_depth: SearchDepth | None) -> list[tuple[str, list[tuple[int, float]]]]:
    """(label, [(depth, recall)] in depth order) of every recall curve measured: the index's
    plain one, with each query's own document excluded, and build-shards' own (its training
    chunks, the sequence's documents excluded)."""
    recall = manifest.recall_at_k
    curves = [(f"index: {recall.measure}", [(p.depth, p.recall) for p in recall.curve or []])]
    own = recall.own_document_excluded
    if own is not None and own.curve:
        curves.append((f"index, own document excluded: recall@{own.k}", [(p.depth, p.recall) for p in own.curve]))
    if search_depth is not None and search_depth.curve and search_depth.curve[0]["depth"] is not None:
        curves.append(
            (
                "build-shards, own documents excluded: neighbour recall",
                [(p["depth"], p["recall"]) for p in search_depth.curve],
            )
        )
    return [(label, sorted(points)) for label, points in curves if points]


def recall_figure(manifest, search_depth: SearchDepth | None = None) -> str:
    recall = manifest.recall_at_k
    figure = _figure(6.5, 3.4)
    ax = figure.subplots()
    depths: set[int] = set()
    for (label, points), colour in zip(recall_curves(manifest, search_depth), ("#4c72b0", "#dd8452", "#55a868")):
        ax.plot([d for d, _ in points], [r for _, r in points], marker="o", color=colour, label=label)
        depths |= {d for d, _ in points}
    ticks = sorted(depths)
    if recall.target is not None:
        ax.axhline(recall.target, linestyle="--", color="grey", linewidth=1, label=f"target {recall.target}")
    if manifest.nprobe is not None:
        ax.plot(
            [manifest.nprobe],
            [recall.value],
            marker="o",
            markersize=11,
            fillstyle="none",
            color="#c44e52",
            linestyle="none",
            label=f"chosen depth {manifest.nprobe}",
        )
    if search_depth is not None and search_depth.depth not in (None, manifest.nprobe):
        ax.axvline(
            search_depth.depth, color="#55a868", linestyle=":", label=f"build-shards searched at {search_depth.depth}"
        )
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [str(d) for d in ticks])
    ax.set_xlabel("search depth (nprobe / efSearch)")
    ax.set_ylabel("recall")
    ax.legend(fontsize=8, loc="lower right")
    return _img(figure, "index recall against search depth")


STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; max-width: 1100px; margin: 1.5em auto;
       padding: 0 1em; color: #222; line-height: 1.4; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; } h2 { border-bottom: 1px solid #ccc; padding-bottom: 0.2em; }
nav a { margin-right: 1em; } .muted { color: #666; } img { max-width: 100%; }
table { border-collapse: collapse; margin: 0.5em 0 1em; font-size: 0.92em; }
th, td { border: 1px solid #ddd; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }
th { background: #f4f4f4; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
.columns { display: flex; gap: 2em; flex-wrap: wrap; } .columns > div { flex: 1; min-width: 320px; }
.sample { font-family: ui-monospace, monospace; font-size: 0.85em; white-space: pre-wrap; word-break: break-word; }
.sample .sequence { font-weight: bold; margin-top: 0.8em; } .sample .chunk { margin-top: 0.4em; }
.sample .neighbour { padding-left: 2em; color: #444; }
"""


class _Html(str):
    """A table cell that is HTML already (not escaped again)."""


def _table(rows, header: tuple[str, ...] | None = None, numeric: tuple[int, ...] = ()) -> str:
    def cell(value) -> str:
        return value if isinstance(value, _Html) else html.escape(str(value))

    head = "" if header is None else "<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>"
    body = "".join(
        "<tr>"
        + "".join(f"<td{' class=num' if i in numeric else ''}>{cell(value)}</td>" for i, value in enumerate(row))
        + "</tr>"
        for row in rows
    )
    return f"<table>{head}{body}</table>"


def _sample_line(line: str) -> str:
    kind = (
        "sequence"
        if line.startswith("== ")
        else "chunk"
        if line.startswith("-- ")
        else "neighbour"
        if line.startswith("   ")
        else ""
    )
    return f'<div class="{kind}">{html.escape(line.strip())}</div>'


def _recall_body(manifest, search_depth: SearchDepth | None = None) -> str:
    recall = manifest.recall_at_k
    if manifest.nprobe is None:
        return (
            f"<p>An exact index ({html.escape(manifest.index_factory)}): no search depth to tune; "
            f"{html.escape(recall.measure)} = {recall.value:.3f} on {recall.sample_size:,} queries.</p>"
        )
    if recall.curve is None:
        return (
            f"<p>The tuning curve is not recorded (a manifest from before it was); the chosen depth "
            f"{manifest.nprobe} gives {html.escape(recall.measure)} = {recall.value:.3f}.</p>"
        )
    plateau = (
        f" The tuning stopped on a plateau: two doublings of the depth gained less than {PLATEAU_GAIN}."
        if recall.plateau
        else ""
    )
    own = recall.own_document_excluded
    excluded = (
        f" The same queries were also searched as build-shards searches, their own document excluded, keeping "
        f"{own.k} neighbours: recall@{own.k} {own.value:.3f} at the chosen depth; the index keeps the deeper of the "
        "two depths that reach the target (on long documents a chunk's nearest lists are its own document's)."
        if own is not None
        else " The queries' documents were not known, so no curve with them excluded was measured."
    )
    shards = ""
    if search_depth is not None and search_depth.curve and search_depth.curve[0]["depth"] is not None:
        shards = (
            f" build-shards measured its own sampled training chunks, their sequence's documents excluded, from the "
            f"index's depth {search_depth.index_depth} and searched at {search_depth.depth} "
            f"(recall_below_target: {search_depth.recall_below_target})."
        )
    return (
        f"<p>{html.escape(recall.measure)} on {recall.sample_size:,} sampled indexed vectors, at each depth "
        f"the tuning measured; it keeps the smallest depth that reaches the target.{plateau}"
        f"{html.escape(excluded + shards)}</p>" + recall_figure(manifest, search_depth)
    )


def _rejected_body(rejected: list[RejectedReason]) -> str:
    if not rejected:
        return "<p>No input record was rejected.</p>"
    rows = [
        (
            r.reason,
            f"{r.count:,}",
            _Html(
                "<br>".join(
                    html.escape(f"{e['source']}:{e['position']}: {e['excerpt'][:EXCERPT_CHARS]}") for e in r.examples
                )
                or "—"
            ),
        )
        for r in rejected
    ]
    return _table(
        rows, ("reason", "records", f"examples (source:position: excerpt; up to {EXAMPLES_PER_REASON})"), numeric=(1,)
    )


def render(report: Report) -> str:
    """The report as one HTML page with its figures inline."""
    sections = []  # (anchor, title, body)
    summary, counters = "", ""
    if report.index is not None:
        summary += f"<div><h3>Index</h3>{_table(index_summary(report.index))}</div>"
    if report.shards is not None:
        summary += f"<div><h3>Shards</h3>{_table(shards_summary(report.shards))}</div>"
    manifests = [(kind, m) for kind, m in (("index", report.index), ("shards", report.shards)) if m is not None]
    for kind, manifest in manifests:
        rows = [(name, f"{value:,}") for name, value in sorted(manifest.counters.items())]
        counters += (
            f"<div><h3>{kind.capitalize()} counters</h3>{_table(rows, ('counter', 'value'), numeric=(1,))}</div>"
        )
    sections.append(
        (
            "summary",
            "Config and manifests",
            "<p class=muted>The settings as the manifests record them.</p>"
            f'<div class="columns">{summary}</div><div class="columns">{counters}</div>',
        )
    )
    if report.shards is not None:
        scores = report.scores
        read = (
            "all shards"
            if scores.shards_read == scores.shards_total
            else f"a sample of {scores.shards_read} of {scores.shards_total} shards, chosen by name"
        )
        sections.append(
            (
                "neighbours",
                "Neighbours",
                _table(neighbour_quality(report.shards))
                + f"<h3>Scores by rank</h3><p class=muted>Filled slots of {scores.sequences:,} sequences "
                f"({read}); quantiles to within 0.005.</p>"
                + _table(
                    score_table(scores),
                    ("rank", "filled slots", "mean", "10th pct", "median", "90th pct"),
                    numeric=(1, 2, 3, 4, 5),
                )
                + (scores_figure(scores) if scores.counts.sum() else "<p>No filled slot.</p>"),
            )
        )
        sections.append(
            (
                "overlap",
                "Chunk overlap r(C)",
                "<p class=muted>RETRO's leakage audit: for each training chunk, the longest token run it "
                "shares with its neighbours, as a share of the chunk length m.</p>"
                + overlap_figure(overlap_bars(report.shards.overlap)),
            )
        )
    if report.index is not None:
        search_depth = report.shards.search_depth if report.shards is not None else None
        sections.append(("recall", "Index recall against search depth", _recall_body(report.index, search_depth)))
    sections.append(
        (
            "timings",
            "Stage timings",
            "<p class=muted>Wall time from the driver building the job to its commit writing the "
            "manifest.</p>"
            + _table(
                timing_rows(manifests),
                ("job", "started (UTC)", "wall time", "records", "throughput"),
                numeric=(2, 3, 4),
            ),
        )
    )
    sections.append(("rejected", "Rejected records", _rejected_body(report.rejected)))
    if report.shards is not None:
        sections.append(
            (
                "samples",
                "Sample sequences",
                '<div class="sample">' + "".join(_sample_line(line) for line in report.samples) + "</div>"
                if report.samples
                else f"<p>{html.escape(report.samples_note)}</p>",
            )
        )
    title = html.escape(f"ratrain-pipeline report: {report.path}")
    nav = "".join(f'<a href="#{anchor}">{html.escape(name)}</a>' for anchor, name, _ in sections)
    body = "".join(
        f'<section id="{anchor}"><h2>{html.escape(name)}</h2>\n{content}\n</section>\n'
        for anchor, name, content in sections
    )
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{title}</title>'
        f"<style>{STYLE}</style></head>\n<body><h1>{title}</h1><nav>{nav}</nav>\n{body}</body></html>\n"
    )
