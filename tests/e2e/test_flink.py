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
from pipeline.run import run_all
from schemas.config import config_from_dict
from tests.helpers import (
    LocalFlinkCluster,
    assert_matches_the_local_run,
    assert_same_data_files,
    small_config,
    write_config,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CLI = str(Path(sys.executable).parent / "ratrain-pipeline")


def test_long_documents_on_flink_write_the_local_runners_bytes(flink_cluster, long_documents_built_locally, tmp_path):
    """Both stages on the cluster at parallelism 2 with LOOPBACK workers and every exchange
    blocking (an option only Beam's Java job server reads): every chunk, embedding, index slice
    and shard file equal to the local runner's, every neighbour slot filled, the same recall;
    Flink lists both jobs FINISHED, run in the mode asked for, each with subtasks on both
    TaskManagers."""
    config, local = long_documents_built_locally
    before = flink_cluster.job_ids()
    options = [*flink_cluster.options, "--environment_type=LOOPBACK", "--execution_mode_for_batch=BATCH_FORCED"]
    report = run_all(config_from_dict(config(tmp_path / "out")), options)
    assert [status for status, _ in report.values()] == ["built", "built"]

    assert report["build-shards"][1]["neighbour_slots_padded"] == 0
    assert_matches_the_local_run(tmp_path / "out", local)

    jobs = flink_cluster.job_ids() - before
    assert len(jobs) == 2
    for job in jobs:
        assert flink_cluster.rest(f"/jobs/{job}")["state"] == "FINISHED"
        assert flink_cluster.rest(f"/jobs/{job}/config")["execution-config"]["execution-mode"] == "BATCH_FORCED"
        assert flink_cluster.task_managers_of(job) == set(LocalFlinkCluster.TASK_MANAGERS)


def test_a_detached_build_shards_commits_itself_on_flink_with_an_external_worker_pool(
    flink_cluster, worker_pool, six_documents_built_locally, tmp_path
):
    """The layout of deploy/flink/ on one machine: workers from a worker pool process
    (EXTERNAL) that both TaskManagers share. build-shards --wait-for-index --detach, over the
    index the local runner committed, returns once Flink lists the job (Beam's job server, a
    child of the command, ends with it); the cluster finishes the job and it commits the shards
    itself, with the local runner's bytes. (A detached build-index chained into build-shards
    --wait-for-index runs on Beam's portable runner: tests/e2e/test_runners.py.)"""
    corpus, local = six_documents_built_locally
    out = tmp_path / "out"
    shutil.copytree(local / "index", out / "index")
    path = write_config(tmp_path / "c.yaml", small_config(out, corpus))
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

    assert_same_data_files(out, local)
    assert all(line.startswith("OK") for line in validate_path(str(out)))
    assert flink_cluster.rest(f"/jobs/{job}")["name"].rsplit("-", 3)[0] == "ratrain-build-shards"


def _running_vertex(cluster: LocalFlinkCluster, job: str, step: str) -> bool:
    return any(step in v["name"] and v["status"] == "RUNNING" for v in cluster.rest(f"/jobs/{job}")["vertices"])


def test_a_task_manager_killed_mid_build_index_leaves_the_undisturbed_bytes(
    flink_cluster, long_documents_built_locally, tmp_path
):
    """SIGKILL to one TaskManager while the embed stage runs. Flink's restart strategy reruns
    the job on the slots left, or the job fails and a re-run builds it; either way the index
    committed is the undisturbed run's, byte for byte, and a failed run commits nothing."""
    config, local = long_documents_built_locally
    path = write_config(tmp_path / "c.yaml", config(tmp_path / "out"))
    command = [CLI, "build-index", "--config", str(path), "--", *flink_cluster.options, "--environment_type=LOOPBACK"]
    before = flink_cluster.job_ids()
    build = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while True:  # readiness poll: until the cluster runs the job's embed stage
            jobs = flink_cluster.job_ids() - before
            if jobs and _running_vertex(flink_cluster, next(iter(jobs)), "EmbedChunks"):
                break
            assert build.poll() is None and time.monotonic() < deadline, "build-index ended before its embed stage ran"
            time.sleep(0.2)
        flink_cluster.kill("taskmanager-1")
        _, stderr = build.communicate(timeout=900)
        (job,) = jobs
        if build.returncode != 0:
            assert not (tmp_path / "out" / "index" / "manifest.json").exists(), "a failed job committed"
            flink_cluster.restore()
            rerun = subprocess.run(command, capture_output=True, text=True, timeout=900)
            assert rerun.returncode == 0, rerun.stderr[-3000:]
        else:  # Flink restarted it: the loss is in the job's exception history
            assert flink_cluster.rest(f"/jobs/{job}")["state"] == "FINISHED"
            assert flink_cluster.rest(f"/jobs/{job}/exceptions")["exceptionHistory"]["entries"], stderr[-3000:]
    finally:
        if build.poll() is None:  # SIGINT: the command's exit hooks stop the job server it started
            build.send_signal(signal.SIGINT)
            try:
                build.wait(60)
            except subprocess.TimeoutExpired:
                build.kill()
        flink_cluster.restore()

    assert_same_data_files(tmp_path / "out", local, stages=("index/chunks", "index/embeddings", "index/faiss"))
    assert all(line.startswith("OK") for line in validate_path(str(tmp_path / "out" / "index")))
