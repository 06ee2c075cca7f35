"""deploy/: the manifests parse, name the right images and versions, and the documented options
are ones the CLI accepts (checked with --dry-run, offline)."""

import importlib.metadata
import importlib.util
import json
import posixpath
import re
import shlex
import string
import sys

import apache_beam
import pytest
import yaml

from pipeline.cli import main
from pipeline.flex_template import split_args
from pipeline.jobs.options import pipeline_options
from tests.helpers import REPO, small_config, write_config

DEPLOY = REPO / "deploy"
# The variables deploy/README.md has the user export before `envsubst`.
ENV = {
    "PROJECT": "p",
    "REGION": "europe-west4",
    "BUCKET": "b",
    "IMAGE": "europe-west4-docker.pkg.dev/p/ratrain/worker:0.1.0",
    "JOB_HOST": "localhost",
    "CONFIG": "gs://b/config.yaml",
}


def rendered(path) -> str:
    """A deploy file as `envsubst` writes it: every ${VAR} one the README exports."""
    return string.Template(path.read_text()).substitute(ENV)


def options(name: str) -> list[str]:
    return rendered(DEPLOY / name / "options.txt").split()


@pytest.mark.parametrize(
    "path", sorted(p.relative_to(DEPLOY).as_posix() for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".txt"))
)
@pytest.mark.unit
def test_applied_files_have_no_placeholder_left(path):
    text = rendered(DEPLOY / path)
    assert "${" not in text and "$(" not in text
    if path.endswith(".yaml"):
        assert list(yaml.safe_load_all(text))


def dockerfile_stages(path) -> list[dict]:
    """A Dockerfile as the builder reads it: per build stage its base image, name, WORKDIR, the
    files its COPY instructions place ({absolute destination: (source stage or None, sources)}),
    its ENV and its RUN commands (as argument lists)."""
    text = re.sub(r"\\\n", " ", path.read_text())  # line continuations
    stages = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, rest = line.partition(" ")
        instruction, args = instruction.upper(), shlex.split(rest)
        if instruction == "FROM":
            name = args[2] if len(args) > 2 and args[1].upper() == "AS" else None
            stages.append({"image": args[0], "name": name, "workdir": "/", "files": {}, "env": {}, "run": []})
            continue
        stage = stages[-1]
        if instruction == "WORKDIR":
            stage["workdir"] = posixpath.join(stage["workdir"], args[0])
        elif instruction == "COPY":
            source = next((a.split("=", 1)[1] for a in args if a.startswith("--from=")), None)
            *sources, target = [a for a in args if not a.startswith("--")]
            target = posixpath.normpath(posixpath.join(stage["workdir"], target))
            if len(sources) == 1 and not target.endswith("/") and not sources[0].endswith("/"):
                stage["files"][target] = (source, sources[0])
            else:  # into a directory
                for item in sources:
                    stage["files"][posixpath.join(target, posixpath.basename(item.rstrip("/")))] = (source, item)
        elif instruction == "ENV":
            pairs = [a.split("=", 1) for a in args] if "=" in args[0] else [args[:1] + [" ".join(args[1:])]]
            stage["env"].update(pairs)
        elif instruction == "RUN":
            stage["run"].append(args)
    return stages


def python_of(image: str) -> str | None:
    """The Python version an image reference names (`...python3.11...`, `...python311...`)."""
    found = re.search(r"python(\d)\.?(\d+)", image)
    return found and f"{found.group(1)}.{found.group(2)}"


def pip_installs(stage: dict) -> list[list[str]]:
    """The arguments of each `pip install` the stage runs."""
    installs = []
    for args in stage["run"]:
        for start in [i for i in range(len(args) - 1) if args[i : i + 2] == ["pip", "install"]]:
            end = args.index("&&", start) if "&&" in args[start:] else len(args)
            installs.append(args[start + 2 : end])
    return installs


PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"


