"""The commit step runs on a worker, and runners retry a failed step: a commit run again after
dying at any point ends in the state of one uninterrupted commit."""

import json

import pytest
from apache_beam.io.filesystems import FileSystems
from pydantic import BaseModel

from pipeline.common import fileio
from pipeline.common.errors import StageError
from pipeline.jobs.commit import commit_directory, new_staging_dir, publish_rejected

pytestmark = pytest.mark.unit

FILES = ["chunks/chunks-00000.parquet", "chunks/chunks-00001.parquet", "faiss/index.faiss"]


def _stage(output, files=FILES):
    staging = new_staging_dir(str(output), "index")
    for path in files:
        target = output / ".staging" / staging.rsplit("/", 1)[1] / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(f"new {path}")
    return staging


def _tree(directory):
    return {p.relative_to(directory).as_posix(): p.read_text() for p in directory.rglob("*") if p.is_file()}


def _old_version(final):
    (final / "chunks").mkdir(parents=True)
    (final / "chunks" / "chunks-00000.parquet").write_text("old")
    (final / "chunks" / "chunks-00007.parquet").write_text("old, no longer listed")
    (final / "manifest.json").write_text(json.dumps({"version": "old"}))


def test_a_commit_replaces_the_old_version_and_writes_the_manifest_last(tmp_path):
    final = tmp_path / "index"
    _old_version(final)
    staging = _stage(tmp_path)
    commit_directory(staging, str(final), {"version": "new"}, FILES)
    assert _tree(final) == {
        **{p: f"new {p}" for p in FILES},
        "manifest.json": json.dumps({"version": "new"}, indent=2, sort_keys=True) + "\n",
    }
    assert not (tmp_path / ".staging").exists()


@pytest.mark.parametrize("moved_before_dying", [0, 1, 2, 3])
def test_a_commit_run_again_after_dying_half_way_ends_as_an_uninterrupted_one(tmp_path, moved_before_dying):
    reference, final = tmp_path / "reference", tmp_path / "retried"
    for root in (reference, final):
        _old_version(root / "index")
    commit_directory(_stage(reference), str(reference / "index"), {"version": "new"}, FILES)

    staging = _stage(final)
    rename = FileSystems.rename

    def die_after_some(sources, targets):
        rename(sources[:moved_before_dying], targets[:moved_before_dying])
        raise RuntimeError("worker lost")

    FileSystems.rename = die_after_some
    try:
        with pytest.raises(RuntimeError, match="worker lost"):
            commit_directory(staging, str(final / "index"), {"version": "new"}, FILES)
    finally:
        FileSystems.rename = rename
    assert not (final / "index" / "manifest.json").exists()  # never a manifest over mixed content
    commit_directory(staging, str(final / "index"), {"version": "new"}, FILES)  # the retry
    assert _tree(final / "index") == _tree(reference / "index")
    commit_directory(staging, str(final / "index"), {"version": "new"}, FILES)  # a retry after success
    assert _tree(final / "index") == _tree(reference / "index")


def test_a_listed_file_neither_staged_nor_in_place_fails_the_commit(tmp_path):
    staging = _stage(tmp_path, FILES[:2])
    with pytest.raises(FileNotFoundError, match=r"1 file\(s\) neither staged nor in place: \['faiss/index.faiss'\]"):
        commit_directory(staging, str(tmp_path / "index"), {"version": "new"}, FILES)
    assert not (tmp_path / "index" / "manifest.json").exists()


def test_rejected_records_are_published_once_whatever_the_retries(tmp_path):
    staging = _stage(tmp_path, ["_rejected/build-index.jsonl"])
    publish_rejected(staging, str(tmp_path))
    publish_rejected(staging, str(tmp_path))
    assert (tmp_path / "rejected" / "build-index.jsonl").read_text() == "new _rejected/build-index.jsonl"


def test_a_commit_retried_after_success_keeps_the_first_timings(tmp_path):
    staging = new_staging_dir(str(tmp_path), "index")
    first = {"version": "new", "timings": {"wall_seconds": 1.0}}
    commit_directory(staging, str(tmp_path / "index"), first, [])
    commit_directory(staging, str(tmp_path / "index"), {**first, "timings": {"wall_seconds": 2.0}}, [])
    assert json.loads((tmp_path / "index" / "manifest.json").read_text()) == first


