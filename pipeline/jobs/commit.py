"""The commit protocol (docs/design.md §8): a stage writes into `<output>/.staging/<stage>-<id>/`; the
commit moves the staged files into place and writes `manifest.json` last, so a directory with a
manifest is whole.

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
from pipeline.jobs.lease import Claim, check_held, release
from schemas.file_table import split_entries
from schemas.manifest import FILE_TABLE, INLINE_FILE_ENTRIES, MANIFEST_FILE

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


def _without_timings(manifest: dict) -> dict:
    """A manifest less its `timings`: a retried commit step reads its clock again."""
    return {key: value for key, value in manifest.items() if key != "timings"}


def commit_stage(
    manifest: BaseModel,
    *,
    staging: str,
    output: str,
    final: str,
    clock,
    staged: list[str],
    max_rejected_fraction: float = 1.0,
    replace: tuple[str, ...] | None = None,
    inline_entries: int = INLINE_FILE_ENTRIES,
    replaces: str | None = None,
    reads: tuple[tuple[str, str], ...] = (),
    claim: Claim | None = None,
) -> None:
    """A job's last step: refuse a job whose inputs changed under it (`reads`: the committed
    directories it read, with the sha256 of their manifests then), publish its rejected
    records, refuse a job that rejected too much (staging discarded, nothing committed), else
    move the staged files into `final` and write the manifest, with the job's timings, last.
    `clock` names the stage (`stage`) and reads the commit's own clock (`timings(counters)`:
    `pipeline.jobs.job.StageClock`). The manifest stays a model until here, where it is
    written: with more than `inline_entries` file entries, they go to its file table
    (schemas/file_table.py). `claim`: the output's lease the job took, checked to be still its
    own before anything moves, and released once committed where the claim says so."""
    data, table = split_entries(manifest, inline_entries)
    if claim is not None and not _in_place(final, data, staging, None):  # a retry after the commit: no check
        check_held(claim.output, claim.token)
    already = bool(reads) and _in_place(final, data, staging, None)  # a retry after the commit: nothing to refuse
    for directory, sha256 in reads if not already else ():
        if fileio.manifest_sha256(directory) != sha256:
            discard_staging(staging)
            raise StageError(
                f"{clock.stage}: {fileio.join(directory, MANIFEST_FILE)} changed while this job read it (a change "
                "was committed there); nothing was committed: run again"
            )
    if replaces is not None:  # before anything moves: not even its rejected records
        _in_place(final, data, staging, replaces)
    publish_rejected(staging, output)
    rejected, records = rejected_share(data["counters"])
    if records and rejected / records > max_rejected_fraction:
        discard_staging(staging)
        reasons = ", ".join(
            f"{k[len('rejected_') :]} {v:,}" for k, v in data["counters"].items() if k.startswith("rejected_") and v
        )
        raise StageError(
            f"{clock.stage}: {rejected:,} of {records:,} input records rejected "
            f"({rejected / records:.0%}: {reasons}), more than max_rejected_fraction "
            f"{max_rejected_fraction:.0%}; see {fileio.join(output, 'rejected')}"
        )
    commit_directory(
        staging,
        final,
        {**data, "timings": clock.timings(data["counters"])},
        staged,
        replace=replace,
        table=table,
        replaces=replaces,
    )
    if claim is not None and claim.released_by_commit:
        release(claim.output, claim.token)


def commit_directory(
    staging: str,
    final: str,
    manifest: dict,
    staged: list[str],
    *,
    replace: tuple[str, ...] | None = None,
    table: bytes | None = None,
    replaces: str | None = None,
) -> None:
    """Move the files `staged` (paths relative to both directories) from `staging` into
    `final`, then write the manifest's file table `table` (None: its entries are inline, and
    no table stays) and `final/manifest.json` last.

    replace=None: `final` is the stage's own directory and keeps nothing else. Otherwise only
    these subdirectories of `final` are cleared of what the new manifest does not list (the
    rest, e.g. reused chunks, stays). The old manifest goes first, so a crash in between
    leaves a directory without a manifest (rebuilt on the next run), never a manifest over
    mixed content. Run again after a crash, it moves what is still staged, checks that the
    rest arrived, and writes the same manifest; after a finished commit it changes nothing.
    `replaces`: the sha256 of the manifest the job built on (an append); another manifest in
    its place fails the commit, staging discarded, so two jobs never mix their files.
    """
    manifest_path = fileio.join(final, MANIFEST_FILE)
    if _in_place(final, manifest, staging, replaces):
        return  # an earlier attempt of this commit finished (its timings stand)
    wanted = set(staged)
    # one listing of each directory, not one request per file: an append keeps ~10^6 files in place
    in_place = {_relative(path, final) for path in fileio.list_files(final)}
    waiting = {_relative(path, staging) for path in fileio.list_files(staging)} & wanted
    missing = sorted(wanted - waiting - in_place)
    if missing:
        raise FileNotFoundError(f"commit of {final}: {len(missing)} file(s) neither staged nor in place: {missing[:3]}")
    if MANIFEST_FILE in in_place:
        FileSystems.delete([manifest_path])
    kept = wanted | {FILE_TABLE, MANIFEST_FILE}  # rewritten or deleted below
    scopes = None if replace is None else tuple(f"{sub}/" for sub in replace)
    stale = [fileio.join(final, p) for p in sorted(in_place - kept) if scopes is None or p.startswith(scopes)]
    if stale:
        FileSystems.delete(stale)
    sources = [fileio.join(staging, path) for path in sorted(waiting)]
    targets = [fileio.join(final, path) for path in sorted(waiting)]
    for target in targets:
        fileio.ensure_parent(target)
    if sources:
        FileSystems.rename(sources, targets)
    discard_staging(staging)
    table_path = fileio.join(final, FILE_TABLE)
    if table is not None:
        fileio.write_bytes(table_path, table)
    elif FILE_TABLE in in_place:
        FileSystems.delete([table_path])
    fileio.write_json_atomic(manifest_path, manifest)


def _in_place(final: str, manifest: dict, staging: str, replaces: str | None) -> bool:
    """Whether `final` holds this manifest already (an earlier attempt committed it); a
    StageError, staging discarded, when it holds one other than `replaces` (if given)."""
    path = fileio.join(final, MANIFEST_FILE)
    if not fileio.exists(path):
        return False
    current = fileio.read_bytes(path)
    if _without_timings(json.loads(current)) == _without_timings(manifest):
        return True
    if replaces is not None and fileio.sha256_bytes(current) != replaces:
        discard_staging(staging)
        raise StageError(
            f"commit of {final}: its manifest changed while this job ran (another job committed there); "
            "nothing was committed: run again"
        )
    return False


def discard_staging(staging: str) -> None:
    """Delete a staging directory; the last stage out removes `.staging/` too."""
    fileio.delete_tree(staging)
    parent = posixpath.dirname(staging.rstrip("/"))
    if "://" not in parent and fileio.exists(parent) and not fileio.list_files(parent):
        FileSystems.delete([parent])
