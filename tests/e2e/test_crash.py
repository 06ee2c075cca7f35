"""A run killed with SIGKILL at any point leaves no directory whose manifest exists over
incomplete content, and the next run finishes the work with the bytes of an uninterrupted run."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.check.validate import validate_index, validate_shards
from pipeline.cli import main
from pipeline.common.fileio import committed
from pipeline.run import run_all
from schemas.config import config_from_dict
from schemas.manifest import IndexManifest, ShardsManifest
from tests.helpers import BAD_RECORDS, sample_documents, small_config, write_config, write_jsonl

pytestmark = pytest.mark.e2e

CLI = str(Path(sys.executable).parent / "ratrain-pipeline")


def _staged(out: Path, stage: str, suffix: str) -> bool:
    return any((out / ".staging").glob(f"{stage}-*/**/*{suffix}"))


KILL_POINTS = {  # when to kill: a condition on the output directory, polled
    "chunks staged": lambda out: _staged(out, "index", ".parquet"),
    "index committed": lambda out: (out / "index" / "manifest.json").exists(),
    "shards staged": lambda out: _staged(out, "shards", ".arrow"),
}
KILL_POINT_STAGE = {"chunks staged": "index", "index committed": "index", "shards staged": "shards"}


def _run_until(config: Path, out: Path, condition) -> bool:
    """Start `run`; SIGKILL its process group once `condition(out)` holds. False if the run
    ended first (the condition never held while it ran)."""
    process = subprocess.Popen(
        [CLI, "run", "--config", str(config)],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        while process.poll() is None:
            if condition(out):
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                return True
            time.sleep(0.01)  # polling a condition, not timing anything
        return False
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)


def _data_files(out: Path) -> dict:
    return {
        p.relative_to(out): p.read_bytes()
        for p in out.rglob("*")
        if p.is_file() and p.suffix in (".parquet", ".faiss", ".arrow")
    }


# Kill points inside a commit, too short to hit by polling: the run kills itself there.
# "moving files" (before the put): half of the stage's files have been moved into place;
# "manifest unwritten" (after the put): the commit's manifest is put, its manifest.json copy
# not yet renamed into place; "cleaning up": what only the previous commit lists is deleted,
# the previous commit's manifest not yet.
COMMIT_KILLER = """
import os, signal, sys
from apache_beam.io.filesystems import FileSystems
from pipeline.cli import main

final, point = sys.argv[1].rstrip("/") + "/", sys.argv[2]
rename, delete = FileSystems.rename, FileSystems.delete

