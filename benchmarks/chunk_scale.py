"""Reading and chunking many tiny documents: the largest worker's peak memory as the number of
documents grows.

    .venv/bin/python benchmarks/chunk_scale.py [--documents 250000 1000000] [--workdir DIR]

Per corpus size N (the same seed, so each corpus extends the smaller ones):

1. Data: N tiny documents (8-40 words, one chunk each) in 16 JSONL files, with id fields.
2. A Beam job wiring the build-index stage's own transforms up to the chunk files
   (`ReadCorpus` -> `ChunkDocuments` -> `WriteGroupedFiles` of `chunks_table`), with
   `--direct_num_workers=2 --direct_running_mode=multi_processing`, in a subprocess.
   It stops after chunking: the encoder's memory does not depend on the corpus size.
3. The chunk files are checked: N dense ids in doc-id order.
4. The floor, the same way: a Beam job that reads the same lines (`ReadFromText`), tokenizes
   and cuts them into the same chunk rows and writes them grouped into files of the same size,
   with no duplicate check and no chunk ids (files keyed by a hash). It holds what any Beam
   chunker holds on this runner, so what ours adds over it is what its id assignment and
   deduplication keep.

Reported: documents/s (wall time, interpreter start included), peak RSS (VmHWM) of the main
process and of the largest worker process (polled from /proc every 0.2 s). With Beam's local
runner the main process holds every shuffle in memory (on a cluster the shuffle service holds
it on disk); the workers are where a Dataflow or Flink job's memory goes, and theirs is the
figure that must stay flat as N grows. Before chunk ids were assigned by doc-id buckets, every
worker that cut chunks held a dict of all N documents' first chunk ids (~100 B per document).
Beam's local runner hands each worker its share of a stage's grouped input as one message, so
on it both grow with N; the ratio of ours to the floor is the figure that must stay flat.
Results: a table on stdout, JSON in benchmarks/results/chunk_scale.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
from benchmarks.report import write_results  # noqa: E402
from benchmarks.retrieve_join import WorkerPeak, record_rss  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "chunk_scale.json"
M, FILES, CHUNK_FILE_ROWS, MB = 64, 16, 65536, 2**20
WORKERS = ["--direct_num_workers=2", "--direct_running_mode=multi_processing"]


def write_corpus(directory: Path, documents: int) -> None:
    """`documents` tiny documents, document i the same in every corpus size."""
    words = np.array(
        "the of and a to in is was for on that by with as at from his her an were "
        "river city music theory light metal north winter engine paper".split()
    )
    directory.mkdir(parents=True)
    per_file = -(-documents // FILES)
    for f in range(FILES):
        lines = []
        for i in range(f * per_file, min((f + 1) * per_file, documents)):
            rng = np.random.default_rng(i)
            text = " ".join(words[rng.integers(0, len(words), rng.integers(8, 41))])
            lines.append(json.dumps({"id": f"doc-{i}", "text": text}))
        (directory / f"part-{f:02d}.jsonl").write_text("\n".join(lines) + "\n")


def job_main(corpus: str, out: str) -> None:
    """The stage's transforms up to the chunk files, on 2 worker processes."""

    from pipeline.chunks.beam import ChunkDocuments
    from pipeline.chunks.chunk_files import chunks_table
    from pipeline.chunks.chunking import load_tokenizer, pad_id_of
    from pipeline.common.models import resolve_tokenizer
    from pipeline.common.writers import WriteGroupedFiles, parquet_bytes
    from pipeline.corpus.read import ReadCorpus
    from pipeline.jobs.options import new_pipeline
    from schemas.stage_config import CorpusConfig

    tokenizer = resolve_tokenizer(None)
    pad = pad_id_of(load_tokenizer(tokenizer))
    workers = WorkerPeak()
    with new_pipeline(WORKERS) as p:
        documents, _, _ = p | "ReadCorpus" >> ReadCorpus(CorpusConfig(paths=[f"{corpus}/*.jsonl"], id_field="id"))
        chunks, _ = documents | "ChunkDocuments" >> ChunkDocuments(tokenizer, M, pad)
        _ = chunks | "WriteChunks" >> WriteGroupedFiles(
            f"{out}/chunks",
            relative_to=out,
            prefix="chunks",
            extension="parquet",
            key=lambda c: c.chunk_id,
            rows_per_file=CHUNK_FILE_ROWS,
            to_bytes=lambda rows: parquet_bytes(chunks_table(rows, M)),
        )
    record_rss(out, workers.stop())


