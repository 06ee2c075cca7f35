"""A training corpus blended from three real sources of different kinds (Python documentation
sections, standard-library docstrings, this project's README) at weights 0.6 / 0.3 / 0.1: the
token shares got, the repeats of the source upsampled, the source column as other readers see
it, decontamination of every source, and the same bytes on a re-run and on the multi-process
runner."""

from __future__ import annotations

import json
import shutil
from collections import Counter

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pytest
import torch
from apache_beam.testing.util import assert_that, equal_to

from pipeline.build_shards.job import build_shards
from pipeline.check.html import render
from pipeline.check.inspect import inspect_shards
from pipeline.check.plan import plan_validation
from pipeline.check.problems import ValidationFailed
from pipeline.check.report import gather
from pipeline.check.validate import validate_path
from pipeline.check.validate_beam import ValidateOutput
from pipeline.common import fileio
from schemas.arrow import read_shard_table, shard_column, shard_sources
from schemas.config import config_from_dict
from schemas.evaluation import read_evaluation
from schemas.manifest import ShardsManifest
from tests.helpers import (
    REPO,
    assert_same_data_files,
    current_manifest,
    local_pipeline,
    read_rejected,
    rewrite_manifest,
    rewrite_shard,
    sample_documents,
    stdlib_docstrings,
    write_jsonl,
)
from tests.trainer_fixtures import write_checkpoint
from trainer.checkpoint import rank_states
from trainer.dataset import ShardDataError, ShardDataset
from trainer.evaluate import main as eval_main
from trainer.train import main as train_main

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

WEIGHTS = {"pydocs": 0.6, "docstrings": 0.3, "readme": 0.1}
MULTI_PROCESS = ["--direct_num_workers=2", "--direct_running_mode=multi_processing"]


@pytest.fixture(scope="module")
def blended(built_output, tmp_path_factory):
    """(config, output) of build-shards over the built index with the three sources, an
    evaluation corpus holding one document of each of the first two."""
    root, config, _ = built_output
    tmp = tmp_path_factory.mktemp("blend")
    pydocs, docstrings = sample_documents(40, start=16), stdlib_docstrings()
    write_jsonl(tmp / "pydocs" / "docs.jsonl", pydocs)
    write_jsonl(tmp / "docstrings" / "docs.jsonl", docstrings)
    (tmp / "readme").mkdir()
    # its first 8,000 characters: about half what the blend takes of it, so it is repeated
    (tmp / "readme" / "README.md").write_text((REPO / "README.md").read_text()[:8000])
    write_jsonl(tmp / "evaluation" / "eval.jsonl", [{**pydocs[3], "id": "eval-0"}, {**docstrings[5], "id": "eval-1"}])
    blend = {
        **config,
        "output": str(tmp / "out"),
        "training_corpus": [
            {"name": "pydocs", "paths": [str(tmp / "pydocs" / "*.jsonl")], "id_field": "id", "weight": 0.6},
            {"name": "docstrings", "paths": [str(tmp / "docstrings" / "*.jsonl")], "id_field": "id", "weight": 0.3},
            {"name": "readme", "paths": [str(tmp / "readme" / "*.md")], "format": "text", "weight": 0.1, "repeat": 4},
        ],
        "evaluation_corpus": {"paths": [str(tmp / "evaluation" / "*.jsonl")], "id_field": "id"},
        "decontamination": {"apply_to": ["training"]},
    }
    shutil.copytree(root / "out" / "index", tmp / "out" / "index")
    build_shards(config_from_dict(blend), [])
    return blend, tmp / "out"


def _tables(out):
    manifest = fileio.committed_manifest(str(out / "shards"), ShardsManifest)
    return manifest, [read_shard_table(pa.memory_map(str(out / "shards" / e.path))) for e in manifest.shards]


def test_each_source_gets_its_share_of_tokens_counted_in_the_shards(blended):
    config, out = blended
    manifest, tables = _tables(out)
    assert manifest.training_corpus == "blend"
    assert [s.name for s in manifest.sources] == list(WEIGHTS)
    by_name = {s.name: s for s in manifest.sources}
    for name, weight in WEIGHTS.items():
        assert by_name[name].weight == pytest.approx(weight)
        assert abs(by_name[name].share - weight) <= 0.01, (name, by_name[name].share)
    # the README is upsampled (its repeats counted), a larger source subsampled
    readme = by_name["readme"]
    assert readme.repeats > 0 and readme.sequences > readme.sequences_available
    assert any(s.repeats == 0 and s.sequences < s.sequences_available for s in manifest.sources)
    for s in manifest.sources:  # every sequence is in a row, left out, or repeated
        assert s.sequences_available - s.left_out + s.repeats == s.sequences and (s.left_out == 0 or s.repeats == 0)
    # what the manifest says, counted again from the shards' rows
    rows, tokens = Counter(), Counter()
    for table in tables:
        names, sources = shard_sources(table)
        assert names == tuple(WEIGHTS)  # every shard's dictionary whole, in the config's order
        real = (shard_column(table, "tokens")[:, :-1] != manifest.pad_id).sum(axis=1)
        for source, count in zip(sources.tolist(), real.tolist()):
            rows[names[source]] += 1
            tokens[names[source]] += count
    assert rows == {s.name: s.sequences for s in manifest.sources}
    assert tokens == {s.name: s.tokens for s in manifest.sources}
    assert manifest.num_sequences == sum(rows.values())
    # the sources are interleaved: every shard but the last holds rows of at least two
    assert all(len(set(shard_sources(t)[1].tolist())) >= 2 for t in tables[:-1])
    assert all(line.startswith("OK") for line in validate_path(str(out / "shards")))


