"""Retrieval + join (the build-shards stage): throughput against an in-process floor, and
peak memory as the chunk database grows.

    .venv/bin/python benchmarks/retrieve_join.py [--sizes 50000 200000 800000]
        [--query-chunks 49152] [--workdir DIR] [--repeat 3]

Per chunk-database size N (same seed, so each database extends the smaller ones):

1. Data: N chunks of m = 64 random tokens in documents of 1-40 chunks (`chunk_document`, so
   continuations are real), their 384-d `LowRankClusters` embeddings, both as the pipeline's
   own Parquet files (65,536 rows each), and an `IVF256,PQ32x8np` index (nprobe 16) over all
   of them: its size grows by 40 B per chunk, so what grows with N is the chunk database.
2. The training sequences are fixed: the first `--query-chunks` chunks (all in the first
   chunk file), packed into sequences of n = 512 tokens (L = 8 chunks), k = 2 neighbours
   from 32 candidates.
3. Builders, each a subprocess of its own, one after the other, each after the data has been
   read into the page cache (else the first pays every disk read for those after it):
   - ours: a Beam job wiring the stage's own transforms as `build-shards` does
     (`PackSequences` -> `RetrieveNeighbours` -> `WriteShards`), retrieving from the whole
     chunk database (its files are read where a hit or a kept neighbour lies; the queries'
     embedding file where its search batches are searched), run twice:
     in-process (FnApiRunner, one process) and with
     `--direct_num_workers=2 --direct_running_mode=multi_processing`;
   - floor: numpy and faiss in one process: every chunk read into arrays, one faiss search
     for all queries, the same-document exclusion and the token gather done with array
     indexing, the same Arrow shards written. It holds the whole chunk database: that is
     what the Beam stage must never do, and why it is the speed floor, not a competitor.
   Ours in one process and the floor then run `--repeat` - 1 more times, alternating: their
   wall time (and seq/s, and the ratio) is the median of those runs, as a run of either moves
   by a third between runs on a shared VM; CPU, kernel time, faults and memory are the first
   run's.
4. Each builder's fixed cost: ours in one process and the floor run again for one search batch
   (64 sequences). What remains of their times is what the rest of the sequences cost: the
   "marginal" ratio sets ours against the floor on that part alone, the part that grows with a
   training set (interpreter start, imports, Beam's graph and the floor's reading of the
   whole database are left out).
5. Both write their shards; the benchmark checks that ours and the floor chose the same
   neighbour ids for at least 99.9% of the slots (faiss ties can differ between searches of
   different batch shapes) before reporting anything.

Reported: sequences/s (training sequences written per second of wall time, interpreter
start included), system CPU time and minor page faults (memory allocated and freed again is
faulted in afresh; where that is slow, as on a VM that returns freed pages to its host, the
builder that churns memory pays for it), peak RSS (VmHWM) of the main process and, for the multi-process run, of the
largest worker process (polled from /proc every 0.2 s inside the job process). With Beam's local runner
the main process holds every shuffle in memory, as a cluster's shuffle service would hold it
on disk; the workers are where a Dataflow or Flink job's memory goes, and theirs is the figure
that must stay flat as N grows 4x. Results: a table on stdout, JSON in
benchmarks/results/retrieve_join.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
from benchmarks.report import peak_rss_kb, read_into_page_cache, write_results  # noqa: E402
from benchmarks.synthetic import LowRankClusters  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "retrieve_join.json"
M, SEQ_TOKENS, K, CANDIDATES, DIM = 64, 512, 2, 32, 384
L = SEQ_TOKENS // M
FILE_ROWS, SHARD_ROWS, PAD, VOCAB = 65536, 256, 0, 30000
FACTORY, NPROBE = "IVF256,PQ32x8np", 16
SEED = 20261130
FIXED_COST_CHUNKS = 64 * L  # one search batch (SEQUENCES_PER_SEARCH sequences): a run of it is the fixed cost
MB = 1e6


# --- data --------------------------------------------------------------------------------------


def make_chunks(n: int):
    """N chunks in documents of 1-40 chunks (the last one partly padded), dense ids."""
    from pipeline.chunks.chunking import chunk_document

    rng = np.random.default_rng([SEED, 0])
    chunks, doc = [], 0
    while len(chunks) < n:
        length = int(rng.integers(1, 41)) * M - int(rng.integers(0, M))
        tokens = rng.integers(1, VOCAB, length).astype(np.int32)
        chunks += list(chunk_document(doc, tokens, len(chunks), M, PAD))
        doc += 1
    last = chunks[n - 1]
    if n < len(chunks) and chunks[n].doc_id == last.doc_id:  # cut a document: it ends here now
        chunks[n - 1] = type(last)(last.chunk_id, last.doc_id, last.position, last.tokens, np.full(M, PAD, np.int32))
    return chunks[:n]


def ensure_data(workdir: Path, n: int) -> Path:
    import faiss

    from pipeline.chunks.chunk_files import chunks_table
    from pipeline.common.writers import embeddings_table, parquet_bytes
    from pipeline.index.search import set_search_depth
    from pipeline.index.train import build_index

    root = workdir / f"db-{n}"
    if (root / "done").exists():
        print(f"[data] reusing {root}", flush=True)
        return root
    shutil.rmtree(root, ignore_errors=True)
    (root / "chunks").mkdir(parents=True)
    (root / "embeddings").mkdir()
    start = time.perf_counter()
    chunks = make_chunks(n)
    vectors = LowRankClusters(DIM, seed=SEED).sample(n, np.random.default_rng([SEED, 1]))
    for number, begin in enumerate(range(0, n, FILE_ROWS)):
        part = slice(begin, begin + FILE_ROWS)
        (root / "chunks" / f"chunks-{number:05d}.parquet").write_bytes(parquet_bytes(chunks_table(chunks[part], M)))
        rows = list(zip(range(begin, min(begin + FILE_ROWS, n)), vectors[part]))
        (root / "embeddings" / f"embeddings-{number:05d}.parquet").write_bytes(parquet_bytes(embeddings_table(rows)))
    index = build_index(np.arange(n, dtype=np.int64), vectors, FACTORY)
    set_search_depth(index, NPROBE)
    faiss.write_index(index, str(root / "index.faiss"))
    (root / "done").write_text("")
    print(f"[data] {n:,} chunks, embeddings and {FACTORY}: {time.perf_counter() - start:.1f} s", flush=True)
    return root


# --- the two builders (each runs as its own subprocess) ----------------------------------------


def ours_main(root: str, out: str, query_chunks: int, beam_args: list[str]) -> None:
    import apache_beam as beam
    import pyarrow.parquet as pq
    from apache_beam.io.parquetio import ReadAllFromParquetBatched

    from pipeline.chunks.chunk_files import TRAINING_COLUMNS, ChunkFileRanges, TrainingChunks
    from pipeline.jobs.options import new_pipeline
    from pipeline.retrieve.beam import DocumentSpans, PackSequences, RetrieveNeighbours
    from pipeline.retrieve.search import Retrieval
    from pipeline.shards.write import WriteShards

    limit = query_chunks
    files = sorted(Path(root, "chunks").glob("*.parquet"))
    chunk_files = ChunkFileRanges.from_entries(
        root,
        [  # what the index manifest would list
            SimpleNamespace(path=f"chunks/{p.name}", rows=pq.ParquetFile(p).metadata.num_rows) for p in files
        ],
    )

    workers = WorkerPeak()
    with new_pipeline(beam_args, type_check=False) as p:  # as build-shards over its own chunks
        # the training chunks are the first `limit` + 1 (the last gives the last sequence its
        # target token, then is left over), from as many files as hold them
        used = limit // FILE_ROWS + 1
        training = (
            p
            | "TrainingFiles" >> beam.Create([str(f) for f in files[:used]])
            | "ReadTrainingChunks" >> ReadAllFromParquetBatched(columns=list(TRAINING_COLUMNS))
            | "TrainingChunkBlocks" >> beam.Map(lambda batch: TrainingChunks.of(batch).heads())
            | "TrainingChunks" >> beam.Map(lambda rows: rows.take(np.flatnonzero(rows.chunk_id <= limit)))
        )
        sequences = training | "PackSequences" >> PackSequences(L, PAD)
        spans = p | "DocumentSpans" >> DocumentSpans(f"{root}/chunks/*.parquet")
        spec = Retrieval(
            index_path=f"{root}/index.faiss",
            depth=NPROBE,
            chunk_files=chunk_files,
            chunks_per_seq=L,
            chunk_tokens=M,
            neighbours=K,
            candidates=CANDIDATES,
            pad_id=PAD,
            tokens_from_chunk_files=True,
        )
        # the queries: read by the search from the embedding files, as build-shards over its own chunks does
        rows = ((sequences, spans) | "RetrieveNeighbours" >> RetrieveNeighbours(spec, SHARD_ROWS)).rows
        _ = rows | "WriteShards" >> WriteShards(out, SHARD_ROWS, PAD)
    record_rss(out, workers.stop())


def floor_main(root: str, out: str, query_chunks: int) -> None:
    import faiss
    import pyarrow.parquet as pq

    from pipeline.shards.rows import ShardRow
    from pipeline.shards.write import rows_to_ipc
    from schemas.arrow import shard_column, tensor_column_to_numpy

    tables = [pq.read_table(p) for p in sorted(Path(root, "chunks").glob("*.parquet"))]
    docs = np.concatenate([t["doc_id"].to_numpy() for t in tables])
    tokens = np.concatenate([shard_column(t, "tokens") for t in tables])
    continuations = np.concatenate([tensor_column_to_numpy(t["continuation"]) for t in tables])
    emb = pq.read_table(sorted(Path(root, "embeddings").glob("*.parquet"))[0])
    queries = tensor_column_to_numpy(emb["embedding"])[:query_chunks].astype(np.float32)
    index = faiss.read_index(f"{root}/index.faiss")
    faiss.extract_index_ivf(index).nprobe = NPROBE
    scores, found = index.search(queries, CANDIDATES)  # [Q, C]
    sequences = query_chunks // L
    seq_docs = docs[: sequences * L].reshape(sequences, L)  # each sequence's documents,
    following = docs[np.minimum(np.arange(1, sequences + 1) * L, len(docs) - 1)]  # + the target's
    own = np.concatenate([seq_docs, following[:, None]], axis=1)  # [S, L + 1]
    found = found[: sequences * L].reshape(sequences, L, CANDIDATES)
    scores = scores[: sequences * L].reshape(sequences, L, CANDIDATES)
    allowed = (found >= 0) & ~(docs[np.maximum(found, 0)][..., None] == own[:, None, None, :]).any(-1)
    order = np.argsort(~allowed, axis=-1, kind="stable")[..., :K]  # first k allowed, by rank
    picked = np.take_along_axis(found, order, -1)
    ok = np.take_along_axis(allowed, order, -1)
    ids = np.where(ok, picked, -1)
    values = np.concatenate([tokens[np.maximum(ids, 0)], continuations[np.maximum(ids, 0)]], -1)
    values[~ok] = PAD
    kept_scores = np.where(ok, np.take_along_axis(scores, order, -1), 0).astype(np.float32)
    seq_tokens = np.concatenate(
        [
            tokens[: sequences * L].reshape(sequences, -1),
            tokens[np.minimum(np.arange(1, sequences + 1) * L, len(docs) - 1), :1],
        ],
        1,
    )
    Path(out).mkdir(parents=True, exist_ok=True)
    for begin in range(0, sequences, SHARD_ROWS):
        rows = [
            ShardRow(
                seq_id=s,
                tokens=seq_tokens[s],
                neighbours=values[s],
                neighbour_ids=ids[s],
                neighbour_scores=kept_scores[s],
                doc_ids=tuple(sorted(set(own[s].tolist()))),
            )
            for s in range(begin, min(begin + SHARD_ROWS, sequences))
        ]
        Path(out, f"shard-{begin // SHARD_ROWS:05d}.arrow").write_bytes(rows_to_ipc(rows, PAD))
    record_rss(out)


# --- measuring -----------------------------------------------------------------------------------


def descendants(pid: str) -> list[str]:
    found = []
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            for child in children.read_text().split():
                found += [child, *descendants(child)]
        except OSError:  # it exited meanwhile
            pass
    return found


class WorkerPeak:
    """Polls the peak RSS of this process's descendants (Beam's worker processes) until stopped."""

    def __init__(self):
        self.peak_kb, self.stopped = 0, threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _poll(self):
        while True:
            for pid in descendants(str(os.getpid())):
                self.peak_kb = max(self.peak_kb, peak_rss_kb(pid))
            if self.stopped.wait(0.2):  # woken at once by stop(): the job's time is not a poll longer
                return

    def stop(self) -> int:
        self.stopped.set()
        self.thread.join()
        return self.peak_kb


def record_rss(out: str, workers_kb: int = 0) -> None:
    Path(out, "rss.json").write_text(json.dumps({"self_kb": peak_rss_kb(), "children_kb": workers_kb}))


def measured(args: list[str], out: Path, data: Path) -> dict:
    """Run a builder on `data` (read into the page cache first, for every builder alike)."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    read_into_page_cache(data)
    start = time.perf_counter()
    with open(out.with_suffix(".log"), "w") as log:
        proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), *args], stdout=log, stderr=subprocess.STDOUT, cwd=REPO
        )
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if status != 0:
        raise SystemExit(f"{args[0]} failed, see {out.with_suffix('.log')}")
    rss = json.loads((out / "rss.json").read_text())
    return {
        "wall_s": wall,
        "cpu_s": usage.ru_utime + usage.ru_stime,  # workers' CPU included
        "sys_s": usage.ru_stime,
        # fresh memory is touched page by page: what a builder allocates and frees again costs
        # it here (on a VM that hands freed memory back to the host, up to ~10 s per GB)
        "minor_faults": usage.ru_minflt,
        "peak_rss_mb": rss["self_kb"] * 1024 / MB,
        "worker_peak_rss_mb": rss["children_kb"] * 1024 / MB or None,
    }


