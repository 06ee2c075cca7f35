"""What a detached job on Flink needs beyond Beam: waiting until Flink itself has the job.

With `--runner=FlinkRunner` and no `--job_endpoint`, Beam starts its Flink job server as a child
of this process and stops it when the process exits. The job server reports the job running as
soon as it accepted it, before it has built the Flink job and submitted it to the cluster; a
detached command that exited then would take the job with it. So it waits until the cluster's
REST API lists the job (under the job's name, which this process chooses: `name_the_job`).
"""

from __future__ import annotations

import json
import secrets
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from datetime import datetime, timezone

from apache_beam.options.pipeline_options import (
    FlinkRunnerOptions,
    GoogleCloudOptions,
    PipelineOptions,
    PortableOptions,
    StandardOptions,
)
from apache_beam.runners.runner import PipelineState

from pipeline.jobs.options import runner_kind


class FlinkSubmissionError(RuntimeError):
    """The Flink cluster did not receive a detached job."""


def job_server_is_a_child(options: PipelineOptions) -> bool:
    """Whether Beam runs the Flink job server as a child of this process (FlinkRunner without
    --job_endpoint, and not submitting an uber jar to the cluster itself), so that it ends when
    this process does."""
    return (
        runner_kind(options.view_as(StandardOptions).runner) == "flink"
        and not options.view_as(PortableOptions).job_endpoint
        and not options.view_as(FlinkRunnerOptions).flink_submit_uber_jar
    )


def name_the_job(options: PipelineOptions, stage: str) -> str:
    """The job's name, which Flink lists it under: the one given (--job_name), else a new one
    for this stage (Beam's job server would make one up that this process never learns)."""
    named = options.view_as(GoogleCloudOptions)
    if not named.job_name:
        named.job_name = f"ratrain-{stage}-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}-{secrets.token_hex(3)}"
    return named.job_name


def rest_address(options: PipelineOptions) -> str:
    """The cluster's REST API, from --flink_master (read it before the job runs: FlinkRunner
    rewrites the option while it submits)."""
    master = options.view_as(FlinkRunnerOptions).flink_master.strip()
    return master if master.startswith(("http://", "https://")) else f"http://{master}"


def listed_jobs(address: str) -> list[dict]:
    """The cluster's jobs as its REST API at `address` lists them (`/jobs/overview`)."""
    try:
        with urllib.request.urlopen(f"{address}/jobs/overview", timeout=10) as response:
            return json.load(response)["jobs"]
    except (OSError, urllib.error.URLError, ValueError, KeyError) as err:
        raise FlinkSubmissionError(f"cannot read the Flink cluster's jobs at {address}: {err}") from err


def wait_until_flink_has(
    address: str, name: str, known: set[str], beam_state: Callable[[], str], *, timeout: float = 600, every: float = 1
) -> str:
    """Poll the cluster's REST API until it lists a job called `name` whose id is not in
    `known` (the ids listed before it was submitted); that job's Flink id. Raises when the job
    failed on arrival, when Beam's job server gave up on it first (`beam_state`, the Beam job's
    state: translating or submitting it failed), or when nothing arrived within `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:  # readiness poll: the job server builds and submits the Flink job in its own time
        jobs = [job for job in listed_jobs(address) if job["name"] == name and job["jid"] not in known]
        if jobs:
            (job,) = jobs
            if job["state"] in ("FAILED", "CANCELED"):
                raise FlinkSubmissionError(f"Flink job {name} ({job['jid']}) is {job['state']}")
            return job["jid"]
        state = beam_state()
        if state in (PipelineState.FAILED, PipelineState.CANCELLED):
            raise FlinkSubmissionError(f"Beam's Flink job server reports job {name} {state} before Flink had it")
        if time.monotonic() > deadline:
            raise FlinkSubmissionError(f"the Flink cluster at {address} did not list job {name} within {timeout:.0f} s")
        time.sleep(every)