def test_decontamination_applies_to_every_source(blended):
    _, out = blended
    manifest, _ = _tables(out)
    removed = [r for r in read_rejected(out, "build-shards") if r["reason"] == "near_duplicate_of_evaluation"]
    assert sorted(r["source"].split("/")[-2] for r in removed) == ["docstrings", "pydocs"]
    documents = {s.name: s.documents for s in manifest.sources}
    assert documents == {"pydocs": 39, "docstrings": len(stdlib_docstrings()) - 1, "readme": 1}


def test_hugging_face_datasets_and_polars_read_the_source_column(blended, tmp_path):
    datasets = pytest.importorskip("datasets")
    polars = pytest.importorskip("polars")
    _, out = blended
    manifest, _ = _tables(out)
    paths = [str(out / "shards" / e.path) for e in manifest.shards]
    expected = {s.name: s.sequences for s in manifest.sources}
    loaded = datasets.load_dataset("arrow", data_files=paths, split="train", cache_dir=str(tmp_path))
    assert Counter(loaded["source"]) == expected
    frame = polars.concat([polars.read_ipc(path) for path in paths])
    counts = frame.group_by(polars.col("source").cast(polars.String)).len()
    assert dict(zip(counts["source"].to_list(), counts["len"].to_list())) == expected


def test_a_rerun_on_the_multi_process_runner_writes_the_same_bytes(blended, tmp_path):
    """build-shards again, in other processes (the local runner's worker processes): the same
    shards and the same sources in the manifest."""
    config, out = blended
    shutil.copytree(out / "index", tmp_path / "multi" / "index")
    build_shards(config_from_dict({**config, "output": str(tmp_path / "multi")}), MULTI_PROCESS)
    assert_same_data_files(tmp_path / "multi", out, stages=("shards",))
    again = json.loads((tmp_path / "multi" / "shards" / "manifest.json").read_text())
    assert again["sources"] == json.loads((out / "shards" / "manifest.json").read_text())["sources"]


def test_validate_finds_a_row_counted_under_another_source(blended, tmp_path):
    """A row moved to another source, the shard re-signed: its manifest entry's rows per source
    no longer match (in process and in the Beam job); with the entry made to match too, the
    per-source totals no longer match the manifest's sources."""
    _, out = blended
    shards = tmp_path / "out" / "shards"
    shutil.copytree(out, tmp_path / "out")

    def move(columns):
        columns["source"][0] = (columns["source"][0] + 1) % len(WEIGHTS)

    rewrite_shard(shards, move)
    with pytest.raises(ValidationFailed, match=r"shard-00000.arrow: \[[\d, ]+\] rows per source, manifest says"):
        validate_path(str(shards))
    # a reader selecting sources refuses the shard too (or skips it, when told to)
    with pytest.raises(ShardDataError, match=r"shard-00000.arrow: \[[\d, ]+\] rows per source, the manifest says"):
        list(ShardDataset(shards, sources=list(WEIGHTS), shuffle=False))
    with pytest.warns(UserWarning, match="skipping a bad shard"):
        rows = sum(1 for _ in ShardDataset(shards, sources=list(WEIGHTS), shuffle=False, skip_bad_shards=True))
    assert rows == len(ShardDataset(shards)) - json.loads(current_manifest(shards).read_text())["shards"][0]["rows"]
    with local_pipeline() as pipeline:
        verdict = pipeline | ValidateOutput.of(plan_validation(str(shards))) | beam.Map(lambda v: v.passed)
        assert_that(verdict, equal_to([False]))
    manifest = json.loads(current_manifest(shards).read_text())
    table = read_shard_table(pa.memory_map(str(shards / manifest["shards"][0]["path"])))
    manifest["shards"][0]["source_rows"] = np.bincount(shard_sources(table)[1], minlength=len(WEIGHTS)).tolist()
    rewrite_manifest(shards, json.dumps(manifest))
    with pytest.raises(ValidationFailed, match=r"source \w+ has \d+ rows and \d+ tokens in the shards, manifest says"):
        validate_path(str(shards))


