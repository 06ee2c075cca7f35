"""`report`: one self-contained HTML page on an output, index or shards directory; and the
stage timings and recall curves the manifests record for it. Most tests report on a copy of the
session's built output (e2e)."""

import json
import re
import shutil
from datetime import datetime
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet  # noqa: F401  # pa.parquet
import pytest

from pipeline.build_index.faiss_only import build_vector_index
from pipeline.check.figures import recall_curves
from pipeline.check.html import write_report
from pipeline.check.report import overlap_bars
from pipeline.check.report_samples import gather_scores
from pipeline.check.report_sources import read_shards_manifest
from pipeline.cli import main
from schemas.arrow import read_shard_table, shard_column
from schemas.evaluation import evaluation_json, score_rows
from schemas.manifest import IndexManifest, ShardsManifest
from schemas.measures import OwnDocumentRecall, Recall, SearchDepth
from schemas.stage_config import IndexConfig
from tests.helpers import BAD_REASONS, current_manifest, rewrite_manifest, rewrite_shards_as_schema_version_1
from tests.trainer_fixtures import write_checkpoint

INLINE_PNG = re.compile(r'<img alt="[^"]+" src="data:image/png;base64,[A-Za-z0-9+/]+=*">')


@pytest.fixture
def output(built_output, tmp_path):
    """A copy of the built output (the report is written into the directory it covers; the
    shared one is compared file by file by other tests)."""
    root, _, _ = built_output
    shutil.copytree(root / "out", tmp_path / "out")
    return tmp_path / "out"


def _report(directory) -> str:
    path = write_report(str(directory))
    assert path == str(directory / "report.html")
    page = (directory / "report.html").read_text()
    assert "<link" not in page and "<script" not in page and "@import" not in page and "url(" not in page
    assert all(source.startswith("data:image/png;base64,") for source in re.findall(r'src="([^"]*)"', page))
    return page


def _sections(page: str) -> list[str]:
    return re.findall(r'<section id="([a-z]+)">', page)


def _section(page: str, name: str) -> str:
    return re.search(rf'<section id="{name}">(.*?)</section>', page, re.S).group(1)


@pytest.mark.e2e
def test_the_report_of_an_output_is_one_page_with_its_figures_inline(output):
    page = _report(output)
    assert _sections(page) == ["summary", "neighbours", "overlap", "recall", "timings", "rejected", "samples"]
    summary = _section(page, "summary")
    assert summary.count("schema version") == 2 and "IVF list training" not in summary  # a Flat index
    assert len(INLINE_PNG.findall(page)) == 2  # scores by rank, overlap (an exact index has no depth curve)
    assert INLINE_PNG.search(_section(page, "neighbours")) and INLINE_PNG.search(_section(page, "overlap"))
    assert "An exact index (Flat)" in _section(page, "recall")
    rejected = _section(page, "rejected")
    assert all(f"<td>{reason}</td>" in rejected for reason in BAD_REASONS)
    assert "b.jsonl:" in rejected  # an example names its source and position
    timings = _section(page, "timings")
    assert "build-index" in timings and "build-shards" in timings and "not recorded" not in timings
    assert _section(page, "samples").count("== sequence") == 3


@pytest.mark.e2e
def test_the_report_of_an_index_directory(output):
    page = _report(output / "index")
    assert _sections(page) == ["summary", "recall", "timings", "rejected"]
    assert "empty_text" in _section(page, "rejected") and not INLINE_PNG.search(page)


@pytest.mark.e2e
def test_an_ivf_index_records_its_tuning_curve_and_the_report_draws_it(output, tmp_path):
    cfg = IndexConfig(type="IVF8,Flat", target_recall=0.99)
    manifest = build_vector_index([str(output / "index" / "embeddings" / "*.parquet")], str(tmp_path / "ivf"), cfg, [])
    curve = manifest.recall_at_k.curve
    depths = [point.depth for point in curve]
    assert depths == sorted(depths) and depths[0] == 1 and manifest.nprobe in depths
    assert {p.depth: p.recall for p in curve}[manifest.nprobe] == manifest.recall_at_k.value
    assert manifest.timings.stage == "index" and manifest.timings.records == "index_vectors_added"
    page = _report(tmp_path / "ivf")
    assert _sections(page) == ["summary", "recall", "timings", "rejected"]
    assert "one k-means" in _section(page, "summary")
    assert len(INLINE_PNG.findall(_section(page, "recall"))) == 1