@pytest.mark.unit
def test_the_dataflow_image_runs_this_beam_and_python_and_installs_the_project_as_here():
    """What the image is, whatever the Dockerfile's wording: every stage's Python is this one,
    the workers' base is Beam's SDK image of the installed Beam, and the project goes in whole,
    under constraints.txt, with the torch release it pins."""
    *builders, image = dockerfile_stages(DEPLOY / "dataflow" / "Dockerfile")
    repository, _, tag = image["image"].partition(":")
    assert repository.startswith("apache/beam_python") and repository.endswith("_sdk")
    assert tag == apache_beam.__version__
    assert {python_of(stage["image"]) for stage in [*builders, image]} == {PYTHON}
    copied = {source for stage, source in image["files"].values() if stage is None}
    packages = importlib.metadata.distribution("ratrain-pipeline").read_text("top_level.txt").split()
    assert packages and set(packages) <= copied  # the packages an install here holds
    assert {"pyproject.toml", "constraints.txt"} <= copied
    project = [args for args in pip_installs(image) if "." in args]
    assert project and all(args[args.index("-c") + 1] == "constraints.txt" for args in project)
    pinned = re.search(r"^torch==(\S+)", (REPO / "constraints.txt").read_text(), re.M).group(1)
    torch = [(args, a) for args in pip_installs(image) for a in args if a.startswith("torch==")]
    assert [a for _, a in torch] == [f"torch=={pinned}"]  # before the project: its CUDA build
    assert "/whl/cu" in torch[0][0][torch[0][0].index("--index-url") + 1]