def test_inspect_and_the_report_show_each_source(blended):
    _, out = blended
    manifest, _ = _tables(out)
    lines = inspect_shards(str(out / "shards"), 3)
    assert [line for line in lines if line.startswith("source ")] == [f"source {s.summary()}" for s in manifest.sources]
    headers = [line for line in lines if line.startswith("== sequence")]
    assert len(headers) == 3 and all(any(f"(source {name}, " in h for name in WEIGHTS) for h in headers)
    page = render(gather(str(out)))
    section = page[page.index('<section id="sources">') : page.index("</section>", page.index('id="sources"'))]
    assert all(f"<td>{name}</td>" in section for name in WEIGHTS) and "<img alt=" in section


def test_a_dataset_reads_the_sources_it_selects_or_weights(blended):
    _, out = blended
    manifest, tables = _tables(out)
    names = [s.name for s in manifest.sources]
    rows = {s.name: s.sequences for s in manifest.sources}
    seq_ids = {name: set() for name in names}  # each source's rows, by seq id
    for table in tables:
        for seq_id, source in zip(table["seq_id"].to_pylist(), shard_sources(table)[1].tolist()):
            seq_ids[names[source]].add(seq_id)

    def read(**selection) -> tuple[Counter, dict]:
        counts, seen = Counter(), {name: set() for name in names}
        for batch in ShardDataset(out / "shards", batch_size=16, batched=True, seed=3, **selection):
            for seq_id, source in zip(batch["seq_id"].tolist(), batch["source"].tolist()):
                counts[names[source]] += 1
                seen[names[source]].add(seq_id)
        return counts, seen

    assert read()[0] == rows
    selected, seen = read(sources=["readme"])
    assert selected == {"readme": rows["readme"]} and seen["readme"] == seq_ids["readme"]
    half = round((rows["pydocs"] + rows["readme"]) / 2)
    weighted, seen = read(sources={"pydocs": 1, "readme": 1})
    assert weighted == {"pydocs": half, "readme": half}  # the README's rows repeated, pydocs' subsampled
    assert seen["readme"] == seq_ids["readme"] and seen["pydocs"] < seq_ids["pydocs"]
    with pytest.raises(ShardDataError, match="no source 'books' in the shards"):
        ShardDataset(out / "shards", sources=["books"])
    # a resume reads the rows its state counted: another selection, or none, is refused
    state = ShardDataset(out / "shards", sources=["readme"]).state_dict()
    for other in (None, ["pydocs"], {"readme": 1}):
        with pytest.raises(ValueError, match="cannot resume: state read sources"):
            ShardDataset(out / "shards", sources=other).load_state_dict(state)


def test_ratrain_eval_scores_each_source_on_its_own(blended, tmp_path, capsys):
    _, out = blended
    manifest, _ = _tables(out)
    tiny = {"dim": 16, "depth": 2, "heads": 2, "encoder_depth": 1, "cca_layers": (1,)}
    checkpoint = write_checkpoint(
        tmp_path / "ckpt.pt", vocab_size=30522, sequence_tokens=128, chunk_tokens=32, pad_id=manifest.pad_id, **tiny
    )
    scores = tmp_path / "eval.json"
    eval_main(["--checkpoint", str(checkpoint), "--shards", str(out / "shards"), "--json", str(scores)])
    evaluation = read_evaluation(scores.read_text())
    rows = json.loads(scores.read_text())["sources"]
    assert [row["name"] for row in rows] == list(WEIGHTS)
    assert [s.sequences for s in evaluation.sources] == [s.sequences for s in manifest.sources]
    # each source's targets are its rows' tokens but the first; together, all of them
    for source, share in zip(evaluation.sources, manifest.sources):
        assert source.with_neighbours.all.tokens == share.tokens - share.sequences + _last_targets(out, source.name)
        assert source.blanked is not None and source.blanked.all.mean_loss is not None
    assert sum(s.with_neighbours.all.tokens for s in evaluation.sources) == evaluation.with_neighbours.all.tokens
    printed = capsys.readouterr().out
    assert all(f"source {name}: " in printed for name in WEIGHTS)


def _last_targets(out, name: str) -> int:
    """The rows of source `name` whose target token (the n+1-th, past the input tokens) is not padding."""
    manifest, tables = _tables(out)
    count = 0
    for table in tables:
        names, sources = shard_sources(table)
        tokens = shard_column(table, "tokens")[sources == names.index(name)]
        count += int((tokens[:, -1] != manifest.pad_id).sum())
    return count


def test_ratrain_train_reads_the_sources_it_is_given(blended, tmp_path):
    _, out = blended
    tiny = ["--vocab-size", "30522", "--dim", "16", "--depth", "2", "--heads", "2", "--encoder-depth", "1"]
    common = ["--shards", str(out / "shards"), "--steps", "2", "--batch-size", "4", *tiny]
    train_main([*common, "--sources", "readme=1,docstrings=3", "--checkpoint", str(tmp_path / "ckpt.pt")])
    state = rank_states(torch.load(tmp_path / "ckpt.pt", weights_only=True))[0]["dataset"]
    assert state["sources"] == {"readme": 1.0, "docstrings": 3.0} and state["position"] == 8
    with pytest.raises(SystemExit, match="ratrain-train: error: .*no source 'books' in the shards"):
        train_main([*common, "--sources", "books"])
