import gc
import os
import re
import zipfile

import pytest

from pipeline.jobs.options import (
    FLINK_UBER_JAR_ENTRY,
    LOCAL_RUNNER,
    PipelineOptionsError,
    check_beam_args,
    check_detachable,
    encoder_threads,
    new_pipeline,
    pipeline_options,
    runner_kind,
    thread_environment,
)

pytestmark = pytest.mark.unit

MULTI = ["--direct_running_mode=multi_processing"]


def test_local_runner_is_the_default_and_an_explicit_runner_wins():
    assert pipeline_options([]).get_all_options()["runner"] == LOCAL_RUNNER
    assert pipeline_options(["--runner=PortableRunner"]).get_all_options()["runner"] == "PortableRunner"


@pytest.mark.parametrize("workers, cores, threads", [(2, 2, "1"), (2, 16, "8"), (4, 2, "1"), (0, 8, "1")])
def test_worker_processes_share_the_cores(monkeypatch, workers, cores, threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    args = MULTI + [f"--direct_num_workers={workers}"]
    assert thread_environment(pipeline_options(args), {}) == {"OMP_NUM_THREADS": threads}
    assert "OMP_NUM_THREADS" not in os.environ  # parsing options changes nothing
    new_pipeline(args)  # where the runner is set up
    assert os.environ["OMP_NUM_THREADS"] == threads


@pytest.mark.parametrize("args", [[], ["--direct_num_workers=4"], MULTI + ["--direct_num_workers=1"]])
def test_one_process_keeps_every_core(monkeypatch, args):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    new_pipeline(args)
    assert "OMP_NUM_THREADS" not in os.environ


def test_the_users_thread_count_wins(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    new_pipeline(MULTI + ["--direct_num_workers=2"])
    assert os.environ["OMP_NUM_THREADS"] == "3"


@pytest.mark.parametrize(
    "configured, device, args, threads",
    [
        (3, "cpu", MULTI + ["--direct_num_workers=2"], 3),  # configured wins
        (None, "cpu", [], 8),  # in-process: every core
        (None, "cpu", MULTI + ["--direct_num_workers=2"], 4),  # local workers share them
        (None, "cpu", MULTI + ["--direct_num_workers=16"], 1),
        (None, "cpu", ["--runner=PortableRunner", "--environment_type=LOOPBACK"], 8),  # calls back here
        (None, "cpu", ["--runner=flink", "--environment_type=LOOPBACK"], 8),  # so do Flink's TaskManagers
        (None, "cpu", ["--runner=FlinkRunner", "--environment_type=EXTERNAL"], 1),
        (None, "cpu", ["--runner=SparkRunner"], 8),  # Beam picks LOOPBACK for Spark in its job server
        (None, "cpu", ["--runner=FlinkRunner", "--flink_master=host:8081"], 1),  # and DOCKER for a cluster
        (None, "cpu", ["--runner=DataflowRunner"], 1),  # a process per worker core
        (None, "cpu", ["--runner=PortableRunner", "--environment_type=DOCKER"], 1),
        (2, "cuda", [], None),  # threads do not touch GPU bytes
    ],
)
def test_encoder_threads_are_fixed_once_per_job(monkeypatch, configured, device, args, threads):
    monkeypatch.setenv("OMP_NUM_THREADS", "5")  # what faiss gets does not decide the encoder's
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert encoder_threads(configured, device, pipeline_options(args)) == threads


@pytest.mark.parametrize(
    "runner, kind",
    [
        ("FlinkRunner", "flink"),
        ("flink", "flink"),
        ("apache_beam.runners.portability.flink_runner.FlinkRunner", "flink"),
        ("PortableRunner", "portable"),
        ("DataflowRunner", "dataflow"),
        (None, None),
    ],
)
def test_a_runner_is_known_by_any_name_beam_resolves(runner, kind):
    assert runner_kind(runner) == kind


@pytest.mark.parametrize(
    "args, refused",
    [
        (["--runner=FlinkRunner", "--flink_master=localhost:8081", "--environment_type=LOOPBACK"], "LOOPBACK"),
        (["--runner=PortableRunner", "--job_endpoint=localhost:8099", "--environment_type=LOOPBACK"], "LOOPBACK"),
        (
            ["--runner=FlinkRunner", "--environment_type=EXTERNAL", "--environment_config=localhost:50000"],
            "Flink runs inside",
        ),
        (["--runner=SparkRunner", "--spark_master_url=local[2]", "--environment_type=EXTERNAL"], "Spark driver"),
        (["--runner=SparkRunner", "--job_endpoint=localhost:8099", "--environment_type=EXTERNAL"], None),
        (["--runner=SparkRunner", "--job_endpoint=localhost:8099"], "LOOPBACK"),  # Beam's default for local[N]
        (["--runner=PortableRunner", "--job_endpoint=embed", "--environment_type=EXTERNAL"], "embed"),
        (["--runner=FlinkRunner", "--flink_master=localhost:8081", "--environment_type=EXTERNAL"], None),
        (["--runner=PortableRunner", "--job_endpoint=localhost:8099", "--environment_type=EXTERNAL"], None),
        ([], None),  # the local runner finishes the job before the command returns
    ],
)
def test_detaching_is_refused_where_the_job_would_end_with_this_process(args, refused):
    options = pipeline_options(args)
    if refused is None:
        check_detachable(options)
    else:
        with pytest.raises(PipelineOptionsError, match=re.escape(refused)):
            check_detachable(options)


# --- options Beam would drop are refused ------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        [
            "--runner=DataflowRunner",
            "--project=p",
            "--region=r",
            "--temp_location=gs://b/t",
            "--staging_location=gs://b/s",
            "--sdk_container_image=i",
            "--experiments=use_runner_v2",
            "--machine_type=n1-highmem-8",
            "--disk_size_gb=100",
            "--max_num_workers=32",
            "--number_of_worker_harness_threads=4",
            "--dataflow_service_options=a=b",
        ],
        [
            "--runner",
            "PortableRunner",
            "--job_endpoint",
            "h:8099",
            "--artifact_endpoint",
            "h:8098",
            "--environment_type",
            "EXTERNAL",
            "--environment_config",
            "localhost:50000",
            "--parallelism",
            "16",
            "--sdk_worker_parallelism",
            "4",
        ],
        ["--runner=FlinkRunner", "--flink_master=m:8081", "--flink_version=1.19", "--flink_submit_uber_jar"],
        ["--runner=FlinkRunner", "--flink_master=m:8081", "--execution_mode_for_batch=BATCH_FORCED"],
        ["--runner=SparkRunner", "--spark_master_url=spark://m:7077"],
        ["--direct_num_workers", "-1"],  # a negative number is a value
        ["--update_compatibility_version"],  # its value is optional
        ["--runner=direct"],
        ["--runner=fnapi"],
        ["--runner=apache_beam.runners.render.RenderRunner", "--render_output=x.png"],
    ],
)
def test_beam_options_in_either_form_are_accepted(args):
    assert check_beam_args(args) == args


