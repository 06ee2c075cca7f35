"""Beam pipeline options: whatever follows `--` on the command line, over local defaults.

The local default is the in-process FnApiRunner: Beam's DirectRunner would first try to
download the Prism binary, which a machine without network cannot do.

Beam itself drops an option it does not know with a log line (a typo then silently changes
nothing); `check_beam_args` refuses it instead, naming it.
"""

from __future__ import annotations

import difflib
import importlib
import os
import re
import zipfile
from collections.abc import Mapping, Sequence

import apache_beam as beam
from apache_beam.options.pipeline_options import (
    DirectOptions,
    FlinkRunnerOptions,
    PipelineOptions,
    PipelineOptionsT,
    PortableOptions,
    SparkRunnerOptions,
    StandardOptions,
    TypeOptions,
    _BeamArgumentParser,
)
from apache_beam.runners.portability.flink_runner import MAGIC_HOST_NAMES
from apache_beam.runners.portability.spark_runner import LOCAL_MASTER_PATTERN

from pipeline.jobs.dofn_specs import cache_dofn_specs
from pipeline.jobs.worker_pool import serve_loopback_workers_by_caller

LOCAL_RUNNER = "FnApiRunner"
# Runners (`runner_kind`) whose SDK workers run on the machine that launches the job.
IN_PROCESS_RUNNERS = {None, "fnapi", "direct", "bundlebaseddirect", "switchingdirect"}
# Runners that take a job through Beam's portable Job API; with LOOPBACK workers, the workers are
# threads of the process that submits (Beam's runner starts a worker pool in it).
PORTABLE_RUNNERS = {"portable", "flink", "spark"}


class FlinkJobServerOptions(PipelineOptions):
    """Options of Beam's Flink runner that its Java job server reads and Beam's Python SDK does
    not declare: undeclared, Beam would drop them before the job server saw them (and
    `check_beam_args` would refuse them)."""

    @classmethod
    def _add_argparse_args(cls, parser):
        parser.add_argument(
            "--execution_mode_for_batch",
            choices=["PIPELINED", "PIPELINED_FORCED", "BATCH", "BATCH_FORCED"],
            default=None,
            help="Flink's data exchange in a batch job (Flink's ExecutionMode; Flink's default is PIPELINED). "
            "BATCH_FORCED makes every exchange blocking: a stage starts when the stages it reads have ended.",
        )


def runner_kind(runner: str | None) -> str | None:
    """A runner's name as `create_runner` resolves it, lower case and without 'Runner':
    'FlinkRunner', 'flink' and 'apache_beam.runners.portability.flink_runner.FlinkRunner' are 'flink'."""
    if runner is None:
        return None
    name = runner.rsplit(".", 1)[-1].lower()
    return name[: -len("runner")] if name.endswith("runner") and name != "runner" else name


def _engine_in_the_job_server(options: PipelineOptions) -> bool:
    """Whether Flink or Spark runs inside the job server Beam starts for the job (FlinkRunner
    with --flink_master=[auto] or [local]; SparkRunner with a local[...] master)."""
    kind = runner_kind(options.view_as(StandardOptions).runner)
    if kind == "flink":
        return options.view_as(FlinkRunnerOptions).flink_master in MAGIC_HOST_NAMES  # Flink inside Beam's job server
    master = options.view_as(SparkRunnerOptions).spark_master_url
    return kind == "spark" and re.match(LOCAL_MASTER_PATTERN, master) is not None


def loopback_workers(options: PipelineOptions) -> bool:
    """Whether the job's SDK workers are threads of this process: a portable runner with
    LOOPBACK workers, asked for or chosen by Beam (Flink and Spark inside their job server get
    them when no --environment_type is given, as their `default_environment` decides)."""
    if runner_kind(options.view_as(StandardOptions).runner) not in PORTABLE_RUNNERS:
        return False
    environment = options.view_as(PortableOptions).environment_type
    return environment == "LOOPBACK" or (environment is None and _engine_in_the_job_server(options))


def with_defaults(beam_args: list[str]) -> list[str]:
    args = list(beam_args)
    if not any(a == "--runner" or a.startswith("--runner=") for a in args):
        args.insert(0, f"--runner={LOCAL_RUNNER}")
    return args


