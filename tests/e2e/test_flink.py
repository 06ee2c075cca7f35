"""The pipeline on a real Flink cluster: one JobManager and two TaskManagers, each its own JVM,
started by deploy/local/runners.py as `make flink-up` does, and Beam's Flink job server.
Flink runs the graph with its own operators (batch GroupByKey as a sort, its network shuffle,
its restart strategy); what it writes is compared byte for byte with the local runner's output
of the same config."""

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.check.validate import validate_path
from tests.helpers import (
    DATA_STAGES,
    LocalFlinkCluster,
    assert_matches_the_local_run,
    assert_same_data_files,
    write_config,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CLI = str(Path(sys.executable).parent / "ratrain-pipeline")


def _running_vertex(cluster: LocalFlinkCluster, job: str, step: str) -> bool:
    return any(step in v["name"] and v["status"] == "RUNNING" for v in cluster.rest(f"/jobs/{job}")["vertices"])


def _build_index_with_a_task_manager_killed(cluster: LocalFlinkCluster, command: list[str]) -> str:
    """Run `command` (a build-index on the cluster); SIGKILL one TaskManager while the job's
    embed stage runs. Flink's restart strategy reruns the lost tasks on the slots left, and
    the job finishes with the loss in its exception history. The job's id."""
    before = cluster.job_ids()
    build = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while True:  # readiness poll: until the cluster runs the job's embed stage
            jobs = cluster.job_ids() - before
            if jobs and _running_vertex(cluster, next(iter(jobs)), "EmbedChunks"):
                break
            assert build.poll() is None and time.monotonic() < deadline, "build-index ended before its embed stage ran"
            time.sleep(0.2)
        (job,) = jobs
        # the job runs on both TaskManagers (evenly spread slots) before one is lost
        assert cluster.task_managers_of(job) == set(LocalFlinkCluster.TASK_MANAGERS)
        cluster.kill("taskmanager-1")
        _, stderr = build.communicate(timeout=900)
        assert build.returncode == 0, f"the job was not restarted:\n{stderr[-3000:]}"
        assert cluster.rest(f"/jobs/{job}")["state"] == "FINISHED"
        assert cluster.rest(f"/jobs/{job}/exceptions")["exceptionHistory"]["entries"], stderr[-3000:]
        return job
    finally:
        if build.poll() is None:  # SIGINT: the command's exit hooks stop the job server it started
            build.send_signal(signal.SIGINT)
            try:
                build.wait(60)
            except subprocess.TimeoutExpired:
                build.kill()
        cluster.restore()


def test_long_documents_build_index_on_flink_writes_the_local_runners_bytes_with_a_task_manager_killed(
    flink_cluster, long_documents_built_locally, tmp_path
):
    """build-index on the cluster at parallelism 2 with LOOPBACK workers and every exchange
    blocking (an option only Beam's Java job server reads) loses a TaskManager to SIGKILL while
    its embed stage runs (`_build_index_with_a_task_manager_killed`). Every chunk, embedding and
    index slice file equals the local runner's, validate passes, and the job ran in the mode
    asked for. (build-shards of the same documents on the cluster: the detached test below.)"""
    config, local = long_documents_built_locally
    out = tmp_path / "out"
    path = write_config(tmp_path / "c.yaml", config(out))
    options = [*flink_cluster.options, "--environment_type=LOOPBACK", "--execution_mode_for_batch=BATCH_FORCED"]
    job = _build_index_with_a_task_manager_killed(
        flink_cluster, [CLI, "build-index", "--config", str(path), "--", *options]
    )
    assert_same_data_files(out, local, stages=DATA_STAGES[:-1])  # the index stage's folders
    assert all(line.startswith("OK") for line in validate_path(str(out / "index")))
    assert flink_cluster.rest(f"/jobs/{job}/config")["execution-config"]["execution-mode"] == "BATCH_FORCED"


def test_a_detached_build_shards_commits_itself_on_flink_with_an_external_worker_pool(
    flink_cluster, worker_pool, long_documents_built_locally, tmp_path
):
    """The layout of deploy/flink/ on one machine: workers from a worker pool process
    (EXTERNAL) that both TaskManagers share. build-shards --wait-for-index --detach, over the
    index in slices the local runner committed, returns once Flink lists the job (Beam's job
    server, a child of the command, ends with it); the cluster finishes the job, with subtasks
    on both TaskManagers, and it commits the shards itself: the local runner's bytes, every
    neighbour slot filled, the same recall, validate passing. (A detached build-index chained
    into build-shards --wait-for-index runs on Beam's portable runner: tests/e2e/test_runners.py.)"""
    config, local = long_documents_built_locally
    out = tmp_path / "out"
    shutil.copytree(local / "index", out / "index")
    path = write_config(tmp_path / "c.yaml", config(out))
    options = [*flink_cluster.options, "--environment_type=EXTERNAL", f"--environment_config={worker_pool}"]
    before = flink_cluster.job_ids()
    shards = subprocess.run(
        [CLI, "build-shards", "--config", str(path), "--wait-for-index", "--poll-every", "1", "--detach", "--"]
        + options,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert shards.returncode == 0 and "build-shards submitted as job" in shards.stderr, shards.stderr[-3000:]
    (job,) = flink_cluster.job_ids() - before  # on the cluster when the command returned
    deadline = time.monotonic() + 600

    def finished() -> bool:  # it commits itself, then Flink marks it finished
        state = flink_cluster.rest(f"/jobs/{job}")["state"]
        assert state not in ("FAILED", "CANCELED"), f"the detached build-shards job {state}"
        return state == "FINISHED" and (out / "shards" / "manifest.json").exists()

    while not finished():  # readiness poll
        assert time.monotonic() < deadline, "the detached build-shards job never committed and finished"
        time.sleep(0.5)

    assert_matches_the_local_run(out, local)
    assert flink_cluster.task_managers_of(job) == set(LocalFlinkCluster.TASK_MANAGERS)
    assert flink_cluster.rest(f"/jobs/{job}")["name"].rsplit("-", 3)[0] == "ratrain-build-shards"