def test_an_option_only_the_flink_job_server_reads_reaches_it_and_is_checked():
    """Declared (FlinkJobServerOptions), so Beam sends it in the job's options (tests/e2e/test_flink.py
    reads it back from Flink), and a value Flink has no name for is refused before submitting."""
    options = pipeline_options(["--runner=FlinkRunner", "--execution_mode_for_batch=BATCH_FORCED"])
    assert options.get_all_options()["execution_mode_for_batch"] == "BATCH_FORCED"
    with pytest.raises(PipelineOptionsError, match="invalid choice: 'BLOCKING'"):
        check_beam_args(["--runner=FlinkRunner", "--execution_mode_for_batch=BLOCKING"])


def test_an_uber_jar_from_a_jar_without_the_flink_runner_is_refused_before_submitting(tmp_path):
    """deploy/local's job server jars only name their classpath: Flink, given the uber jar
    built from one, failed with "entry point class ... was not found in the jar file"."""
    launcher, whole = tmp_path / "launcher.jar", tmp_path / "whole.jar"
    with zipfile.ZipFile(launcher, "w") as jar:
        jar.writestr("META-INF/MANIFEST.MF", "Class-Path: lib/a.jar\n")
    with zipfile.ZipFile(whole, "w") as jar:
        jar.writestr(FLINK_UBER_JAR_ENTRY, b"")
    flink = ["--runner=FlinkRunner", "--flink_master=m:8081", "--flink_submit_uber_jar"]
    with pytest.raises(PipelineOptionsError, match="holds no Flink runner"):
        check_beam_args([*flink, f"--flink_job_server_jar={launcher}"])
    assert check_beam_args([*flink, f"--flink_job_server_jar={whole}"])
    assert check_beam_args([flink[0], flink[1], f"--flink_job_server_jar={launcher}"])  # its own job server: fine


