"""Test helpers (not fixtures): a slice of the sample corpus, small configs, shard rewriting,
chunk and embedding files as the index stage writes them, the GCS emulator, a local
TestPipeline. Fixtures live in conftest.py; tests import helpers from here, never from
conftest."""

from __future__ import annotations

import json
import os
import re
from contextlib import contextmanager
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
SAMPLE_CORPUS = REPO / "examples" / "corpus"


PRECISION_ENV = "RATRAIN_TEST_PRECISION"


def suite_precision() -> str:
    """The `embedding.precision` the suite's builds run in: `pytest --embedding-precision
    float32|bfloat16` (or RATRAIN_TEST_PRECISION) forces the path this CPU would not choose
    itself; by default `auto` (bfloat16 on CPUs with AVX512-BF16 or AMX, else float32)."""
    return os.environ.get(PRECISION_ENV, "auto")


def sample_documents(count: int, start: int = 0) -> list[dict]:
    """The first `count` documents (from `start`) of the sample corpus, in file order."""
    docs = []
    for path in sorted(SAMPLE_CORPUS.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            docs.append(json.loads(line))
    return docs[start : start + count]


# standard-library modules whose docstrings make a second kind of real text (API reference, not prose)
DOCSTRING_MODULES = ("json", "collections", "argparse", "pathlib", "textwrap", "csv", "functools", "itertools")


def stdlib_docstrings(modules=DOCSTRING_MODULES, min_chars: int = 200) -> list[dict]:
    """The docstrings of these modules' own functions and classes, at least `min_chars` long,
    as documents with an id (`module.name`), in a fixed order."""
    import importlib
    import inspect

    docs = []
    for name in modules:
        module = importlib.import_module(name)
        for attr, value in sorted(vars(module).items()):
            own = (inspect.isfunction(value) or inspect.isclass(value)) and getattr(value, "__module__", "") == name
            text = inspect.getdoc(value) if own else None
            if text and len(text) >= min_chars:
                docs.append({"id": f"{name}.{attr}", "text": text})
    return docs


def write_jsonl(path: Path, records: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def small_config(output: Path, corpus_glob: str, **overrides) -> dict:
    config = {
        "output": str(output),
        "retrieval_corpus": {"paths": [corpus_glob], "format": "jsonl", "id_field": "id"},
        "training_corpus": "same",
        "chunk_tokens": 32,
        "sequence_tokens": 128,
        "neighbours": 2,
        "neighbour_candidates": 16,
        "shard_rows": 16,
        "chunk_file_rows": 200,
        # One encoder thread, as each process of a two-worker run has: embedding bytes are
        # reproducible for the same config, hardware and encoder threads, and tests compare
        # bytes across runs, runners and worker counts.
        "embedding": {"batch_size": 32, "cpu_threads": 1, "precision": suite_precision()},
    }
    config.update(overrides)
    return config


DATA_STAGES = ("index/chunks", "index/embeddings", "index/faiss", "shards")


def sliced_corpus_config(tmp_path: Path, docs: list[dict], **overrides) -> dict:
    """`docs` written as the corpus of a small IVF index in slices of 400 KB (3 or more over a
    few dozen sample documents), its output in tmp_path/out."""
    write_jsonl(tmp_path / "corpus" / "a.jsonl", docs)
    index = {"type": "IVF8,Flat", "nprobe": 2, "slice_bytes": "400KB"}
    return small_config(tmp_path / "out", str(tmp_path / "corpus" / "*.jsonl"), index=index, **overrides)


def assert_same_data_files(out: Path, reference: Path, stages: tuple[str, ...] = DATA_STAGES) -> None:
    """`out` holds every data file (all but the JSON manifests and build info) that `reference`,
    an output of the same config, holds under `stages`, byte for byte."""
    for stage in stages:
        files = sorted(p.relative_to(reference) for p in (reference / stage).iterdir() if p.suffix != ".json")
        assert files and [(reference / f).read_bytes() for f in files] == [(out / f).read_bytes() for f in files]


def write_config(path: Path, config: dict) -> Path:
    path.write_text(yaml.safe_dump(config))
    return path


def is_manifest(name: str) -> bool:
    """A commit manifest's file name, or its manifest.json copy: what holds a run's timings."""
    return name == "manifest.json" or re.fullmatch(r"manifest-\d{6,}\.json", name) is not None


def current_manifest(directory: Path) -> Path:
    """The manifest readers read: the directory's newest commit manifest (or, in an output from
    before numbered commits, manifest.json)."""
    numbered = sorted(directory.glob("manifest-*.json"))
    return numbered[-1] if numbered else directory / "manifest.json"


def rewrite_manifest(directory: Path, text: str | bytes) -> None:
    """Replace the current commit's manifest, and its manifest.json copy, with `text`: a
    change made behind the pipeline's back, where its readers look."""
    data = text.encode() if isinstance(text, str) else text
    for path in {current_manifest(directory), directory / "manifest.json"}:
        path.write_bytes(data)


def rewrite_shard(shards_dir: Path, change, name: str | None = None, version: int | None = None) -> None:
    """Apply `change(columns)` to one shard (`name`, default the first) and re-sign it in the
    manifest, so only the content checks can notice. `version`: write that shard layout
    (schema_version) instead of the current one."""
    import pyarrow as pa

    from pipeline.common.fileio import sha256_bytes
    from schemas.arrow import read_shard_table, shard_column, shard_ipc_bytes, shard_sources, shard_table
    from schemas.shard_columns import ShardDims, array_columns

    manifest = json.loads(current_manifest(shards_dir).read_text())
    entry = next(e for e in manifest["shards"] if name is None or e["path"] == name)
    table = read_shard_table(pa.memory_map(str(shards_dir / entry["path"])))
    arrays = {column.name for column in array_columns()}
    columns = {c: shard_column(table, c).copy() if c in arrays else table[c].to_pylist() for c in table.column_names}
    sources, indices = shard_sources(table)
    columns["source"] = indices.copy()
    change(columns)
    dims = ShardDims(manifest["sequence_tokens"], manifest["chunk_tokens"], manifest["neighbours"])
    version_arg = {} if version is None else {"version": version}
    data = shard_ipc_bytes(shard_table(columns, dims=dims, pad_id=manifest["pad_id"], sources=sources, **version_arg))
    (shards_dir / entry["path"]).write_bytes(data)
    entry.update(bytes=len(data), sha256=sha256_bytes(data))
    rewrite_manifest(shards_dir, json.dumps(manifest))


def rewrite_shards_as_schema_version_1(shards_dir: Path) -> None:
    """Rewrite every shard in the old layout (IPC file, tensor extension columns) under a
    manifest that says schema_version 1."""
    manifest = json.loads(current_manifest(shards_dir).read_text())
    for entry in manifest["shards"]:
        rewrite_shard(shards_dir, lambda columns: None, entry["path"], version=1)
    manifest = json.loads(current_manifest(shards_dir).read_text())
    rewrite_manifest(shards_dir, json.dumps({**manifest, "schema_version": 1}))


def shard_rows(shards_dir: Path):
    """(tokens [n + 1], doc ids, neighbours [L, k, 2m], neighbour ids [L, k], scores [L, k]) of
    each sequence of a shard directory, in seq id order."""
    import pyarrow as pa

    from schemas.arrow import read_shard_table, shard_column

    for path in sorted(shards_dir.glob("shard-*.arrow")):
        table = read_shard_table(pa.memory_map(str(path)))
        columns = [shard_column(table, c) for c in ("tokens", "neighbours", "neighbour_ids", "neighbour_scores")]
        for row, doc_ids in enumerate(table["doc_ids"].to_pylist()):
            tokens, neighbours, ids, scores = (column[row] for column in columns)
            yield tokens, doc_ids, neighbours, ids, scores


def read_rejected(out: Path, stage: str) -> list[dict]:
    """Every rejected record a stage published (`rejected/<stage>-NNNNN.jsonl`)."""
    return [
        json.loads(line)
        for path in sorted((out / "rejected").glob(f"{stage}-*.jsonl"))
        for line in path.read_text().splitlines()
    ]


# one of each kind of bad record, with the reason it must be rejected for
BAD_RECORDS = [
    '{"id": "broken", "text": "no closing brace"',
    '["not", "an", "object"]',
    '{"id": "blank", "text": "   "}',
    '{"id": "numeric", "text": 12}',
    '{"id": "tutorial/appetite", "text": "a second document with a taken id"}',
]
BAD_REASONS = ["malformed_json", "not_an_object", "empty_text", "text_not_a_string", "duplicate_id"]


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class LocalService:
    """A server process of the test session listening on 127.0.0.1:`port`: started, waited for
    until it accepts connections, stopped."""

    def __init__(self, command: list[str], port: int, what: str, env: dict[str, str] | None = None):
        import socket
        import subprocess
        import time

        self.port = port
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + 60
        while True:  # a readiness poll, not a timing sleep
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                return
            except OSError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    self.process.kill()
                    raise RuntimeError(f"{what} did not start") from None
                time.sleep(0.05)

    def stop(self):
        self.process.terminate()
        self.process.wait(10)


@contextmanager
def python_service(module: str, port_option: str):
    """`python -m module port_option PORT` on a free port while in the block: its address. This
    interpreter's directory leads PATH (Beam's worker pool starts each worker as `python`)."""
    import sys

    port = free_port()
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    service = LocalService([sys.executable, "-m", module, port_option, str(port)], port, module, env)
    try:
        yield f"localhost:{port}"
    finally:
        service.stop()


class GcsEmulator:
    """A `gcp-storage-emulator` on 127.0.0.1 (in memory), the one stand-in for the cloud."""

    def __init__(self):
        import sys

        self.port = free_port()
        emulator = str(Path(sys.executable).parent / "gcp-storage-emulator")
        command = [emulator, "start", "--host", "127.0.0.1", "--port", str(self.port), "--in-memory"]
        self.service = LocalService(command, self.port, "gcp-storage-emulator")
        self.host = f"http://127.0.0.1:{self.port}"

    def client(self):
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        return storage.Client(credentials=AnonymousCredentials(), project="test")

    def bucket(self, name: str) -> str:
        """Create a bucket; its gs:// URL."""
        self.client().create_bucket(name)
        return f"gs://{name}"

    def upload(self, directory: Path, url: str) -> str:
        """Copy a local directory tree to gs://bucket/prefix; the URL."""
        bucket_name, _, prefix = url[len("gs://") :].partition("/")
        bucket = self.client().bucket(bucket_name)
        for path in sorted(Path(directory).rglob("*")):
            if path.is_file():
                bucket.blob(f"{prefix}/{path.relative_to(directory).as_posix()}").upload_from_filename(str(path))
        return url

    def stop(self):
        self.service.stop()


def assert_matches_the_local_run(out: Path, local: Path) -> None:
    """`out`, built by another runner from the config `local` was built from by the local
    runner (`long_documents_built_locally`): every data file the same bytes, the index in
    slices, every neighbour slot filled, the same neighbour recall, `validate` passing."""
    from pipeline.check.validate import validate_path
    from pipeline.common import fileio
    from schemas.manifest import IndexManifest, ShardsManifest

    assert_same_data_files(out, local)
    index = fileio.committed_manifest(str(out / "index"), IndexManifest)
    assert sum(f.path.startswith("faiss/slice-") for f in index.files) >= 3
    shards, local_shards = (fileio.committed_manifest(str(o / "shards"), ShardsManifest) for o in (out, local))
    assert shards.neighbour_fill == 1.0 and shards.neighbour_recall == local_shards.neighbour_recall
    assert all(line.startswith("OK") for line in validate_path(str(out)))


LOCAL_RUNNERS = REPO / "deploy" / "local" / "runners.py"


def local_runners(*args: str) -> str:
    """What `deploy/local/runners.py ARGS` prints; a RuntimeError with its message if it fails."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, str(LOCAL_RUNNERS), *args], capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"runners.py {args[0]} failed: {done.stderr.strip()}")
    return done.stdout


class LocalFlinkCluster:
    """A Flink session cluster of this machine (1 JobManager, 2 TaskManagers, each its own JVM)
    started by the project's helper, `deploy/local/runners.py`, as `make flink-up` does,
    in `directory` with its REST API on a free port. `options`: the Beam options it printed."""

    TASK_MANAGERS = ("taskmanager-1", "taskmanager-2")

    def __init__(self, directory: Path):
        port = free_port()
        self.directory = directory
        self.options = self._helper("up", "--rest-port", str(port)).splitlines()[-1].split()
        self.rest_port = port

    def _helper(self, *args: str) -> str:
        return local_runners(*args, "--dir", str(self.directory))

    def restore(self) -> None:
        """Start again whatever of the cluster is not running (a killed TaskManager)."""
        self._helper("up")

    def stop(self) -> None:
        self._helper("down")

    def kill(self, process: str) -> None:
        """SIGKILL to one of the cluster's processes ("taskmanager-1"), once its pid is checked
        to be that process (its command line names this cluster's conf directory)."""
        import signal

        pid = int((self.directory / "pids" / f"{process}.pid").read_text())
        command_line = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert str(self.directory.resolve() / "conf").encode() in command_line, f"pid {pid} is not {process}"
        os.kill(pid, signal.SIGKILL)

    def rest(self, path: str):
        import urllib.request

        with urllib.request.urlopen(f"http://localhost:{self.rest_port}{path}", timeout=10) as response:
            return json.load(response)

    def job_ids(self) -> set[str]:
        return {job["jid"] for job in self.rest("/jobs/overview")["jobs"]}

    def task_managers_of(self, job: str) -> set[str]:
        """The TaskManagers that ran (or run) any subtask of `job`: of a running job, the steps
        not deployed yet show as "(unassigned)", left out."""
        return {
            task_manager["taskmanager-id"]
            for vertex in self.rest(f"/jobs/{job}")["vertices"]
            for task_manager in self.rest(f"/jobs/{job}/vertices/{vertex['id']}/taskmanagers")["taskmanagers"]
        } - {"(unassigned)"}


def write_chunk_files(
    directory: Path, chunks: list, rows_per_file: int = 5, vectors=None, row_group_rows: int | None = None
):
    """The chunk database as the index stage writes it: `chunks/chunks-NNNNN.parquet` under
    `directory`, file NNNNN holding ids NNNNN·rows_per_file ... (several files, so lookups
    cross them; Parquet row groups of `row_group_rows`), and with `vectors` (row = chunk id)
    `embeddings/embeddings-NNNNN.parquet` holding the same ids; its `ChunkFileRanges`."""
    from pipeline.chunks.chunk_files import ChunkFileRanges, chunks_table
    from pipeline.common.writers import embeddings_table, parquet_bytes
    from schemas.manifest import FileEntry

    (directory / "chunks").mkdir(parents=True)
    (directory / "embeddings").mkdir()
    entries = []
    for number, begin in enumerate(range(0, len(chunks), rows_per_file)):
        part = chunks[begin : begin + rows_per_file]
        path = f"chunks/chunks-{number:05d}.parquet"
        (directory / path).write_bytes(parquet_bytes(chunks_table(part, len(part[0].tokens)), row_group_rows))
        entries.append(FileEntry(path=path, rows=len(part), bytes=0, sha256=""))
        if vectors is not None:
            rows = [(c.chunk_id, vectors[c.chunk_id]) for c in part]
            (directory / f"embeddings/embeddings-{number:05d}.parquet").write_bytes(
                parquet_bytes(embeddings_table(rows), row_group_rows)
            )
    return ChunkFileRanges.from_entries(str(directory), entries)


def write_embedding_files(directory: Path, ids, vectors, files: int) -> list[str]:
    """Real embeddings Parquet files, as the embed stage writes them: `files` files of
    consecutive rows, `embeddings-NNNNN.parquet`; their paths."""
    import numpy as np

    from pipeline.common.writers import embeddings_table, parquet_bytes

    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for number, part in enumerate(np.array_split(np.arange(len(ids)), files)):
        path = directory / f"embeddings-{number:05d}.parquet"
        path.write_bytes(parquet_bytes(embeddings_table(list(zip(ids[part].tolist(), vectors[part])))))
        paths.append(str(path))
    return paths


def write_list_slices(directory: Path, index, slices: int):
    """A filled IVF index written as build-index writes an index in slices by lists:
    slice-NNNNN.faiss, quantizer.faiss and list_owners.npy under `directory`: the Routing that
    reaches them."""
    import faiss

    from pipeline.index.files import LIST_OWNERS_FILE, QUANTIZER_FILE, write_owners
    from pipeline.index.routing import list_owners, list_sizes, slice_by_lists
    from pipeline.retrieve.search import Routing

    ivf = faiss.extract_index_ivf(index)
    owner = list_owners(ivf.quantizer.reconstruct_n(0, ivf.nlist), list_sizes(index), slices)
    slices = slice_by_lists(index, owner)
    for number, index_slice in enumerate(slices):
        faiss.write_index(index_slice, str(directory / f"slice-{number:05d}.faiss"))
    quantizer = faiss.clone_index(index)
    quantizer.reset()
    faiss.write_index(quantizer, str(directory / QUANTIZER_FILE))
    write_owners(owner, str(directory / LIST_OWNERS_FILE))
    return Routing(str(directory), len(slices), ivf.nlist)


def local_pipeline():
    """A TestPipeline on the in-process runner (the default DirectRunner would try a download)."""
    from apache_beam.options.pipeline_options import PipelineOptions
    from apache_beam.testing.test_pipeline import TestPipeline

    return TestPipeline(options=PipelineOptions(["--runner=FnApiRunner"]))


def shards_manifest(filled: int = 80, **fields):
    """A shards manifest of one shard of 10 sequences of L = 4 chunks with k = 2 (80 neighbour
    slots), `filled` of them holding a neighbour; `fields` replace any of its fields."""
    from schemas.manifest import CREATED_BY, ShardEntry, ShardsManifest

    return ShardsManifest(
        **{
            "config_hash": "c",
            "index_manifest_sha256": "i",
            "training_corpus": "same",
            "sequence_tokens": 128,
            "chunk_tokens": 32,
            "neighbours": 2,
            "neighbour_tokens": 64,
            "pad_id": 0,
            "num_sequences": 10,
            "shards": [
                ShardEntry(path="shard-00000.arrow", rows=10, bytes=1, sha256="s", neighbour_slots_filled=filled)
            ],
            "counters": {"sequences": 10},
            "created_by": CREATED_BY,
            "overlap": {},
            **fields,
        }
    )


def tie_tolerance(precision: str) -> float:
    """How far a score the Retriever finds (its queries embedded afresh) may be from the
    build's and still count as a tie. float32: the last bits. Reduced precision: an embedding
    depends on the batch it was computed in (the build's groups of 2,048 chunks against one
    sequence's 8); on an Intel Xeon with AMX, bfloat16 scores of the same pair differed by up
    to 2e-4."""
    return 1e-6 if precision == "float32" else 1e-3
