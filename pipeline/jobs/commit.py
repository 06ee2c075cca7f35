"""The commit protocol (docs/design.md §8): a stage writes into `<output>/.staging/<stage>-<id>/`;
the commit moves the staged files into place, under names no earlier commit's manifest lists
for other bytes, and puts its manifest, `manifest-NNNNNN.json`, once, last; then it is finished
(`pipeline.jobs.commits`). Readers see the previous commit whole until the put, the new one
after it.

The commit runs as the last step of the stage's own pipeline, on a worker, so a job submitted
to a cluster commits itself with no driver waiting for it. Runners retry a failed step, so
every function here can run again after dying half-way: it picks up where the last attempt
stopped and ends in the same state.
"""

from __future__ import annotations

import contextlib
import json
import posixpath
import uuid
from collections.abc import Iterable

from apache_beam.io.filesystem import BeamIOError
from apache_beam.io.filesystems import FileSystems
from pydantic import BaseModel

from pipeline.common import fileio
from pipeline.common.errors import StageError
from pipeline.common.rejected import rejected_share
from pipeline.jobs import commits
from pipeline.jobs.entry_pieces import PIECES_DIR, EntryPiece, KeptEntries, merged_entries
from pipeline.jobs.lease import Claim, check_held, release
from schemas.file_table import entries_arrow, entries_field, entry_model
from schemas.manifest import INLINE_FILE_ENTRIES, commit_table, versioned
from schemas.table_writer import TableWriter

REJECTED_STAGING = "_rejected"


def new_staging_dir(output: str, stage: str, dry_run: bool = False) -> str:
    """A fresh staging directory for `stage`, after deleting what a killed run of it left in
    `<output>/.staging/` (one run per output directory at a time; a dry run deletes nothing)."""
    root = fileio.join(output, ".staging")
    if not dry_run:
        stale = {
            posixpath.relpath(path.replace("\\", "/"), root.rstrip("/")).split("/")[0]
            for path in fileio.list_files(root)
        }
        for name in sorted(n for n in stale if n.startswith(f"{stage}-")):
            fileio.delete_tree(fileio.join(root, name))
    return fileio.join(root, f"{stage}-{uuid.uuid4().hex[:12]}")


def _relative(path: str, directory: str) -> str:
    return posixpath.relpath(path.replace("\\", "/"), directory.rstrip("/"))


def publish_rejected(staging: str, output: str) -> None:
    """Move the job's rejected-record files to `<output>/rejected/`."""
    source_dir = fileio.join(staging, REJECTED_STAGING)
    for source in fileio.list_files(source_dir):
        fileio.move(source, fileio.join(output, "rejected", posixpath.basename(source)))


def commit_stage(
    manifest: BaseModel,
    *,
    staging: str,
    output: str,
    final: str,
    clock,
    staged: list[str],
    pieces: Iterable[EntryPiece] = (),
    kept: KeptEntries | None = None,
    max_rejected_fraction: float = 1.0,
    inline_entries: int = INLINE_FILE_ENTRIES,
    replaces: str | None = None,
    reads: tuple[tuple[str, str], ...] = (),
    claim: Claim | None = None,
    keep_commits: int = commits.KEPT_COMMITS,
) -> None:
    """A job's last step. A retry of a commit whose put was done only finishes it. Otherwise:
    refuse a job whose inputs changed under it (`reads`: the committed directories it read,
    with the sha256 of their manifests then), one whose base changed (`replaces`: the sha256
    of the manifest an append built on) and one that lost the output's lease (`claim`);
    publish its rejected records; refuse a job that rejected too much (staging discarded,
    nothing committed); else commit the staged files (`commit_directory`). `clock` names the
    stage (`stage`) and reads the commit's own clock (`timings(counters)`:
    `pipeline.jobs.job.StageClock`). With more than `inline_entries` file entries, they go to
    the commit's file table (schemas/file_table.py). A claim that says so is released once
    committed."""
    job = posixpath.basename(staging.rstrip("/"))
    current = fileio.current_manifest(final)
    if current is None or commits.job_of(current[1]) != job:  # not a retry after this job's put
        if claim is not None:
            check_held(claim.output, claim.token)
        for directory, sha256 in reads:
            if fileio.manifest_sha256(directory) != sha256:
                discard_staging(staging)
                raise StageError(
                    f"{clock.stage}: the manifest of {directory} changed while this job read it (a change "
                    "was committed there); nothing was committed: run again"
                )
        if replaces is not None and (current is None or fileio.sha256_bytes(current[1]) != replaces):
            discard_staging(staging)
            raise StageError(
                f"commit of {final}: its manifest changed while this job ran (another job committed there); "
                "nothing was committed: run again"
            )
        publish_rejected(staging, output)
        counters = manifest.counters  # type: ignore[attr-defined]
        rejected, records = rejected_share(counters)
        if records and rejected / records > max_rejected_fraction:
            discard_staging(staging)
            reasons = ", ".join(
                f"{k[len('rejected_') :]} {v:,}" for k, v in counters.items() if k.startswith("rejected_") and v
            )
            raise StageError(
                f"{clock.stage}: {rejected:,} of {records:,} input records rejected "
                f"({rejected / records:.0%}: {reasons}), more than max_rejected_fraction "
                f"{max_rejected_fraction:.0%}; see {fileio.join(output, 'rejected')}"
            )
        commit_directory(
            staging,
            final,
            manifest,
            staged,
            pieces=pieces,
            kept=kept,
            timings=lambda counters: {**clock.timings(counters), "job": job},
            inline_entries=inline_entries,
        )
    commits.finish(final, type(manifest), keep_commits)
    discard_staging(staging)
    if claim is not None and claim.released_by_commit:
        release(claim.output, claim.token)


