"""The commit step runs on a worker, and runners retry a failed step: a commit run again after
dying at any point ends in the state of one uninterrupted commit, and until its manifest is put
readers see the previous commit whole."""

import hashlib
import json
import tracemalloc
from types import SimpleNamespace

import pyarrow as pa
import pytest
from apache_beam.io.filesystems import FileSystems
from pydantic import BaseModel

from pipeline.common import fileio
from pipeline.common.errors import StageError
from pipeline.jobs import commits
from pipeline.jobs.commit import commit_directory, commit_stage, new_staging_dir, publish_rejected
from pipeline.jobs.entry_pieces import PIECE_NUMBERS, PIECES_DIR, piece_name, write_piece
from schemas.arrow import SCHEMA_VERSION
from schemas.manifest import FileEntry, FileTable, versioned
from schemas.table_writer import TableWriter

pytestmark = pytest.mark.unit

FILES = ["chunks/chunks-00000.parquet", "chunks/chunks-00001.parquet", "faiss/index.faiss"]


class Written(BaseModel):  # a manifest as a job hands it to its commit
    schema_version: int = SCHEMA_VERSION
    version: str
    files: list[FileEntry]
    counters: dict[str, int] = {}
    file_table: FileTable | None = None
    timings: dict | None = None


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _stage(output, files=FILES, version="new"):
    staging = new_staging_dir(str(output), "index")
    for path in files:
        target = output / ".staging" / staging.rsplit("/", 1)[1] / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(f"{version} {path}")
    return staging


def _written(files=FILES, version="new") -> Written:
    return Written(
        version=version, files=[FileEntry(path=p, rows=1, bytes=1, sha256=_sha(f"{version} {p}")) for p in files]
    )


CLOCK = SimpleNamespace(stage="build-index", timings=lambda counters: {"wall_seconds": 1.0})


def _commit(output, staging, written=None, **kwargs):
    commit_stage(
        written or _written(),
        staging=staging,
        output=str(output),
        final=str(output / "index"),
        clock=CLOCK,
        staged=[e.path for e in (written or _written()).files],
        **kwargs,
    )


def _tree(directory):
    return {p.relative_to(directory).as_posix(): p.read_text() for p in directory.rglob("*") if p.is_file()}


def _readable(final) -> dict:
    """What a reader sees: the current commit's manifest, and each file it lists, checked."""
    path, data = fileio.current_manifest(str(final))
    manifest = Written.model_validate_json(data)
    for entry in manifest.files:
        assert _sha((final / entry.path).read_text()) == entry.sha256, f"{entry.path} is not what {path} lists"
    return {e.path: (final / e.path).read_text() for e in manifest.files}


def test_a_commit_moves_the_files_puts_its_manifest_once_and_copies_it(tmp_path):
    _commit(tmp_path, _stage(tmp_path))
    final = tmp_path / "index"
    assert _readable(final) == {p: f"new {p}" for p in FILES}
    assert (final / "manifest.json").read_bytes() == (final / "manifest-000001.json").read_bytes()
    assert json.loads((final / "manifest.json").read_text())["timings"]["job"].startswith("index-")
    assert not (tmp_path / ".staging").exists()


@pytest.mark.parametrize("moved_before_dying", [0, 1, 2, 3])
def test_a_second_commit_dying_before_its_put_leaves_the_first_whole_and_a_retry_finishes_it(
    tmp_path, moved_before_dying
):
    _commit(tmp_path, _stage(tmp_path, version="old"), _written(version="old"))
    final = tmp_path / "index"
    first = _readable(final)
    second = _written(FILES[1:])  # chunks-00000 gone, the others rewritten
    staging = _stage(tmp_path, FILES[1:])
    rename = FileSystems.rename

    def die_after_some(sources, targets):
        rename(sources[:moved_before_dying], targets[:moved_before_dying])
        raise RuntimeError("worker lost")

    FileSystems.rename = die_after_some
    try:
        with pytest.raises(RuntimeError, match="worker lost"):
            _commit(tmp_path, staging, second)
    finally:
        FileSystems.rename = rename
    assert _readable(final) == first  # the first commit, whole, until the second's put
    _commit(tmp_path, staging, second)  # the retry
    assert _readable(final) == {  # rewritten files take the commit's number: the first commit's stay
        "chunks/chunks-00001.c000002.parquet": "new chunks/chunks-00001.parquet",
        "faiss/index.c000002.faiss": "new faiss/index.faiss",
    }
    assert sorted(p.name for p in final.iterdir()) == ["chunks", "faiss", "manifest-000002.json", "manifest.json"]
    assert sorted(_tree(final)) == [
        "chunks/chunks-00001.c000002.parquet",
        "faiss/index.c000002.faiss",
        "manifest-000002.json",
        "manifest.json",
    ]  # what only the first commit listed is gone once the second is complete