@pytest.mark.e2e
def test_the_report_of_a_shards_directory_decodes_with_the_index_beside_it(output, tmp_path):
    page = _report(output / "shards")
    assert _sections(page) == ["summary", "neighbours", "overlap", "timings", "rejected", "samples"]
    assert len(INLINE_PNG.findall(page)) == 2 and "No input record was rejected" in _section(page, "rejected")
    assert _section(page, "samples").count("== sequence") == 3
    shutil.copytree(output / "shards", tmp_path / "alone" / "shards")
    alone = _report(tmp_path / "alone" / "shards")
    assert "No index beside the shards" in _section(alone, "samples") and len(INLINE_PNG.findall(alone)) == 2


@pytest.mark.e2e
def test_the_report_reads_schema_version_1_shards(output):
    rewrite_shards_as_schema_version_1(output / "shards")
    page = _report(output / "shards")
    assert _sections(page) == ["summary", "neighbours", "overlap", "timings", "rejected", "samples"]
    assert len(INLINE_PNG.findall(page)) == 2 and _section(page, "samples").count("== sequence") == 3


@pytest.mark.e2e
def test_manifests_from_before_timings_and_curves_are_reported_as_not_recorded(output):
    for name in ("index", "shards"):
        manifest = json.loads(current_manifest(output / name).read_text())
        del manifest["timings"]
        rewrite_manifest(output / name, json.dumps(manifest))
    assert IndexManifest.model_validate_json((output / "index" / "manifest.json").read_text()).timings is None
    timings = _section(_report(output), "timings")
    assert timings.count("not recorded") == 4  # started and wall time of both stages


@pytest.mark.unit
def test_report_of_a_directory_that_is_no_output_fails_with_one_line(tmp_path, capsys):
    (tmp_path / "something").mkdir()
    with pytest.raises(SystemExit) as exit_:
        main(["report", str(tmp_path / "something")])
    assert exit_.value.code == 1
    err = capsys.readouterr().err.strip()
    assert err == (
        f"error: {tmp_path}/something: not an output, index or shards directory (no manifest "
        f"here, nor in {tmp_path}/something/index or {tmp_path}/something/shards)"
    )
    assert not (tmp_path / "something" / "report.html").exists()


@pytest.mark.e2e
def test_the_report_shows_the_scores_of_each_evaluation_given(output, tmp_path, capsys):
    """Two checkpoints (one reads neighbours, one was trained without) scored on the output's
    shards by ratrain-eval: the page holds each one's table with the numbers of its JSON."""
    from trainer.evaluate import evaluate

    shards = read_shards_manifest(str(output / "shards"))
    shape = {"vocab_size": 30522, "sequence_tokens": shards.sequence_tokens, "chunk_tokens": shards.chunk_tokens}
    tiny = {"dim": 16, "depth": 2, "heads": 2, "encoder_depth": 1, "cca_layers": (1,)}
    files, evaluations = [], []
    for name, retrieval in (("retro", True), ("ablation", False)):
        checkpoint = write_checkpoint(tmp_path / f"{name}.pt", step=7, retrieval=retrieval, **shape, **tiny)
        evaluation = evaluate(str(checkpoint), str(output / "shards"), batch_size=4, max_sequences=4)
        (tmp_path / f"{name}.json").write_text(evaluation_json(evaluation))
        files.append(str(tmp_path / f"{name}.json"))
        evaluations.append(evaluation)
    main(["report", str(output), "--eval", files[0], "--eval", files[1]])
    assert capsys.readouterr().out.strip() == str(output / "report.html")
    page = (output / "report.html").read_text()
    assert _sections(page) == [
        "summary",
        "neighbours",
        "overlap",
        "evaluation",
        "recall",
        "timings",
        "rejected",
        "samples",
    ]
    section = _section(page, "evaluation")
    assert len(INLINE_PNG.findall(section)) == 2  # loss by r(C), one per evaluation
    tables = re.findall(r"<h3>(.*?)</h3>.*?<table>(.*?)</table>", section, re.S)
    assert [title for title, _ in tables] == [f"{tmp_path}/retro.pt (step 7)", f"{tmp_path}/ablation.pt (step 7)"]
    for (_, table), evaluation in zip(tables, evaluations):
        cells = [re.findall(r"<td[^>]*>(.*?)</td>", row) for row in re.findall(r"<tr>(.*?)</tr>", table)[1:]]
        expected = score_rows(evaluation)
        assert len(cells) == len(expected) == 4 + 7  # all, copyable, not, low overlap; 6 buckets and none
        for row, score in zip(cells, expected):
            with_ = score.with_neighbours
            assert row[1] == f"{with_.tokens:,}"
            assert row[2] == ("—" if with_.mean_loss is None else f"{with_.mean_loss:.4f}")
            assert row[3] == ("—" if score.blanked_loss is None else f"{score.blanked_loss:.4f}")
            assert row[5] == ("—" if with_.accuracy is None else f"{with_.accuracy:.3f}")
        assert cells[3][0] == "<b>low overlap: r ≤ 0.125</b>"  # the loss to report
    retro, ablation = evaluations
    assert f"{retro.with_neighbours.all.mean_loss:.4f}" in tables[0][1]
    assert f"{retro.blanked.all.mean_loss:.4f}" in tables[0][1]
    assert "No blanked pass: the model has no retrieval" in section and ablation.blanked is None


