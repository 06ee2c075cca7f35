"""`validate --sample`: its time as the number of shards grows, apart from the whole-file hashes,
and the share of the chunk bytes it reads.

    .venv/bin/python benchmarks/validate_sample.py [--shards 1000 10000] [--sample 0.01] [--full-up-to 10000]
        [--rows-per-shard 1] [--m 8] [--chunk-file-rows 1000] [--row-group-rows 1024]

Data: one synthetic output per shard count, written with the project's own writers and
schemas under real manifests, so `validate` accepts it: one index shared by all of them
(`training_corpus: same`, m = 8 by default, L = 2 chunks a sequence, documents of 2 chunks,
the largest count's sequences' worth of chunks, 1,000 rows a chunk file in row groups of
1,024 rows (the pipeline's), 16-dim unit embeddings, a faiss Flat index) and, per count,
that many shards of `--rows-per-shard` sequences (seq s = document s), each neighbour (k = 2)
a chunk of another document with its tokens and continuation.

For each count, with the files in the page cache (just written):
- `plan`: reading the manifests and choosing the sample;
- `hashes`: size and sha256 of the listed files no content check reads (the unsampled
  shards and embedding files, the faiss index), timed on their own;
- `total`: `validate_path(DIR, sample, hash_all=True)` end to end (`--hash-all`: its hashes
  included; without it a sample checks those files by size, from one listing), best of 5;
- the same at the fraction that checks as many shards as the smallest count does;
- `full`: the whole check (`--sample 1`), for counts up to --full-up-to;
- `read`: the chunk-file bytes read to check rows (sampled files whole, of the others the row
  groups the sampled shards' references fall in; hashing apart) ÷ all chunk-file bytes.
`total - hashes` is what the sample itself costs: it grows with the shards checked, and at
an equal number checked it should stay flat however many shards the output holds.
Results: a table on stdout, JSON in benchmarks/results/validate_sample.json.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
import pyarrow as pa  # noqa: E402

from benchmarks.report import write_results  # noqa: E402
from pipeline.check.facts import ChunkFileUnit, ListedFile  # noqa: E402
from pipeline.check.plan import plan_validation  # noqa: E402
from pipeline.check.problems import check_listed_file  # noqa: E402
from pipeline.check.units import units  # noqa: E402
from pipeline.check.validate import run_in_process, validate_path  # noqa: E402
from pipeline.chunks.chunk_files import CHUNK_ROW_GROUP_ROWS  # noqa: E402
from pipeline.common.fileio import sha256_bytes  # noqa: E402
from pipeline.common.writers import parquet_bytes  # noqa: E402
from schemas.arrow import chunk_schema, embedding_schema, fixed_size_list, shard_ipc_bytes, shard_table  # noqa: E402
from schemas.manifest import INLINE_FILE_ENTRIES, FileEntry, Fingerprint, IndexManifest, ShardEntry, ShardsManifest
from schemas.measures import Recall
from schemas.shard_columns import ShardDims
from tests.trainer_fixtures import write_manifest  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "validate_sample.json"
M, L, K, DIM, PAD = 8, 2, 2, 16, 0
CHUNK_FILE_ROWS = 1000
REPEATS = 5  # timed runs of each validation; the fastest counts (this machine is shared)


def _write(directory: Path, name: str, data: bytes, rows: int) -> dict:
    path = directory / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return {"path": name, "rows": rows, "bytes": len(data), "sha256": sha256_bytes(data)}


@dataclass(frozen=True)
class Layout:
    """The synthetic output's sizes."""

    m: int = M
    chunk_file_rows: int = CHUNK_FILE_ROWS
    row_group_rows: int = CHUNK_ROW_GROUP_ROWS  # of a chunk file


