"""Refreshing the shards after the database changed, against building them again: the time of
build-shards' refresh and of a full build-shards over the same changed index, and how their
neighbours compare.

    .venv/bin/python benchmarks/refresh.py [--workdir DIR] [--chunks 50000] [--append 0.1]
        [--delete 0.01] [--index Flat|IVF] [--again]

Corpus (real text): as benchmarks/append.py, the docstrings of the Python standard library and
the installed packages in hash order, about --chunks chunks in 10 files.

1. `build-index` and `build-shards` over the 10 files (the base), default settings but the index
   type: Flat (exact) or IVF{nlist},Flat with the factory's nlist.
2. The change: one more file of about --append of the base's chunks (`build-index`: an append),
   then --delete of the base's documents (`build-index --delete`, chosen in hash order).
   The changed output is kept in --workdir (`changed/`): `--again` starts from it, for timing
   another version of the refresh without building the base again.
3. The output copied; `build-shards` in one (a refresh), `build-shards --full` in the copy: each
   a subprocess, its wall time, one after the other on the same machine.
4. Their shards compared row by row (seq id): sequences and tokens must be equal; neighbour
   slots equal, and each slot that differs listed with both scores (a near-tie when they are
   within 1e-5), and the slots whose two chunks hold the same tokens (a corpus's exact
   duplicates tie, and float noise picks among them). With IVF, the recall each measured
   against exact search (their manifests).
Results: a table on stdout, JSON in benchmarks/results/refresh-<index>.json.
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
from benchmarks.append import BASE_FILES, base_and_extra, write_files  # noqa: E402
from benchmarks.report import write_results  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
NEAR_TIE = 1e-5


def config(workdir: Path, corpus: Path, index_type: str) -> Path:
    path = workdir / "config.yaml"
    path.write_text(
        json.dumps(
            {
                "output": str(workdir / "out"),
                "retrieval_corpus": {"paths": [str(corpus / "*.jsonl")], "id_field": "id"},
                "index": {"type": index_type},
            }
        )
    )
    return path


def timed(*command: str) -> float:
    start = time.perf_counter()
    subprocess.run([str(REPO / ".venv" / "bin" / "ratrain-pipeline"), *command], check=True)
    return time.perf_counter() - start


def shard_rows(out: Path) -> dict[str, np.ndarray]:
    """Every row of the committed shards, in seq id order."""
    import pyarrow as pa

    from schemas.arrow import read_shard_table, shard_column
    from schemas.manifest import ShardsManifest

    manifest = ShardsManifest.model_validate_json((out / "shards" / "manifest.json").read_text())
    tables = [read_shard_table(pa.memory_map(str(out / "shards" / e.path))) for e in manifest.shards]
    columns = ("seq_id", "tokens", "neighbour_ids", "neighbour_scores", "neighbours")
    rows = {c: np.concatenate([shard_column(t, c) for t in tables]) for c in columns}
    order = np.argsort(rows["seq_id"], kind="stable")
    return {c: v[order] for c, v in rows.items()}


def compare(refreshed: dict, full: dict) -> dict:
    """Slot by slot: equal, and each slot that differs with both scores."""
    if not (
        np.array_equal(refreshed["seq_id"], full["seq_id"]) and np.array_equal(refreshed["tokens"], full["tokens"])
    ):
        raise SystemExit("the refresh and the full build hold different sequences")
    differ = np.argwhere(refreshed["neighbour_ids"] != full["neighbour_ids"])
    listed = [
        {
            "seq_id": int(full["seq_id"][s]),
            "chunk": int(j),
            "slot": int(slot),
            "refreshed": [
                int(refreshed["neighbour_ids"][s, j, slot]),
                float(refreshed["neighbour_scores"][s, j, slot]),
            ],
            "full": [int(full["neighbour_ids"][s, j, slot]), float(full["neighbour_scores"][s, j, slot])],
        }
        for s, j, slot in differ.tolist()
    ]
    near = sum(abs(d["refreshed"][1] - d["full"][1]) <= NEAR_TIE for d in listed)
    m = full["neighbours"].shape[-1] // 2
    same_chunk = (refreshed["neighbours"][..., :m] == full["neighbours"][..., :m]).all(
        -1
    )  # the chunk, not its continuation
    slots = full["neighbour_ids"].size
    return {
        "slots": slots,
        "equal": slots - len(listed),
        "near_ties": near,
        "same_chunk_tokens": int(same_chunk.sum()),
        "differing": listed,
    }


def build_and_change(workdir: Path, args) -> dict[str, float]:
    """The base built (index and shards), then changed: an append and a delete. Their seconds."""
    from pipeline.corpus.records import doc_id_for
    from pipeline.index.factory import nlist_for

    base, extra = base_and_extra(workdir, args.chunks, args.append)
    corpus = workdir / "corpus"
    shutil.rmtree(corpus, ignore_errors=True)
    write_files(corpus, "base", base, BASE_FILES)
    index_type = "Flat" if args.index == "Flat" else f"IVF{nlist_for(int(args.chunks * (1 + args.append)))},Flat"
    cfg = config(workdir, corpus, index_type)
    shutil.rmtree(workdir / "out", ignore_errors=True)
    seconds = {"base_index": timed("build-index", "--config", str(cfg))}
    seconds["base_shards"] = timed("build-shards", "--config", str(cfg))
    write_files(corpus, "more", extra, 1)
    seconds["append"] = timed("build-index", "--config", str(cfg))
    chosen = sorted(base, key=lambda d: doc_id_for("delete" + d["id"]))[: max(1, round(len(base) * args.delete))]
    (workdir / "delete.txt").write_text("".join(d["id"] + "\n" for d in chosen))
    seconds["delete"] = timed("build-index", "--config", str(cfg), "--delete", str(workdir / "delete.txt"))
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--chunks", type=int, default=50_000)
    parser.add_argument("--append", type=float, default=0.1)
    parser.add_argument("--delete", type=float, default=0.01)
    parser.add_argument("--index", choices=("Flat", "IVF"), default="Flat")
    parser.add_argument("--again", action="store_true", help="start from --workdir's changed database")
    args = parser.parse_args()
    if args.again and not (args.workdir and (args.workdir / "changed").is_dir()):
        parser.error("--again needs the --workdir of an earlier run (its changed/ directory)")
    from pipeline.embed.encoder import cpu_summary
    from schemas.manifest import IndexManifest, ShardsManifest

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="refresh-bench-"))
    out, changed = workdir / "out", workdir / "changed"
    cfg = workdir / "config.yaml"
    seconds = {}
    if not args.again:
        seconds = build_and_change(workdir, args)
        shutil.rmtree(changed, ignore_errors=True)
        shutil.copytree(out, changed)
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(changed, out)

    full_dir = workdir / "full"
    shutil.rmtree(full_dir, ignore_errors=True)
    shutil.copytree(out, full_dir)
    full_cfg = workdir / "full.yaml"
    full_cfg.write_text(cfg.read_text().replace(str(out), str(full_dir)))
    seconds["refresh"] = timed("build-shards", "--config", str(cfg))
    seconds["full"] = timed("build-shards", "--config", str(full_cfg), "--full")

    index = IndexManifest.model_validate_json((out / "index" / "manifest.json").read_text())
    refreshed = ShardsManifest.model_validate_json((out / "shards" / "manifest.json").read_text())
    full = ShardsManifest.model_validate_json((full_dir / "shards" / "manifest.json").read_text())
    slots = compare(shard_rows(out), shard_rows(full_dir))
    record = refreshed.refreshes[-1]
    results = {
        "cpu": cpu_summary(),
        "index": index.index_factory,
        "chunks": index.num_chunks,
        "appended_chunks": index.generations[1].num_chunks,
        "deleted_documents": index.deleted_documents,
        "deleted_chunks": index.deleted_chunks,
        "documents": index.num_documents,
        "sequences": refreshed.num_sequences,
        "seconds": seconds,
        "refresh_over_full": seconds["refresh"] / seconds["full"],
        "shards_rewritten": sum(last - first + 1 for first, last in record.rewritten),
        "shards_kept": record.kept,
        "refresh_counters": {k: v for k, v in refreshed.counters.items() if "sequences" in k or "chunks" in k},
        "recall": {
            "refresh": refreshed.neighbour_recall.value if refreshed.neighbour_recall else None,
            "full": full.neighbour_recall.value if full.neighbour_recall else None,
        },
        "neighbours": slots,
    }
    write_results(results, RESULTS / f"refresh-{args.index.lower()}.json")
    print(f"CPU: {results['cpu']}; {index.index_factory}; {index.num_chunks:,} chunks")
    print("| step | seconds |")
    print("|---|---:|")
    for name, value in seconds.items():
        print(f"| {name} | {value:.1f} |")
    print(f"refresh ÷ full build-shards: {results['refresh_over_full']:.3f}")
    print(
        f"neighbour slots equal: {slots['equal']:,} of {slots['slots']:,} ({slots['equal'] / slots['slots']:.5f}); "
        f"of the {len(slots['differing'])} that differ, {slots['near_ties']} are near-ties (scores within {NEAR_TIE}); "
        f"slots holding the same chunk tokens: {slots['same_chunk_tokens']:,}"
    )
    print(f"recall against exact search: refresh {results['recall']['refresh']}, full {results['recall']['full']}")
    print(
        f"counters: {results['refresh_counters']}; shards rewritten {results['shards_rewritten']}, kept {record.kept}"
    )


if __name__ == "__main__":
    main()
