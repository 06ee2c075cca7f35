"""Shared fixtures: one built output that the end-to-end tests share (building it embeds a few
hundred chunks with the real encoder, so it is done once per session), the GCS emulator and a
Flink cluster; and the rule that every test is marked unit, beam or e2e. Helpers (sample
corpus, configs, shard rewriting, `local_pipeline`) live in tests/helpers.py; tests import them
from there, never from conftest."""

from __future__ import annotations

import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock

from tests.helpers import (
    BAD_RECORDS,
    PRECISION_ENV,
    GcsEmulator,
    LocalFlinkCluster,
    local_runners,
    python_service,
    sample_documents,
    small_config,
    write_config,
    write_jsonl,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pytest_addoption(parser):
    parser.addoption(
        "--embedding-precision",
        choices=("auto", "float32", "bfloat16"),
        default=None,
        help="embedding.precision of the suite's builds (default: auto, or $RATRAIN_TEST_PRECISION)",
    )


def pytest_configure(config):
    precision = config.getoption("--embedding-precision")
    if precision is not None:  # the environment carries it to subprocesses too
        os.environ[PRECISION_ENV] = precision


KINDS = ("unit", "beam", "e2e")  # pyproject.toml [tool.pytest.ini_options] markers says what each means
OWN_PROCESS = "RATRAIN_TESTS_OWN_PROCESS"  # set in the process tests/test_own_process.py starts
RUNS_OWN_PROCESS = Path(__file__).with_name("test_own_process.py")
OWN_PROCESS_FILES = pytest.StashKey[list[str]]()  # the files holding own_process tests: its process collects only them


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: the rule holds for every collected test
def pytest_collection_modifyitems(config, items):
    """Every test is exactly one kind: unit, beam or e2e (slow may come on top). A test without
    one, or with two, stops the collection with the list of offenders."""
    wrong = []
    for item in items:
        kinds = sorted({mark.name for mark in item.iter_markers() if mark.name in KINDS})
        if len(kinds) != 1:
            wrong.append(f"  {item.nodeid}: {', '.join(kinds) or 'no kind'}")
    if wrong:
        raise pytest.UsageError(
            "each test needs exactly one of the markers unit, beam, e2e (see pyproject.toml; a module-level "
            "`pytestmark = pytest.mark.unit` where the whole file is one kind):\n" + "\n".join(wrong)
        )
    # the own_process tests run only in the process tests/test_own_process.py starts for them
    mine = bool(os.environ.get(OWN_PROCESS))
    config.stash[OWN_PROCESS_FILES] = sorted(
        {str(item.path) for item in items if item.get_closest_marker("own_process") is not None}
    )
    kept = [item for item in items if (item.get_closest_marker("own_process") is not None) == mine]
    if mine or len(kept) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept
    # The longest test first (the one that runs the own_process tests, over 2 min), then the
    # files holding slow tests, each file's tests kept together (its module fixtures built
    # once): with `make test`'s worker processes, the longest start first instead of leaving
    # one worker busy at the end.
    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: (item.path != RUNS_OWN_PROCESS, item.path not in slow_files))


def pytest_report_header(config):
    """Which CPU and precision ran the suite: bfloat16 results differ between CPU kinds."""
    from pipeline.embed.encoder import cpu_summary, resolve_precision
    from tests.helpers import suite_precision

    precision = suite_precision()
    return f"embedding precision: {precision} -> {resolve_precision(precision, 'cpu')} on {cpu_summary()}"


def built_once(tmp_path_factory, name: str, build: Callable[[Path], object]):
    """What `build(root)` returns and writes under `root`, made once for every worker process of
    the session (`make test` runs pytest-xdist): the first to ask builds it under a file lock,
    the others wait for it and read its pickled result. The tests only read what it wrote."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # each worker's temporary directory is in the session's
        base = base.parent
    root, result = base / name, base / f"{name}.pickle"
    with FileLock(f"{root}.lock"):
        if not result.exists():
            shutil.rmtree(root, ignore_errors=True)  # what a build that failed left
            root.mkdir()
            result.write_bytes(pickle.dumps(build(root)))
    return pickle.loads(result.read_bytes())


@pytest.fixture(scope="session")
def built_output(tmp_path_factory):
    """A committed index + shards built by `run` from 16 real documents (~500 chunks) plus one
    bad record of each kind."""
    from pipeline.run import run_all
    from schemas.config import config_from_dict

    def build(root: Path):
        docs = sample_documents(16)
        write_jsonl(root / "corpus" / "a.jsonl", docs[:8])
        write_jsonl(root / "corpus" / "b.jsonl", docs[8:] + BAD_RECORDS)
        config = small_config(root / "out", str(root / "corpus" / "*.jsonl"))
        write_config(root / "config.yaml", config)
        return root, config, run_all(config_from_dict(config), [])

    return built_once(tmp_path_factory, "built", build)


@pytest.fixture(scope="session")
def job_service():
    """Beam's own Python job service (the portable Job API), its address."""
    with python_service("apache_beam.runners.portability.local_job_service_main", "--port") as address:
        yield address


