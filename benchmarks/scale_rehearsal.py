"""Scale rehearsal: every step of the index stage and of build-shards measured at N and 4N
chunks over many files, each compared with its memory-model row, and every shuffle's bytes
counted, so that what grows with the corpus shows before a cluster pays for it.

    .venv/bin/python benchmarks/scale_rehearsal.py [--n 250000] [--file-rows 1000]
        [--factory IVF4096,PQ32x8np] [--slice-bytes 16MB] [--corpus-docs 300] [--workdir DIR]
        [--parts index shards corpus] [--reuse] [--flink "OPTIONS"]

Parts, each at N and 4N (4N's files are 4× as many as N's, of the same rows):

- index: `ratrain-pipeline index` over synthetic embeddings (`LowRankClusters`, 384-d,
  `--file-rows` rows a file: ≥ 1,000 files at 4N with the defaults), `--factory` (2^12 lists:
  two-level training; 2^14 lists need N ≥ 638,976, 39 training vectors a list) at nprobe 16,
  written as one index file and as slices of `--slice-bytes`.
- shards: build-shards' transforms (`PackSequences` -> `RetrieveNeighbours` -> `WriteShards`,
  wired as `benchmarks/retrieve_join.py` wires them) over the same database, every chunk a
  training chunk (`training_corpus: same`), with synthetic tokens in documents of 1-40
  chunks, m = 64, L = 8, k = 2, searching the index part's one index file.
- corpus: the real `build-index` and `build-shards` (`ratrain-pipeline`, the real encoder) on
  Python docstrings (`examples/stdlib_docstrings.py --site-packages`), `--corpus-docs` and 4×
  as many documents: shuffled bytes per chunk of the whole stages. Smaller than N: build-index
  ran 20,426 docstring chunks in 261 s on 2 cores of an AMD EPYC without AVX512 (~78 chunks/s),
  so 250,000 real chunks would take ~53 minutes (an estimate at that rate).

Every job runs with two local worker processes (`--direct_num_workers=2
--direct_running_mode=multi_processing`), so a bundle's memory is a worker's and not the
runner's, and with `benchmarks/bundle_peaks` on its PYTHONPATH: each bundle's rise of its
worker's resident memory (VmHWM over VmRSS at its start), bytes read (rchar) and seconds; the
runner's encoded bytes into every GroupByKey. A step is a bundle's transforms less Beam's own
(grouping, impulse and reshuffle parts), named to depth 2 (`BuildIndex/FillParts`).

Beam's local runner gives each of its workers one bundle holding its share of a stage's input;
the recorder makes that input stream to the worker in ~1 MB messages beside the bundle (the
runner would send it as one message before the bundle starts, and the worker would hold all of
it) and keeps Beam's data-channel buffers at 1 MB (10 MB and 100 MB otherwise, filled only as
far as a bundle's output reaches), so a bundle's rise is what its steps hold, as on a runner
whose shuffle reads stream (`benchmarks/bundle_peaks`). The jobs run with glibc's mmap
threshold fixed (`MALLOC_MMAP_THRESHOLD_=131072`; `--allocator dynamic` leaves glibc's
default): by default a process raises its threshold to the largest array it freed, after which
arrays that size come from its heap, which keeps what they free, so a bundle's rise depended on
what earlier bundles freed, not only on what it held (two-level training's steps, whose input
is the same at N and 4N, moved 0.46-2.16x from N to 4N that way in three runs; docs/scale.md).
Fixed, arrays above 128 KiB are mapped and unmapped each time, which costs the jobs time (the
index stage 1.15-1.4x slower here, three runs), not memory. With `BUNDLE_PEAKS_TRACE=1` the
workers trace Python's allocations too (5-25x slower: use a smaller `--n`), and each step's row
adds its Python objects' peak at N and 4N: the terms of the
memory model's "build-shards: write one shard" row come from that.

`--flink "OPTIONS"` (`make flink-up`'s last line) runs build-shards once more at N and 4N on
that Flink cluster, at parallelism 1 with every exchange blocking, so that each stage runs alone
and its grouped values stream to it, with the same recorder (`runner_args`).

Per step the table has the largest bundle's rise at N and 4N and their ratio, bytes read and
shuffled (the shuffles its transforms feed) at 4N, and bundle seconds summed; where the memory
model has the step's row (`pipeline/jobs/memory_model.py`, at 4N and this config, SDK
process excluded) the measured rise is set against it. Growth ≤ 1.25× from N to 4N, or growth
as the row says within 1.5× of it, passes. Results: a table on stdout, JSON in
benchmarks/results/scale_rehearsal.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
from benchmarks.report import write_results  # noqa: E402
from benchmarks.synthetic import LowRankClusters  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "scale_rehearsal.json"
PEAKS = REPO / "benchmarks" / "bundle_peaks"
CLI = [sys.executable, "-c", "from pipeline.cli import main; main()"]  # this checkout's code (PYTHONPATH below)
M, SEQ_TOKENS, K, CANDIDATES, DIM, PAD, VOCAB = 64, 512, 2, 32, 384, 0, 30000
L = SEQ_TOKENS // M
SHARD_ROWS, NPROBE, SEED = 1024, 16, 20261205
MB = 1e6
# Beam's own parts of a bundle (grouping, impulses, reshuffles): a transform's name is cut at the
# first of these; what is left names the pipeline's step
BEAM_PARTS = {
    "Group",
    "GroupByKey",
    "Precombine",
    "KeyWithVoid",
    "InjectDefault",
    "DoOnce",
    "ExtractOutputs",
    "Merge",
    "UnKey",
    "AddRandomKeys",
    "RemoveRandomKeys",
    "ReshufflePerKey",
    "Impulse",
    "Write",
    "Read",
    "CombinePerKey",
}
GROWTH_FLAT = 1.25  # from N to 4N, a step that holds no more
MODEL_SLACK = 1.5  # a growing step measured within this of its row
NOISE_MB = 32  # below this at 4N a rise is allocator noise, not a step's holding
LOCAL_WORKERS = 2  # worker processes of Beam's local runner, each its own process
REUSE = False  # --reuse: a job already recorded in the workdir is read back, not run again
# --allocator fixed (the default): what the jobs add to their environment
FIXED_MMAP_THRESHOLD = {"MALLOC_MMAP_THRESHOLD_": "131072"}
ALLOCATOR_ENV: dict[str, str] = {}


# --- data --------------------------------------------------------------------------------------


def ensure_database(workdir: Path, n: int, file_rows: int) -> Path:
    """~n chunks of synthetic tokens in documents of 1-40 chunks and their embeddings, as
    chunks/chunks-NNNNN.parquet and embeddings/embeddings-NNNNN.parquet of `file_rows` rows:
    generated file by file, never the whole database at once."""
    from pipeline.chunks.chunk_files import chunks_table
    from pipeline.chunks.chunking import chunk_document
    from pipeline.common.writers import embeddings_table, parquet_bytes

    root = workdir / f"db-{n}-{file_rows}"
    if (root / "done").exists():
        return root
    shutil.rmtree(root, ignore_errors=True)
    (root / "chunks").mkdir(parents=True)
    (root / "embeddings").mkdir()
    start = time.perf_counter()
    rng, clusters = np.random.default_rng([SEED, 0]), LowRankClusters(DIM, seed=SEED)
    pending, doc, number, written = [], 0, 0, 0
    while written < n:
        length = int(rng.integers(1, 41)) * M - int(rng.integers(0, M))
        tokens = rng.integers(1, VOCAB, length).astype(np.int32)
        pending += list(chunk_document(doc, tokens, written + len(pending), M, PAD))
        doc += 1
        while len(pending) >= file_rows or (pending and written + len(pending) >= n):
            part, pending = pending[:file_rows], pending[file_rows:]
            vectors = clusters.sample(len(part), np.random.default_rng([SEED, 1, number]))
            (root / "chunks" / f"chunks-{number:05d}.parquet").write_bytes(parquet_bytes(chunks_table(part, M)))
            rows = list(zip([c.chunk_id for c in part], vectors))
            (root / "embeddings" / f"embeddings-{number:05d}.parquet").write_bytes(
                parquet_bytes(embeddings_table(rows))
            )
            number, written = number + 1, written + len(part)
    (root / "done").write_text(json.dumps({"chunks": written, "documents": doc, "files": number}))
    print(f"[data] {written:,} chunks in {number} files: {time.perf_counter() - start:.1f} s", flush=True)
    return root


def chunk_count(root: Path) -> int:
    return json.loads((root / "done").read_text())["chunks"]


# --- one measured job --------------------------------------------------------------------------


def measured_job(name: str, argv: list[str], work: Path) -> dict:
    """Run `argv` with the bundle recorder on: wall seconds, every bundle, every shuffle."""
    peaks, done_file = work / f"{name}-bundles", work / f"{name}.json"
    if REUSE and done_file.exists():
        return {**json.loads(done_file.read_text()), **_recorded(peaks)}
    shutil.rmtree(peaks, ignore_errors=True)
    peaks.mkdir(parents=True)
    env = {
        **os.environ,
        **ALLOCATOR_ENV,
        "BUNDLE_PEAKS_DIR": str(peaks),
        "PYTHONPATH": f"{PEAKS}{os.pathsep}{REPO}",
        "HF_HUB_OFFLINE": "1",
    }
    start = time.perf_counter()
    with open(work / f"{name}.log", "w") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - start
    if status != 0:
        raise SystemExit(f"{name} failed ({status}): see {work / f'{name}.log'}")
    measured = {"wall_s": wall, "peak_rss_mb": usage.ru_maxrss * 1024 / MB}  # the job's own process
    done_file.write_text(json.dumps(measured))
    found = _recorded(peaks)
    shuffled = sum(found["shuffles"].values()) / MB
    print(f"[{name}] {wall:.1f} s, {len(found['bundles'])} bundles, {shuffled:.1f} MB shuffled", flush=True)
    return {**measured, **found}


def _recorded(peaks: Path) -> dict:
    bundles = [json.loads(line) for f in sorted(peaks.glob("[0-9]*.jsonl")) for line in f.open()]
    shuffles: dict[str, int] = defaultdict(int)
    for f in peaks.glob("shuffles-*.json"):
        for transform, size in json.loads(f.read_text()).items():
            shuffles[transform] += size
    return {"bundles": bundles, "shuffles": dict(shuffles)}


def _fresh(out: Path, work: Path) -> None:
    """Remove a job's earlier output, unless it is recorded and read back (--reuse)."""
    if not (REUSE and (work / f"{out.name}.json").exists()):
        shutil.rmtree(out, ignore_errors=True)