def floor_main(corpus: str, out: str, documents: str) -> None:
    """The same chunk rows without ids or deduplication, grouped by a hash into as many files."""
    import apache_beam as beam

    from pipeline.chunks.chunk_files import chunks_table
    from pipeline.chunks.chunking import Chunk, chunk_document, load_tokenizer, pad_id_of, tokenize_batch
    from pipeline.common.models import resolve_tokenizer
    from pipeline.common.writers import WriteGroupedFiles, parquet_bytes
    from pipeline.jobs.options import new_pipeline

    path = resolve_tokenizer(None)
    pad = pad_id_of(load_tokenizer(path))
    files = -(-int(documents) // CHUNK_FILE_ROWS)

    def chunks(lines: list[str]) -> list[Chunk]:
        texts = [json.loads(line)["text"] for line in lines]
        return [
            c
            for tokens in tokenize_batch(load_tokenizer(path), texts)
            for c in chunk_document(hash(tokens.tobytes()) & 0x7FFF_FFFF, tokens, 0, M, pad)
        ]

    workers = WorkerPeak()
    with new_pipeline(WORKERS) as p:
        _ = (
            p
            | "ReadLines" >> beam.io.ReadFromText(f"{corpus}/*.jsonl")
            | "Batch" >> beam.BatchElements(min_batch_size=1, max_batch_size=256)
            | "Chunk" >> beam.FlatMap(chunks)
            | "WriteChunks"
            >> WriteGroupedFiles(
                f"{out}/chunks",
                relative_to=out,
                prefix="chunks",
                extension="parquet",
                key=lambda c: c.doc_id % files * CHUNK_FILE_ROWS,
                rows_per_file=CHUNK_FILE_ROWS,
                to_bytes=lambda rows: parquet_bytes(chunks_table(rows, M)),
            )
        )
    record_rss(out, workers.stop())


def check_chunks(out: Path, documents: int) -> None:
    """N dense chunk ids, one per tiny document, in doc-id order."""
    import pyarrow.parquet as pq

    tables = [pq.read_table(p, columns=["chunk_id", "doc_id"]) for p in sorted(out.glob("chunks/*.parquet"))]
    ids = np.concatenate([t["chunk_id"].to_numpy() for t in tables])
    docs = np.concatenate([t["doc_id"].to_numpy() for t in tables])
    if not (np.array_equal(ids, np.arange(documents)) and np.all(np.diff(docs) > 0)):
        raise SystemExit(f"chunk ids are not dense and in doc-id order in {out}")


def measure(job: str, corpus: Path, out: Path, documents: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    start = time.perf_counter()
    with open(out.with_suffix(".log"), "w") as log:
        status = subprocess.call(
            [
                sys.executable,
                str(Path(__file__).resolve()),
                job,
                str(corpus),
                str(out),
                *([str(documents)] if job == "floor" else []),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
    wall = time.perf_counter() - start
    if status != 0:
        raise SystemExit(f"the {job} job failed, see {out.with_suffix('.log')}")
    if job == "job":
        check_chunks(out, documents)
    rss = json.loads((out / "rss.json").read_text())
    return {
        "documents": documents,
        "wall_s": wall,
        "documents_per_s": documents / wall,
        "main_peak_rss_mb": rss["self_kb"] / 1024,
        "worker_peak_rss_mb": rss["children_kb"] / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, nargs="+", default=[250_000, 1_000_000])
    parser.add_argument("--workdir", help="keep corpora here (reused); default: a temporary one")
    args = parser.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="chunk_scale-"))
    runs = {"ours": [], "floor": []}
    for n in args.documents:
        corpus = workdir / f"corpus-{n}"
        if not corpus.exists():
            write_corpus(corpus, n)
        for name, job in (("ours", "job"), ("floor", "floor")):
            runs[name].append(r := measure(job, corpus, workdir / f"{name}-{n}", n))
            print(
                f"{name:>5} {n:>10,} documents: {r['wall_s']:7.1f} s, {r['documents_per_s']:8.0f} docs/s, "
                f"main {r['main_peak_rss_mb']:6.0f} MB, largest worker {r['worker_peak_rss_mb']:5.0f} MB",
                flush=True,
            )
    growth = {name: r[-1]["worker_peak_rss_mb"] / r[0]["worker_peak_rss_mb"] for name, r in runs.items()}
    over_floor = [o["worker_peak_rss_mb"] / f["worker_peak_rss_mb"] for o, f in zip(runs["ours"], runs["floor"])]
    print(
        f"\ndocuments x{args.documents[-1] / args.documents[0]:.0f}: largest worker's peak RSS "
        f"x{growth['ours']:.2f} (floor x{growth['floor']:.2f}); ours / floor: "
        + ", ".join(f"{r:.2f}" for r in over_floor)
    )
    write_results({"runs": runs, "worker_rss_growth": growth, "worker_rss_over_floor": over_floor}, RESULTS)
    if not args.workdir:
        shutil.rmtree(workdir)


if __name__ == "__main__":
    if sys.argv[1:2] == ["job"]:
        job_main(*sys.argv[2:4])
    elif sys.argv[1:2] == ["floor"]:
        floor_main(*sys.argv[2:5])
    else:
        main()