def local_worker_processes(options: PipelineOptions) -> int | None:
    """How many SDK worker processes share this machine's cores, or None when the workers run
    elsewhere (a cluster runner, or a portable job service with its own worker environment)."""
    if runner_kind(options.view_as(StandardOptions).runner) in IN_PROCESS_RUNNERS:
        direct = options.view_as(DirectOptions)
        if direct.direct_running_mode != "multi_processing":
            return 1
        return direct.direct_num_workers or os.cpu_count() or 1  # 0 means one worker per core
    if loopback_workers(options):
        return 1  # the runner calls back into this process
    return None


def encoder_threads(configured: int | None, device: str, options: PipelineOptions) -> int | None:
    """Intra-op threads of each CPU encoder process. Part of what decides the embeddings' last
    bits (CPU matrix kernels split their sums by thread count), so it is fixed once per job
    and recorded in the manifest. Configured: as given. Otherwise this machine's share of
    the cores where the workers run here, and 1 on cluster runners (one SDK process per
    core). None on a GPU, where threads do not touch the arithmetic."""
    if not device.startswith("cpu"):
        return None
    if configured is not None:
        return configured
    workers = local_worker_processes(options)
    return 1 if workers is None else max(1, (os.cpu_count() or 1) // workers)


def no_timed_flush_on_local_runner() -> None:
    """Turn off the local runner's 1 s timed flush of the data it sends its SDK workers.

    Beam 2.77's FnApiRunner writes a bundle's input into a `TimeBasedBufferingClosableOutputStream`
    (`worker_handlers.DATA_BUFFER_TIME_LIMIT_MS` = 1000) whose flusher thread sends the buffer
    and then clears it (`data_plane.py`, `flush`: `get()`, send, `_clear()`), while the runner
    thread's `write` takes no lock: whatever the runner writes during the send is dropped, and
    the worker processes a short bundle with no error. With several SDK worker processes
    (`--direct_running_mode=multi_processing` or `multi_threading`) a stage's input goes out
    in ~10 MB messages, and once writing one worker's share takes longer than a second (a
    large shuffle, a loaded machine) the tail of it can vanish: build-shards then saw
    sequences with 11 of their 16 neighbours, a lost query embedding (KeyError) or a lost
    sequence. `tests/jobs/test_local_runner.py` holds the reproduction (xfail while Beam has the race).
    Without the timed flush the stream flushes by size only, from the writing thread: nothing
    is lost. Batch jobs gain nothing from timed flushes, and cluster runners (Dataflow,
    Flink) never run this code."""
    from apache_beam.runners.portability.fn_api_runner import worker_handlers

    worker_handlers.DATA_BUFFER_TIME_LIMIT_MS = 0


def thread_environment(options: PipelineOptions, environ: Mapping[str, str]) -> dict[str, str]:
    """What the environment needs for local multi-process runs: each worker process gets its
    share of the cores for the OpenMP pools of faiss and torch (every process using all cores
    made a 2-worker index build on 2 cores 10-100x slower). An OMP_NUM_THREADS set by the user
    wins; worker processes inherit the environment. Empty when nothing is to be set."""
    workers = local_worker_processes(options)
    if workers is None or workers == 1 or "OMP_NUM_THREADS" in environ:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // workers))}


class PipelineOptionsError(ValueError):
    """Arguments meant for Beam that Beam would not use, or a value it cannot parse."""


class _StrictParser(_BeamArgumentParser):
    """Beam's parser, raising instead of printing its usage and exiting."""

    def error(self, message):
        if message.startswith("ambiguous option: "):  # as Beam's own parser (none with allow_abbrev=False)
            return
        raise PipelineOptionsError(f"Beam pipeline options: {message}")


def _options_classes() -> list[type[PipelineOptions]]:
    """Every PipelineOptions subclass imported so far that declares options: Beam's standard
    ones (Dataflow, portable, Flink, Spark, ...), and any the project or a runner module defines.
    A subclass of a subclass counts too (`view_as` reads its options)."""
    found: dict[str, type[PipelineOptions]] = {}
    pending = list(PipelineOptions.__subclasses__())
    while pending:
        cls = pending.pop(0)
        pending.extend(cls.__subclasses__())
        if "_add_argparse_args" in cls.__dict__:
            found.setdefault(f"{cls.__module__}.{cls.__qualname__}", cls)  # a module imported twice: once
    return list(found.values())


def beam_option_parser() -> _BeamArgumentParser:
    """One parser holding every option Beam would accept now (as `get_all_options` builds it)."""
    parser = _StrictParser(allow_abbrev=False, add_help=False, conflict_handler="resolve")
    for cls in _options_classes():
        cls._add_argparse_args(parser)  # pylint: disable=protected-access
    return parser


def _runner_arg(args: Sequence[str]) -> str | None:
    runner = None
    for i, arg in enumerate(args):
        if arg.startswith("--runner="):
            runner = arg.split("=", 1)[1]
        elif arg == "--runner" and i + 1 < len(args):
            runner = args[i + 1]
    return runner


KNOWN_RUNNERS = {path.rsplit(".", 1)[1].lower() for path in StandardOptions.ALL_KNOWN_RUNNERS}


def _check_runner(runner: str | None) -> None:
    """The names Beam's `create_runner` resolves: a known runner's name in any case, with or
    without its 'Runner' suffix, or a dotted module.Class path."""
    if runner is None or "." in runner or {runner.lower(), runner.lower() + "runner"} & KNOWN_RUNNERS:
        return
    close = difflib.get_close_matches(runner, StandardOptions.KNOWN_RUNNER_NAMES, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    raise PipelineOptionsError(
        f"unknown runner {runner}{hint}; known: {', '.join(StandardOptions.KNOWN_RUNNER_NAMES)} or a module.Class path"
    )


# Flink runs an uber jar itself (the job server jar with the pipeline added) from this class
FLINK_UBER_JAR_ENTRY = "org/apache/beam/runners/flink/FlinkPipelineRunner.class"


def _check_flink_uber_jar(known) -> None:
    """--flink_submit_uber_jar with a --flink_job_server_jar that holds no runner (a launcher
    that only names its classpath, as deploy/local/runners.py writes) fails inside Flink with
    a stack trace; say so before submitting."""
    jar = known.flink_job_server_jar
    if runner_kind(known.runner) != "flink" or not known.flink_submit_uber_jar or not jar or not os.path.isfile(jar):
        return
    try:
        with zipfile.ZipFile(jar) as archive:
            holds_runner = FLINK_UBER_JAR_ENTRY in archive.namelist()
    except zipfile.BadZipFile:
        raise PipelineOptionsError(f"--flink_job_server_jar={jar} is not a jar") from None
    if not holds_runner:
        raise PipelineOptionsError(
            f"--flink_submit_uber_jar: {jar} holds no Flink runner (a launcher naming its classpath?), and Flink "
            "runs the uber jar built from it; give a self-contained job server jar, or leave out "
            "--flink_submit_uber_jar to run the job server on this machine"
        )


_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")  # a negative number is a value, as argparse reads it


def check_beam_args(beam_args: Sequence[str], cli_options: Mapping[str, str] | None = None) -> list[str]:
    """The arguments, if Beam knows every option among them; else one PipelineOptionsError
    naming the ones it does not (never their values: they may be credentials), with a close
    match. Both `--name=value` and `--name value`. `cli_options`: the command line's own
    options, each with where it belongs (one given among Beam's is named as misplaced, and
    they are candidates for the close match)."""
    args, cli_options = list(beam_args), dict(cli_options or {})
    if "--" in args:
        raise PipelineOptionsError("a second `--` among the Beam pipeline options (one `--` ends the command's own)")
    runner = _runner_arg(args)
    if runner and "." in runner:  # a runner module may define options of its own: Beam imports it to run
        module = runner.rsplit(".", 1)[0]
        try:
            importlib.import_module(module)
        except ImportError as err:  # say so now, not as "unknown option" for the module's own options
            raise PipelineOptionsError(f"--runner={runner}: cannot import {module} ({err})") from None
    parser = beam_option_parser()
    known, extra = parser.parse_known_args(args)
    unknown = list(
        dict.fromkeys(a.split("=", 1)[0] for a in extra if a.startswith("-") and a != "-" and not _NUMBER.match(a))
    )
    for name in unknown:
        if name in cli_options:
            raise PipelineOptionsError(f"{name} is not a Beam pipeline option: {cli_options[name]}")
    if unknown:
        candidates = [*cli_options, *(o for action in parser._actions for o in action.option_strings)]

        def named(name: str) -> str:
            close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.75)
            return f"{name} (did you mean {close[0]}?)" if close else name

        what = (
            "neither a ratrain-pipeline option nor a Beam pipeline option"
            if cli_options
            else "not a Beam pipeline option"
        )
        plural = "s" if len(unknown) > 1 else ""
        raise PipelineOptionsError(f"unknown option{plural} {', '.join(map(named, unknown))}: {what}")
    if extra:  # no unknown option to take them as its value
        raise PipelineOptionsError(
            f"unexpected argument {extra[0]!r} among the Beam pipeline options (--name=value or --name value)"
        )
    _check_runner(known.runner)
    _check_flink_uber_jar(known)
    return args


def check_detachable(options: PipelineOptions) -> None:
    """Refuse `--detach` where the job would end with this process: LOOPBACK workers are its
    threads, `--job_endpoint=embed` runs the job service in it, and without --job_endpoint the
    runner starts its job server as a child of this process, which with FlinkRunner's
    `--flink_master=[auto]` (or `[local]`) runs Flink itself, and with SparkRunner the Spark
    driver (unless --spark_submit_uber_jar hands the job to a Spark cluster). On an in-process
    runner the job finishes before the command returns."""
    if loopback_workers(options):
        raise PipelineOptionsError(
            "--detach with LOOPBACK workers: they run in this process, which exits once the job is "
            "submitted; use --environment_type=EXTERNAL (a worker pool) to detach"
        )
    endpoint = options.view_as(PortableOptions).job_endpoint
    if endpoint == "embed":
        raise PipelineOptionsError("--detach with --job_endpoint=embed: the job service runs in this process")
    if endpoint:
        return  # a job server of its own, which outlives this process
    kind = runner_kind(options.view_as(StandardOptions).runner)
    if kind == "flink" and _engine_in_the_job_server(options):
        flink_master = options.view_as(FlinkRunnerOptions).flink_master
        raise PipelineOptionsError(
            f"--detach with --flink_master={flink_master}: Flink runs inside the job server this process "
            "starts and stops; give the cluster's --flink_master=HOST:PORT to detach"
        )
    if kind == "spark" and not options.view_as(SparkRunnerOptions).spark_submit_uber_jar:
        raise PipelineOptionsError(
            "--detach with --runner=SparkRunner: the Spark driver runs inside the job server this process "
            "starts and stops; give a running job server (--job_endpoint) or submit to a Spark cluster "
            "(--spark_submit_uber_jar --spark_rest_url) to detach"
        )


class ViewOnceOptions(PipelineOptions):
    """Beam's options, each view (`view_as(cls)`) made once. Beam asks for a view at every
    transform it applies and every type it checks, and each new view parses every flag again
    (~1 ms): ~2,400 times, ~2.5 s of a 13 s six-document `run`. A view holds no values of its own
    (they live in the options' shared `_all_options`), and the flags never change after
    construction, so the view made first answers every later ask."""

    def view_as(self, cls: type[PipelineOptionsT]) -> PipelineOptionsT:
        views: dict = self.__dict__.setdefault("_views", {})
        if cls not in views:
            views[cls] = super().view_as(cls)
        return views[cls]


def pipeline_options(beam_args: list[str]) -> PipelineOptions:
    """The options for these arguments (unknown ones refused) over the local defaults. Changes
    nothing in this process: `new_pipeline` sets up the runner."""
    return ViewOnceOptions(with_defaults(check_beam_args(beam_args)))


def new_pipeline(beam_args: list[str], dry_run: bool = False, type_check: bool = True) -> beam.Pipeline:
    """A pipeline for these options, with what its runner needs set in this process (runners
    whose workers run here: their share of the cores, no timed flush). A dry run builds it on
    the local runner: the configured runner (Dataflow's checks its buckets when the pipeline is
    created) is never contacted. Without `type_check` Beam does not infer element types while
    the graph is built (as `--no_pipeline_type_check`): a job whose shuffles need no registered
    coder saves that time (0.1-0.2 s of a 1.5 s build-shards). Beam's look for stateful DoFns is
    answered once per DoFn class (`pipeline/jobs/dofn_specs.py`: ~20% of a small local run)."""
    options = pipeline_options(beam_args)
    cache_dofn_specs()
    if not type_check:
        options.view_as(TypeOptions).pipeline_type_check = False
    if local_worker_processes(options) is not None:
        os.environ.update(thread_environment(options, os.environ))
        no_timed_flush_on_local_runner()
    if loopback_workers(options):
        serve_loopback_workers_by_caller()
    if dry_run:
        from apache_beam.runners.portability.fn_api_runner import FnApiRunner

        return beam.Pipeline(runner=FnApiRunner(), options=options)
    return beam.Pipeline(options=options)
