"""The report as one self-contained HTML page: `render` and `write_report`."""

from __future__ import annotations

import html
from collections.abc import Sequence

from pipeline.check.figures import evaluation_figure, overlap_figure, recall_figure, scores_figure, shares_figure
from pipeline.check.report import (
    GENERATION_COLUMNS,
    REPORT_FILE,
    SOURCE_COLUMNS,
    Report,
    gather,
    generation_rows,
    index_summary,
    neighbour_quality,
    overlap_bars,
    shards_summary,
    source_rows,
    timing_rows,
)
from pipeline.check.report_samples import EXAMPLES_PER_REASON, EXCERPT_CHARS, RejectedReason, score_table
from pipeline.common import fileio
from pipeline.index.recall import PLATEAU_GAIN
from schemas.evaluation import Evaluation, score_rows
from schemas.manifest import IndexManifest
from schemas.measures import SearchDepth

STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; max-width: 1100px; margin: 1.5em auto;
       padding: 0 1em; color: #222; line-height: 1.4; overflow-wrap: break-word; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; } h2 { border-bottom: 1px solid #ccc; padding-bottom: 0.2em; }
nav a { margin-right: 1em; } .muted { color: #666; } img { max-width: 100%; }
table { border-collapse: collapse; margin: 0.5em 0 1em; font-size: 0.92em; }
th, td { border: 1px solid #ddd; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }
th { background: #f4f4f4; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
/* A value column (a model path, an excerpt) breaks anywhere, so its table fits the width it is given; a column
   of .columns keeps min-width auto, never narrower than its table: a wider one moves the next column below. */
td:last-child:not(.num) { overflow-wrap: anywhere; }
.columns { display: flex; gap: 0 2em; flex-wrap: wrap; } .columns > div { flex: 1 1 22em; }
@media (max-width: 45em) { body { padding: 0 0.5em; } table { font-size: 0.85em; } th, td { padding: 0.2em 0.35em; } }
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
    if search_depth is not None and search_depth.curve and search_depth.curve[0].depth is not None:
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


RECORD_FIELDS = ("source", "position", "reason", "excerpt")  # every rejected record's; a reason may add more


def _rejected_example(record: dict) -> str:
    """source:position: [what the reason adds, e.g. a near-duplicate's jaccard] excerpt."""
    added = ", ".join(f"{key} {value}" for key, value in record.items() if key not in RECORD_FIELDS)
    return (
        f"{record['source']}:{record['position']}: "
        + (f"[{added}] " if added else "")
        + record["excerpt"][:EXCERPT_CHARS]
    )


def rejected_body(rejected: list[RejectedReason]) -> str:
    if not rejected:
        return "<p>No input record was rejected.</p>"
    rows = [
        (r.reason, f"{r.count:,}", _Html("<br>".join(html.escape(_rejected_example(e)) for e in r.examples) or "—"))
        for r in rejected
    ]
    return _table(
        rows,
        ("reason", "records", f"examples (source:position: [details] excerpt; up to {EXAMPLES_PER_REASON})"),
        numeric=(1,),
    )


def _score(value: float | None, digits: int = 4) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _evaluation_body(evaluations: tuple[Evaluation, ...]) -> str:
    body = (
        "<p class=muted>Scores of next-token targets (pad left out) from <code>ratrain-eval</code>: mean loss in "
        "nats and accuracy (argmax = target), with the shards' neighbours and with every neighbour blanked; gain = "
        "loss blanked − loss with neighbours. <i>Copyable</i>: the target occurs among the neighbour tokens its "
        "position attends to. Targets are grouped by r(C) of the chunk that holds them. Report a model by its "
        "loss on low-overlap chunks (in bold): there the neighbours do not hold the chunk's own text.</p>"
    )
    for evaluation in evaluations:
        rows = []
        for row in score_rows(evaluation):
            label = html.escape(row.label)
            rows.append(
                (
                    _Html(f"<b>{label}</b>" if row.reported else label),
                    f"{row.with_neighbours.tokens:,}",
                    _score(row.with_neighbours.mean_loss),
                    _score(row.blanked_loss),
                    _score(row.gain),
                    _score(row.with_neighbours.accuracy, 3),
                    _score(row.blanked_accuracy, 3),
                )
            )
        step = "step not recorded" if evaluation.step is None else f"step {evaluation.step:,}"
        blanked_note = (
            f"Blanked: {evaluation.blanked_note}."
            if evaluation.blanked is not None
            else f"No blanked pass: {evaluation.blanked_note}."
        )
        body += (
            f"<h3>{html.escape(evaluation.checkpoint)} ({step})</h3>"
            f"<p>{evaluation.sequences:,} sequences of {html.escape(evaluation.shards)} (m = "
            f"{evaluation.chunk_tokens}, k = {evaluation.neighbours}). {html.escape(blanked_note)}</p>"
            + _table(
                rows,
                (
                    "targets",
                    "count",
                    "loss with neighbours",
                    "loss blanked",
                    "gain",
                    "accuracy with neighbours",
                    "accuracy blanked",
                ),
                numeric=(1, 2, 3, 4, 5, 6),
            )
            + evaluation_figure(evaluation)
        )
    return body


def render(report: Report) -> str:
    """The report as one HTML page with its figures inline."""
    sections = []  # (anchor, title, body)
    summary, counters = "", ""
    if report.index is not None:
        summary += f"<div><h3>Index</h3>{_table(index_summary(report.index))}</div>"
    if report.shards is not None and report.shard_files is not None:
        summary += f"<div><h3>Shards</h3>{_table(shards_summary(report.shards, report.shard_files))}</div>"
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
        scores, files = report.scores, report.shard_files
        assert scores is not None and files is not None  # gather reads both whenever there are shards
        read = (
            "all shards"
            if scores.shards_read == scores.shards_total
            else f"a sample of {scores.shards_read} of {scores.shards_total} shards, chosen by name"
        )
        sections.append(
            (
                "neighbours",
                "Neighbours",
                _table(neighbour_quality(report.shards, files))
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
                + (
                    overlap_figure(overlap_bars(report.shards.overlap))
                    if report.shards.overlap
                    else "<p>Not recorded in the manifest.</p>"
                ),
            )
        )
    if report.shards is not None and report.shards.sources:
        sections.append(
            (
                "sources",
                "Training sources",
                "<p class=muted>The blend's sources: each one's share of the training tokens asked (its weight) "
                "and got (counted in the shards), and the rows repeating a sequence of a source upsampled.</p>"
                + _table(source_rows(report.shards), SOURCE_COLUMNS, numeric=(1, 2, 3, 4, 5, 6, 7, 8))
                + shares_figure(report.shards.sources),
            )
        )
    if report.evaluations:
        sections.append(("evaluation", "Checkpoint evaluation", _evaluation_body(report.evaluations)))
    if isinstance(report.index, IndexManifest) and (
        len(report.index.generations) > 1 or report.index.deleted_documents
    ):
        sections.append(
            (
                "generations",
                "Index generations",
                "<p class=muted>Each build or change of the index: the corpus files it read, the chunk ids "
                "it added, the documents it deleted (in no search since), and the appended vectors' "
                f"1-recall@10 at the index's depth (the build measured {report.index.recall_at_k.value:.3f}).</p>"
                + _table(generation_rows(report.index), GENERATION_COLUMNS, numeric=(1, 3)),
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
    sections.append(("rejected", "Rejected records", rejected_body(report.rejected)))
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


def write_report(path: str, evaluations: Sequence[str] = ()) -> str:
    """Gather, render and write `<path>/report.html` (with the scores of `ratrain-eval --json`
    files `evaluations`); its path."""
    report = gather(path, evaluations)
    target = fileio.join(path.rstrip("/"), REPORT_FILE)
    fileio.write_bytes(target, render(report).encode("utf-8"))
    return target
