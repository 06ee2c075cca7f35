"""deploy/: the manifests parse, name the right images and versions, and the documented options
are ones the CLI accepts (checked with --dry-run, offline)."""
import json
import re
import string
import sys

import apache_beam
import pytest
import yaml

from pipeline.cli import main
from pipeline.flex_template import split_args
from pipeline.options import pipeline_options
from tests.conftest import REPO, small_config, write_config

DEPLOY = REPO / "deploy"
ENV = {"PROJECT": "p", "REGION": "europe-west4", "BUCKET": "b",
       "IMAGE": "europe-west4-docker.pkg.dev/p/ratrain/worker:0.1.0"}


def options(name: str) -> list[str]:
    text = string.Template((DEPLOY / name / "options.txt").read_text()).substitute(ENV)
    return text.split()


def test_dataflow_image_matches_the_project():
    dockerfile = (DEPLOY / "dataflow" / "Dockerfile").read_text()
    base = re.search(r"^FROM apache/beam_python(\d+\.\d+)_sdk:(\S+)$", dockerfile, re.M)
    assert base and base.group(1) == f"{sys.version_info.major}.{sys.version_info.minor}"
    assert base.group(2) == apache_beam.__version__
    pinned = re.search(r"torch==(\S+)", (REPO / "constraints.txt").read_text()).group(1)
    assert f"torch=={pinned} " in dockerfile and "download.pytorch.org/whl/cu" in dockerfile
    assert (REPO / dockerfile.split("FLEX_TEMPLATE_PYTHON_PY_FILE=/opt/ratrain/")[1].split()[0]).is_file()
    metadata = json.loads((DEPLOY / "dataflow" / "metadata.json").read_text())
    assert {p["name"] for p in metadata["parameters"]} == {"config", "command"}


def test_dataflow_options_parse():
    parsed = pipeline_options(options("dataflow")).get_all_options()
    assert parsed["runner"] == "DataflowRunner" and parsed["sdk_container_image"] == ENV["IMAGE"]
    assert parsed["temp_location"] == "gs://b/tmp" and parsed["project"] == "p"


def test_flink_manifests_name_the_worker_image_and_beam_version():
    (deployment,) = yaml.safe_load_all((DEPLOY / "flink" / "flink-deployment.yaml").read_text())
    assert deployment["kind"] == "FlinkDeployment"
    (pool,) = deployment["spec"]["taskManager"]["podTemplate"]["spec"]["containers"]
    assert pool["image"] == "${IMAGE}" and pool["args"] == ["--worker_pool"]
    assert pool["ports"][0]["containerPort"] == 50000
    server, service = yaml.safe_load_all((DEPLOY / "flink" / "beam-job-server.yaml").read_text())
    (container,) = server["spec"]["template"]["spec"]["containers"]
    flink = deployment["spec"]["flinkVersion"].replace("v", "").replace("_", ".")
    assert container["image"] == f"apache/beam_flink{flink}_job_server:{apache_beam.__version__}"
    assert any(a.startswith("--flink-master=ratrain-flink-rest:") for a in container["args"])
    assert {p["port"] for p in service["spec"]["ports"]} == {8099, 8098, 8097}
    parsed = pipeline_options(options("flink")).get_all_options()
    assert parsed["runner"] == "PortableRunner" and parsed["environment_type"] == "EXTERNAL"
    assert parsed["environment_config"] == "localhost:50000" and parsed["job_endpoint"].endswith(":8099")


@pytest.mark.parametrize("runner", ["dataflow", "flink"])
def test_documented_options_pass_a_dry_run(runner, tmp_path, capsys):
    path = write_config(tmp_path / "c.yaml", small_config("gs://b/out", "gs://b/corpus/*.jsonl"))
    main(["build-index", "--config", str(path), "--dry-run", "--", *options(runner)])
    plan = json.loads(capsys.readouterr().out)["build-index"]
    assert plan["options"]["runner"] == pipeline_options(options(runner)).get_all_options()["runner"]
    assert [s["stage"] for s in plan["stages"]][:3] == ["ReadRetrievalCorpus", "DocumentProgress", "ChunkDocuments"]


def test_flex_template_splits_its_parameters_from_beam_options():
    config, command, beam_args = split_args(["--config=gs://b/c.yaml", "--command=build-index",
                                             "--runner=DataflowRunner", "--project=p"])
    assert (config, command, beam_args) == ("gs://b/c.yaml", "build-index", ["--runner=DataflowRunner", "--project=p"])
    assert split_args(["--config", "gs://b/c.yaml"])[1] == "run"
    with pytest.raises(SystemExit):
        split_args(["--command=run"])  # no config
