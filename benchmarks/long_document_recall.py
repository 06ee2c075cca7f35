"""Neighbour recall on long documents with IVF indexes: the search depth tuned on the search
build-shards makes (each chunk's own documents excluded), against the depth tuned without.

    .venv/bin/python benchmarks/long_document_recall.py [--corpora pages stdlib] [--workdir DIR]

Corpora, real text as long documents:
- `pages`: the sample corpus as 14 book-length documents of 4 consecutive pages each
  (`examples/long_documents.py`);
- `stdlib`: the 30 standard-library modules of this Python ranked 11th-40th by size, one
  document each (code and docstrings: text the sample corpus does not hold).

Settings: m = 64, n = 1024, k = 2, `index.target_recall` 0.95, the neighbour check's 200
sampled training chunks. Per corpus the chunks and embeddings are built once; each row then
rebuilds only the faiss index (run skips what matches) and builds the shards:
- `before`: IVF64,Flat at the depth the plain tuning picks (the query itself excluded; set
  through index.nprobe) with `recall_below_target: warn`: what the shards hold without the
  depth tuned on the search that is made (docs/long_document_recall.md names this row
  `plain tuning only`);
- `IVF64,Flat`: one index file, depths tuned as they are now;
- `IVF64,Flat, shards`: the same with the index in slices, one per embeddings file of 1,000
  vectors (>= 4; docs/long_document_recall.md names these rows `slices`);
- `auto, budget < Flat`: index.type auto with a memory budget half of Flat's size (auto then
  picks an IVF index with compressed codes), in one file and in one index slice per embeddings
  file.
Reported per row: the factory, index files, the index's depth (and the depths its plain and
own-document tunings reached), build-shards' depth, its neighbour recall, and build-shards' wall
time from its manifest. Results: a table on stdout, JSON in
benchmarks/results/long_document_recall.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
from benchmarks.report import write_results  # noqa: E402
from examples.long_documents import long_documents  # noqa: E402
from pipeline.embed.encoder import cpu_summary  # noqa: E402
from pipeline.index.factory import estimated_bytes  # noqa: E402
from pipeline.run import run_all  # noqa: E402
from schemas.config import config_from_dict  # noqa: E402

TARGET = 0.95
CHUNK_FILE_ROWS = 1000


def write_corpus(name: str, path: Path) -> None:
    if name == "pages":
        documents = long_documents(pages_per_document=4)
    else:
        library = Path(sysconfig.get_paths()["stdlib"])
        modules = sorted(library.glob("*.py"), key=lambda p: (-p.stat().st_size, p.name))[10:40]
        documents = [{"id": p.name, "text": p.read_text(errors="replace")} for p in modules]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(d) + "\n" for d in documents))


def config(corpus: Path, out: Path, index: dict, policy: str = "deepen") -> dict:
    return {
        "output": str(out),
        "retrieval_corpus": {"paths": [str(corpus)], "format": "jsonl", "id_field": "id"},
        "chunk_tokens": 64,
        "sequence_tokens": 1024,
        "neighbours": 2,
        "shard_rows": 128,
        "chunk_file_rows": CHUNK_FILE_ROWS,
        "recall_below_target": policy,
        "index": {"target_recall": TARGET, **index},
    }


def first_reaching(curve) -> int | None:
    return next((p["depth"] for p in curve or [] if p["recall"] >= TARGET), None)


def build(cfg: dict) -> dict:
    run_all(config_from_dict(cfg), [])
    out = Path(cfg["output"])
    index = json.loads((out / "index" / "manifest.json").read_text())
    shards = json.loads((out / "shards" / "manifest.json").read_text())
    recall = index["recall_at_k"]
    own = recall.get("own_document_excluded") or {}
    depth = shards.get("search_depth") or {}
    return {
        "chunks": index["num_chunks"],
        "documents": index["num_documents"],
        "factory": index["index_factory"],
        "index_files": sum(f["path"].startswith("faiss/") and f["path"].endswith(".faiss") for f in index["files"]),
        "index_depth": index["nprobe"],
        "plain_tuning_depth": first_reaching(recall["curve"]),
        "own_document_tuning_depth": own.get("depth"),
        "build_shards_depth": depth.get("depth"),
        "build_shards_curve": depth.get("curve"),
        "neighbour_recall": shards["neighbour_recall"]["value"],
        "build_shards_seconds": shards["timings"]["wall_seconds"],
    }


def run_corpus(name: str, workdir: Path) -> dict:
    corpus = workdir / name / "corpus.jsonl"
    out = workdir / name / "out"
    if not corpus.exists():
        write_corpus(name, corpus)
    rows = {"IVF64,Flat": build(config(corpus, out, {"type": "IVF64,Flat"}))}
    plain_depth = rows["IVF64,Flat"]["plain_tuning_depth"]
    rows["before"] = build(config(corpus, out, {"type": "IVF64,Flat", "nprobe": plain_depth}, policy="warn"))
    one_file_each = estimated_bytes("IVF64,Flat", CHUNK_FILE_ROWS, 384)  # an index slice per embeddings file
    rows["IVF64,Flat, shards"] = build(config(corpus, out, {"type": "IVF64,Flat", "slice_bytes": one_file_each}))
    flat = estimated_bytes("Flat", rows["IVF64,Flat"]["chunks"], 384)
    rows["auto, budget < Flat"] = build(config(corpus, out, {"type": "auto", "memory_budget": flat // 2}))
    chosen = rows["auto, budget < Flat"]["factory"]
    shards = {"type": "auto", "memory_budget": flat // 2, "slice_bytes": estimated_bytes(chosen, CHUNK_FILE_ROWS, 384)}
    rows["auto, budget < Flat, shards"] = build(config(corpus, out, shards))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpora", nargs="+", default=["pages", "stdlib"], choices=["pages", "stdlib"])
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="long-document-recall-"))
    results = {"cpu": cpu_summary(), "target_recall": TARGET, "corpora": {}}
    print(f"{cpu_summary()}; target recall {TARGET}")
    print(
        "| corpus | row | factory | index files | index depth (plain / own document) | build-shards depth "
        "| neighbour recall | build-shards s |"
    )
    print("|---|---|---|---:|---|---:|---:|---:|")
    for name in args.corpora:
        rows = run_corpus(name, workdir)
        results["corpora"][name] = rows
        for label in rows:
            r = rows[label]
            print(
                f"| {name} ({r['documents']} docs, {r['chunks']:,} chunks) | {label} | {r['factory']} "
                f"| {r['index_files']} | {r['index_depth']} ({r['plain_tuning_depth']} / "
                f"{r['own_document_tuning_depth']}) | {r['build_shards_depth']} | {r['neighbour_recall']:.3f} "
                f"| {r['build_shards_seconds']:.1f} |"
            )
    write_results(results, Path(__file__).resolve().parent / "results" / "long_document_recall.json")


if __name__ == "__main__":
    main()