def step_name(transform: str) -> str:
    """A transform's step: its name to depth 3, cut before Beam's own parts and a ParDo's or
    Map's own label (`BuildIndex/FillParts/ParDo(_FillPart)` -> `BuildIndex/FillParts`)."""
    kept = []
    for part in transform.split("/")[:3]:
        if part in BEAM_PARTS or "(" in part or part.startswith(("Map(", "FlatMap(")):
            break
        kept.append(part)
    return "/".join(kept)


def steps_of(job: dict) -> dict[str, dict]:
    """Per step (a bundle's steps: its transforms' names, to depth 3, less Beam's own parts):
    its largest bundle's rise, the bytes its bundles read, their seconds, and the bytes it sent
    into shuffles. A bundle of Beam's parts alone (a group read back, say) is named by them."""
    steps: dict[str, dict] = {}
    for bundle in job["bundles"]:
        # the runner's own nodes: Beam's local runner's `ref_...`, Flink's data channel `fn/read`, `fn/write`
        transforms = [t for t in bundle["transforms"] if not t.startswith(("ref_", "fn/"))]
        own = sorted({step_name(t) for t in transforms} - {""}) or sorted(
            {"/".join(t.split("/")[:3]) for t in transforms}
        )
        name = " + ".join(_outermost(own))
        step = steps.setdefault(name, {"rise_mb": 0.0, "read_mb": 0.0, "seconds": 0.0, "bundles": 0})
        step["rise_mb"] = max(step["rise_mb"], bundle["rise_kb"] * 1024 / MB)
        if "traced_rise_kb" in bundle:  # BUNDLE_PEAKS_TRACE: its Python objects' part of the rise
            step["traced_mb"] = max(step.get("traced_mb", 0.0), bundle["traced_rise_kb"] * 1024 / MB)
        step["read_mb"] += bundle["read_bytes"] / MB
        step["seconds"] += bundle["seconds"]
        step["bundles"] += 1
        fed = {t.rsplit("/Write", 1)[0] for t in transforms if t.endswith("/Write")}
        step.setdefault("feeds", set()).update(g for g in job["shuffles"] if any(g.startswith(f) for f in fed))
    for step in steps.values():
        step["shuffled_mb"] = sum(job["shuffles"][g] for g in step.pop("feeds", ())) / MB
    return steps


