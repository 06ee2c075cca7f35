"""Scale simulation: the job graphs, manifests and per-process memory of 10^8 and 3·10^10 chunks,
from synthetic manifests (file entries generated as a build of that size lists them, no data).

    .venv/bin/python benchmarks/scale_sim.py [--chunks 1e8 3e10] [--json FILE]

Sizes follow docs/scale.md's defaults: m = 64, n = 2,048 (L = 32), k = 2, `chunk_file_rows`
65,536, `shard_rows` 1,024, 384-d embeddings, `index.slice_bytes` 16 GiB, and its PQ32 index
(`IVF262144_HNSW32,PQ32x8np` at 10^8 chunks, `IVF1048576_HNSW32,PQ32x8np` above). For each size:

- a committed index directory (its manifest: chunk files, embedding files and index slices) and
  a shards directory (its manifest: one entry per training shard, `training_corpus: same`);
- the job graph of build-index, build-shards, validate, an append (one new corpus file and
  three documents deleted) and a delete of DELETES documents, built as the CLI builds them (a
  dry run; all but build-index read the synthetic manifests) and serialised as a runner is
  sent it: Dataflow refuses a request over 20 MB;
- each manifest's bytes and the time to read and check it as the pipeline does;
- the chunk-file lookup a worker builds from the index manifest (`CommittedChunkFiles.ranges`):
  its runs, the Python allocations' peak while it is built (tracemalloc) and its pickled size;
- the memory model's largest step (`pipeline/jobs/memory_model.py`): what one worker process
  holds at once, the largest element and group included.

Nothing here is a measurement of a run at that size: graph and manifest sizes (and the lookup's)
are exact for the code as it is; the memory model's figures are its estimates.
"""

from __future__ import annotations

import argparse
import json
import math
import pickle
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.build_index.append import change_index  # noqa: E402
from pipeline.build_index.job import build_index  # noqa: E402
from pipeline.build_shards.job import build_shards  # noqa: E402
from pipeline.check.plan import plan_validation  # noqa: E402
from pipeline.check.validate_beam import validate_job_graph_bytes  # noqa: E402
from pipeline.chunks.committed import CommittedChunkFiles  # noqa: E402
from pipeline.common import fileio  # noqa: E402
from pipeline.common.names import file_name  # noqa: E402
from pipeline.index.factory import estimated_bytes, ivf_lists  # noqa: E402
from pipeline.index.files import LIST_OWNERS_FILE, QUANTIZER_FILE, searched_files  # noqa: E402
from pipeline.index.slices import vectors_per_slice  # noqa: E402
from pipeline.jobs.memory_model import Corpus, largest, stage_memory  # noqa: E402
from pipeline.jobs.reuse import CorpusChanges  # noqa: E402
from schemas.config import PipelineConfig  # noqa: E402
from schemas.manifest import (
    CREATED_BY,
    FILE_TABLE,
    MANIFEST_FILE,
    FileEntry,
    Fingerprint,
    IndexManifest,
    InputFile,
    ShardEntry,
    ShardsManifest,
    read_manifest,
)
from schemas.measures import Recall
from tests.trainer_fixtures import write_manifest as write_committed  # noqa: E402

DIM, M, N, K = 384, 64, 2048, 2
CHUNK_FILE_ROWS, SHARD_ROWS = 65_536, 1_024
SLICE_BYTES = 16 * 2**30
MB = 2**20


def index_type(chunks: int) -> str:
    """docs/scale.md's PQ32 index of that size."""
    return f"IVF{262_144 if chunks <= 10**8 else 1_048_576}_HNSW32,PQ32x8np"


def config(output: Path, chunks: int = 10**8) -> PipelineConfig:
    """docs/scale.md's settings for `chunks` chunks, writing under `output`."""
    return PipelineConfig.model_validate(
        {
            "output": str(output),
            "retrieval_corpus": {"paths": [str(output / "corpus" / "*.jsonl.gz")], "format": "jsonl"},
            "training_corpus": "same",
            "chunk_tokens": M,
            "sequence_tokens": N,
            "neighbours": K,
            "shard_rows": SHARD_ROWS,
            "chunk_file_rows": CHUNK_FILE_ROWS,
            "index": {"type": index_type(chunks), "memory_budget": "2TiB", "slice_bytes": SLICE_BYTES},
        }
    )


def _entry(path: str, rows: int, size: int) -> FileEntry:
    return FileEntry(path=path, rows=rows, bytes=size, sha256="0" * 64)


