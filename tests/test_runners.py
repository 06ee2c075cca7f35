"""The runner is configuration: the same pipeline through Beam's portable Job API (the path Flink
and Spark take), against Beam's own Python job service, with LOOPBACK workers."""
import socket
import subprocess
import sys
import time

import pytest

from pipeline.run import run_all
from pipeline.validate import validate_path
from schemas.config import config_from_dict
from tests.conftest import sample_documents, small_config, write_jsonl


@pytest.fixture(scope="module")
def job_service():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "apache_beam.runners.portability.local_job_service_main",
                                "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:  # readiness poll
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            break
        except OSError:
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError("the Beam job service did not start")
            time.sleep(0.05)
    yield f"localhost:{port}"
    process.terminate()
    process.wait(10)


def test_portable_runner_writes_the_fnapi_runners_bytes(job_service, tmp_path):
    write_jsonl(tmp_path / "corpus" / "a.jsonl", sample_documents(6))
    corpus = str(tmp_path / "corpus" / "*.jsonl")
    portable = config_from_dict(small_config(tmp_path / "portable", corpus))
    report = run_all(portable, ["--runner=PortableRunner", f"--job_endpoint={job_service}",
                                "--environment_type=LOOPBACK"])
    assert [status for status, _ in report.values()] == ["built", "built"]
    assert report["build-shards"][1]["sequences"] > 0
    assert all(line.startswith("OK") for line in validate_path(str(tmp_path / "portable")))

    run_all(config_from_dict(small_config(tmp_path / "local", corpus)), [])
    for stage in ("index/chunks", "index/embeddings", "index/faiss", "shards"):
        local = sorted(p for p in (tmp_path / "local" / stage).iterdir() if p.suffix != ".json")
        assert local and [p.read_bytes() for p in local] == \
            [(tmp_path / "portable" / p.relative_to(tmp_path / "local")).read_bytes() for p in local]