def _outermost(names: list[str]) -> list[str]:
    """Leave out a name that another one extends (`BuildIndex/TrainIndex` beside `BuildIndex/TrainIndex/Train`)."""
    return [n for n in names if not any(o != n and o.startswith(n + "/") for o in names)]


# --- the memory model's rows ---------------------------------------------------------------------


# a step (as `step_name` names it) -> its memory-model row (a prefix of the row's name); a
# bundle that fuses several steps is set against the largest of their rows
MODEL_ROWS = {
    "BuildIndex/TrainIndex/EncoderSubset": "index: first-level and encoder subsets",
    "BuildIndex/TrainIndex/FirstLevelSubset": "index: first-level and encoder subsets",
    "BuildIndex/TrainIndex/GroupFirstLevelSubset": "index: write one subset file",
    "BuildIndex/TrainIndex/WriteFirstLevelSubset": "index: write one subset file",
    "BuildIndex/TrainIndex/GroupEncoderSubset": "index: write one subset file",
    "BuildIndex/TrainIndex/WriteEncoderSubset": "index: write one subset file",
    "BuildIndex/TrainIndex/GatherFirstLevelSubset": "index: train first level",
    "BuildIndex/TrainIndex/TrainFirstLevel": "index: train first level",
    "BuildIndex/TrainIndex/AssignFirstLevel": "index: assign one sample file",
    "BuildIndex/TrainIndex/GroupByFirstLevel": "index: train one first-level cluster",
    "BuildIndex/TrainIndex/TrainSecondLevel": "index: train one first-level cluster",
    "BuildIndex/TrainIndex/GroupByListBlock": "index: write one block of centroids",
    "BuildIndex/TrainIndex/Centroids": "index: write one block of centroids",
    "BuildIndex/TrainIndex/SumLists": "index: Lloyd step over one sample file",
    "BuildIndex/TrainIndex/SumBlocks": "index: Lloyd step: combine",
    "BuildIndex/TrainIndex/MoveBlocks": "index: Lloyd step: move",
    "BuildIndex/TrainIndex/GatherEncoderSubset": "index: assemble trained",
    "BuildIndex/TrainIndex/AssembleQuantizer": "index: assemble trained",
    "BuildIndex/FillParts": "index: fill",
    "BuildIndex/MergeAndTune": "index: merge",
    "BuildIndex/GatherParts": "index: gather the filled parts",
    "BuildIndex/AssembleSlices": "index: assemble one slice",
    "BuildIndex/GroupSlices": "index: assemble one slice",
    "BuildIndex/ListsBySlice": "index: assemble one piece",
    "BuildIndex/GroupPieces": "index: assemble one piece",
    "BuildIndex/AssemblePieces": "index: assemble one piece",
    "BuildIndex/MergeSlices": "index: merge the slices' search results",
    "BuildIndex/TuneSlices": "index: merge the slices' search results",
    "EntryPieces/KeyByPiece": "a stage's file entries: write one piece",
    "EntryPieces/WritePiece": "a stage's file entries: write one piece",
    "Commit": "build-index: commit",  # the `index` command's: its faiss files, fewer than the row's
    "RetrieveNeighbours/Search": "build-shards: search",
    "RetrieveNeighbours/NeighbourTokens": "build-shards: join one chunk file",
    "RetrieveNeighbours/AssembleRows": "build-shards: write one shard",
    "WriteShards": "build-shards: write one shard",
}


