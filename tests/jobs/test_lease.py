"""One writer per output: the lease is taken once, refused to a second taker with its holder
named, taken over when expired or when its process has ended, renewed, released only by its
holder; a commit refuses to run for a job that lost it."""

import json
import logging
import multiprocessing
import subprocess
import sys
import time

import pytest

from pipeline.common import conditional
from pipeline.common.errors import StageError
from pipeline.jobs.commit import commit_stage
from pipeline.jobs.lease import LEASE_FILE, Claim, Holder, Lease, LeaseHeld, check_held

pytestmark = pytest.mark.unit


def test_a_second_taker_is_refused_with_the_holder_named_and_the_lease_is_free_once_released(tmp_path):
    first = Lease.take(str(tmp_path), "build-index", seconds=60)
    with pytest.raises(
        LeaseHeld, match=rf"{tmp_path} is being written by build-index \(pid \d+ on .*, user .*\), started "
    ):
        Lease.take(str(tmp_path), "build-shards", seconds=60)
    first.release()
    assert not (tmp_path / LEASE_FILE).exists()
    Lease.take(str(tmp_path), "build-shards", seconds=60).release()
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing left beside it


def _write_holder(path, **fields):
    holder = Holder.new("build-index", 60)
    path.write_bytes(Holder(**{**holder.__dict__, **fields}).to_bytes())


def test_an_expired_lease_and_one_whose_process_ended_are_taken_over_with_a_warning(tmp_path, caplog):
    _write_holder(tmp_path / LEASE_FILE, expires=time.time() - 1)
    with caplog.at_level(logging.WARNING, logger="ratrain"):
        Lease.take(str(tmp_path), "build-shards", seconds=60).release()
    assert "took over the lease of build-index" in caplog.text and "expired at" in caplog.text

    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    _write_holder(tmp_path / LEASE_FILE, pid=int(ended.stdout))
    with caplog.at_level(logging.WARNING, logger="ratrain"):
        Lease.take(str(tmp_path), "build-shards", seconds=60).release()
    assert f"process {int(ended.stdout)} on this host has ended" in caplog.text


def test_a_live_holder_on_another_host_is_not_taken_over(tmp_path):
    _write_holder(tmp_path / LEASE_FILE, host="another-host", pid=1)
    with pytest.raises(LeaseHeld, match="pid 1 on another-host"):
        Lease.take(str(tmp_path), "build-shards", seconds=60)


def test_renewal_moves_the_expiry_and_release_leaves_a_lease_taken_over_alone(tmp_path):
    lease = Lease.take(str(tmp_path), "build-index", seconds=60)
    before = json.loads((tmp_path / LEASE_FILE).read_text())["expires"]
    lease.seconds = 120  # renewed for longer: the expiry moves on by a minute at least
    assert lease.renew() and json.loads((tmp_path / LEASE_FILE).read_text())["expires"] >= before + 60
    _write_holder(tmp_path / LEASE_FILE, host="another-host")  # taken over by a run elsewhere
    assert not lease.renew()
    lease.release()
    assert json.loads((tmp_path / LEASE_FILE).read_text())["host"] == "another-host"


def _take(output, job, results):
    try:
        Lease.take(output, job, seconds=60)
        results.put(job)
    except LeaseHeld:
        results.put(None)


def test_of_many_processes_taking_one_lease_at_once_exactly_one_gets_it(tmp_path):
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    takers = [context.Process(target=_take, args=(str(tmp_path), f"job-{i}", results)) for i in range(4)]
    for taker in takers:
        taker.start()
    for taker in takers:
        taker.join()
    got = [results.get() for _ in takers]
    assert len([job for job in got if job is not None]) == 1


def test_a_commit_for_a_job_that_lost_its_lease_commits_nothing(tmp_path):
    output, staging = tmp_path / "out", tmp_path / "out" / ".staging" / "index-1"
    (staging / "chunks").mkdir(parents=True)
    (staging / "chunks" / "a.parquet").write_text("a")
    lease = Lease.take(str(output), "build-index", seconds=60)
    claim = Claim(str(output), lease.holder.token, released_by_commit=True)
    _write_holder(output / LEASE_FILE, host="another-host")  # taken over meanwhile

    class Clock:
        stage = "build-index"

        def timings(self, counters):
            return {}

    from pydantic import BaseModel

    class Manifest(BaseModel):
        counters: dict = {"documents_read": 1}
        files: list = []

    with pytest.raises(StageError, match="no longer holds the output's lease .*another-host.*nothing was committed"):
        commit_stage(
            Manifest(),
            staging=str(staging),
            output=str(output),
            final=str(output / "index"),
            clock=Clock(),
            staged=["chunks/a.parquet"],
            claim=claim,
        )
    assert not (output / "index").exists()
    with pytest.raises(StageError):
        check_held(str(output), lease.holder.token)
    assert conditional.read_versioned(str(output / LEASE_FILE)) is not None


def test_a_detached_jobs_lease_outlives_the_process_that_submitted_it(tmp_path):
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    _write_holder(tmp_path / LEASE_FILE, pid=int(ended.stdout), detached=True)
    with pytest.raises(LeaseHeld, match=f"pid {int(ended.stdout)} on "):
        Lease.take(str(tmp_path), "build-shards", seconds=60)
