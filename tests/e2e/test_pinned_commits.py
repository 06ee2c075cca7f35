"""Readers pin a commit: validate, inspect, the trainer's dataset, the online Retriever and the
report each read one commit of a directory, the newest or the one named (`--commit N`), while
it is kept (keep_commits); shards are validated against the index commit they were built
from; a trainer resumes on the commit its data position counts in."""

import json

import pytest
from click.testing import CliRunner

from pipeline.build_index.job import build_index
from pipeline.build_shards.job import build_shards
from pipeline.check.problems import ValidationFailed
from pipeline.check.report import gather
from pipeline.check.validate import validate_path
from pipeline.cli import cli
from pipeline.retrieve.online import Retriever
from schemas.config import config_from_dict
from tests.helpers import sample_documents, small_config, write_jsonl
from trainer.dataset import ShardDataError, ShardDataset

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _manifest(directory, number):
    return json.loads((directory / f"manifest-{number:06d}.json").read_text())


def test_every_reader_reads_the_commit_it_names_while_it_is_kept(tmp_path):
    write_jsonl(tmp_path / "corpus" / "a.jsonl", sample_documents(8))
    out = tmp_path / "out"
    index, shards = out / "index", out / "shards"
    cfg = config_from_dict(small_config(out, str(tmp_path / "corpus" / "*.jsonl"), keep_commits=2))
    build_index(cfg, [])
    build_shards(cfg, [])
    write_jsonl(tmp_path / "corpus" / "b.jsonl", sample_documents(4, start=8))
    build_index(cfg, [])  # an append: index commit 2; the shards are still commit 1's, built from index commit 1
    chunks = [_manifest(index, n)["num_chunks"] for n in (1, 2)]
    assert chunks[0] < chunks[1]

    # validate: the shards against the index commit they were built from, while it is kept;
    # the output as a whole names the mismatch; an index commit by number
    (line,) = validate_path(str(shards))
    assert line.startswith("OK shards")
    with pytest.raises(ValidationFailed, match="built against a different index") as failed:
        validate_path(str(out))
    added = f"{chunks[1] - chunks[0]:,} chunks added, 0 documents deleted"
    assert f"its generation 0, which has changed since (generation 1: {added}); run build-shards" in str(failed.value)
    (line,) = validate_path(str(index), commits={str(index): 1})
    assert line.startswith(f"OK index {index}: {chunks[0]} chunks")
    (line,) = validate_path(str(index))
    assert line.startswith(f"OK index {index}: {chunks[1]} chunks")
    runner = CliRunner()
    result = runner.invoke(cli, ["validate", str(index), "--commit", "1"])
    assert result.exit_code == 0 and f"{chunks[0]} chunks" in result.output
    result = runner.invoke(cli, ["validate", str(index), "--commit", "7"])
    assert result.exit_code != 0 and "no commit 7 (commits kept: 1, 2)" in result.output
    result = runner.invoke(cli, ["validate", str(out), "--commit", "1"])  # two directories: which?
    assert result.exit_code != 0 and "no commits here (an output's are in its index/ and shards/)" in result.output

    # the online Retriever: the newest commit, or the one named, whose chunks it looks up
    assert Retriever.open(str(index)).manifest.num_chunks == chunks[1]
    pinned = Retriever.open(str(index), commit=1)
    assert pinned.manifest.num_chunks == chunks[0]
    assert pinned.chunk_files.num_chunks == chunks[0]

    build_shards(cfg, [])  # shards commit 2, over index commit 2
    sequences = [_manifest(shards, n)["num_sequences"] for n in (1, 2)]
    assert sequences[0] < sequences[1]
    assert all(line.startswith("OK") for line in validate_path(str(out)))
    result = runner.invoke(cli, ["validate", str(shards), "--commit", "1"])  # against index commit 1
    assert result.exit_code == 0 and f"{sequences[0]} sequences" in result.output, result.output
    result = runner.invoke(cli, ["inspect", str(shards), "--commit", "1"])
    assert result.exit_code == 0 and f"{sequences[0]} sequences" in result.output

    # the trainer's dataset: pinned at construction; a state resumes only on its own commit
    old, new = ShardDataset(str(shards), commit=1), ShardDataset(str(shards))
    assert (old.commit, len(old)) == (1, sequences[0]) and (new.commit, len(new)) == (2, sequences[1])
    old.advance(1)
    again = ShardDataset(str(shards), commit=1)
    again.load_state_dict(old.state_dict())
    assert again.position == 1
    with pytest.raises(ValueError, match="commit"):
        new.load_state_dict({**new.state_dict(), "commit": 1})
    with pytest.raises(ShardDataError, match="no commit 5"):
        ShardDataset(str(shards), commit=5)

    # the report reads each directory's current commit, found once
    report = gather(str(out))
    assert (report.index.num_chunks, report.shards.num_sequences) == (chunks[1], sequences[1])
