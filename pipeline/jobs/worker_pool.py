"""A Beam SDK worker pool that several Flink TaskManagers can share.

A portable runner asks a worker pool for a Python worker (`StartWorker`) and later stops it
(`StopWorker`), naming it by an id. Beam's Java runner numbers those ids per JVM
(`DefaultJobBundleFactory`: "<factory>-<environment>" from a static counter), so two
TaskManagers both start a worker "1-1". Beam's Python pool files workers under the bare id, and
when one TaskManager stops its "1-1" it stops the one filed last: often the other
TaskManager's, in the middle of a bundle, and the job fails with "SDK harness closed
connection". That happens wherever one pool serves more than one TaskManager: LOOPBACK (the
pool is the submitting process) and EXTERNAL with one pool per machine.

`WorkerPool` files each worker under its id and the connection that asked for it (a
TaskManager's environment sends StartWorker and StopWorker over one channel), so a stop reaches
only the worker its own caller started.

    python -m pipeline.jobs.worker_pool --service_port 50000   # EXTERNAL workers, one process each
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from apache_beam.portability.api import beam_fn_api_pb2
from apache_beam.runners.worker import worker_pool_main

log = logging.getLogger("ratrain")


def worker_key(worker_id: str, caller: str) -> str:
    """The name a worker is filed under: its id and the gRPC peer that started it."""
    return f"{worker_id} from {caller}"


class WorkerPool(worker_pool_main.BeamFnExternalWorkerPoolServicer):
    """Beam's worker pool, its workers filed by id and caller (`worker_key`) in the tables Beam's
    StartWorker and StopWorker keep."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._filing = threading.Lock()
        if not (isinstance(self._worker_processes, dict) and isinstance(self._worker_threads, dict)):
            raise TypeError("Beam's worker pool no longer keeps _worker_processes and _worker_threads")

    def StartWorker(self, request, context):  # noqa: N802 (gRPC's method name)
        key = worker_key(request.worker_id, context.peer())
        with self._filing:  # Beam's StartWorker files it under the bare id: refile before another start can
            response = super().StartWorker(request, context)
            for workers in (self._worker_processes, self._worker_threads):
                if request.worker_id in workers:
                    workers[key] = workers.pop(request.worker_id)
        return response

    def StopWorker(self, request, context):  # noqa: N802
        key = worker_key(request.worker_id, context.peer())
        with self._filing:
            filed = {*self._worker_processes, *self._worker_threads}
            if key not in filed:  # the caller's channel reconnected: a worker of that id, if only one
                same_id = [k for k in filed if k.startswith(worker_key(request.worker_id, ""))]
                if len(same_id) != 1:  # none, or which one is ambiguous: it ends when its runner hangs up
                    log.debug("StopWorker %s: %d workers of that id, none stopped", key, len(same_id))
                    return beam_fn_api_pb2.StopWorkerResponse()
                key = same_id[0]
        return super().StopWorker(beam_fn_api_pb2.StopWorkerRequest(worker_id=key), context)


def _hung_up_worker_threads(args: threading.ExceptHookArgs) -> None:
    """When a runner closes a LOOPBACK worker's environment after its work (Flink does, stage by
    stage), the worker's gRPC streams end CANCELLED and Beam's threads raise that on their way
    out: two tracebacks per worker of a job that succeeds. Those go to the debug log; a job's
    real failure comes from its runner. Any other error in a thread is reported as before."""
    import grpc

    error = args.exc_value
    if isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.CANCELLED:
        log.debug("worker thread %s: streams closed by the runner", args.thread.name if args.thread else "?")
        return
    threading.__excepthook__(args)


def serve_loopback_workers_by_caller() -> None:
    """Make the pool a portable runner starts in this process for LOOPBACK workers a
    `WorkerPool` (Beam's runner creates it through this module attribute), and keep the
    CANCELLED of its threads' hung-up streams out of the terminal."""
    setattr(worker_pool_main, "BeamFnExternalWorkerPoolServicer", WorkerPool)  # noqa: B010 (mypy: a class)
    threading.excepthook = _hung_up_worker_threads


def main(argv: list[str] | None = None) -> None:
    """A pool for EXTERNAL workers, each worker a process of its own (as Beam's
    `worker_pool_main`), until interrupted."""
    parser = argparse.ArgumentParser(description="A Beam SDK worker pool for --environment_type=EXTERNAL.")
    parser.add_argument("--service_port", type=int, required=True, help="the port it listens on (0: any)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    # Beam starts each worker as `python -c ...`: this interpreter's, with the project installed
    os.environ["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    address, server = WorkerPool.start(use_process=True, port=args.service_port)
    # SIGTERM as SIGINT: an orderly exit, whose atexit hook (Beam's) stops the worker processes
    signal.signal(signal.SIGTERM, lambda *_: signal.raise_signal(signal.SIGINT))
    log.info("worker pool listening at %s", address)
    try:
        server.wait_for_termination()
    except KeyboardInterrupt:
        server.stop(0)


if __name__ == "__main__":
    main()
