"""The shuffle loss on Beam's local multi-process runner, reduced to its cause, and the
project's avoidance (`pipeline.jobs.options.no_timed_flush_on_local_runner`).

The runner writes a bundle's input into a stream whose 1 s timed flush sends the buffer and
then clears it, while the runner's `write` takes no lock: what is written during the send is
dropped. The xfail tests pin Beam's behaviour (apache-beam 2.77): when an upgrade fixes it
they pass, strict xfail turns that into a failure, and the avoidance can go.
"""

from __future__ import annotations

import subprocess
import sys
import threading

import apache_beam as beam
import pytest
from apache_beam.runners.portability.fn_api_runner import worker_handlers
from apache_beam.runners.worker import data_plane

from pipeline.jobs.options import new_pipeline
from tests.helpers import REPO

BEAM_RACE = (
    f"apache-beam {beam.__version__}: TimeBasedBufferingClosableOutputStream.flush clears "
    "what write() added while the flush was sending"
)


def sent_while_a_flush_sends(time_limit_ms: int) -> bytes:
    """Everything a runner-side data stream hands on when one message is written while its
    timed flush (if any) is sending the one before; the handshake makes the interleaving
    certain, with no sleep."""
    sent, sending, written = [], threading.Event(), threading.Event()

    def send(data: bytes) -> None:  # the flush callback: the gRPC send queue in the runner
        sent.append(data)
        if data and not sending.is_set():
            sending.set()
            assert written.wait(10)

    stream = data_plane.ClosableOutputStream.create(sent.append, send, time_limit_ms)
    stream.write(b"a" * 8)
    if time_limit_ms:
        assert sending.wait(10), "the timed flush never ran"
    stream.write(b"b" * 8)
    written.set()
    stream.close()
    return b"".join(sent)


@pytest.mark.xfail(strict=True, reason=BEAM_RACE)
@pytest.mark.unit
def test_beam_keeps_what_is_written_while_its_timed_flush_sends():
    assert sent_while_a_flush_sends(time_limit_ms=1) == b"a" * 8 + b"b" * 8


@pytest.mark.unit
def test_local_runs_flush_by_size_only_and_lose_nothing():
    saved = worker_handlers.DATA_BUFFER_TIME_LIMIT_MS
    try:
        worker_handlers.DATA_BUFFER_TIME_LIMIT_MS = 1000  # Beam's default
        new_pipeline(["--direct_num_workers=2", "--direct_running_mode=multi_processing"])
        assert worker_handlers.DATA_BUFFER_TIME_LIMIT_MS == 0
        stream = data_plane.ClosableOutputStream.create(None, None, worker_handlers.DATA_BUFFER_TIME_LIMIT_MS)
        assert not isinstance(stream, data_plane.TimeBasedBufferingClosableOutputStream)
        assert sent_while_a_flush_sends(worker_handlers.DATA_BUFFER_TIME_LIMIT_MS) == b"a" * 8 + b"b" * 8
    finally:
        worker_handlers.DATA_BUFFER_TIME_LIMIT_MS = saved


def _minimal_job(*args: str) -> str:
    """One run of the Beam-only reproduction (`benchmarks/shuffle_loss_minimal.py`) with 2 worker
    processes and the race window opened by timing alone; its summary line."""
    out = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "shuffle_loss_minimal.py"),
            "--runs",
            "1",
            "--sequences",
            "3000",
            "--widen",
            "0.4",
            *args,
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason=BEAM_RACE)
@pytest.mark.beam
def test_a_multi_process_beam_job_keeps_every_element_with_the_timed_flush():
    assert _minimal_job() == "0/1 runs lost elements"


@pytest.mark.slow
@pytest.mark.beam
def test_a_multi_process_beam_job_keeps_every_element_with_the_avoidance():
    assert _minimal_job("--no-time-flush") == "0/1 runs lost elements"
