"""The commit protocol (docs/design.md §8): a stage writes into `<output>/.staging/<stage>-<id>/`;
the commit moves the staged files into place, under names no earlier commit's manifest lists,
and puts its manifest, `manifest-NNNNNN.json`, once, last; then it is finished
(`pipeline.jobs.commits`). Readers see the previous commit whole until the put, the new one
after it.

The commit runs as the last step of the stage's own pipeline, on a worker, so a job submitted
to a cluster commits itself with no driver waiting for it. Runners retry a failed step, so
every function here can run again after dying half-way: it picks up where the last attempt
stopped and ends in the same state.
"""

from __future__ import annotations

import json
import posixpath
import uuid

from apache_beam.io.filesystems import FileSystems
from pydantic import BaseModel

from pipeline.common import fileio
from pipeline.common.errors import StageError
from pipeline.common.rejected import rejected_share
from pipeline.jobs import commits
from pipeline.jobs.lease import Claim, check_held, release
from schemas.file_table import entries_field, split_entries, with_entry_paths
from schemas.manifest import INLINE_FILE_ENTRIES, commit_table, versioned

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
            timings=lambda counters: {**clock.timings(counters), "job": job},
            inline_entries=inline_entries,
        )
    commits.finish(final, type(manifest), keep_commits)
    discard_staging(staging)
    if claim is not None and claim.released_by_commit:
        release(claim.output, claim.token)


def commit_directory(
    staging: str,
    final: str,
    manifest: BaseModel,
    staged: list[str],
    *,
    timings,
    inline_entries: int = INLINE_FILE_ENTRIES,
) -> None:
    """Commit the files `staged` (paths relative to both directories) into `final` as its next
    commit: each moved from `staging` to its name in `final`, the commit's number added to the
    name of one an existing commit lists (never overwritten); the file table written (more
    than `inline_entries` entries); then the commit's manifest put, once (`commits.put`), with
    `timings(counters)`. The directory is listed once, not probed per file. Run again after
    dying before the put, it makes the same names, moves what is still staged and checks that
    the rest arrived; until the put, readers see the previous commit whole."""
    numbered = commits.numbered_commits(final)
    number = numbered[-1][0] + 1 if numbered else 1
    listed = commits.listed_by_commits(final, numbered, type(manifest))
    signed = {e.path: e.sha256 for e in getattr(manifest, entries_field(manifest))}
    # a new file under a name an existing commit lists for other bytes gets this commit's
    # number: decided by the manifests alone, so a retry after dying half-way decides the same
    names = {p: versioned(p, number) if p in listed and signed.get(p, listed[p]) != listed[p] else p for p in staged}
    manifest = with_entry_paths(manifest, names)
    data, table = split_entries(manifest, inline_entries, table_path=commit_table(number))
    wanted = {names[path]: path for path in staged}  # final name -> staged name
    in_place = {_relative(path, final) for path in fileio.list_files(final)}
    waiting = {_relative(path, staging) for path in fileio.list_files(staging)}
    moving = sorted(name for name, path in wanted.items() if path in waiting)
    missing = sorted(set(wanted) - set(moving) - in_place)
    if missing:
        raise FileNotFoundError(f"commit of {final}: {len(missing)} file(s) neither staged nor in place: {missing[:3]}")
    targets = [fileio.join(final, name) for name in moving]
    for target in targets:
        fileio.ensure_parent(target)
    if targets:
        FileSystems.rename([fileio.join(staging, wanted[name]) for name in moving], targets)
    if table is not None:
        fileio.write_bytes(fileio.join(final, commit_table(number)), table)
    stamped = {**data, "commit": number, "timings": timings(data["counters"])}
    text = (json.dumps(stamped, indent=2, sort_keys=True) + "\n").encode()
    if not commits.put(final, number, text):
        raise StageError(f"commit of {final}: commit {number} was made by another job meanwhile; nothing was committed")


def discard_staging(staging: str) -> None:
    """Delete a staging directory; the last stage out removes `.staging/` too."""
    fileio.delete_tree(staging)
    parent = posixpath.dirname(staging.rstrip("/"))
    if "://" not in parent and fileio.exists(parent) and not fileio.list_files(parent):
        FileSystems.delete([parent])
