import os

import pytest

from pipeline.options import LOCAL_RUNNER, encoder_threads, pipeline_options

MULTI = ["--direct_running_mode=multi_processing"]


def test_local_runner_is_the_default_and_an_explicit_runner_wins():
    assert pipeline_options([]).get_all_options()["runner"] == LOCAL_RUNNER
    assert pipeline_options(["--runner=PortableRunner"]).get_all_options()["runner"] == "PortableRunner"


@pytest.mark.parametrize("workers, cores, threads", [(2, 2, "1"), (2, 16, "8"), (4, 2, "1"), (0, 8, "1")])
def test_worker_processes_share_the_cores(monkeypatch, workers, cores, threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    pipeline_options(MULTI + [f"--direct_num_workers={workers}"])
    assert os.environ["OMP_NUM_THREADS"] == threads


@pytest.mark.parametrize("args", [[], ["--direct_num_workers=4"], MULTI + ["--direct_num_workers=1"]])
def test_one_process_keeps_every_core(monkeypatch, args):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    pipeline_options(args)
    assert "OMP_NUM_THREADS" not in os.environ


def test_the_users_thread_count_wins(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    pipeline_options(MULTI + ["--direct_num_workers=2"])
    assert os.environ["OMP_NUM_THREADS"] == "3"


@pytest.mark.parametrize("configured, device, args, threads", [
    (3, "cpu", MULTI + ["--direct_num_workers=2"], 3),                # configured wins
    (None, "cpu", [], 8),                                             # in-process: every core
    (None, "cpu", MULTI + ["--direct_num_workers=2"], 4),             # local workers share them
    (None, "cpu", MULTI + ["--direct_num_workers=16"], 1),
    (None, "cpu", ["--runner=PortableRunner", "--environment_type=LOOPBACK"], 8),  # calls back here
    (None, "cpu", ["--runner=DataflowRunner"], 1),                    # a process per worker core
    (None, "cpu", ["--runner=PortableRunner", "--environment_type=DOCKER"], 1),
    (2, "cuda", [], None),                                            # threads do not touch GPU bytes
])
def test_encoder_threads_are_fixed_once_per_job(monkeypatch, configured, device, args, threads):
    monkeypatch.setenv("OMP_NUM_THREADS", "5")  # what faiss gets does not decide the encoder's
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert encoder_threads(configured, device, pipeline_options(args)) == threads