def model_rows(chunks: int, file_rows: int, factory: str, slice_bytes: str | None) -> dict[str, int]:
    """The memory model's rows at this size and config, the SDK process left out (the rise a
    bundle can show is what it holds on top of it)."""
    from pipeline.jobs.memory_model import SDK_PROCESS, Corpus, stage_memory
    from schemas.config import PipelineConfig

    cfg = PipelineConfig.model_validate(
        {
            "output": "unused",
            "retrieval_corpus": {"paths": ["unused"]},
            "training_corpus": "same",
            "chunk_tokens": M,
            "sequence_tokens": SEQ_TOKENS,
            "neighbours": K,
            "shard_rows": SHARD_ROWS,
            "chunk_file_rows": file_rows,
            "index": {"type": factory, **({"slice_bytes": slice_bytes} if slice_bytes else {})},
        }
    )
    return {row["stage"]: row["bytes"] - SDK_PROCESS for row in stage_memory(cfg, Corpus.of(chunks), DIM)}


def model_row(step: str, rows: dict[str, int]) -> tuple[str, float] | None:
    """The largest memory-model row of the steps a bundle fuses (None: none has a row)."""
    found = [
        (stage, size / MB)
        for part in step.split(" + ")
        for name, prefix in MODEL_ROWS.items()
        if part.startswith(name)
        for stage, size in rows.items()
        if stage.startswith(prefix)
    ]
    return max(found, key=lambda row: row[1]) if found else None