def test_a_commit_dying_after_its_put_is_finished_by_a_retry_or_by_the_next_job(tmp_path):
    _commit(tmp_path, _stage(tmp_path, version="old"), _written(version="old"))
    final = tmp_path / "index"
    finish = commits.finish
    commits.finish = lambda *args, **kwargs: (_ for _ in ()).throw(RuntimeError("worker lost"))
    try:
        with pytest.raises(RuntimeError, match="worker lost"):
            _commit(tmp_path, _stage(tmp_path))
    finally:
        commits.finish = finish
    assert set(_readable(final).values()) == {f"new {p}" for p in FILES}  # the new commit, whole
    assert json.loads((final / "manifest.json").read_text())["version"] == "old"  # its copy not yet made
    commits.finish(str(final), Written)  # what the next job on the directory does first
    assert json.loads((final / "manifest.json").read_text())["version"] == "new"
    assert not (final / "manifest-000001.json").exists() and not (final / "chunks" / "chunks-00000.parquet").exists()


def test_a_listed_file_neither_staged_nor_in_place_fails_the_commit(tmp_path):
    staging = _stage(tmp_path, FILES[:2])
    with pytest.raises(FileNotFoundError, match=r"1 file\(s\) neither staged nor in place: \['faiss/index.faiss'\]"):
        _commit(tmp_path, staging)
    assert fileio.current_manifest(str(tmp_path / "index")) is None


def test_rejected_records_are_published_once_whatever_the_retries(tmp_path):
    staging = _stage(tmp_path, ["_rejected/build-index.jsonl"])
    publish_rejected(staging, str(tmp_path))
    publish_rejected(staging, str(tmp_path))
    assert (tmp_path / "rejected" / "build-index.jsonl").read_text() == "new _rejected/build-index.jsonl"


def test_a_commit_retried_after_success_keeps_the_first_timings(tmp_path):
    staging = _stage(tmp_path)
    _commit(tmp_path, staging)
    first = (tmp_path / "index" / "manifest.json").read_bytes()
    _commit(tmp_path, staging)  # the runner retries a commit step that had finished
    assert (tmp_path / "index" / "manifest.json").read_bytes() == first
    assert fileio.commits(str(tmp_path / "index"))[-1][0] == 1


def test_a_commit_built_on_a_manifest_that_another_job_replaced_commits_nothing(tmp_path):
    _commit(tmp_path, _stage(tmp_path, version="old"), _written(version="old"))
    final = tmp_path / "index"
    appended_to = fileio.sha256_bytes((final / "manifest.json").read_bytes())
    _commit(tmp_path, _stage(tmp_path, version="another job's"), _written(version="another job's"))
    before = _tree(final)
    with pytest.raises(StageError, match="changed while this job ran"):
        _commit(tmp_path, _stage(tmp_path), replaces=appended_to)
    assert _tree(final) == before and not (tmp_path / ".staging").exists()
    in_place = fileio.manifest_sha256(str(final))  # built on the manifest in place, the same commit goes through
    _commit(tmp_path, _stage(tmp_path), replaces=in_place)
    assert json.loads((final / "manifest.json").read_text())["version"] == "new"


def test_a_job_whose_input_changed_while_it_ran_commits_nothing_but_a_retry_after_its_commit_passes(tmp_path):
    index = tmp_path / "index"
    _commit(tmp_path, _stage(tmp_path, version="old"), _written(version="old"))
    read_then = fileio.manifest_sha256(str(index))
    shards = _written(["shard-00000.arrow"], version="shards")

    def commit(staging):
        commit_stage(
            shards,
            staging=staging,
            output=str(tmp_path),
            final=str(tmp_path / "shards"),
            clock=CLOCK,
            staged=["shard-00000.arrow"],
            reads=((str(index), read_then),),
        )

    def a_change(version):
        _commit(tmp_path, _stage(tmp_path, version=version), _written(version=version))

    a_change("a change")  # committed meanwhile
    with pytest.raises(StageError, match="changed while this job read it"):
        commit(_stage(tmp_path, ["shard-00000.arrow"], version="shards"))
    assert not (tmp_path / "shards").exists() and not (tmp_path / ".staging").exists()

    a_change("old")  # the index as the job read it (same bytes but for the timings' job)
    read_then = fileio.manifest_sha256(str(index))
    staging = _stage(tmp_path, ["shard-00000.arrow"], version="shards")
    commit(staging)
    assert json.loads((tmp_path / "shards" / "manifest.json").read_text())["version"] == "shards"
    a_change("a later change")
    commit(staging)  # the runner retries a commit that had finished: it stands
    assert json.loads((tmp_path / "shards" / "manifest.json").read_text())["version"] == "shards"


