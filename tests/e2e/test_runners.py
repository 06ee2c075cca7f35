"""The runner is configuration: the same pipeline through Beam's portable Job API (the path Flink
and Spark take), against Beam's own Python job service, with LOOPBACK workers."""

import json
import pathlib
import subprocess
import sys
import time

import pytest

from pipeline.check.validate import validate_path
from pipeline.check.validate_beam import validate_with_beam
from pipeline.run import run_all
from schemas.config import config_from_dict
from tests.helpers import assert_same_data_files, small_config, write_config

pytestmark = pytest.mark.e2e


@pytest.mark.slow  # 30-50 s
def test_detached_stages_commit_themselves_on_an_external_worker_pool(
    job_service, beam_worker_pool, six_documents_built_locally, tmp_path
):
    """build-index --detach exits once the job service has the job; build-shards
    --wait-for-index --detach waits for that index to commit, submits and exits; the shards then
    commit on the worker pool with no submitting process left, with the in-process runner's bytes."""
    corpus, in_process = six_documents_built_locally
    config = write_config(tmp_path / "c.yaml", small_config(tmp_path / "pool", corpus))
    beam_args = [
        "--runner=PortableRunner",
        f"--job_endpoint={job_service}",
        "--environment_type=EXTERNAL",
        f"--environment_config={beam_worker_pool}",
    ]
    cli = str(pathlib.Path(sys.executable).parent / "ratrain-pipeline")
    submitted = subprocess.run(
        [cli, "build-index", "--config", str(config), "--detach", "--", *beam_args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert submitted.returncode == 0 and "build-index submitted" in submitted.stderr, submitted.stderr
    waited = subprocess.run(
        [
            cli,
            "build-shards",
            "--config",
            str(config),
            "--wait-for-index",
            "--poll-every",
            "0.2",
            "--detach",
            "--",
            *beam_args,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert waited.returncode == 0 and "build-shards submitted" in waited.stderr, waited.stderr
    shards = tmp_path / "pool" / "shards" / "manifest.json"
    deadline = time.monotonic() + 600
    while not shards.exists():  # readiness poll: the job commits on its own
        assert time.monotonic() < deadline, "the detached build-shards job never committed"
        time.sleep(0.2)
    assert all(line.startswith("OK") for line in validate_path(str(tmp_path / "pool")))

    assert_same_data_files(tmp_path / "pool", in_process)


def test_portable_runner_writes_the_fnapi_runners_bytes(job_service, six_documents_built_locally, tmp_path):
    corpus, in_process = six_documents_built_locally
    portable = config_from_dict(small_config(tmp_path / "portable", corpus))
    beam_args = ["--runner=PortableRunner", f"--job_endpoint={job_service}", "--environment_type=LOOPBACK"]
    report = run_all(portable, beam_args)
    assert [status for status, _ in report.values()] == ["built", "built"]
    assert report["build-shards"][1]["sequences"] > 0
    lines = validate_path(str(tmp_path / "portable"))
    assert all(line.startswith("OK") for line in lines)
    assert validate_with_beam(str(tmp_path / "portable"), beam_args) == lines  # validate as a job on that runner

    assert_same_data_files(tmp_path / "portable", in_process)


DATAFLOW = [
    "--runner=DataflowRunner",
    "--project=p",
    "--region=europe-west4",
    "--temp_location=gs://no-such-bucket/tmp",
    "--sdk_container_image=europe-docker.pkg.dev/p/ratrain/worker:1",
]


def test_dry_run_shows_the_dataflow_plan_offline(tmp_path, capsys):
    """No credentials, no network: the graph is built, nothing is read, written or submitted."""
    from pipeline.cli import main

    config = small_config(
        "gs://no-such-bucket/out",
        "gs://no-such-bucket/corpus/*.jsonl",
        embedding={"device": "cuda", "accelerator": "type:nvidia-l4;count:1;install-nvidia-driver", "model_copies": 1},
        index={"min_ram": "64GB", "accelerator": "type:nvidia-l4;count:1"},
    )
    path = write_config(tmp_path / "c.yaml", config)
    main(["run", "--config", str(path), "--dry-run", "--", *DATAFLOW])
    plan = json.loads(capsys.readouterr().out)
    index_stages = {s["stage"]: s.get("resource_hints", {}) for s in plan["build-index"]["stages"]}
    assert index_stages["EmbedChunks"] == {"accelerator": "type:nvidia-l4;count:1;install-nvidia-driver"}
    assert index_stages["BuildIndex"] == {"min_ram_bytes": "64000000000"}
    assert index_stages["BuildIndex/TrainIndex/Train"] == {
        "min_ram_bytes": "64000000000",
        "accelerator": "type:nvidia-l4;count:1",
    }
    shard_stages = {s["stage"]: s.get("resource_hints", {}) for s in plan["build-shards"]["stages"]}
    assert shard_stages["RetrieveNeighbours"] == {"min_ram_bytes": "64000000000"}
    for stage in ("build-index", "build-shards"):
        options = plan[stage]["options"]
        assert options["runner"] == "DataflowRunner" and options["project"] == "p"
        assert options["sdk_container_image"] == "europe-docker.pkg.dev/p/ratrain/worker:1"
    assert not list(tmp_path.iterdir())[1:]  # only the config: nothing written
