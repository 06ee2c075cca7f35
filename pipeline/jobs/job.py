"""What every job shares: `Job`, the template each runs as (its graph, then the one commit step,
running), the clock its manifest's timings come from, and where its directories are.

Each job (build-index, build-shards, `index`) writes into a staging directory under
`<output>/.staging/`; its last step, on a worker, builds the manifest from the data the job
wrote (file entries, counts computed as data: `pipeline.common.tally`) and commits
(`pipeline.jobs.commit`): rejected records to `<output>/rejected/`, the files into place,
manifest.json last (docs/design.md §8). So a job submitted to a cluster and left (`detach`)
commits itself; attached, the driver waits and reads the committed manifest.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import apache_beam as beam
from apache_beam.runners.runner import PipelineResult
from pydantic import BaseModel

from pipeline.chunks.chunking import load_tokenizer, pad_id_of
from pipeline.common import fileio
from pipeline.common.errors import StageError
from pipeline.common.models import (
    DEFAULT_MODEL_NAMES,
    resolve_tokenizer,
)
from pipeline.common.progress import StageTimer
from pipeline.jobs import commits
from pipeline.jobs.commit import commit_stage, discard_staging, new_staging_dir
from pipeline.jobs.commits import KEPT_COMMITS
from pipeline.jobs.entry_pieces import WriteEntryPieces
from pipeline.jobs.flink import job_server_is_a_child, listed_jobs, name_the_job, rest_address, wait_until_flink_has
from pipeline.jobs.lease import ATTACHED_SECONDS, DETACHED_SECONDS, Claim, Lease
from pipeline.jobs.options import check_detachable, new_pipeline
from schemas.config import PipelineConfig
from schemas.file_table import entry_model
from schemas.manifest import MANIFEST_FILE, StageTimings

log = logging.getLogger("ratrain")


@dataclass(frozen=True)
class Submitted:
    """A detached stage: submitted, committing itself when it finishes."""

    stage: str
    manifest: str  # where its manifest appears once committed
    job: str | None = None  # the runner's job id, where it has one


@dataclass(frozen=True)
class Tokenization:
    name: str  # as recorded in the manifest: the config value or the default encoder's
    path: str
    pad_id: int

    @classmethod
    def of(cls, cfg: PipelineConfig) -> Tokenization:
        name = cfg.tokenizer or DEFAULT_MODEL_NAMES[0]
        path = resolve_tokenizer(name)
        if not os.path.isfile(path):
            raise StageError(f"tokenizer: file not found: {path}")
        return cls(name, path, pad_id_of(load_tokenizer(path)))


def stage_timings(stage: str, started: float, committed: float, counters: dict[str, int], records: str) -> dict:
    """A manifest's `timings`: the wall time from `started` to `committed` (seconds since the
    epoch) and the throughput in the counter `records` (None when the clocks disagree so far
    that the wall time is not positive)."""
    wall = committed - started
    return StageTimings(
        stage=stage,
        started=_utc(started),
        committed=_utc(committed),
        wall_seconds=round(wall, 3),
        records=records,
        records_per_second=round(counters.get(records, 0) / wall, 1) if wall > 0 else None,
    ).model_dump(mode="json")


def _utc(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat(timespec="seconds")


@dataclass(frozen=True)
class StageClock:
    """A job's name, the counter its throughput counts, and when the driver built its pipeline.
    The commit step runs on a worker, maybe long after the driver left (detached): it reads
    its own clock against `started` (wall-clock time, comparable across machines)."""

    stage: str
    records: str
    started: float = field(default_factory=time.time)

    def timings(self, counters: dict[str, int]) -> dict:
        return stage_timings(self.stage, self.started, time.time(), counters, self.records)


@dataclass(frozen=True, kw_only=True)
class Committed:
    """What a job's graph hands its commit step: the manifest (one `model` instance, built from
    the data written; its entries only those `staged_of(manifest)` names and those in place), the
    staged files' entries (`staged`: the commit lists them beside the manifest's), what a change
    keeps of the previous commit (`kept`), and what must be written before the commit (`after`)."""

    manifest: beam.PCollection
    staged: beam.PCollection | None = None
    kept: beam.PCollection | None = None  # one KeptEntries: what a change keeps of the previous commit
    staged_of: Callable[[Any], list[str]] | None = None
    after: tuple[beam.PCollection, ...] = ()


class Job:
    """One Beam job, run as a template: a job function makes one with its settings, resolves its
    inputs (or, for a dry run, stands them in), and calls `run(graph)`, where `graph(pipeline,
    staging)` builds the job's steps writing into `staging` and returns what it `Committed`; the
    commit step, running and reading back the committed manifest are here. A job that writes
    nothing (`validate`: `Job.reading`) has no staging, manifest or commit: its graph returns
    None."""

    def __init__(
        self,
        name: str,
        *,
        records: str,
        output: str,
        directory: str,
        model: type[BaseModel] | None,
        beam_args: list[str],
        staging: str | None,
        dry_run: bool = False,
        detach: bool = False,
        max_rejected_fraction: float = 1.0,
        replaces: str | None = None,
        reads: tuple[tuple[str, str], ...] = (),
        keep_commits: int = KEPT_COMMITS,
        type_check: bool = True,
    ):
        self.output, self.directory, self.model = output, directory, model
        self.reads = reads
        self.dry_run, self.detach = dry_run, detach
        self.max_rejected_fraction, self.replaces, self.keep_commits = max_rejected_fraction, replaces, keep_commits
        self.pipeline = new_pipeline(beam_args, dry_run, type_check)
        if detach and not dry_run:  # before the staging directory replaces an earlier one
            check_detachable(self.pipeline.options)
        self.staging_stage, self.staging = staging, ""  # made in `run`, once the output's lease is held
        self.claim: Claim | None = None
        # where the job server ends with this process, a detached run waits until Flink lists the job
        wait_for_flink = detach and not dry_run and job_server_is_a_child(self.pipeline.options)
        self.flink_job_name = name_the_job(self.pipeline.options, name) if wait_for_flink else None
        self.clock = StageClock(name, records)

    @classmethod
    def reading(cls, name: str, directory: str, beam_args: list[str]) -> Job:
        """A job that reads `directory` and writes nothing: `run(graph)` waits for it (its graph returns None)."""
        return cls(
            name, records="", output=directory, directory=directory, model=None, beam_args=beam_args, staging=None
        )

    def _commit(self, committed: Committed) -> None:
        """The job's last step (`commit_stage`), once the manifest exists and every PCollection in
        `committed.after` is written. The staged files' entries reach it as pieces written by
        workers (`WriteEntryPieces`), never gathered on one."""
        staged_of, claim = committed.staged_of, self.claim
        staging, output, directory, clock = self.staging, self.output, self.directory, self.clock
        fraction, replaces, reads, keep = self.max_rejected_fraction, self.replaces, self.reads, self.keep_commits
        staged = (
            committed.staged if committed.staged is not None else self.pipeline | "NothingStaged" >> beam.Create([])
        )
        pieces = beam.pvalue.AsList(staged | "EntryPieces" >> WriteEntryPieces(staging, entry_model(self.model)))

        kept = committed.kept if committed.kept is not None else self.pipeline | "NothingKept" >> beam.Create([None])

        def commit(manifest, pieces, kept, *_after):
            commit_stage(
                manifest,
                staging=staging,
                output=output,
                final=directory,
                clock=clock,
                staged=staged_of(manifest) if staged_of is not None else [],
                pieces=pieces,
                kept=kept,
                max_rejected_fraction=fraction,
                replaces=replaces,
                reads=reads,
                claim=claim,
                keep_commits=keep,
            )

        after = (beam.pvalue.AsList(pc) for pc in committed.after)
        _ = committed.manifest | "Commit" >> beam.Map(commit, pieces, beam.pvalue.AsSingleton(kept), *after)

    def run(self, graph: Callable[[beam.Pipeline, str], Committed | None]):
        """The job: the output's lease taken (a job that writes, not a dry run), its staging
        directory made, its `graph` built, then its commit step; run. Dry run:
        `describe(pipeline)`. Detached: `Submitted` once the runner has the job (its commit
        releases the lease). Attached: the committed manifest's summary (its entries only where they
        are inline, `fileio.committed_summary`; the lease released here); a job that fails leaves
        no staging behind."""
        lease = None
        if self.staging_stage is not None and not self.dry_run:
            outer = Lease.held_here(self.output)  # `run` holds it across its jobs
            if outer is not None:
                self.claim = Claim(self.output, outer.holder.token, released_by_commit=False)
            else:
                seconds = DETACHED_SECONDS if self.detach else ATTACHED_SECONDS
                lease = Lease.take(self.output, self.clock.stage, seconds=seconds, detached=self.detach)
                self.claim = Claim(self.output, lease.holder.token, released_by_commit=self.detach)
                if not self.detach:
                    lease.keep()
        try:
            result = self._run(graph)
        except BaseException:
            if (
                self.staging and not self.dry_run and not self.detach
            ):  # ours (we hold the lease): nothing half-done stays
                discard_staging(self.staging)
            if lease is not None:
                lease.release()
            raise
        if lease is not None and self.detach:
            lease.hand_over()
        elif lease is not None:
            lease.release()
        return result

    def _run(self, graph: Callable[[beam.Pipeline, str], Committed | None]):
        if self.staging_stage is not None:
            if not self.dry_run and self.model is not None:  # a commit that died after its put: finished now
                commits.finish(self.directory, self.model, self.keep_commits)
            self.staging = new_staging_dir(self.output, self.staging_stage, self.dry_run)
        committed = graph(self.pipeline, self.staging)
        if (committed is None) != (self.model is None):
            raise TypeError(f"{self.clock.stage}: a job commits a manifest exactly when it writes one")
        if committed is not None:
            self._commit(committed)
        if self.dry_run:
            return describe(self.pipeline)
        if self.model is None:
            self.pipeline.run().wait_until_finish()
            return None
        handed_over = None
        if self.flink_job_name is not None:
            address, name = rest_address(self.pipeline.options), self.flink_job_name
            known = {job["jid"] for job in listed_jobs(address)}

            def handed_over(result: PipelineResult) -> str:
                return wait_until_flink_has(address, name, known, lambda: result.state)

        return run_stage(
            self.pipeline, self.clock, self.directory, self.model, detach=self.detach, handed_over=handed_over
        )


def index_dir(cfg: PipelineConfig) -> str:
    return fileio.join(cfg.output, "index")


def shards_dir(cfg: PipelineConfig) -> str:
    return fileio.join(cfg.output, "shards")


def describe(pipeline: beam.Pipeline) -> dict:
    """What `--dry-run` prints: the resolved Beam options and the top-level stages with their
    resource hints (accelerator, min_ram), and any step inside one with hints of its own."""

    def hints(applied) -> dict:
        return {urn.split(":")[2]: value.decode() for urn, value in (applied.resource_hints or {}).items()}

    def hinted_steps(applied):  # steps inside a stage that carry hints of their own
        for part in applied.parts:
            if hints(part) and hints(part) != hints(applied):
                yield {"stage": part.full_label, "resource_hints": hints(part)}
            yield from hinted_steps(part)

    stages = []
    for applied in pipeline.transforms_stack[0].parts:
        stages.append({"stage": applied.full_label, **({"resource_hints": hints(applied)} if hints(applied) else {})})
        stages += hinted_steps(applied)
    options = pipeline.options.get_all_options(drop_default=True, retain_unknown_options=True)
    return {"options": options, "stages": stages, "graph_bytes": graph_bytes(pipeline)}


#: Dataflow refuses a job request larger than this (the graph with every transform's pickled arguments).
DATAFLOW_REQUEST_BYTES = 20 * 1024 * 1024


def graph_bytes(pipeline: beam.Pipeline) -> int:
    """The size of the job graph a runner is sent (the runner API proto, with every
    transform's pickled arguments): what a runner's request limit is checked against."""
    size = pipeline.to_runner_api().ByteSize()
    if size > DATAFLOW_REQUEST_BYTES // 2:
        log.warning("the job graph is %.1f MB (Dataflow refuses requests over 20 MB)", size / 2**20)
    return size


def run_stage(
    pipeline: beam.Pipeline,
    clock: StageClock,
    directory: str,
    model,
    *,
    detach: bool,
    handed_over: Callable[[PipelineResult], str] | None = None,
):
    """Run a job that commits itself. Attached: wait, then read and return the committed
    manifest. Detached: return once the runner has the job (`Submitted`); `handed_over`, where
    submitting is not enough, waits until the runner holds the job and returns its id."""
    name, main = clock.stage, clock.records
    manifest_path = fileio.join(directory, MANIFEST_FILE)
    with StageTimer(name) as timer:
        result = pipeline.run()
        if detach:
            job = handed_over(result) if handed_over is not None else getattr(result, "job_id", lambda: None)()
            log.info(
                "%s: submitted%s; it commits %s when it finishes", name, f" (job {job})" if job else "", manifest_path
            )
            return Submitted(name, manifest_path, job)
        result.wait_until_finish()
        # its fields: entries in a file table stay there (~1.6 GB as objects at 3e10 chunks)
        manifest = fileio.committed_summary(directory, model)
        timer.done(manifest.counters, main)
    return manifest