def rename_then_die(sources, targets, *args, **kwargs):
    if point == "moving files" and len(targets) > 1 and targets[0].startswith(final):
        rename(sources[:len(sources) // 2], targets[:len(targets) // 2], *args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)
    if point == "manifest unwritten" and targets == [final + "manifest.json"]:
        os.kill(os.getpid(), signal.SIGKILL)
    return rename(sources, targets, *args, **kwargs)

def delete_then_die(paths, *args, **kwargs):
    if point == "cleaning up" and paths == [final + "manifest-000001.json"]:
        os.kill(os.getpid(), signal.SIGKILL)
    return delete(paths, *args, **kwargs)

FileSystems.rename, FileSystems.delete = rename_then_die, delete_then_die
sys.exit(main(sys.argv[3:]))
"""
COMMIT_POINTS = [(stage, point) for stage in ("index", "shards") for point in ("moving files", "manifest unwritten")]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[Path, dict]:
    """An uninterrupted run's output (index and shards, committed) and config: seven short real
    documents (~120 chunks, two shards, so a commit moves more than one file; the first one's id
    is the one a bad record takes again) plus one bad record of each kind (under the
    max_rejected_fraction); the bytes every interrupted run's rerun must end with."""
    root = tmp_path_factory.mktemp("uninterrupted")
    docs = sample_documents(1) + sample_documents(6, start=7)
    write_jsonl(root / "corpus" / "a.jsonl", docs[:4])
    write_jsonl(root / "corpus" / "b.jsonl", docs[4:] + BAD_RECORDS)
    config = small_config(root / "out", str(root / "corpus" / "*.jsonl"))
    run_all(config_from_dict(config), [])
    return root / "out", config


def _hostile_run_config(tmp_path: Path, stage: str, uninterrupted: tuple[Path, dict]) -> tuple[Path, Path]:
    """The config of a run over the uninterrupted run's corpus (its config but the output) and
    the run's output directory. A run to be killed in build-shards starts where a run that had
    committed the index stands (the uninterrupted output but its shards), so it builds only the
    shards; a run to be killed in build-index starts from nothing."""
    done, config = uninterrupted
    out = tmp_path / "out"
    if stage == "shards":
        shutil.copytree(done, out, ignore=lambda directory, names: ["shards"] if Path(directory) == done else [])
    return write_config(tmp_path / "c.yaml", {**config, "output": str(out)}), out


def _nothing_half_committed_and_rerun_matches(config: Path, out: Path, uninterrupted: Path, stage: str) -> None:
    if (out / "index" / "manifest.json").exists():  # whatever claims to be committed is whole
        validate_index(str(out / "index"))
    if (out / "shards" / "manifest.json").exists():
        validate_shards(str(out / "shards"))
    main(["run", "--config", str(config)])  # the rerun in this process: only the killed run needs its own
    assert _data_files(out) == _data_files(uninterrupted)
    assert not (out / ".staging").exists()
    assert not list(out.rglob("*.tmp-*"))
    if stage == "shards":  # a run killed in build-shards left the committed index as it was
        assert (out / "index" / "manifest.json").read_bytes() == (
            uninterrupted / "index" / "manifest.json"
        ).read_bytes()


@pytest.mark.parametrize("point", list(KILL_POINTS))
def test_killed_run_leaves_nothing_half_committed_and_a_rerun_finishes_it(point, uninterrupted, tmp_path):
    config, out = _hostile_run_config(tmp_path, KILL_POINT_STAGE[point], uninterrupted)
    assert _run_until(config, out, KILL_POINTS[point]), f"the run finished before '{point}'"
    _nothing_half_committed_and_rerun_matches(config, out, uninterrupted[0], KILL_POINT_STAGE[point])


# the index commit points take 30-45 s each (slow); the shards ones ~10 s
@pytest.mark.parametrize(
    "stage,point",
    [
        pytest.param(stage, point, marks=pytest.mark.slow) if stage == "index" else (stage, point)
        for stage, point in COMMIT_POINTS
    ],
)
def test_run_killed_inside_a_commit_is_finished_by_the_next_run(stage, point, uninterrupted, tmp_path):
    config, out = _hostile_run_config(tmp_path, stage, uninterrupted)
    killed = subprocess.run(
        [sys.executable, "-c", COMMIT_KILLER, str(out / stage), point, "run", "--config", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    assert killed.returncode == -signal.SIGKILL, f"the run was not killed {point} of {stage}"
    assert not (out / stage / "manifest.json").exists()
    _nothing_half_committed_and_rerun_matches(config, out, uninterrupted[0], stage)


@pytest.fixture(scope="module")
def first_index(tmp_path_factory) -> tuple[Path, Path, dict]:
    """An index of eight documents, committed, its corpus directory and its config: what each
    append below starts from (the index copied; the corpus stays where it was read, and each
    case adds its new file there and takes it away after)."""
    root = tmp_path_factory.mktemp("first-index")
    write_jsonl(root / "corpus" / "a.jsonl", sample_documents(8))
    first = small_config(root / "out", str(root / "corpus" / "*.jsonl"))
    main(["build-index", "--config", str(write_config(root / "a.yaml", first))])
    return root / "out", root / "corpus", first


@pytest.mark.parametrize("point", ["moving files", "manifest unwritten", "cleaning up"])
def test_an_append_killed_inside_its_commit_leaves_a_whole_commit_and_its_rerun_embeds_only_the_new_files(
    point, first_index, tmp_path
):
    """Before the put the index is the first build, whole; after it, the append, whole; the
    rerun appends (or finishes) rather than rebuilding: its last generation holds only the new
    file's documents."""
    built, corpus, first = first_index
    out = tmp_path / "out"
    shutil.copytree(built, out)
    config = write_config(tmp_path / "c.yaml", {**first, "output": str(out)})
    added = sample_documents(4, start=8)
    write_jsonl(corpus / "b.jsonl", added)
    try:
        killed = subprocess.run(
            [sys.executable, "-c", COMMIT_KILLER, str(out / "index"), point, "build-index", "--config", str(config)],
            capture_output=True,
        )
        assert killed.returncode == -signal.SIGKILL, f"the append was not killed {point}"
        validate_index(str(out / "index"))  # the commit a reader finds now is whole (else ValidationFailed)
        generations = len(committed(str(out / "index"), IndexManifest).generations)  # type: ignore[union-attr]
        assert generations == (1 if point == "moving files" else 2)
        main(["build-index", "--config", str(config)])
    finally:
        (corpus / "b.jsonl").unlink()
    index = committed(str(out / "index"), IndexManifest)
    assert index is not None and [g.number for g in index.generations] == [0, 1]
    assert index.generations[1].num_documents == len(added) and index.num_documents == 8 + len(added)
    validate_index(str(out / "index"))
    assert not (out / ".staging").exists() and len(list((out / "index").glob("manifest-*.json"))) == 1


@pytest.fixture(scope="module")
def first_shards(tmp_path_factory) -> tuple[Path, dict]:
    """An output of eight documents, index and shards committed, and its config: what each
    rebuild below starts from (copied; the corpus stays where it was read)."""
    root = tmp_path_factory.mktemp("first-shards")
    write_jsonl(root / "corpus" / "a.jsonl", sample_documents(8))
    first = small_config(root / "out", str(root / "corpus" / "*.jsonl"))
    main(["run", "--config", str(write_config(root / "a.yaml", first))])
    return root / "out", first


@pytest.mark.parametrize("point", ["moving files", "manifest unwritten", "cleaning up"])
def test_a_shards_rebuild_killed_inside_its_commit_leaves_whole_shards(point, first_shards, tmp_path):
    """Shards rebuilt over committed ones (another neighbour count): killed before the put, the
    first shards are whole; after it or while cleaning up, the rebuilt ones; the rerun ends
    with the rebuilt ones and one commit."""
    built, first = first_shards
    out = tmp_path / "out"
    shutil.copytree(built, out)
    rebuilt = write_config(tmp_path / "b.yaml", {**first, "output": str(out), "neighbours": 1})
    killed = subprocess.run(
        [sys.executable, "-c", COMMIT_KILLER, str(out / "shards"), point, "build-shards", "--config", str(rebuilt)],
        capture_output=True,
    )
    assert killed.returncode == -signal.SIGKILL, f"the rebuild was not killed {point}"
    validate_shards(str(out / "shards"))  # the commit a reader finds now is whole (else ValidationFailed)
    current = committed(str(out / "shards"), ShardsManifest)
    assert current is not None and current.neighbours == (2 if point == "moving files" else 1)
    main(["run", "--config", str(rebuilt)])
    assert committed(str(out / "shards"), ShardsManifest).neighbours == 1  # type: ignore[union-attr]
    validate_shards(str(out / "shards"))
    assert [p.name for p in (out / "shards").glob("manifest-*.json")] == ["manifest-000002.json"]
    assert not (out / ".staging").exists()