FLINK: list[str] = []  # --flink: the Beam options that submit to a Flink cluster


def runner_args(runner: int | str) -> list[str]:
    """A job's runner: a count of local worker processes, or "flink": the --flink cluster at
    parallelism 1 with every exchange blocking, the SDK worker in the job's own process
    (LOOPBACK). There a stage starts when the one before it has ended and Flink's batch runner
    streams a stage's input through its bundles, so each step is measured alone, its grouped
    values streamed to it as a cluster's are. Bundles that still run at once (branches with no
    exchange between them) are one record, named by all their steps. build-shards at 10^6
    chunks stalled in this mode, in the stage that reads the queries (docs/scale.md)."""
    if runner == "flink":
        chosen = [o for o in FLINK if not o.startswith("--parallelism")]
        one_at_a_time = ["--parallelism=1", "--execution_mode_for_batch=BATCH_FORCED"]
        # one SDK worker for the whole job, not one started per stage (Beam's default): 92 s
        # against 117 s at 250,007 chunks
        return [*chosen, "--environment_type=LOOPBACK", *one_at_a_time, "--environment_cache_millis=3600000"]
    return [f"--direct_num_workers={runner}", "--direct_running_mode=multi_processing"]


def compared(jobs: dict[str, dict], rows_n: dict, rows_4n: dict) -> list[dict]:
    """One row per step seen in the 4N job (`jobs`: by size label): its growth from N and its model row's."""
    at_n, at_4n = steps_of(jobs["N"]), steps_of(jobs["4N"])
    table = []
    for step, big in sorted(at_4n.items(), key=lambda kv: -kv[1]["rise_mb"]):
        small = at_n.get(step)
        entry = {
            "step": step,
            "rise_n_mb": small["rise_mb"] if small else None,
            "rise_4n_mb": big["rise_mb"],
            "growth": big["rise_mb"] / small["rise_mb"] if small and small["rise_mb"] > 0 else None,
            "read_4n_mb": big["read_mb"],
            "shuffled_n_mb": small["shuffled_mb"] if small else None,
            "shuffled_4n_mb": big["shuffled_mb"],
            "seconds_4n": big["seconds"],
            "bundles_4n": big["bundles"],
            **({"traced_n_mb": small.get("traced_mb"), "traced_4n_mb": big["traced_mb"]} if "traced_mb" in big else {}),
        }
        row, row_n = model_row(step, rows_4n), model_row(step, rows_n)
        if row:
            entry.update(model_row=row[0], model_4n_mb=row[1], model_growth=row[1] / row_n[1] if row_n[1] else None)
        entry["verdict"] = verdict(entry)
        table.append(entry)
    return table


def verdict(entry: dict) -> str:
    """flat: grew ≤ GROWTH_FLAT from N to 4N; grows as its row: its memory-model row grows too,
    and the measure at 4N is within MODEL_SLACK of the row; GROWS otherwise. The measure is the
    step's largest bundle's rise."""
    held, growth, model = entry["rise_4n_mb"], entry["growth"], entry.get("model_4n_mb")
    if held < NOISE_MB:
        return "flat (under the noise floor)"
    if growth is not None and growth <= GROWTH_FLAT:
        return "flat"
    if model and (entry.get("model_growth") or 1) > GROWTH_FLAT and held <= model * MODEL_SLACK:
        return "grows as its row"
    return "GROWS" if growth is not None else "not seen at N"


# --- the parts -----------------------------------------------------------------------------------


def _named(runner: int | str) -> str:
    """A job's name suffix: none on the local runner."""
    return "-flink" if runner == "flink" else ""


def index_part(work: Path, root: Path, factory: str, slice_bytes: str | None, tag: str, runner: int | str) -> dict:
    out = work / f"index-{tag}-{root.name}{_named(runner)}"
    _fresh(out, work)
    argv = [*CLI, "index", "--embeddings", str(root / "embeddings" / "*.parquet"), "--output", str(out)]
    argv += ["--type", factory, "--nprobe", str(NPROBE)]
    argv += ["--slice-bytes", slice_bytes] if slice_bytes else []
    job = measured_job(out.name, [*argv, "--", *runner_args(runner)], work)
    return {**job, "output": str(out)}