def test_an_output_from_before_numbered_commits_is_kept_as_commit_0_until_the_first_is_complete(tmp_path):
    final = tmp_path / "index"
    (final / "chunks").mkdir(parents=True)
    (final / "chunks" / "chunks-00007.parquet").write_text("old 7")
    legacy = Written(
        version="legacy", files=[FileEntry(path="chunks/chunks-00007.parquet", rows=1, bytes=5, sha256=_sha("old 7"))]
    )
    (final / "manifest.json").write_text(legacy.model_dump_json())
    assert _readable(final) == {"chunks/chunks-00007.parquet": "old 7"}
    _commit(tmp_path, _stage(tmp_path))
    assert _readable(final) == {p: f"new {p}" for p in FILES}
    assert sorted(_tree(final)) == [*FILES[:2], "faiss/index.faiss", "manifest-000001.json", "manifest.json"]


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
    kept = [f"chunks/chunks-{i:06d}.parquet" for i in range(100_000)]
    final = tmp_path / "index"
    (final / "chunks").mkdir(parents=True)
    for path in kept:
        (final / path).write_text(f"old {path}")
    (final / "faiss").mkdir()
    (final / "faiss" / "index.faiss").write_text("old faiss/index.faiss")
    base = _written([*kept, "faiss/index.faiss"], version="old")
    (final / "manifest.json").write_text(base.model_dump_json())  # a committed output, from before numbered commits
    appended = [f"chunks/chunks-{i:06d}.parquet" for i in range(100_000, 100_010)] + ["faiss/index.faiss"]
    written = Written(version="new", files=[*base.files[:-1], *_written(appended).files])
    staging = _stage(tmp_path, appended)
    counting = CountingFileSystems(monkeypatch)
    _commit(tmp_path, staging, written)
    assert (final / "faiss" / "index.c000001.faiss").read_text() == "new faiss/index.faiss"
    assert len(list((final / "chunks").iterdir())) == 100_010
    assert counting.requests["match"] <= 10, counting.requests  # listings, not one request per kept file
    assert counting.total < 20 * len(appended), counting.requests


def test_a_commit_whose_number_another_job_took_commits_nothing(tmp_path):
    _commit(tmp_path, _stage(tmp_path, version="old"), _written(version="old"))
    final = tmp_path / "index"
    staging = _stage(tmp_path)
    theirs = json.dumps({"version": "another job's", "timings": {"job": "index-another"}})
    (final / "manifest-000002.json").write_text(theirs)  # put between our listing and our put
    numbered = commits.numbered_commits
    commits.numbered_commits = lambda directory: numbered(directory)[:1]  # as listed before it appeared
    try:
        with pytest.raises(StageError, match="commit 2 was made by another job meanwhile"):
            _commit(tmp_path, staging)
    finally:
        commits.numbered_commits = numbered
    assert (final / "manifest-000002.json").read_text() == theirs


def test_kept_commits_stay_readable_until_collected(tmp_path):
    for version in ("first", "second", "third"):
        _commit(tmp_path, _stage(tmp_path, version=version), _written(version=version), keep_commits=2)
    final = tmp_path / "index"
    assert [n for n, _ in fileio.commits(str(final))] == [2, 3]
    _, second = fileio.current_manifest(str(final), 2)
    for entry in Written.model_validate_json(second).files:  # commit 2, whole beside commit 3
        assert (final / entry.path).read_text() == f"second {entry.path.replace('.c000002', '')}"
    commits.finish(str(final), Written, keep=1)  # what gc does
    assert [n for n, _ in fileio.commits(str(final))] == [3] and fileio.current_manifest(str(final), 2) is None
    assert _readable(final) == {f"{p.rsplit('.', 1)[0]}.c000003.{p.rsplit('.', 1)[1]}": f"third {p}" for p in FILES}


def test_a_cleanup_that_died_after_deleting_an_old_file_table_is_finished(tmp_path):
    for version in ("first", "second"):
        _commit(
            tmp_path, _stage(tmp_path, version=version), _written(version=version), keep_commits=2, inline_entries=1
        )
    final = tmp_path / "index"
    (final / "files-000001.parquet").unlink()  # deleted, then the cleanup died before commit 1's manifest
    commits.finish(str(final), Written, keep=1)
    assert [n for n, _ in fileio.commits(str(final))] == [2]
    path, data = fileio.current_manifest(str(final))
    listed = [p for paths in commits.listed_paths_of(str(final), path, Written) for p in paths]  # its table too
    assert {p for p in listed if not p.startswith("files-")} == {versioned(p, 2) for p in FILES}
    assert all((final / p).exists() for p in listed)


