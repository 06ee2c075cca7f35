"""The worker pool over real gRPC: two callers (two TaskManagers) start workers under the same
id, as Beam's Java runner numbers them per JVM, and each stop reaches its own caller's worker;
a stop over a new connection (a channel that reconnected) reaches a worker only when its id
names one."""

import os
import sys
import time

import grpc
import pytest
from apache_beam.portability.api import beam_fn_api_pb2, beam_fn_api_pb2_grpc, endpoints_pb2

from pipeline.jobs.worker_pool import WorkerPool

pytestmark = pytest.mark.e2e  # a gRPC service and worker processes

WORKER = """#!{python}
import os, sys, time
control = [a.split("=", 1)[1] for a in sys.argv if a.startswith("--control_endpoint=")][0]
open(os.path.join({directory!r}, control), "w").write(str(os.getpid()))
time.sleep(600)
"""


def _alive(pid: int, worker) -> bool:
    """Whether `pid` runs, and runs the `worker` script (not a process that took a freed pid)."""
    try:
        with open(f"/proc/{pid}/stat") as stat, open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return stat.read().split()[2] != "Z" and str(worker).encode() in cmdline.read()  # a zombie has exited
    except FileNotFoundError:
        return False


def _caller(address: str):
    """A stub on a connection of its own (gRPC would otherwise share one between channels)."""
    channel = grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
    return beam_fn_api_pb2_grpc.BeamFnExternalWorkerPoolStub(channel), channel


def _start(stub, worker_id: str, control: str) -> None:
    endpoint = endpoints_pb2.ApiServiceDescriptor(url=control)
    request = beam_fn_api_pb2.StartWorkerRequest(worker_id=worker_id, control_endpoint=endpoint)
    assert not stub.StartWorker(request).error


def test_each_caller_stops_only_the_worker_it_started(tmp_path):
    worker = tmp_path / "worker"
    worker.write_text(WORKER.format(python=sys.executable, directory=str(tmp_path)))
    worker.chmod(0o755)
    address, server = WorkerPool.start(use_process=True, container_executable=str(worker))
    (first, first_channel), (second, second_channel) = _caller(address), _caller(address)
    reconnected, reconnected_channel = _caller(address)
    try:
        _start(first, "1-1", "first")
        _start(second, "1-1", "second")  # the other TaskManager's first worker: the same id
        deadline = time.monotonic() + 30
        while not ((tmp_path / "first").exists() and (tmp_path / "second").exists()):  # readiness poll
            assert time.monotonic() < deadline, "the workers did not start"
            time.sleep(0.05)
        pids = {name: int((tmp_path / name).read_text()) for name in ("first", "second")}

        stop = beam_fn_api_pb2.StopWorkerRequest(worker_id="1-1")
        reconnected.StopWorker(stop)  # two workers of that id: which one is not known
        assert _alive(pids["first"], worker) and _alive(pids["second"], worker)
        first.StopWorker(stop)
        assert not _alive(pids["first"], worker) and _alive(pids["second"], worker)
        reconnected.StopWorker(stop)  # now the id names one
        assert not _alive(pids["second"], worker)
    finally:
        for channel in (first_channel, second_channel, reconnected_channel):
            channel.close()
        server.stop(0)
        for name in ("first", "second"):
            if (tmp_path / name).exists():
                pid = int((tmp_path / name).read_text())
                if _alive(pid, worker):
                    os.kill(pid, 9)
