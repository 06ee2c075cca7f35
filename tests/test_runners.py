"""The runner is configuration: the same pipeline through Beam's portable Job API (the path Flink
and Spark take), against Beam's own Python job service, with LOOPBACK workers."""
import json
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


DATAFLOW = ["--runner=DataflowRunner", "--project=p", "--region=europe-west4",
            "--temp_location=gs://no-such-bucket/tmp", "--sdk_container_image=europe-docker.pkg.dev/p/ratrain/worker:1"]


def test_dry_run_shows_the_dataflow_plan_offline(tmp_path, capsys):
    """No credentials, no network: the graph is built, nothing is read, written or submitted."""
    from pipeline.cli import main
    from tests.conftest import write_config

    config = small_config("gs://no-such-bucket/out", "gs://no-such-bucket/corpus/*.jsonl",
                          embedding={"device": "cuda", "accelerator": "type:nvidia-l4;count:1;install-nvidia-driver",
                                     "model_copies": 1},
                          index={"min_ram": "64GB"})
    path = write_config(tmp_path / "c.yaml", config)
    main(["run", "--config", str(path), "--dry-run", "--", *DATAFLOW])
    plan = json.loads(capsys.readouterr().out)
    index_stages = {s["stage"]: s.get("resource_hints", {}) for s in plan["build-index"]["stages"]}
    assert index_stages["EmbedChunks"] == {"accelerator": "type:nvidia-l4;count:1;install-nvidia-driver"}
    assert index_stages["BuildIndex"] == {"min_ram_bytes": "64000000000"}
    shard_stages = {s["stage"]: s.get("resource_hints", {}) for s in plan["build-shards"]["stages"]}
    assert shard_stages["RetrieveNeighbours"] == {"min_ram_bytes": "64000000000"}
    for stage in ("build-index", "build-shards"):
        options = plan[stage]["options"]
        assert options["runner"] == "DataflowRunner" and options["project"] == "p"
        assert options["sdk_container_image"] == "europe-docker.pkg.dev/p/ratrain/worker:1"
    assert not list(tmp_path.iterdir())[1:]  # only the config: nothing written


def test_placement_hints_do_not_change_what_is_built(tmp_path):
    plain = config_from_dict(small_config(tmp_path, "x"))
    placed = config_from_dict(small_config(tmp_path, "x", embedding={
        "batch_size": 32, "accelerator": "type:nvidia-l4;count:1", "model_copies": 1}, index={"min_ram": "64GB"}))
    assert (plain.embed_hash(), plain.index_hash(), plain.shards_hash()) == \
        (placed.embed_hash(), placed.index_hash(), placed.shards_hash())