@pytest.mark.unit
def test_an_evaluation_file_that_is_missing_or_not_scores_fails_with_one_line(tmp_path, capsys):
    from benchmarks.validate_sample import write_index

    write_index(tmp_path / "index", 4, np.random.default_rng(0))
    (tmp_path / "other.json").write_text(json.dumps({"checkpoint": "c.pt"}))
    for path, message in (
        (tmp_path / "missing.json", "no such evaluation file"),
        (tmp_path / "other.json", "not the JSON of ratrain-eval (step: Field required)"),
    ):
        with pytest.raises(SystemExit):
            main(["report", str(tmp_path / "index"), "--eval", str(path)])
        assert capsys.readouterr().err.strip() == f"error: {path}: {message}"
    assert not (tmp_path / "index" / "report.html").exists()


@pytest.mark.e2e
def test_the_cli_prints_the_report_path(output, capsys):
    main(["report", str(output)])
    assert capsys.readouterr().out.strip() == str(output / "report.html")


# --- what the report reads ----------------------------------------------------------------------


@pytest.mark.e2e
def test_committed_manifests_carry_positive_timings(built_output):
    root, _, _ = built_output
    for name, model, stage, records in (
        ("index", IndexManifest, "build-index", "chunks"),
        ("shards", ShardsManifest, "build-shards", "sequences"),
    ):
        manifest = model.model_validate_json((root / "out" / name / "manifest.json").read_text())
        timings = manifest.timings
        assert (timings.stage, timings.records) == (stage, records)
        assert timings.wall_seconds > 0 and timings.records_per_second > 0
        assert datetime.fromisoformat(timings.started) <= datetime.fromisoformat(timings.committed)
        # the rate is rounded to 0.1 and computed from the wall time before it was rounded to 1 ms
        count, wall = manifest.counters[records], timings.wall_seconds
        assert timings.records_per_second == pytest.approx(count / wall, abs=0.05 + count * 0.0005 / wall**2 + 1e-9)


@pytest.mark.unit
def test_overlap_bars_name_each_threshold_range():
    assert overlap_bars({"0.125": 7, "0.0": 1, "1.0": 2}) == [("r ≤ 0.0", 1), ("(0.0, 0.125]", 7), ("(0.125, 1.0]", 2)]


@pytest.mark.e2e
def test_score_histograms_hold_every_filled_slot_and_sample_shards_when_asked(built_output):
    root, _, _ = built_output
    shards = root / "out" / "shards"
    manifest = read_shards_manifest(str(shards))
    ids, scores = [], []
    for entry in manifest.shards:
        table = read_shard_table(pa.memory_map(str(shards / entry.path)))
        ids.append(shard_column(table, "neighbour_ids").reshape(-1, manifest.neighbours))
        scores.append(shard_column(table, "neighbour_scores").reshape(-1, manifest.neighbours))
    ids, scores = np.concatenate(ids), np.concatenate(scores)
    sample = gather_scores(str(shards), manifest)
    assert (sample.shards_read, sample.sequences) == (len(manifest.shards), manifest.num_sequences)
    for rank in range(manifest.neighbours):
        filled = scores[ids[:, rank] >= 0, rank]
        assert sample.counts[rank].sum() == len(filled) > 0
        assert sample.sums[rank] / len(filled) == pytest.approx(filled.mean(), abs=1e-5)
        assert abs(sample.quantile(rank, 0.5) - np.median(filled)) <= 0.005 + 1e-6
    one = gather_scores(str(shards), manifest, max_sequences=1)
    assert one.shards_read == 1 < one.shards_total and one.sequences < manifest.num_sequences