def test_options_of_any_imported_options_class_are_accepted():
    from apache_beam.options.pipeline_options import GoogleCloudOptions, PipelineOptions

    class ProjectOptions(PipelineOptions):
        @classmethod
        def _add_argparse_args(cls, parser):
            parser.add_argument("--ratrain_test_only_flag", type=int)

    class MoreCloudOptions(GoogleCloudOptions):  # a subclass of a subclass: view_as reads it too
        @classmethod
        def _add_argparse_args(cls, parser):
            parser.add_argument("--ratrain_test_only_other", default="x")

    try:
        args = ["--ratrain_test_only_flag", "3", "--ratrain_test_only_other=y"]
        assert pipeline_options(args).view_as(ProjectOptions).ratrain_test_only_flag == 3
        assert pipeline_options(args).view_as(MoreCloudOptions).ratrain_test_only_other == "y"
    finally:  # registered for as long as they live: not in the other tests' options
        del ProjectOptions, MoreCloudOptions
        gc.collect()
    with pytest.raises(PipelineOptionsError, match="unknown option --ratrain_test_only_flag"):
        check_beam_args(["--ratrain_test_only_flag=3"])


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--direct_num_worker=2"],
            "unknown option --direct_num_worker (did you mean --direct_num_workers?): not a Beam pipeline option",
        ),
        (["--temp-location", "gs://b/t"], "unknown option --temp-location (did you mean --temp_location?)"),
        (["--zzz", "--qqq=1", "--zzz"], "unknown options --zzz, --qqq: not a Beam pipeline option"),
        (["-x"], "unknown option -x"),
        (["--project", "p", "stray"], "unexpected argument 'stray' among the Beam pipeline options"),
        (["--project=p", "--", "--region=r"], "a second `--` among the Beam pipeline options"),
        (
            ["--direct_num_workers=two"],
            "Beam pipeline options: argument --direct_num_workers: invalid int value: 'two'",
        ),
        (["--project"], "Beam pipeline options: argument --project: expected one argument"),
        (["--runner=Dataflow_Runner"], "unknown runner Dataflow_Runner (did you mean DataflowRunner?)"),
    ],
)
def test_what_beam_would_drop_or_cannot_parse_is_one_error(args, message):
    with pytest.raises(PipelineOptionsError) as raised:
        pipeline_options(args)  # an error, not argparse's usage text and SystemExit
    assert str(raised.value).startswith(message) and "\n" not in str(raised.value)


def test_the_command_lines_own_options_are_named_and_suggested():
    ours = {"--force": "it is an option of `run`, put it before `--`"}
    with pytest.raises(PipelineOptionsError, match="^--force is not a Beam pipeline option: it is an option of `run`"):
        check_beam_args(["--project=p", "--force"], ours)
    with pytest.raises(PipelineOptionsError, match=r"^unknown option --forse \(did you mean --force\?\): neither"):
        check_beam_args(["--forse"], ours)


def test_an_unknown_options_value_is_never_in_the_error():
    for args in (["--api_token=s3cr3t"], ["--api_token", "s3cr3t"]):
        with pytest.raises(PipelineOptionsError) as raised:
            check_beam_args(args)
        assert "--api_token" in str(raised.value) and "s3cr3t" not in str(raised.value)


def test_a_runner_module_that_cannot_be_imported_is_named():
    with pytest.raises(PipelineOptionsError, match=r"--runner=no_such_module\.Runner: cannot import no_such_module"):
        check_beam_args(["--runner=no_such_module.Runner"])


@pytest.mark.parametrize(
    "type_check, args, inferred",
    [(True, [], True), (False, [], False), (True, ["--no_pipeline_type_check"], False)],
)
def test_type_inference_is_left_off_where_the_job_or_the_arguments_say(type_check, args, inferred):
    from apache_beam.options.pipeline_options import TypeOptions

    pipeline = new_pipeline(args, type_check=type_check)
    assert pipeline.options.view_as(TypeOptions).pipeline_type_check is inferred


def test_each_view_is_made_once_and_every_view_and_copy_reads_the_same_values():
    """`view_as` answers with the view it made first (Beam asks thousands of times a job); a
    value set through one view is read through every other, and a deep copy (what
    `beam.Pipeline` keeps) keeps its views over its own values, apart from the original's."""
    import copy

    from apache_beam.options.pipeline_options import DebugOptions, StandardOptions, TypeOptions

    options = pipeline_options(["--experiments=a", "--no_pipeline_type_check"])
    assert options.view_as(TypeOptions) is options.view_as(TypeOptions)
    assert options.view_as(TypeOptions).pipeline_type_check is False
    options.view_as(StandardOptions).streaming = True
    assert options.view_as(StandardOptions).streaming and options.get_all_options()["streaming"]
    kept = copy.deepcopy(options)
    kept.view_as(DebugOptions).experiments.append("b")
    kept.view_as(StandardOptions).streaming = False
    assert kept.get_all_options()["experiments"] == ["a", "b"] and not kept.get_all_options()["streaming"]
    assert options.view_as(DebugOptions).experiments == ["a"] and options.view_as(StandardOptions).streaming
    fresh = pipeline_options(["--experiments=a", "--no_pipeline_type_check"])
    fresh.view_as(StandardOptions).streaming = True
    assert options.get_all_options() == fresh.get_all_options()  # what the runner is sent
