"""The report's figures (matplotlib, inline PNG): the overlap audit, neighbour scores by rank,
the search depth's recall curves, a checkpoint's loss by chunk overlap, and a blend's shares of
tokens per source.
"""

from __future__ import annotations

import base64
import html
import io

import numpy as np

from pipeline.check.report_samples import ScoreSample
from pipeline.check.report_sources import ReportError
from schemas.evaluation import NO_CHUNK, Evaluation
from schemas.measures import SearchDepth, SourceShare

DRAWN_BINS = 40  # bins across the scores' range in the figure


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
    if search_depth is not None and search_depth.curve and search_depth.curve[0].depth is not None:
        curves.append(
            (
                "build-shards, own documents excluded: neighbour recall",
                [(p.depth, p.recall) for p in search_depth.curve],
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


def evaluation_figure(evaluation: Evaluation) -> str:
    """Mean loss per r(C) bucket of the target's chunk, with neighbours and blanked (where there is a blanked pass)."""
    buckets = [b for b in evaluation.with_neighbours.overlap_buckets if b.bucket != NO_CHUNK]
    blanked = evaluation.blanked
    passes = [("with neighbours", [b.score for b in buckets], "#4c72b0")]
    if blanked is not None:
        passes.append(
            ("neighbours blanked", [b.score for b in blanked.overlap_buckets if b.bucket != NO_CHUNK], "#dd8452")
        )
    figure = _figure(7.5, 3.2)
    ax = figure.subplots()
    width = 0.8 / len(passes)
    for i, (label, scores, colour) in enumerate(passes):
        positions = [x + (i - (len(passes) - 1) / 2) * width for x in range(len(buckets))]
        losses = [np.nan if s.mean_loss is None else s.mean_loss for s in scores]
        ax.bar(positions, losses, width, color=colour, label=label)
    ax.set_xticks(range(len(buckets)), [f"{b.r_range}\n{b.score.tokens:,} targets" for b in buckets], fontsize=8)
    ax.set_xlabel("r(C) of the chunk holding the target token")
    ax.set_ylabel("mean loss (nats per target)")
    ax.legend(fontsize=8, ncols=len(passes), loc="lower center", bbox_to_anchor=(0.5, 1.0))  # above the bars
    return _img(figure, "mean loss by chunk overlap r(C)")


def shares_figure(sources: list[SourceShare]) -> str:
    """Each source's share of the training tokens: asked (its weight) beside got (counted in the shards)."""
    figure = _figure(7.5, 0.6 + 0.45 * len(sources))
    ax = figure.subplots()
    rows = np.arange(len(sources))
    ax.barh(rows - 0.2, [s.weight for s in sources], 0.4, color="#c7c7c7", label="asked (weight)")
    got = ax.barh(rows + 0.2, [s.share for s in sources], 0.4, color="#4c72b0", label="got (tokens in the shards)")
    ax.bar_label(
        got, [f"{s.share:.1%}" + (f", {s.repeats:,} repeats" if s.repeats else "") for s in sources], fontsize=8
    )
    ax.set_yticks(rows, [s.name for s in sources])
    ax.invert_yaxis()  # the config's order, top down
    ax.set_xlabel("share of the training tokens (padding not counted)")
    ax.margins(x=0.25)
    ax.legend(fontsize=8, ncols=2, loc="lower center", bbox_to_anchor=(0.5, 1.0))
    return _img(figure, "training tokens per source, asked and got")