def shards_main(root: str, index_dir: str, out: str, beam_args: list[str]) -> None:
    """build-shards' transforms over the database at `root`, every chunk a training chunk."""
    import apache_beam as beam
    from apache_beam.io.parquetio import ReadAllFromParquetBatched

    from benchmarks.scale_rehearsal import ListedFiles  # by its module's name, not __main__: workers unpickle it
    from pipeline.chunks.chunk_files import TRAINING_COLUMNS, ChunkFileRanges, TrainingChunks
    from pipeline.jobs.options import new_pipeline
    from pipeline.retrieve.beam import DocumentSpans, PackSequences, RetrieveNeighbours
    from pipeline.retrieve.search import Retrieval
    from pipeline.shards.write import WriteShards

    files = sorted(Path(root, "chunks").glob("*.parquet"))
    rows = [_rows(p) for p in files]
    chunk_files = ChunkFileRanges.from_paths(
        root,
        [f"chunks/{p.name}" for p in files],
        rows,
        [f"embeddings/{p.name.replace('chunks', 'embeddings')}" for p in files],
    )
    spec = Retrieval(
        index_path=f"{index_dir}/faiss/index.faiss",
        depth=NPROBE,
        chunk_files=chunk_files,
        chunks_per_seq=L,
        chunk_tokens=M,
        neighbours=K,
        candidates=CANDIDATES,
        pad_id=PAD,
        tokens_from_chunk_files=True,  # as build-shards packs a database's own chunks
    )
    with new_pipeline(beam_args, type_check=False) as p:
        training = (
            p
            | "TrainingFiles" >> beam.Create([str(f) for f in files])
            | "ReadTrainingChunks" >> ReadAllFromParquetBatched(columns=list(TRAINING_COLUMNS))
            | "TrainingChunkBlocks" >> beam.Map(lambda batch: TrainingChunks.of(batch).heads())
        )
        sequences = training | "PackSequences" >> PackSequences(L, PAD)
        # listed, then read file by file, as build-shards reads a committed manifest's (`CommittedFiles`)
        spans = p | "DocumentSpans" >> DocumentSpans(ListedFiles(tuple(str(f) for f in files)))
        found = ((sequences, spans) | "RetrieveNeighbours" >> RetrieveNeighbours(spec, SHARD_ROWS)).rows
        _ = found | "WriteShards" >> WriteShards(out, SHARD_ROWS, PAD)


@dataclass(frozen=True)
class ListedFiles:
    """Files a job reads as those of a committed manifest (`CommittedFiles.paths`), named here."""

    listed: tuple[str, ...]

    def paths(self) -> list[str]:
        return list(self.listed)


def _rows(path: Path) -> int:
    import pyarrow.parquet as pq

    return pq.ParquetFile(path).metadata.num_rows


def shards_part(work: Path, root: Path, index_dir: str, runner: int | str) -> dict:
    out = work / f"shards-{root.name}{_named(runner)}"
    _fresh(out, work)
    argv = [sys.executable, str(Path(__file__).resolve()), "_shards", str(root), index_dir, str(out)]
    job = measured_job(out.name, [*argv, *runner_args(runner)], work)
    written = sorted(out.glob("shard-*.arrow"))
    return {**job, "output": str(out), "shards": len(written)}


def corpus_part(work: Path, documents: int) -> dict:
    """The real build-index and build-shards on `documents` docstrings."""
    source = work / "docstrings.jsonl"
    if not source.exists():
        script = REPO / "examples" / "stdlib_docstrings.py"
        subprocess.run([sys.executable, str(script), str(source), "--site-packages"], check=True)
    lines = source.read_text().splitlines()
    if len(lines) < documents:
        raise SystemExit(f"only {len(lines):,} docstrings for {documents:,} documents")
    slug = work / f"corpus-{documents}"
    shutil.rmtree(slug, ignore_errors=True)
    slug.mkdir(parents=True)
    (slug / "corpus.jsonl").write_text("\n".join(lines[:documents]) + "\n")
    config = slug / "config.yaml"
    config.write_text(
        f"output: {slug / 'out'}\n"
        f"retrieval_corpus: {{paths: ['{slug / 'corpus.jsonl'}'], format: jsonl, text_field: text, id_field: id}}\n"
        "training_corpus: same\nchunk_tokens: 64\nsequence_tokens: 512\nneighbours: 2\nshard_rows: 128\n"
        "chunk_file_rows: 1024\nembedding: {model: all-MiniLM-L6-v2, batch_size: 64, device: cpu}\n"
        "index: {type: auto, memory_budget: 1GiB}\n"
    )
    found = {}
    for stage in ("build-index", "build-shards"):
        found[stage] = measured_job(
            f"{stage}-{documents}", [*CLI, stage, "--config", str(config), "--", *runner_args(LOCAL_WORKERS)], work
        )
    manifest = json.loads((slug / "out" / "index" / "manifest.json").read_text())
    found["chunks"] = manifest["num_chunks"]
    return found