@pytest.fixture(scope="session")
def six_documents_built_locally(tmp_path_factory):
    """Six sample documents (their glob) and what an in-process run of `small_config` writes
    from them: the bytes every runner must write for that corpus (the output directory is no
    part of the config hash)."""
    from pipeline.run import run_all
    from schemas.config import config_from_dict

    def build(root: Path):
        write_jsonl(root / "corpus" / "a.jsonl", sample_documents(6))
        corpus = str(root / "corpus" / "*.jsonl")
        run_all(config_from_dict(small_config(root / "in-process", corpus)), [])
        return corpus, root / "in-process"

    return built_once(tmp_path_factory, "six-local", build)


@pytest.fixture(scope="session")
def beam_worker_pool():
    """Beam's own SDK worker pool as its own process (what the Kubernetes image's `--worker_pool`
    runs, one per TaskManager), its address."""
    with python_service("apache_beam.runners.worker.worker_pool_main", "--service_port") as address:
        yield address


@pytest.fixture(scope="session")
def worker_pool():
    """The project's SDK worker pool as its own process (`python -m pipeline.jobs.worker_pool`),
    its address: one pool that several Flink TaskManagers share."""
    with python_service("pipeline.jobs.worker_pool", "--service_port") as address:
        yield address


@pytest.fixture(scope="session")
def long_documents_built_locally(tmp_path_factory):
    """Three long documents (132-192 chunks, near-duplicate passages planted) and what the
    local runner writes from them with an IVF index in slices (4 of at most 400 KB): (config for
    an output directory, the local output), the reference for other runners."""
    from examples.long_documents import long_documents
    from pipeline.run import run_all
    from schemas.config import config_from_dict

    sliced_ivf = {"type": "IVF8,Flat", "nprobe": 2, "slice_bytes": "400KB"}

    def config_over(root: Path) -> Callable[[Path], dict]:
        def config(out: Path) -> dict:
            return small_config(out, str(root / "corpus" / "*.jsonl"), index=sliced_ivf)

        return config

    def build(root: Path) -> Path:
        pages = ["howto/enum", "library/enum", "tutorial/classes"]
        write_jsonl(root / "corpus" / "docs.jsonl", long_documents(pages, near_duplicates=True))
        run_all(config_from_dict(config_over(root)(root / "local")), [])
        return root

    root = built_once(tmp_path_factory, "long-local", build)
    return config_over(root), root / "local"


@pytest.fixture(scope="session")
def spark_options():
    """The Beam options for Spark inside Beam's Spark job server (`runners.py spark-options`)."""
    return local_runners("spark-options").split()


@pytest.fixture(scope="session")
def flink_cluster(tmp_path_factory):
    """A Flink session cluster (1 JobManager, 2 TaskManagers) started by the project's helper
    from the jars `make runners-install` installed; stopped, by pid, at the end of the session."""
    cluster = LocalFlinkCluster(tmp_path_factory.mktemp("flink"))
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def gcs():
    """The emulator, with STORAGE_EMULATOR_HOST pointing at it for the whole session (Beam's GCS
    client, google-cloud-storage and the trainer's pyarrow client all honour it)."""
    from pipeline.common import fileio

    emulator = GcsEmulator()
    previous = os.environ.get("STORAGE_EMULATOR_HOST")
    os.environ["STORAGE_EMULATOR_HOST"] = emulator.host
    fileio.use_anonymous_gcs_for_emulator()
    yield emulator
    emulator.stop()
    if previous is None:
        del os.environ["STORAGE_EMULATOR_HOST"]
    else:
        os.environ["STORAGE_EMULATOR_HOST"] = previous