def index_manifest(chunks: int, cfg: PipelineConfig) -> IndexManifest:
    """The manifest a build of `chunks` chunks commits: every chunk and embedding file, and the
    index slices."""
    factory = cfg.index.type
    files = []
    for number, first in enumerate(range(0, chunks, CHUNK_FILE_ROWS)):
        rows = min(CHUNK_FILE_ROWS, chunks - first)
        files.append(_entry(f"chunks/{file_name('chunks', number, 'parquet')}", rows, rows * (2 * M * 4 + 24)))
        files.append(_entry(f"embeddings/{file_name('embeddings', number, 'parquet')}", rows, rows * (DIM * 2 + 8)))
    per_slice = vectors_per_slice(factory, DIM, SLICE_BYTES)
    slices = math.ceil(chunks / per_slice)
    for number in range(slices):
        rows = min(per_slice, chunks - number * per_slice)
        files.append(_entry(f"faiss/{file_name('slice', number, 'faiss')}", rows, SLICE_BYTES))
    if slices > 1:  # slices by lists: the quantizer (the trained index alone) and each list's owner
        quantizer = estimated_bytes(factory, 0, DIM)
        files.append(_entry(f"faiss/{QUANTIZER_FILE}", 0, quantizer))
        files.append(_entry(f"faiss/{LIST_OWNERS_FILE}", 0, 4 * (ivf_lists(factory) or 0) + 128))
    fingerprint = Fingerprint(name="synthetic", fingerprint="0" * 64)
    return IndexManifest(
        config_hash="synthetic",
        embed_config_hash="synthetic",
        tokenizer=fingerprint,
        embedding_model=fingerprint,
        num_documents=chunks // 30,
        num_chunks=chunks,
        chunk_tokens=M,
        pad_id=0,
        files=files,
        index_factory=factory,
        nprobe=64,
        dim=DIM,
        metric="inner_product",
        recall_at_k=Recall(measure="synthetic", value=0.95, sample_size=0),
        index_bytes=sum(e.bytes for e in files if e.path.startswith("faiss/")),
        memory_budget=cfg.index.memory_budget,
        training_vectors=0,
        queries_per_second=None,
        slice_bytes=SLICE_BYTES,
        counters={"chunks": chunks},
        created_by=CREATED_BY,
    )