def _tuned_ivf_recall():
    """An IVF index's recall as the index stage records it: both tuning curves, the depth kept
    (8), and build-shards' own deepening from there (to 16)."""
    own = OwnDocumentRecall(
        measure="recall@k", k=2, value=0.96, depth=8, curve=[{"depth": 4, "recall": 0.9}, {"depth": 8, "recall": 0.96}]
    )
    recall = Recall(
        measure="1-recall@10",
        value=0.98,
        sample_size=500,
        nprobe=8,
        target=0.95,
        curve=[{"depth": 1, "recall": 0.9}, {"depth": 2, "recall": 0.96}, {"depth": 8, "recall": 0.98}],
        own_document_excluded=own,
    )
    depth = SearchDepth(
        index_depth=8,
        depth=16,
        target=0.95,
        recall_below_target="deepen",
        curve=[{"depth": 8, "recall": 0.93}, {"depth": 16, "recall": 0.97}],
        plateau=False,
    )
    return recall, depth


@pytest.mark.unit
def test_recall_curves_hold_the_index_s_two_tunings_and_build_shards_deepening():
    recall, depth = _tuned_ivf_recall()
    curves = recall_curves(SimpleNamespace(recall_at_k=recall), depth)
    assert [label.split(":")[0] for label, _ in curves] == [
        "index",
        "index, own document excluded",
        "build-shards, own documents excluded",
    ]
    assert curves[1][1] == [(4, 0.9), (8, 0.96)] and curves[2][1] == [(8, 0.93), (16, 0.97)]
    assert [
        label
        for label, _ in recall_curves(
            SimpleNamespace(recall_at_k=recall.model_copy(update={"own_document_excluded": None})), None
        )
    ] == ["index: 1-recall@10"]


@pytest.mark.e2e
def test_the_recall_section_draws_the_curves_without_and_with_own_documents_excluded(output):
    """The built output's manifests as an IVF index tuned both ways and a build-shards run that
    searched deeper record them: the report's recall section says so and draws one figure."""
    recall, depth = _tuned_ivf_recall()
    index = json.loads(current_manifest(output / "index").read_text())
    index.update(index_factory="IVF64,Flat", nprobe=8, recall_at_k=recall.model_dump(mode="json"))
    rewrite_manifest(output / "index", json.dumps(index))
    shards = json.loads(current_manifest(output / "shards").read_text())
    shards["search_depth"] = depth.model_dump(mode="json")
    rewrite_manifest(output / "shards", json.dumps(shards))
    section = _section(_report(output), "recall")
    assert "recall@2 0.960 at the chosen depth" in section and "searched at 16" in section
    assert len(INLINE_PNG.findall(section)) == 1


@pytest.mark.unit
def test_a_report_on_shards_in_a_file_table_reads_columns_not_entries(tmp_path, monkeypatch):
    """The shards' count, bytes and filled slots come from the file table's columns; the page
    is written without reading every entry as an object."""
    from benchmarks.validate_sample import write_index, write_shards
    from pipeline.common import fileio
    from pipeline.common.models import DEFAULT_MODEL_NAMES

    rng = np.random.default_rng(0)
    db = write_index(tmp_path / "index", 12, rng)
    index_manifest = tmp_path / "index" / "manifest.json"
    raw = json.loads(index_manifest.read_text())
    raw["tokenizer"]["name"] = DEFAULT_MODEL_NAMES[0]  # a tokenizer the report's samples can load
    index_manifest.write_text(json.dumps(raw))
    write_shards(tmp_path / "shards", tmp_path / "index", db, 12, rng, inline_entries=4)
    table = pa.parquet.read_table(tmp_path / "shards" / "files.parquet")
    monkeypatch.setattr(fileio, "whole", lambda *_, **__: pytest.fail("every entry read"))
    page = open(write_report(str(tmp_path))).read()
    size = sum(table["bytes"].to_pylist())
    filled = sum(table["neighbour_slots_filled"].to_pylist())
    assert "<td>12 (" in page and f"{filled:,} of " in page, (size, filled)


@pytest.mark.unit
def test_a_rejected_example_shows_what_its_reason_adds():
    from pipeline.check.html import rejected_body
    from pipeline.check.report_samples import RejectedReason

    near = {"source": "a.jsonl", "position": 3, "reason": "near_duplicate_of_evaluation", "excerpt": "Some text"}
    near.update(doc_id=7, jaccard=0.9312, evaluation_id="eval-1")
    plain = {"source": "b.jsonl", "position": 0, "reason": "empty_text", "excerpt": "{}"}
    body = rejected_body(
        [RejectedReason("near_duplicate_of_evaluation", 1, (near,)), RejectedReason("empty_text", 1, (plain,))]
    )
    assert "a.jsonl:3: [doc_id 7, jaccard 0.9312, evaluation_id eval-1] Some text" in body
    assert "b.jsonl:0: {}" in body