@pytest.mark.unit
def test_the_dataflow_image_is_its_own_flex_template_launcher_with_an_entry_that_imports():
    """Dataflow's launcher binary is in the image, FLEX_TEMPLATE_PYTHON_PY_FILE names a file the
    image holds (copied from this repository) that imports as a module, and nothing makes the
    launcher install the project again. The template's parameters are the entry's own flags."""
    *builders, image = dockerfile_stages(DEPLOY / "dataflow" / "Dockerfile")
    launcher = image["files"]["/opt/google/dataflow/python_template_launcher"]
    assert launcher[0] in {stage["name"] for stage in builders}
    entry = image["env"]["FLEX_TEMPLATE_PYTHON_PY_FILE"]
    stage, source = image["files"][entry]
    assert stage is None and (REPO / source).is_file()
    spec = importlib.util.spec_from_file_location("flex_template_entry", REPO / source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # as a module: imports, submits nothing
    assert callable(module.main)
    assert not {"FLEX_TEMPLATE_PYTHON_SETUP_FILE", "FLEX_TEMPLATE_PYTHON_REQUIREMENTS_FILE"} & image["env"].keys()
    metadata = json.loads((DEPLOY / "dataflow" / "metadata.json").read_text())
    names = [p["name"] for p in metadata["parameters"]]
    config, command, beam_args = split_args([f"--{name}={value}" for name, value in zip(names, ("c", "run"))])
    assert "config" in names and beam_args == []  # every parameter is the entry's, none goes to Beam


@pytest.mark.unit
def test_the_entry_script_shadows_no_standard_module():
    """A script's directory comes first on sys.path: nothing beside it may share a name with
    the standard library (pipeline/inspect.py did, when the entry script lived in pipeline/)."""
    beside = {p.stem for p in (DEPLOY / "dataflow").iterdir() if p.suffix == ".py"} - {"main"}
    assert not beside & set(sys.stdlib_module_names)


@pytest.mark.e2e
def test_the_flex_template_entry_runs_as_a_file_and_submits_detached(tmp_path):
    """As the launcher runs it: the entry script alone in its directory, run as a file with the
    template's parameters and Beam options as flags. On the local runner the submitted job
    commits before the script returns; run again, it submits the next stage."""
    import shutil
    import subprocess

    from tests.helpers import sample_documents, write_jsonl

    write_jsonl(tmp_path / "corpus" / "a.jsonl", sample_documents(2))
    config = write_config(tmp_path / "c.yaml", small_config(tmp_path / "out", str(tmp_path / "corpus" / "*.jsonl")))
    shutil.copy(DEPLOY / "dataflow" / "main.py", tmp_path / "main.py")
    for stage in ("index", "shards"):
        launched = subprocess.run(
            [sys.executable, str(tmp_path / "main.py"), f"--config={config}", "--command=run", "--runner=FnApiRunner"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert launched.returncode == 0, launched.stderr[-2000:]
        assert f"build-{stage} submitted" in launched.stderr
        assert (tmp_path / "out" / stage / "manifest.json").exists()


@pytest.mark.unit
def test_dataflow_options_parse():
    parsed = pipeline_options(options("dataflow")).get_all_options()
    assert parsed["runner"] == "DataflowRunner" and parsed["sdk_container_image"] == ENV["IMAGE"]
    assert parsed["temp_location"] == "gs://b/tmp" and parsed["project"] == "p"


@pytest.mark.unit
def test_flink_manifests_name_the_worker_image_and_beam_version():
    (deployment,) = yaml.safe_load_all(rendered(DEPLOY / "flink" / "flink-deployment.yaml"))
    assert deployment["kind"] == "FlinkDeployment"
    main, pool = deployment["spec"]["taskManager"]["podTemplate"]["spec"]["containers"]
    assert pool["image"] == ENV["IMAGE"] and pool["args"] == ["--worker_pool"]
    assert pool["ports"][0]["containerPort"] == 50000 and pool["resources"]["requests"]
    # without checkpoints Flink's default is no restart: a lost TaskManager would fail the job
    assert deployment["spec"]["flinkConfiguration"]["restart-strategy.type"] == "exponential-delay"
    server, service = yaml.safe_load_all(rendered(DEPLOY / "flink" / "beam-job-server.yaml"))
    (container,) = server["spec"]["template"]["spec"]["containers"]
    flink = deployment["spec"]["flinkVersion"].replace("v", "").replace("_", ".")
    assert container["image"] == f"apache/beam_flink{flink}_job_server:{apache_beam.__version__}"
    assert any(a.startswith("--flink-master=ratrain-flink-rest:") for a in container["args"])
    assert {p["port"] for p in service["spec"]["ports"]} == {8099, 8098, 8097}
    parsed = pipeline_options(options("flink")).get_all_options()
    assert parsed["runner"] == "PortableRunner" and parsed["environment_type"] == "EXTERNAL"
    assert parsed["environment_config"] == "localhost:50000" and parsed["job_endpoint"].endswith(":8099")
    assert int(parsed["sdk_worker_parallelism"]) == 4


def _mounts(pod_spec: dict, container: dict) -> dict:
    """{mount path: claim name} of a container's volumes that are persistent volume claims."""
    claims = {
        v["name"]: v["persistentVolumeClaim"]["claimName"]
        for v in pod_spec.get("volumes", [])
        if "persistentVolumeClaim" in v
    }
    return {m["mountPath"]: claims[m["name"]] for m in container.get("volumeMounts", []) if m["name"] in claims}


@pytest.mark.unit
def test_job_server_and_task_managers_share_the_artifacts_directory():
    """The job server stages artifacts under --artifacts-dir; task managers read that path:
    it must be the same volume in both (else every job fails to find its artifacts)."""
    (deployment,) = yaml.safe_load_all(rendered(DEPLOY / "flink" / "flink-deployment.yaml"))
    server, _ = yaml.safe_load_all(rendered(DEPLOY / "flink" / "beam-job-server.yaml"))
    (claim,) = yaml.safe_load_all(rendered(DEPLOY / "flink" / "artifacts-pvc.yaml"))
    server_pod = server["spec"]["template"]["spec"]
    (container,) = server_pod["containers"]
    artifacts = next(a.split("=", 1)[1] for a in container["args"] if a.startswith("--artifacts-dir="))
    expected = {artifacts: claim["metadata"]["name"]}
    assert _mounts(server_pod, container) == expected and "ReadWriteMany" in claim["spec"]["accessModes"]
    task_pod = deployment["spec"]["taskManager"]["podTemplate"]["spec"]
    for task_container in task_pod["containers"]:
        assert _mounts(task_pod, task_container) == expected, task_container["name"]


@pytest.mark.unit
def test_in_cluster_submission_uses_the_documented_options():
    (job,) = yaml.safe_load_all(rendered(DEPLOY / "flink" / "submit-job.yaml"))
    (container,) = job["spec"]["template"]["spec"]["containers"]
    command = container["command"]
    assert container["image"] == ENV["IMAGE"] and command[:5] == [
        "ratrain-pipeline",
        "run",
        "--config",
        ENV["CONFIG"],
        "--detach",
    ]
    beam_args = command[command.index("--") + 1 :]
    in_cluster = [a.replace("localhost:809", "ratrain-beam-job-server:809") for a in options("flink")]
    assert sorted(beam_args) == sorted(in_cluster)


@pytest.mark.parametrize("runner", ["dataflow", "flink"])
@pytest.mark.e2e  # a dry run: the whole job's graph built through the CLI
def test_documented_options_pass_a_dry_run(runner, tmp_path, capsys):
    path = write_config(tmp_path / "c.yaml", small_config("gs://b/out", "gs://b/corpus/*.jsonl"))
    main(["build-index", "--config", str(path), "--dry-run", "--", *options(runner)])
    plan = json.loads(capsys.readouterr().out)["build-index"]
    assert plan["options"]["runner"] == pipeline_options(options(runner)).get_all_options()["runner"]
    assert [s["stage"] for s in plan["stages"]][:3] == ["ReadRetrievalCorpus", "DocumentProgress", "ChunkDocuments"]


@pytest.mark.unit
def test_flex_template_splits_its_parameters_from_beam_options():
    config, command, beam_args = split_args(
        ["--config=gs://b/c.yaml", "--command=build-index", "--runner=DataflowRunner", "--project=p"]
    )
    assert (config, command, beam_args) == ("gs://b/c.yaml", "build-index", ["--runner=DataflowRunner", "--project=p"])
    assert split_args(["--config", "gs://b/c.yaml"])[1] == "run"
    with pytest.raises(SystemExit):
        split_args(["--command=run"])  # no config


def _local_runners():
    """deploy/local/runners.py, as a module (it runs as a script, beside no package)."""
    spec = importlib.util.spec_from_file_location("local_runners", DEPLOY / "local" / "runners.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.unit
def test_the_local_runners_run_the_releases_the_manifests_and_docs_name():
    runners = _local_runners()
    (deployment,) = yaml.safe_load_all(rendered(DEPLOY / "flink" / "flink-deployment.yaml"))
    assert deployment["spec"]["flinkVersion"] == "v" + runners.FLINK_MINOR.replace(".", "_")
    assert runners.FLINK_VERSION.startswith(runners.FLINK_MINOR + ".")
    flink, spark = runners.FLINK_JOB_SERVER.pinned(), runners.SPARK_JOB_SERVER.pinned()
    assert f"beam-runners-flink-{runners.FLINK_MINOR}-{runners.BEAM_JAVA_VERSION}.jar" in flink
    assert {f"flink-runtime-{runners.FLINK_MINOR}.0.jar", f"flink-clients-{runners.FLINK_MINOR}.0.jar"} <= set(flink)
    assert f"beam-runners-spark-3-{runners.BEAM_JAVA_VERSION}.jar" in spark
    assert f"spark-core_2.12-{runners.SPARK_VERSION}.jar" in spark
    parsed = pipeline_options(runners.spark_options(REPO)).get_all_options()
    assert parsed["runner"] == "SparkRunner" and parsed["spark_master_url"] == runners.SPARK_MASTER
    readme = (DEPLOY / "README.md").read_text()
    for version in (runners.BEAM_JAVA_VERSION, runners.FLINK_VERSION, runners.SPARK_VERSION, apache_beam.__version__):
        assert version in readme


@pytest.mark.unit
def test_the_job_servers_jars_are_checked_against_their_pins(tmp_path):
    runners = _local_runners()
    (tmp_path / "a.jar").write_bytes(b"a")
    pinned = {"a.jar": runners.hashlib.sha256(b"a").hexdigest()}
    runners.check_jars(tmp_path, pinned)
    (tmp_path / "a.jar").write_bytes(b"tampered")
    with pytest.raises(runners.ClusterError, match="sha256 differs"):
        runners.check_jars(tmp_path, pinned)
    (tmp_path / "a.jar").write_bytes(b"a")
    (tmp_path / "b.jar").write_bytes(b"b")
    with pytest.raises(runners.ClusterError, match=r"not pinned \['b.jar'\]"):
        runners.check_jars(tmp_path, pinned)


@pytest.mark.unit
def test_the_local_flink_cluster_can_rerun_a_job_without_one_task_manager(tmp_path):
    """At the defaults a job runs a subtask on every TaskManager, and the slots of the others
    hold the whole job again once one is lost (the restart the SIGKILL test relies on)."""
    runners = _local_runners()
    managers, slots = runners.TASK_MANAGERS, runners.SLOTS
    config = yaml.safe_load(runners.flink_config(tmp_path, 8081, 6123, managers, slots))
    options = [*runners.beam_options(tmp_path, 8081, managers), "--environment_type=LOOPBACK"]
    parallelism = int(pipeline_options(options).get_all_options()["parallelism"])
    assert parallelism == managers == config["parallelism"]["default"]  # a subtask on each
    assert config["taskmanager"]["numberOfTaskSlots"] * (managers - 1) >= parallelism
    # the tasks a lost TaskManager held fail together, counted as one restart
    assert config["cluster"]["evenly-spread-out-slots"] and config["restart-strategy"]["type"] == "exponential-delay"
    assert config["rest"]["bind-address"] == config["taskmanager"]["bind-host"] == "localhost"  # loopback only
    parsed = pipeline_options(runners.spark_options(tmp_path)).get_all_options()
    assert parsed["runner"] == "SparkRunner" and parsed["spark_master_url"] == runners.SPARK_MASTER