def write_index(directory: Path, sequences: int, rng: np.random.Generator, layout: Layout = Layout()) -> dict:
    """An index of `sequences` documents of L chunks; returns the chunk database in memory."""
    import faiss

    m, file_rows = layout.m, layout.chunk_file_rows
    chunks = sequences * L
    ids = np.arange(chunks, dtype=np.int64)
    docs = rng.choice(np.iinfo(np.int64).max, size=sequences, replace=False)[ids // L]
    positions = (ids % L).astype(np.int32)
    tokens = rng.integers(1, 30000, size=(chunks, m), dtype=np.int32)
    continuations = np.full_like(tokens, PAD)
    inside = positions < L - 1  # a continuation is the next chunk of the document, padding at its end
    continuations[inside] = tokens[1:][inside[:-1]]
    vectors = rng.normal(size=(chunks, DIM)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    files = []
    for number, start in enumerate(range(0, chunks, file_rows)):
        part = slice(start, min(start + file_rows, chunks))
        table = pa.Table.from_arrays(
            [
                pa.array(ids[part]),
                pa.array(docs[part]),
                pa.array(positions[part]),
                fixed_size_list(tokens[part], m),
                fixed_size_list(continuations[part], m),
            ],
            schema=chunk_schema(m),
        )
        data = parquet_bytes(table, layout.row_group_rows)
        files.append(_write(directory, f"chunks/chunks-{number:05d}.parquet", data, len(ids[part])))
        table = pa.Table.from_arrays(
            [pa.array(ids[part]), fixed_size_list(vectors[part], DIM)], schema=embedding_schema(DIM)
        )
        files.append(
            _write(directory, f"embeddings/embeddings-{number:05d}.parquet", parquet_bytes(table), len(ids[part]))
        )
    index = faiss.IndexFlatIP(DIM)
    index.add(vectors)
    (directory / "faiss").mkdir(parents=True)
    faiss.write_index(index, str(directory / "faiss" / "index.faiss"))
    files.append(_write(directory, "faiss/index.faiss", (directory / "faiss" / "index.faiss").read_bytes(), chunks))
    fingerprint = Fingerprint(name="synthetic", fingerprint="0" * 64)
    manifest = IndexManifest(
        config_hash="synthetic",
        embed_config_hash="synthetic",
        tokenizer=fingerprint,
        embedding_model=fingerprint,
        num_documents=sequences,
        num_chunks=chunks,
        chunk_tokens=m,
        pad_id=PAD,
        files=[FileEntry(**f) for f in sorted(files, key=lambda f: f["path"])],
        index_factory="Flat",
        nprobe=None,
        dim=DIM,
        metric="inner_product",
        recall_at_k=Recall(measure="synthetic", value=1.0, sample_size=0),
        index_bytes=files[-1]["bytes"],
        memory_budget=0,
        training_vectors=0,
        queries_per_second=None,
        counters={"chunks": chunks},
        created_by="benchmarks/validate_sample.py",
    )
    (directory / "manifest.json").write_text(manifest.model_dump_json(indent=2))
    return {"docs": docs, "tokens": tokens, "continuations": continuations}


def write_shards(
    directory: Path,
    index_directory: Path,
    db: dict,
    shards: int,
    rng: np.random.Generator,
    rows: int = 1,
    inline_entries: int = INLINE_FILE_ENTRIES,
) -> None:
    """`shards` shards of `rows` sequences: sequence s is document s (chunks s·L ... s·L + L - 1);
    with more than `inline_entries`, the manifest's entries in its file table."""
    chunks, m = db["tokens"].shape
    entries = []
    for shard in range(shards):
        seqs = np.arange(shard * rows, (shard + 1) * rows)
        own = seqs[:, None] * L + np.arange(L)
        last = db["continuations"][own[:, -1], :1]
        tokens = np.concatenate([db["tokens"][own].reshape(rows, L * m), last], axis=1)
        neighbour_ids = rng.integers(0, chunks - L, size=(rows, L, K))
        neighbour_ids += (neighbour_ids >= (seqs * L)[:, None, None]) * L  # never a chunk of its own document
        values = np.concatenate([db["tokens"][neighbour_ids], db["continuations"][neighbour_ids]], axis=-1)
        columns = {
            "seq_id": seqs,
            "tokens": tokens,
            "neighbours": values,
            "neighbour_ids": neighbour_ids,
            "neighbour_scores": rng.random((rows, L, K), dtype=np.float32),
            "doc_ids": [[db["docs"][s * L]] for s in seqs],
            "source": np.zeros(rows, np.int8),
        }
        table = shard_table(columns, dims=ShardDims(n=L * m, m=m, k=K), pad_id=PAD)
        entry = _write(directory, f"shard-{shard:05d}.arrow", shard_ipc_bytes(table), rows)
        entries.append(ShardEntry(**entry, neighbour_slots_filled=rows * L * K))
    manifest = ShardsManifest(
        config_hash="synthetic",
        index_manifest_sha256=sha256_bytes((index_directory / "manifest.json").read_bytes()),
        training_corpus="same",
        sequence_tokens=L * m,
        chunk_tokens=m,
        neighbours=K,
        neighbour_tokens=2 * m,
        pad_id=PAD,
        num_sequences=shards * rows,
        shards=entries,
        neighbour_fill=1.0,
        overlap={},
        counters={"sequences": shards * rows},
        created_by="benchmarks/validate_sample.py",
    )
    write_manifest(directory, manifest, inline_entries)


def _best_seconds(run) -> float:
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def chunk_bytes_read(output: Path, sample: float) -> tuple[int, int]:
    """Chunk-file bytes a validation reads to check rows (whole files, row groups; the hashing
    of listed files apart), and the chunk files' bytes in all."""
    plan = plan_validation(str(output), sample)
    return run_in_process(plan).chunk_bytes_read, sum(unit.entry.bytes for unit in units(plan, ChunkFileUnit))


def measure(output: Path, sample: float) -> dict:
    start = time.perf_counter()
    plan = plan_validation(str(output), sample)
    planned = time.perf_counter() - start
    listed = list(units(plan_validation(str(output), sample, hash_all=True), ListedFile))
    hashes = _best_seconds(lambda: [check_listed_file(file.directory, file.entry) for file in listed])
    total = _best_seconds(lambda: validate_path(str(output), sample, hash_all=True))
    read, chunk_bytes = chunk_bytes_read(output, sample)
    return {
        "chunk_bytes_read": read,
        "chunk_bytes": chunk_bytes,
        "sample": sample,
        "shards_checked": plan.samples["shards"].count,
        "files_hashed": len(listed),
        "plan_s": planned,
        "hashes_s": hashes,
        "total_s": total,
        "sample_s": total - hashes,
        "lines": validate_path(str(output), sample),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--shards", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--sample", type=float, default=0.01)
    parser.add_argument("--full-up-to", type=int, default=10000, help="time the full check for counts up to this")
    parser.add_argument("--rows-per-shard", type=int, default=1)
    parser.add_argument("--m", type=int, default=M, help="tokens a chunk")
    parser.add_argument("--chunk-file-rows", type=int, default=CHUNK_FILE_ROWS)
    parser.add_argument("--row-group-rows", type=int, default=CHUNK_ROW_GROUP_ROWS, help="of a chunk file")
    parser.add_argument("--output", default=str(RESULTS))
    args = parser.parse_args()
    layout = Layout(args.m, args.chunk_file_rows, args.row_group_rows)
    results = {"sample": args.sample, "L": L, "k": K, **asdict(layout), "by_shards": []}
    results["rows_per_shard"] = args.rows_per_shard
    rng = np.random.default_rng(0)
    fewest = min(args.shards)
    with tempfile.TemporaryDirectory(prefix="validate-sample-bench-") as temp:
        index = Path(temp) / "index"
        db = write_index(index, max(args.shards) * args.rows_per_shard, rng, layout)
        print(
            f"index: {len(db['tokens']):,} chunks in {-(-len(db['tokens']) // layout.chunk_file_rows)} chunk files "
            f"({layout.row_group_rows} rows a row group, m = {layout.m}); {args.rows_per_shard} rows a shard; "
            f"seconds, best of {REPEATS}; read: chunk bytes read to check rows ÷ all chunk bytes"
        )
        print(
            f"{'shards':>7} | {'sample':>7} {'checked':>7} {'hashed':>7} {'plan':>5} {'hashes':>6} {'total':>6} "
            f"{'total-hashes':>12} {'read':>6} | {'full':>6}"
        )
        for shards in args.shards:
            output = Path(temp) / f"out-{shards}"
            output.mkdir()
            (output / "index").symlink_to(index)  # the same index for every count
            write_shards(output / "shards", index, db, shards, rng, args.rows_per_shard)
            # at the sample asked for, and at the fraction that checks as many shards as the smallest count's
            runs = [measure(output, args.sample)]
            if shards != fewest:
                runs.append(measure(output, args.sample * fewest / shards))
            entry = {"shards": shards, "runs": runs}
            if shards <= args.full_up_to:
                entry["full_s"] = _best_seconds(lambda output=output: validate_path(str(output)))
            results["by_shards"].append(entry)
            for i, run in enumerate(runs):
                full = f"{entry['full_s']:6.2f}" if "full_s" in entry and i == 0 else f"{'':>6}"
                print(
                    f"{shards if i == 0 else '':>7} | {run['sample']:7.4f} {run['shards_checked']:>7,} "
                    f"{run['files_hashed']:>7,} {run['plan_s']:5.2f} {run['hashes_s']:6.2f} {run['total_s']:6.2f} "
                    f"{run['sample_s']:12.2f} {run['chunk_bytes_read'] / run['chunk_bytes']:6.1%} | {full}",
                    flush=True,
                )
        print("\n".join(runs[0]["lines"]))
    write_results(results, args.output)


if __name__ == "__main__":
    main()