# --- report --------------------------------------------------------------------------------------


def print_table(title: str, table: list[dict]) -> None:
    print(f"\n{title}")
    print(
        f"{'step':<58} {'rise N':>8} {'rise 4N':>8} {'x':>5} "
        + f"{'model 4N':>9} {'read 4N':>8} {'shuf N':>8} {'shuf 4N':>8} {'s 4N':>7}  verdict"
    )
    for e in table:
        traced = (
            f"  (Python objects {_mb(e['traced_n_mb'], 0)} -> {_mb(e['traced_4n_mb'], 0)})"
            if "traced_4n_mb" in e
            else ""
        )
        print(
            f"{e['step'][:58]:<58} {_mb(e['rise_n_mb'])} {_mb(e['rise_4n_mb'])} {_times(e['growth'])} "
            + f"{_mb(e.get('model_4n_mb'), 9)} {_mb(e['read_4n_mb'])} {_mb(e['shuffled_n_mb'])} "
            f"{_mb(e['shuffled_4n_mb'])} {e['seconds_4n']:>7.1f}  {e['verdict']}{traced}"
        )


def _times(ratio: float | None) -> str:
    return f"{'-':>5}" if ratio is None else f"{ratio:>5.2f}"


def _mb(value, width: int = 8) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.1f}"


def flink_part(title: str, jobs: dict[str, dict], rows: dict, tag: str, chunks: dict[str, int]) -> dict:
    """A part's table from its Flink runs at N and 4N."""
    table = compared(jobs, rows[("N", tag)], rows[("4N", tag)])
    peak = {label: job["peak_rss_mb"] for label, job in jobs.items()}
    print_table(
        f"{title}, on Flink at parallelism 1, exchanges blocking; the job's process (every bundle runs in "
        f"it) peaks at {peak['N']:,.0f} and {peak['4N']:,.0f} MB ({peak['4N'] / peak['N']:.2f}x); wall "
        f"{jobs['N']['wall_s']:.0f} s and {jobs['4N']['wall_s']:.0f} s",
        table,
    )
    return {
        "chunks": chunks,
        "wall_s": {label: job["wall_s"] for label, job in jobs.items()},
        "peak_rss_mb": peak,
        "table": table,
    }


