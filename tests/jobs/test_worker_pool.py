"""The worker pool over real gRPC: two callers (two TaskManagers) start workers under the same
id, as Beam's Java runner numbers them per JVM, and each stop reaches its own caller's worker."""

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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split()[2] != "Z"  # a zombie has exited


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
    try:
        _start(first, "1-1", "first")
        _start(second, "1-1", "second")  # the other TaskManager's first worker: the same id
        deadline = time.monotonic() + 30
        while not ((tmp_path / "first").exists() and (tmp_path / "second").exists()):  # readiness poll
            assert time.monotonic() < deadline, "the workers did not start"
            time.sleep(0.05)
        pids = {name: int((tmp_path / name).read_text()) for name in ("first", "second")}

        first.StopWorker(beam_fn_api_pb2.StopWorkerRequest(worker_id="1-1"))
        assert not _alive(pids["first"]) and _alive(pids["second"])
        second.StopWorker(beam_fn_api_pb2.StopWorkerRequest(worker_id="1-1"))
        assert not _alive(pids["second"])
    finally:
        first_channel.close()
        second_channel.close()
        server.stop(0)
        for name in ("first", "second"):
            if (tmp_path / name).exists():
                pid = int((tmp_path / name).read_text())
                if _alive(pid):
                    os.kill(pid, 9)
