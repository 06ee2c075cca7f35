"""The command line refuses an option nobody would use: one the command does not know (before
`--` click hands it to Beam) or one Beam does not know (Beam would drop it with a log line).
Either ends with one line on stderr naming it and a non-zero exit, before anything is read or
written; real Beam options keep working, `--name=value` and `--name value`, before or after `--`."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.cli import main
from tests.helpers import sample_documents, small_config, write_config, write_jsonl

CLI = str(Path(sys.executable).parent / "ratrain-pipeline")


@pytest.fixture
def config(tmp_path):
    write_jsonl(tmp_path / "corpus" / "a.jsonl", sample_documents(4))
    return str(write_config(tmp_path / "c.yaml", small_config(tmp_path / "out", str(tmp_path / "corpus" / "*.jsonl"))))


def failure(capsys, argv) -> str:
    """The one stderr line of a command that must fail with exit code 1."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 1 and len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize(
    "command, typo, meant",
    [
        ("run", "--foce", "--force"),
        ("build-index", "--detatch", "--detach"),
        ("build-shards", "--wait-for-indx", "--wait-for-index"),  # fails at once, does not wait
    ],
)
@pytest.mark.unit
def test_a_typo_of_a_command_option_fails_naming_it_and_writes_nothing(tmp_path, capsys, config, command, typo, meant):
    line = failure(capsys, [command, "--config", config, typo])
    assert line.startswith(f"error: unknown option {typo} (did you mean {meant}?)"), line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "beam_args, typo, meant",
    [
        (["--direct_num_worker=2"], "--direct_num_worker", "--direct_num_workers"),
        (
            ["--runner=DataflowRunner", "--project", "p", "--tmp_location", "gs://b/t"],
            "--tmp_location",
            "--temp_location",
        ),
        (["--job-endpoint=localhost:8099"], "--job-endpoint", "--job_endpoint"),
    ],
)
@pytest.mark.unit
def test_an_unknown_beam_option_after_the_separator_fails_naming_it(tmp_path, capsys, config, beam_args, typo, meant):
    line = failure(capsys, ["run", "--config", config, "--", *beam_args])
    assert line.startswith(f"error: unknown option {typo} (did you mean {meant}?)"), line
    assert not (tmp_path / "out").exists()


@pytest.mark.unit
def test_validate_as_a_beam_job_refuses_an_unknown_option(tmp_path, capsys):
    line = failure(capsys, ["validate", str(tmp_path), "--", "--runer=FnApiRunner"])
    assert "unknown option --runer (did you mean --runner?)" in line


@pytest.mark.unit
def test_the_value_of_an_unknown_option_is_never_shown(capsys, config):
    secret = "s3cr3t-token-7f9a"
    for beam_args in (["--api_token", secret], [f"--api_token={secret}"]):
        line = failure(capsys, ["run", "--config", config, "--", *beam_args])
        assert "--api_token" in line and secret not in line


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["run", "--config", "C", "--", "--force"],
            "--force is not a Beam pipeline option: it is an option of `run`, put it before `--`",
        ),
        (["run", "--config", "C", "--debug"], "put it before the command (--debug run ...)"),
        (
            ["run", "--config", "C", "--", "--direct_num_workers=two"],
            "argument --direct_num_workers: invalid int value",
        ),
        (
            ["run", "--config", "C", "--", "--runner=DataflowRuner"],
            "unknown runner DataflowRuner (did you mean DataflowRunner?)",
        ),
        (["run", "--config", "C", "--", "--project", "p", "q"], "unexpected argument 'q'"),
    ],
)
@pytest.mark.unit
def test_misplaced_options_bad_values_and_stray_arguments_are_one_line(tmp_path, capsys, config, argv, message):
    line = failure(capsys, [config if a == "C" else a for a in argv])
    assert message in line, line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "argv",
    [
        [
            "--",
            "--direct_num_workers=2",
            "--direct_running_mode=multi_processing",
            "--temp_location=/tmp/t",
            "--project=p",
            "--experiments=a",
            "--experiments=b",
        ],
        [
            "--",
            "--direct_num_workers",
            "2",
            "--direct_running_mode",
            "multi_processing",
            "--temp_location",
            "/tmp/t",
            "--project",
            "p",
            "--experiments",
            "a",
            "--experiments",
            "b",
        ],
        # before `--` as well (click hands on what the command does not know), and around it
        [
            "--direct_num_workers",
            "2",
            "--direct_running_mode=multi_processing",
            "--temp_location",
            "/tmp/t",
            "--",
            "--project",
            "p",
            "--experiments=a",
            "--experiments",
            "b",
        ],
    ],
)
@pytest.mark.e2e  # a dry run: the whole job's graph built through the CLI
def test_real_beam_options_pass_in_both_forms_before_and_after_the_separator(tmp_path, capsys, config, argv):
    main(["build-index", "--config", config, "--dry-run", *argv])
    options = json.loads(capsys.readouterr().out)["build-index"]["options"]
    assert options["direct_num_workers"] == 2 and options["direct_running_mode"] == "multi_processing"
    assert options["temp_location"] == "/tmp/t" and options["project"] == "p"
    assert {"a", "b"} <= set(options["experiments"])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "beam_args",
    [
        [
            "--runner=PortableRunner",
            "--job_endpoint",
            "localhost:8099",
            "--environment_type=EXTERNAL",
            "--environment_config=localhost:50000",
            "--parallelism=16",
            "--sdk_worker_parallelism",
            "4",
        ],
        [
            "--runner=FlinkRunner",
            "--flink_master=ratrain-flink-rest:8081",
            "--flink_version=1.19",
            "--flink_submit_uber_jar",
            "--environment_type=EXTERNAL",
            "--environment_config=localhost:50000",
        ],
        [
            "--runner",
            "DataflowRunner",
            "--project=p",
            "--region",
            "europe-west4",
            "--temp_location=gs://b/tmp",
            "--sdk_container_image=img",
            "--experiments=use_runner_v2",
            "--machine_type",
            "n1-highmem-8",
            "--max_num_workers=32",
            "--no_use_public_ips",
            "--labels",
            "team=ml",
        ],
    ],
)
@pytest.mark.e2e  # a dry run: the whole job's graph built through the CLI
def test_runner_options_pass_a_dry_run(capsys, config, beam_args):
    main(["run", "--config", config, "--dry-run", "--", *beam_args])
    plan = json.loads(capsys.readouterr().out)
    runner = beam_args[1] if beam_args[0] == "--runner" else beam_args[0].split("=")[1]
    assert plan["build-index"]["options"]["runner"] == plan["build-shards"]["options"]["runner"] == runner


@pytest.mark.e2e
def test_the_console_script_fails_in_one_line(tmp_path, config):
    done = subprocess.run([CLI, "run", "--config", config, "--foce"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        "error: unknown option --foce (did you mean --force?): neither a ratrain-pipeline option nor a Beam "
        "pipeline option"
    ]
    assert not (tmp_path / "out").exists()