#: File entries a commit names, moves and writes to its file table at a time.
COMMIT_BATCH = 4_096


def commit_directory(
    staging: str,
    final: str,
    manifest: BaseModel,
    staged: list[str],
    *,
    pieces: Iterable[EntryPiece] = (),
    kept: KeptEntries | None = None,
    timings,
    inline_entries: int = INLINE_FILE_ENTRIES,
) -> None:
    """Commit into `final`, as its next commit, the files of the entry `pieces` (all staged),
    the manifest's own entries (those in `staged` are staged, the rest in place) and those a
    change keeps of the previous commit (`kept`, in place), in path order, `COMMIT_BATCH` at a
    time (`merged_entries`): each staged file the newest commit does not list with those bytes
    moved from `staging` to its name in `final`, the commit's number added to the name of one an
    existing commit lists for other bytes (never overwritten), and each entry written to the
    commit's file table (more than `inline_entries` entries); then the
    commit's manifest put, once (`commits.put`), with `timings(counters)`. What earlier commits
    list is looked up a row group at a time (`commits.ListedFiles`), and a file is probed only
    where its move failed. Run again after dying before the put, it makes the same names, moves
    what is still staged and checks that the rest arrived; until the put, readers see the
    previous commit whole."""
    numbered = commits.numbered_commits(final)
    number = numbered[-1][0] + 1 if numbered else 1
    listed = commits.ListedFiles(final, numbered, type(manifest))
    field, model = entries_field(manifest), entry_model(manifest)
    pieces, held = list(pieces), getattr(manifest, field)
    in_place = {e.path for e in held} - set(staged)
    inline, reference = [], None
    with contextlib.ExitStack() as stack:
        writer = None
        if len(held) + sum(p.entries for p in pieces) + (kept.count() if kept else 0) > inline_entries:
            raw = stack.enter_context(fileio.open_write(fileio.join(final, commit_table(number))))
            writer = TableWriter(raw, model, commit_table(number))
        for batch in merged_entries(pieces, model, held, kept, batch=COMMIT_BATCH):
            newest, prior = zip(*(listed.newest_and_any(e.path) for e in batch))
            # staged, and not in the newest commit with these bytes (what a change keeps stays in place)
            moving = [e.path not in in_place and n != e.sha256 for e, n in zip(batch, newest)]
            named = [_named(e, number, p) if m else e for e, p, m in zip(batch, prior, moving)]
            _moved(staging, final, [(e.path, n.path) for e, n, m in zip(batch, named, moving) if m])
            if writer is not None:
                writer.write(entries_arrow(named, model))
            else:
                inline += named
        if writer is not None:
            reference = writer.close()
    data = manifest.model_copy(update={field: inline, "file_table": reference}).model_dump(mode="json")
    stamped = {**data, "commit": number, "timings": timings(data["counters"])}
    text = (json.dumps(stamped, indent=2, sort_keys=True) + "\n").encode()
    if not commits.put(final, number, text):
        raise StageError(f"commit of {final}: commit {number} was made by another job meanwhile; nothing was committed")
    fileio.delete_tree(fileio.join(staging, PIECES_DIR))  # listed now: staging holds no file the commit named


def _named(entry, number: int, prior: str | None):
    """The entry under the name it is committed as: its own, or with the commit's number where an
    existing commit lists that name for other bytes (its sha256 there: `prior`; decided by the
    manifests alone, so a retry after dying half-way decides the same)."""
    if prior is None or prior == entry.sha256:
        return entry
    return entry.model_copy(update={"path": versioned(entry.path, number)})


def _moved(staging: str, final: str, names: list[tuple[str, str]]) -> None:
    """Move each staged file (staged name, final name); one whose move fails must be in place
    already (moved by an earlier attempt of this commit), else the commit fails."""
    if not names:
        return
    targets = [fileio.join(final, name) for _, name in names]
    for parent in sorted({posixpath.dirname(t) for t in targets}):
        fileio.ensure_parent(fileio.join(parent, "_"))
    try:
        FileSystems.rename([fileio.join(staging, path) for path, _ in names], targets)
    except BeamIOError as err:
        failed = sorted(_relative(target, final) for _, target in err.exception_details)
        there = fileio.sizes(final, failed)
        missing = [name for name in failed if name not in there]
        if missing:
            raise FileNotFoundError(
                f"commit of {final}: {len(missing)} file(s) neither staged nor in place: {missing[:3]}"
            ) from None


def discard_staging(staging: str) -> None:
    """Delete a staging directory; the last stage out removes `.staging/` too."""
    fileio.delete_tree(staging)
    parent = posixpath.dirname(staging.rstrip("/"))
    if "://" not in parent and fileio.exists(parent) and not fileio.list_files(parent):
        FileSystems.delete([parent])