def test_a_commit_built_on_a_manifest_that_another_job_replaced_commits_nothing(tmp_path):
    final = tmp_path / "index"
    _old_version(final)
    appended_to = fileio.sha256_bytes((final / "manifest.json").read_bytes())
    (final / "manifest.json").write_text(json.dumps({"version": "another job's"}))
    before = _tree(final)
    staging = _stage(tmp_path)
    with pytest.raises(StageError, match="changed while this job ran"):
        commit_directory(staging, str(final), {"version": "new"}, FILES, replace=("faiss",), replaces=appended_to)
    assert _tree(final) == before and not (tmp_path / ".staging").exists()
    # built on the manifest in place, the same commit goes through
    staging = _stage(tmp_path)
    in_place = fileio.sha256_bytes((final / "manifest.json").read_bytes())
    commit_directory(staging, str(final), {"version": "new"}, FILES, replace=("faiss",), replaces=in_place)
    assert json.loads((final / "manifest.json").read_text()) == {"version": "new"}


def test_a_job_whose_input_changed_while_it_ran_commits_nothing_but_a_retry_after_its_commit_passes(tmp_path):
    from types import SimpleNamespace

    from pipeline.jobs.commit import commit_stage
    from schemas.manifest import FileEntry

    class Written(BaseModel):  # a manifest as a job hands it to its commit
        version: str
        files: list[FileEntry]
        counters: dict[str, int] = {}
        file_table: None = None

    index = tmp_path / "index"
    _old_version(index)
    read_then = fileio.sha256_bytes((index / "manifest.json").read_bytes())
    clock = SimpleNamespace(stage="build-shards", timings=lambda counters: {"wall_seconds": 1.0})
    written = Written(version="shards", files=[FileEntry(path="shard-00000.arrow", rows=1, bytes=1, sha256="0")])

    def commit():
        staging = _stage(tmp_path, ["shard-00000.arrow"])
        commit_stage(
            written,
            staging=staging,
            output=str(tmp_path),
            final=str(tmp_path / "shards"),
            clock=clock,
            staged=["shard-00000.arrow"],
            reads=((str(index), read_then),),
        )

    (index / "manifest.json").write_text(json.dumps({"version": "a change"}))  # committed meanwhile
    with pytest.raises(StageError, match="changed while this job read it"):
        commit()
    assert not (tmp_path / "shards").exists() and not (tmp_path / ".staging").exists()

    (index / "manifest.json").write_text(json.dumps({"version": "old"}))  # as the job read it
    commit()
    assert json.loads((tmp_path / "shards" / "manifest.json").read_text())["version"] == "shards"
    (index / "manifest.json").write_text(json.dumps({"version": "a later change"}))
    commit()  # the runner retries a commit that had finished: it stands
    assert json.loads((tmp_path / "shards" / "manifest.json").read_text())["version"] == "shards"


class CountingFileSystems:
    """Every request the commit makes through Beam's FileSystems, counted per file (an exists,
    a read, a create, each path renamed or deleted) or per call (a listing)."""

    COUNTED = ("exists", "open", "create", "rename", "delete", "match", "mkdirs")

    def __init__(self, monkeypatch):
        self.requests = dict.fromkeys(self.COUNTED, 0)
        for name in self.COUNTED:
            monkeypatch.setattr(FileSystems, name, self._counted(name, getattr(FileSystems, name)))

    def _counted(self, name, call):
        def counted(first, *args, **kwargs):
            self.requests[name] += len(first) if name in ("rename", "delete") else 1
            return call(first, *args, **kwargs)

        return counted

    @property
    def total(self) -> int:
        return sum(self.requests.values())


def test_an_append_to_100000_files_costs_requests_for_what_changed_not_for_what_stayed(tmp_path, monkeypatch):
    final, kept = tmp_path / "index", [f"chunks/chunks-{i:06d}.parquet" for i in range(100_000)]
    (final / "chunks").mkdir(parents=True)
    (final / "faiss").mkdir()
    for path in kept:
        (final / path).touch()
    (final / "faiss" / "index.faiss").write_text("generation 0")
    (final / "manifest.json").write_text(json.dumps({"generation": 0}))
    appended = [f"chunks/chunks-{i:06d}.parquet" for i in range(100_000, 100_010)] + ["faiss/index.faiss"]
    staging = _stage(tmp_path, appended)
    counting = CountingFileSystems(monkeypatch)
    commit_directory(staging, str(final), {"generation": 1}, kept + appended, replace=("faiss",))
    assert (final / "faiss" / "index.faiss").read_text() == "new faiss/index.faiss"
    assert len(list((final / "chunks").iterdir())) == 100_010
    assert counting.requests["match"] <= 6, counting.requests  # listings, not one request per kept file
    assert counting.total < 20 * len(appended), counting.requests