def shards_manifest(chunks: int, index_manifest_sha256: str) -> ShardsManifest:
    """The manifest of the training shards of `chunks` chunks (`training_corpus: same`), built
    against the index whose manifest has this sha256."""
    sequences = chunks // (N // M)
    shards = [
        ShardEntry(
            path=file_name("shard", number, "arrow"),
            rows=min(SHARD_ROWS, sequences - first),
            bytes=SHARD_ROWS * 600_000,
            sha256="0" * 64,
            neighbour_slots_filled=SHARD_ROWS * (N // M) * K,
        )
        for number, first in enumerate(range(0, sequences, SHARD_ROWS))
    ]
    return ShardsManifest(
        config_hash="synthetic",
        index_manifest_sha256=index_manifest_sha256,
        training_corpus="same",
        sequence_tokens=N,
        chunk_tokens=M,
        neighbours=K,
        neighbour_tokens=2 * M,
        pad_id=0,
        num_sequences=sequences,
        shards=shards,
        counters={"sequences": sequences},
        created_by=CREATED_BY,
        overlap={},
    )


def write_manifest(directory: Path, manifest) -> int:
    """Write `manifest` into `directory` as the commit step does (`tests.trainer_fixtures`: its
    file table beside it when it lists more than INLINE_FILE_ENTRIES files); the bytes of
    manifest.json and the table."""
    directory.mkdir(parents=True, exist_ok=True)
    write_committed(directory, manifest)
    return sum(path.stat().st_size for path in (directory / MANIFEST_FILE, directory / FILE_TABLE) if path.exists())


def read_seconds(directory: Path, model) -> dict[str, float]:
    """Seconds to read the manifest alone (what a trainer rank reads first) and with every entry
    (what validate, report and inspect read)."""
    started = time.perf_counter()
    summary = read_manifest((directory / MANIFEST_FILE).read_bytes(), str(directory), model)
    read = time.perf_counter()
    fileio.whole(summary, str(directory))
    return {"manifest": read - started, "every_entry": time.perf_counter() - read}


def chunk_lookup(directory: Path, chunks: int) -> dict:
    """What a worker that looks chunks up builds from the index manifest: the chunk files' runs,
    the Python allocations' peak while building them and their pickled size."""
    sha256 = fileio.sha256_bytes((directory / MANIFEST_FILE).read_bytes())
    tracemalloc.start()
    started = time.perf_counter()
    ranges = CommittedChunkFiles(str(directory), chunks, sha256).ranges
    seconds = time.perf_counter() - started
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert ranges.num_chunks == chunks, (ranges.num_chunks, chunks)
    return {
        "runs": len(ranges.chunks),
        "seconds": seconds,
        "peak_bytes": peak,
        "pickled_bytes": len(pickle.dumps(ranges)),
    }


def validate_plan(root: Path, sample: float) -> dict:
    """What `validate`'s plan holds over the output (index and shards): the Python allocations'
    peak while planning, its seconds, and its pickled size (the job's side input)."""
    tracemalloc.start()
    started = time.perf_counter()
    plan = plan_validation(str(root), sample)
    seconds = time.perf_counter() - started
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {"seconds": seconds, "peak_bytes": peak, "pickled_bytes": len(pickle.dumps(plan)), "sample": sample}


DELETES = 100_000  # documents deleted at once in the simulated delete


def append_graph_bytes(cfg: PipelineConfig, *, deletes: int = 3, append: bool = True) -> int:
    """The graph of an append of one corpus file (`append`; else a delete alone), with `deletes`
    documents to delete, to the index committed under `cfg.output` (as build-index builds it,
    not run)."""
    directory = fileio.join(cfg.output, "index")
    previous = fileio.committed(directory, IndexManifest)
    assert previous is not None, f"no committed index in {directory}"
    new = [InputFile(path=fileio.join(cfg.output, "corpus", "new.jsonl"), bytes=100)] if append else []
    return change_index(
        cfg,
        previous,
        previous_sha256=fileio.manifest_sha256(directory) or "",
        changes=CorpusChanges(new=new, changed=[], gone=[]),
        beam_args=[],
        delete=tuple(f"doc-{number:09d}" for number in range(deletes)),
        dry_run=True,
    )["graph_bytes"]


def graph_bytes(cfg: PipelineConfig) -> dict[str, int]:
    """Serialised size of each job's graph, built as `--dry-run` builds it (validate: as
    `validate DIR -- --runner=...` builds it, without running it)."""
    return {
        "build-index": build_index(cfg, [], dry_run=True)["graph_bytes"],
        "build-shards": build_shards(cfg, [], dry_run=True)["graph_bytes"],
        "validate": validate_job_graph_bytes(cfg.output),
        "append (3 deletes)": append_graph_bytes(cfg),
        f"delete ({DELETES:,} documents)": append_graph_bytes(cfg, deletes=DELETES, append=False),
    }


def simulate(chunks: int, root: Path) -> dict:
    cfg = config(root, chunks)
    index = index_manifest(chunks, cfg)
    index_bytes = write_manifest(root / "index", index)
    shards = shards_manifest(chunks, fileio.sha256_bytes((root / "index" / MANIFEST_FILE).read_bytes()))
    shards_bytes = write_manifest(root / "shards", shards)
    heaviest = largest(stage_memory(cfg, Corpus.of(chunks)))
    return {
        "chunks": chunks,
        "index_factory": index.index_factory,
        "chunk_files": math.ceil(chunks / CHUNK_FILE_ROWS),
        "index_slices": len(searched_files([e.path for e in index.files if e.path.startswith("faiss/")])),
        "training_shards": len(shards.shards),
        "graph_bytes": graph_bytes(cfg),
        "manifest_bytes": {"index": index_bytes, "shards": shards_bytes},
        "manifest_read_seconds": {
            "index": read_seconds(root / "index", IndexManifest),
            "shards": read_seconds(root / "shards", ShardsManifest),
        },
        "chunk_lookup": chunk_lookup(root / "index", chunks),
        "validate_plan": [validate_plan(root, sample) for sample in (1.0, 0.01)],
        "largest_step": {"stage": heaviest["stage"], "bytes": heaviest["bytes"]},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=float, nargs="+", default=[1e8, 3e10])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    results = []
    for chunks in args.chunks:
        with tempfile.TemporaryDirectory() as root:
            results.append(simulate(int(chunks), Path(root)))
        r = results[-1]
        lookup = r["chunk_lookup"]
        graphs = ", ".join(f"{job} {size / MB:.2f} MB" for job, size in r["graph_bytes"].items())
        manifests = ", ".join(
            f"{name} {r['manifest_bytes'][name] / MB:.1f} MB (read {seconds['manifest'] * 1000:.1f} ms, "
            f"every entry {seconds['every_entry']:.2f} s)"
            for name, seconds in r["manifest_read_seconds"].items()
        )
        print(
            f"{r['chunks']:.0e} chunks ({r['index_factory']}, {r['chunk_files']:,} chunk files, "
            f"{r['index_slices']} index slices, "
            f"{r['training_shards']:,} shards): graphs {graphs}; manifests with their file tables: {manifests}; "
            f"chunk-file lookup {lookup['runs']} runs, {lookup['pickled_bytes']:,} B pickled, built in "
            f"{lookup['seconds']:.2f} s with a {lookup['peak_bytes'] / MB:.1f} MB peak; validate's plan "
            + ", ".join(
                f"(sample {p['sample']}) {p['seconds']:.1f} s, {p['peak_bytes'] / MB:.1f} MB peak, "
                f"{p['pickled_bytes']:,} B pickled"
                for p in r["validate_plan"]
            )
            + "; "
            + f"largest step {r['largest_step']['stage']} {r['largest_step']['bytes'] / 2**30:.1f} GiB"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