def _committed_table(final, entries: int) -> None:
    """Commit 1 of `final`: `entries` chunk files listed in a file table (the files not written)."""
    paths = [f"chunks/chunks-{i:07d}.parquet" for i in range(entries)]
    final.mkdir(parents=True)
    with open(final / "files-000001.parquet", "wb") as raw:
        writer = TableWriter(raw, FileEntry, "files-000001.parquet")
        writer.write(pa.table({"path": paths, "rows": [1] * entries, "bytes": [1] * entries, "sha256": paths}))
        table = writer.close()
    manifest = Written(version="old", files=[], file_table=table)
    assert commits.put(str(final), 1, manifest.model_dump_json().encode())


def test_a_commit_holds_a_row_group_of_what_earlier_commits_list_not_all_of_it(tmp_path):
    """A commit looks the names earlier commits list up a row group of their file tables at a
    time: over a commit of 4x the files, its peak grows by less than a quarter (holding them
    all, as a dict, it grew 4.0x: 18 to 73 MB)."""
    peaks = []
    for entries in (70_000, 280_000):
        output = tmp_path / str(entries)
        _committed_table(output / "index", entries)
        new = [f"chunks/chunks-{i:07d}.parquet" for i in (5, 69_999)]  # names commit 1 lists for other bytes
        staging = _stage(output, new)
        tracemalloc.start()
        commit_directory(
            staging, str(output / "index"), _written(new), new, timings=lambda counters: {"job": "index-new"}
        )
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        assert fileio.current_manifest(str(output / "index"))[0].endswith("manifest-000002.json")
        assert (output / "index" / versioned(new[1], 2)).read_text() == f"new {new[1]}"
    assert peaks[1] < 1.25 * peaks[0], peaks


def test_a_commit_of_pieces_holds_a_batch_of_each_not_every_entry(tmp_path):
    """The entries reach the commit as pieces (here a refresh's kind: every file already
    committed with its bytes, so nothing moves): over 4x the entries its peak grows by less
    than a quarter (18.8 → 22.3 MB: the pieces 2 → 5, a read batch of each). Held in the
    manifest instead, as the step that gathered them did, the commit alone grew 19.0 → 33.7 MB
    on top of the entries themselves."""
    peaks = []
    for entries in (70_000, 280_000):
        output = tmp_path / str(entries)
        _committed_table(output / "index", entries)
        paths = [f"chunks/chunks-{i:07d}.parquet" for i in range(entries)]
        listed = [FileEntry(path=p, rows=1, bytes=1, sha256=p) for p in paths]
        pieces_dir = output / ".staging" / "index-0123456789ab" / PIECES_DIR
        pieces_dir.mkdir(parents=True)
        pieces = [
            write_piece(
                str(pieces_dir / piece_name(listed[start].path)), listed[start : start + PIECE_NUMBERS], FileEntry
            )
            for start in range(0, entries, PIECE_NUMBERS)
        ]
        del listed, paths
        tracemalloc.start()
        commit_directory(
            str(pieces_dir.parent),
            str(output / "index"),
            Written(version="new", files=[]),
            [],
            pieces=pieces,
            timings=lambda counters: {"job": "index-0123456789ab"},
        )
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        committed = fileio.committed_summary(str(output / "index"), Written)
        assert committed.file_table is not None and committed.file_table.entries == entries
    assert peaks[1] < 1.25 * peaks[0], peaks


def test_a_file_only_an_older_commit_lists_with_the_same_bytes_is_moved_again(tmp_path):
    """A cleanup that died after deleting one of an expired commit's files, then a larger
    keep_commits, leave that commit listing a file that is gone: a new commit staging the same
    bytes under that name moves it into place rather than trusting the older listing."""
    _commit(tmp_path, _stage(tmp_path, version="first"), _written(version="first"), keep_commits=2)
    other = ["chunks/chunks-00009.parquet"]
    _commit(tmp_path, _stage(tmp_path, other, version="second"), _written(other, version="second"), keep_commits=2)
    final = tmp_path / "index"
    (final / FILES[0]).unlink()  # commit 1, no longer newest, lists it still
    _commit(tmp_path, _stage(tmp_path, version="first"), _written(version="first"), keep_commits=2)
    assert _readable(final) == {p: f"first {p}" for p in FILES}