def per_chunk(job: dict, chunks: int) -> float:
    return sum(job["shuffles"].values()) / chunks


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_shards":
        return shards_main(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:])
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--n", type=int, default=250_000, help="chunks at N (4N is run too)")
    parser.add_argument("--file-rows", type=int, default=1000)
    parser.add_argument("--factory", default="IVF4096,PQ32x8np", help="2^14 lists need --n >= 638,976")
    parser.add_argument("--slice-bytes", default="16MB")
    parser.add_argument("--corpus-docs", type=int, default=300)
    parser.add_argument("--parts", nargs="+", default=["index", "shards", "corpus"])
    parser.add_argument("--workdir", help="keep (and reuse) the databases here; default: a temp dir")
    parser.add_argument("--output", default=str(RESULTS))
    parser.add_argument("--reuse", action="store_true", help="read back jobs recorded in --workdir; run the rest")
    parser.add_argument(
        "--allocator",
        choices=["fixed", "dynamic"],
        default="fixed",
        help="glibc's mmap threshold in the jobs: fixed at 128 KiB, or glibc's default (rises as arrays are freed)",
    )
    parser.add_argument(
        "--flink", default="", help="run on Flink: the Beam options that submit to it (`make flink-up`'s last line)"
    )
    args = parser.parse_args()
    global REUSE
    REUSE = args.reuse
    ALLOCATOR_ENV.update(FIXED_MMAP_THRESHOLD if args.allocator == "fixed" else {})
    FLINK[:] = args.flink.split()
    from pipeline.embed.encoder import cpu_summary

    temp = None if args.workdir else tempfile.TemporaryDirectory(prefix="scale-rehearsal-")
    work = Path(args.workdir or temp.name).resolve()
    work.mkdir(parents=True, exist_ok=True)
    results: dict = {"cpu": cpu_summary(), "args": vars(args), "parts": {}}
    print(f"CPU: {cpu_summary()}; glibc's mmap threshold {args.allocator}", flush=True)
    sizes = {"N": args.n, "4N": 4 * args.n}
    roots = (
        {label: ensure_database(work, n, args.file_rows) for label, n in sizes.items()}
        if {
            "index",
            "shards",
        }
        & set(args.parts)
        else {}
    )
    chunks = {label: chunk_count(root) for label, root in roots.items()}
    rows = {
        (label, tag): model_rows(chunks[label], args.file_rows, args.factory, slice_bytes)
        for label in roots
        for tag, slice_bytes in (("one file", None), ("slices", args.slice_bytes))
    }
    indexes = {}
    if "index" in args.parts or "shards" in args.parts:
        for tag, slice_bytes in (("one file", None), ("slices", args.slice_bytes)):
            jobs = {
                label: index_part(work, root, args.factory, slice_bytes, tag.replace(" ", "-"), LOCAL_WORKERS)
                for label, root in roots.items()
            }
            indexes[tag] = {label: job["output"] for label, job in jobs.items()}
            table = compared(jobs, rows[("N", tag)], rows[("4N", tag)])
            title = f"index stage, {tag}: {chunks['N']:,} and {chunks['4N']:,} vectors, {args.factory}"
            print_table(title, table)
            results["parts"][f"index, {tag}"] = {
                "chunks": chunks,
                "wall_s": {label: job["wall_s"] for label, job in jobs.items()},
                "shuffled_per_chunk": {label: per_chunk(job, chunks[label]) for label, job in jobs.items()},
                "table": table,
            }
    if "shards" in args.parts:
        jobs = {
            label: shards_part(work, root, indexes["one file"][label], LOCAL_WORKERS) for label, root in roots.items()
        }
        table = compared(jobs, rows[("N", "one file")], rows[("4N", "one file")])
        print_table(f"build-shards, one index file: {chunks['N']:,} and {chunks['4N']:,} chunks", table)
        results["parts"]["build-shards"] = {
            "chunks": chunks,
            "wall_s": {label: job["wall_s"] for label, job in jobs.items()},
            "shuffled_per_chunk": {label: per_chunk(job, chunks[label]) for label, job in jobs.items()},
            "shuffles_4n": jobs["4N"]["shuffles"],
            "table": table,
        }
    if FLINK:
        if "index" in args.parts:
            for tag, slice_bytes in (("one file", None), ("slices", args.slice_bytes)):
                jobs = {
                    label: index_part(work, root, args.factory, slice_bytes, tag.replace(" ", "-"), "flink")
                    for label, root in roots.items()
                }
                title = f"index stage, {tag}: {chunks['N']:,} and {chunks['4N']:,} vectors, {args.factory}"
                results["parts"][f"index, {tag}, on Flink"] = flink_part(title, jobs, rows, tag, chunks)
        if "shards" in args.parts:
            index_of = indexes["one file"]
            jobs = {label: shards_part(work, root, index_of[label], "flink") for label, root in roots.items()}
            title = f"build-shards, one index file: {chunks['N']:,} and {chunks['4N']:,} chunks"
            results["parts"]["build-shards on Flink"] = flink_part(title, jobs, rows, "one file", chunks)
    if "corpus" in args.parts:
        found = {
            label: corpus_part(work, docs) for label, docs in (("N", args.corpus_docs), ("4N", 4 * args.corpus_docs))
        }
        entry = {}
        for stage in ("build-index", "build-shards"):
            entry[stage] = {
                label: {
                    "chunks": found[label]["chunks"],
                    "wall_s": found[label][stage]["wall_s"],
                    "shuffled_per_chunk": per_chunk(found[label][stage], found[label]["chunks"]),
                    "shuffles": found[label][stage]["shuffles"],
                }
                for label in found
            }
            print(f"\n{stage} on docstrings: shuffled bytes per chunk")
            for label, e in entry[stage].items():
                print(f"  {label}: {e['chunks']:,} chunks, {e['shuffled_per_chunk']:,.0f} B/chunk, {e['wall_s']:.1f} s")
                for transform, size in sorted(e["shuffles"].items(), key=lambda kv: -kv[1])[:6]:
                    print(f"      {size / e['chunks']:>10,.0f} B/chunk  {transform}")
        results["parts"]["corpus"] = entry
    write_results(results, args.output)
    if temp is not None:
        temp.cleanup()


if __name__ == "__main__":
    main()