def neighbour_ids(directory: Path) -> np.ndarray:
    import pyarrow as pa

    from schemas.arrow import read_shard_table, shard_column

    tables = [read_shard_table(pa.memory_map(str(p))) for p in sorted(directory.glob("shard-*.arrow"))]
    order = np.argsort(np.concatenate([t["seq_id"].to_numpy() for t in tables]))
    return np.concatenate([shard_column(t, "neighbour_ids") for t in tables])[order]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_ours":
        return ours_main(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5:])
    if len(sys.argv) > 1 and sys.argv[1] == "_floor":
        return floor_main(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--sizes", type=int, nargs="+", default=[50_000, 200_000, 800_000])
    parser.add_argument("--query-chunks", type=int, default=49152)
    parser.add_argument("--workdir", help="keep (and reuse) data here; default: a temp dir")
    parser.add_argument("--output", default=str(RESULTS))
    parser.add_argument(
        "--repeat", type=int, default=3, help="runs of ours in one process and of the floor, alternating (median)"
    )
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    if args.query_chunks >= FILE_ROWS:
        parser.error(f"--query-chunks must be under {FILE_ROWS} (the training chunks come from the first file)")
    if args.query_chunks >= min(args.sizes):
        parser.error(f"--query-chunks must be under the smallest chunk database, {min(args.sizes):,} chunks")
    temp = None if args.workdir else tempfile.TemporaryDirectory(prefix="retrieve-bench-")
    workdir = Path(args.workdir or temp.name).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    sequences = args.query_chunks // L
    results = {
        "query_chunks": args.query_chunks,
        "sequences": sequences,
        "m": M,
        "n": SEQ_TOKENS,
        "k": K,
        "candidates": CANDIDATES,
        "factory": FACTORY,
        "nprobe": NPROBE,
        "sizes": [],
    }
    multi = ["--direct_num_workers=2", "--direct_running_mode=multi_processing"]
    try:
        for n in args.sizes:
            root = ensure_data(workdir, n)
            runs = {}
            for name, extra in (("ours 1 process", ["_ours"]), ("ours 2 workers", ["_ours"]), ("floor", ["_floor"])):
                out = workdir / f"run-{n}-{name.replace(' ', '-')}"
                beam_args = multi if name == "ours 2 workers" else []
                print(f"[{name}] N = {n:,} ...", flush=True)
                runs[name] = measured([*extra, str(root), str(out), str(args.query_chunks), *beam_args], out, root)
                runs[name]["sequences_per_s"] = sequences / runs[name]["wall_s"]
                runs[name]["out"] = out
            # ours in one process and the floor again, alternating: the median is what is compared
            walls = {name: [runs[name]["wall_s"]] for name in ("ours 1 process", "floor")}
            for again in range(1, args.repeat):
                for name, extra in (("ours 1 process", ["_ours"]), ("floor", ["_floor"])):
                    out = workdir / f"run-{n}-{name.replace(' ', '-')}-again"
                    print(f"[{name}, run {again + 1} of {args.repeat}] N = {n:,} ...", flush=True)
                    walls[name].append(
                        measured([*extra, str(root), str(out), str(args.query_chunks)], out, root)["wall_s"]
                    )
            for name, each in walls.items():
                runs[name] |= {"wall_s_each": each, "wall_s": statistics.median(each)}
                runs[name]["sequences_per_s"] = sequences / runs[name]["wall_s"]
            runs["ours 1 process"]["vs_floor_each_run"] = [
                floor / ours for ours, floor in zip(walls["ours 1 process"], walls["floor"])
            ]
            fixed = {}
            for name, extra in (("ours 1 process", ["_ours"]), ("floor", ["_floor"])):
                out = workdir / f"run-{n}-{name.replace(' ', '-')}-one-batch"
                print(f"[{name}, one search batch] N = {n:,} ...", flush=True)
                fixed[name] = measured([*extra, str(root), str(out), str(FIXED_COST_CHUNKS)], out, root)["wall_s"]
                runs[name]["one_batch_wall_s"] = fixed[name]
            floor_ids = neighbour_ids(runs["floor"].pop("out"))
            for name in ("ours 1 process", "ours 2 workers"):
                agree = float(np.mean(neighbour_ids(runs[name].pop("out")) == floor_ids))
                if agree < 0.999:
                    raise SystemExit(f"{name} and the floor agree on only {agree:.1%} of neighbour ids")
                runs[name]["same_ids_as_floor"] = agree
                runs[name]["throughput_vs_floor"] = runs[name]["sequences_per_s"] / runs["floor"]["sequences_per_s"]
            marginal = (runs["floor"]["wall_s"] - fixed["floor"]) / (
                runs["ours 1 process"]["wall_s"] - fixed["ours 1 process"]
            )
            runs["ours 1 process"]["marginal_vs_floor"] = marginal
            results["sizes"].append({"chunks": n, "runs": runs})
            print(f"\n== chunk database {n:,} chunks, {sequences:,} sequences")
            print(
                f"{'builder':<16} {'wall s':>7} {'cpu s':>7} {'sys s':>6} {'faults k':>8} {'seq/s':>8} "
                f"{'vs floor':>8} {'main RSS MB':>11} {'worker RSS MB':>13}"
            )
            for name, r in runs.items():
                worker = f"{r['worker_peak_rss_mb']:.0f}" if r["worker_peak_rss_mb"] else "-"
                print(
                    f"{name:<16} {r['wall_s']:>7.1f} {r['cpu_s']:>7.1f} {r['sys_s']:>6.1f} "
                    f"{r['minor_faults'] / 1000:>8.0f} {r['sequences_per_s']:>8.1f} "
                    f"{r.get('throughput_vs_floor', 1.0):>8.3f} {r['peak_rss_mb']:>11.0f} {worker:>13}"
                )
            each = ", ".join(f"{r:.2f}" for r in runs["ours 1 process"]["vs_floor_each_run"])
            print(f"ours in one process against the floor, run by run: {each}")
            print(
                f"one search batch ({FIXED_COST_CHUNKS // L} sequences): ours {fixed['ours 1 process']:.1f} s, floor "
                f"{fixed['floor']:.1f} s; the other sequences: ours in one process {marginal:.3f}x the floor"
            )
    finally:
        if temp is not None:
            temp.cleanup()
    first, last = results["sizes"][0], results["sizes"][-1]
    growth = {
        name: last["runs"][name]["worker_peak_rss_mb" if "2 workers" in name else "peak_rss_mb"]
        / first["runs"][name]["worker_peak_rss_mb" if "2 workers" in name else "peak_rss_mb"]
        for name in first["runs"]
    }
    results["rss_growth"] = {"chunks": last["chunks"] / first["chunks"], **growth}
    print(
        f"\nchunk database x{last['chunks'] / first['chunks']:.0f}: peak RSS x"
        + ", x".join(f"{v:.2f} ({k}{' worker' if '2 workers' in k else ''})" for k, v in growth.items())
    )
    write_results(results, args.output)


if __name__ == "__main__":
    main()
