"""Appending to an index against building it again: the cost of a 10% append, and whether the
grown index answers as one filled from scratch with the same trained lists.

    .venv/bin/python benchmarks/append.py [--workdir DIR] [--chunks 50000] [--append 0.1]
        [--slice-bytes SIZE]

Corpus (real text): the docstrings of the Python standard library and the installed packages
(examples/stdlib_docstrings.py --site-packages), documents taken in hash order until about
--chunks chunks (estimated at 2.2 tokens a word; the manifests give the real count), in 10
files; then documents for --append of that, in one more file.

1. `build-index` over the 10 files (the base), then over all 11 (an append: only the new file
   is read, chunked, embedded and added), then `build-index` over all 11 into a fresh output
   (a full rebuild). Each a subprocess; the append against the full rebuild is the cost ratio.
   Index type IVF{nlist},Flat with the factory's nlist for the whole corpus and its tuned depth;
   with --slice-bytes, in slices of at most that size (the append changes them slice by slice).
   build-shards over the grown index is timed too: after a change every shard is built again.
2. Neighbours: the full rebuild's vectors filled into the appended index's trained lists (a
   full rebuild with the same trained quantizer); 2,000 sampled chunks searched in both (top
   10, the query itself left out; slices searched as build-shards routes queries), each
   result named by (document, position) so the two numberings compare; a slot is equal when
   it names the same chunk or the two scores are within the tie tolerance of the precision
   the encoder ran in (bfloat16 embeddings depend on their batch, which differs between the
   builds).
Results: a table on stdout, JSON in benchmarks/results/append.json (append-sliced.json with
--slice-bytes).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
from benchmarks.report import write_results  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "append.json"  # append-sliced.json with --slice-bytes
BASE_FILES = 10
QUERIES, TOP = 2000, 10
# tokens a word, an estimate for choosing documents (docstrings hold code); the manifests count the chunks
TOKENS_PER_WORD = 2.2


def corpus_documents(workdir: Path) -> list[dict]:
    path = workdir / "docstrings.jsonl"
    if not path.exists():
        workdir.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, str(REPO / "examples" / "stdlib_docstrings.py"), str(path), "--site-packages"], check=True
        )
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def take(docs: list[dict], chunks: float, m: int) -> tuple[list[dict], list[dict]]:
    """The documents, in hash order, that make about `chunks` chunks, and the rest."""
    from pipeline.corpus.records import doc_id_for

    ordered = sorted(docs, key=lambda d: doc_id_for("append" + d["id"]))
    made = 0.0
    for n, doc in enumerate(ordered):
        if made >= chunks:
            return ordered[:n], ordered[n:]
        made += max(1.0, len(doc["text"].split()) * TOKENS_PER_WORD / m)
    return ordered, []


def base_and_extra(workdir: Path, chunks: int, share: float) -> tuple[list[dict], list[dict]]:
    """The documents of about `chunks` chunks (the base), and those of about `share` of that
    more (the append), at the default chunk size."""
    from schemas.config import PipelineConfig

    m = PipelineConfig.model_fields["chunk_tokens"].default
    base, rest = take(corpus_documents(workdir), chunks, m)
    return base, take(rest, chunks * share, m)[0]


def write_files(directory: Path, name: str, docs: list[dict], files: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        part = docs[f::files]
        (directory / f"{name}-{f:02d}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in part))


def config(workdir: Path, out: str, corpus: Path, nlist: int, slice_bytes: str | None) -> Path:
    path = workdir / f"{out}.yaml"
    index = {"type": f"IVF{nlist},Flat"} | ({"slice_bytes": slice_bytes} if slice_bytes else {})
    path.write_text(
        json.dumps(
            {
                "output": str(workdir / out),
                "retrieval_corpus": {"paths": [str(corpus / "*.jsonl")], "id_field": "id"},
                "index": index,
            }
        )
    )
    return path


def timed_command(command: str, cfg: Path) -> float:
    start = time.perf_counter()
    subprocess.run([str(REPO / ".venv" / "bin" / "ratrain-pipeline"), command, "--config", str(cfg)], check=True)
    return time.perf_counter() - start


def manifest(out: Path):
    from schemas.manifest import IndexManifest

    return IndexManifest.model_validate_json((out / "index" / "manifest.json").read_text())


def identities(out: Path) -> np.ndarray:
    """(doc id, position) of every chunk id of an index directory, as one int64 pair per id."""
    import pyarrow.parquet as pq

    from pipeline.chunks.chunk_files import in_file_order

    found = []
    for entry in in_file_order(manifest(out).files, "chunks"):
        table = pq.read_table(out / "index" / entry.path, columns=["chunk_id", "doc_id", "position"])
        found.append(np.stack([table[c].to_numpy() for c in ("chunk_id", "doc_id", "position")], axis=1))
    rows = np.concatenate(found)
    named = np.zeros((len(rows), 2), np.int64)
    named[rows[:, 0]] = rows[:, 1:]
    return named


def vectors_of(out: Path) -> tuple[np.ndarray, np.ndarray]:
    from pipeline.index.files import read_embeddings

    batches = [b for p in sorted((out / "index" / "embeddings").glob("*.parquet")) for b in read_embeddings(str(p))]
    return np.concatenate([b[0] for b in batches]), np.concatenate([b[1] for b in batches])


def compare_neighbours(appended: Path, rebuilt: Path, tolerance: float) -> dict:
    """Slots of the appended index's answers equal to the rebuild's, both in the appended
    index's trained lists at its depth."""
    import faiss

    from pipeline.common.names import file_number
    from pipeline.common.sampling import QUERY_SALT, in_sample
    from pipeline.index.files import LIST_OWNERS_FILE, QUANTIZER_FILE, read_owners
    from pipeline.index.routing import search_routed
    from pipeline.index.search import set_search_depth
    from schemas.manifest import unversioned

    # the faiss files by name, wherever the appended index's commits stored them
    stored = {unversioned(e.path): appended / "index" / e.path for e in manifest(appended).files}
    sliced = f"faiss/{QUANTIZER_FILE}" in stored
    refilled = faiss.read_index(str(stored[f"faiss/{QUANTIZER_FILE}" if sliced else "faiss/index.faiss"]))
    refilled.reset()
    ids, vectors = vectors_of(rebuilt)
    refilled.add_with_ids(vectors, ids)
    depth = manifest(appended).nprobe
    set_search_depth(refilled, depth)
    if sliced:
        slice_names = sorted((n for n in stored if n.startswith("faiss/slice-")), key=file_number)
        slices = [faiss.read_index(str(stored[n])) for n in slice_names]
        owner = read_owners(str(stored[f"faiss/{LIST_OWNERS_FILE}"]))

        def search_grown(queries, k):
            return search_routed(refilled, slices, owner, queries, k=k, depth=depth)[:2]
    else:
        grown = faiss.read_index(str(stored["faiss/index.faiss"]))
        set_search_depth(grown, depth)
        search_grown = grown.search
    chosen = in_sample(ids, QUERIES, len(ids), QUERY_SALT)
    query_ids, queries = ids[chosen], vectors[chosen]
    named_rebuilt, named_appended = identities(rebuilt), identities(appended)
    scores_a, found_a = search_grown(queries, TOP + 1)
    scores_r, found_r = refilled.search(queries, TOP + 1)
    equal = slots = 0
    for q in range(len(query_ids)):
        own = tuple(named_rebuilt[query_ids[q]])
        a = [(tuple(named_appended[f]), s) for f, s in zip(found_a[q], scores_a[q]) if f >= 0]
        r = [(tuple(named_rebuilt[f]), s) for f, s in zip(found_r[q], scores_r[q]) if f >= 0]
        a, r = [x for x in a if x[0] != own][:TOP], [x for x in r if x[0] != own][:TOP]
        for (name_a, score_a), (name_r, score_r) in zip(a, r):
            equal += name_a == name_r or abs(score_a - score_r) <= tolerance
        slots += max(len(a), len(r))
    return {"queries": len(query_ids), "slots": slots, "equal": equal, "share": equal / slots, "depth": depth}


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--chunks", type=int, default=50_000)
    parser.add_argument("--append", type=float, default=0.1)
    parser.add_argument("--slice-bytes", help="an index in slices of at most this size (e.g. 16MB)")
    args = parser.parse_args()
    from pipeline.embed.encoder import cpu_summary
    from pipeline.index.factory import nlist_for

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="append-bench-"))
    base, extra = base_and_extra(workdir, args.chunks, args.append)
    grown_corpus, full_corpus = workdir / "corpus-grown", workdir / "corpus-full"
    write_files(grown_corpus, "base", base, BASE_FILES)
    write_files(full_corpus, "base", base, BASE_FILES)
    write_files(full_corpus, "more", extra, 1)
    nlist = nlist_for(int(args.chunks * (1 + args.append)))
    grown_cfg = config(workdir, "appended", grown_corpus, nlist, args.slice_bytes)
    base_seconds = timed_command("build-index", grown_cfg)
    write_files(grown_corpus, "more", extra, 1)
    append_seconds = timed_command("build-index", grown_cfg)
    shards_seconds = timed_command("build-shards", grown_cfg)  # every shard again, over the grown index
    full_seconds = timed_command("build-index", config(workdir, "rebuilt", full_corpus, nlist, args.slice_bytes))

    appended, rebuilt = manifest(workdir / "appended"), manifest(workdir / "rebuilt")
    precision = appended.embedding_precision.precision if appended.embedding_precision else "float32"
    tolerance = 1e-6 if precision == "float32" else 1e-3
    neighbours = compare_neighbours(workdir / "appended", workdir / "rebuilt", tolerance)
    latest = appended.generations[-1]
    results = {
        "cpu": cpu_summary(),
        "precision": precision,
        "index": appended.index_factory,
        "slices": sum(e.path.startswith("faiss/slice-") for e in appended.files),
        "slice_bytes": appended.slice_bytes,
        "base_chunks": latest.first_chunk_id,
        "appended_chunks": latest.num_chunks,
        "rebuilt_chunks": rebuilt.num_chunks,
        "base_seconds": base_seconds,
        "append_seconds": append_seconds,
        "full_rebuild_seconds": full_seconds,
        "build_shards_after_append_seconds": shards_seconds,
        "append_over_full": append_seconds / full_seconds,
        "new_vector_recall": latest.new_vector_recall,
        "build_recall": appended.recall_at_k.value,
        "rebuild_recall": rebuilt.recall_at_k.value,
        "neighbours": {**neighbours, "tolerance": tolerance},
    }
    write_results(results, RESULTS.with_name("append-sliced.json") if args.slice_bytes else RESULTS)
    sliced = f", in {results['slices']} slices" if results["slices"] else ""
    print(
        f"CPU: {results['cpu']}; encoder in {precision}; {appended.index_factory}{sliced} "
        f"at depth {neighbours['depth']}"
    )
    print("| run | chunks | seconds | × full rebuild |")
    print("|---|---:|---:|---:|")
    print(f"| base build (10 files) | {latest.first_chunk_id:,} | {base_seconds:.1f} | |")
    print(f"| append (1 file) | {latest.num_chunks:,} | {append_seconds:.1f} | {append_seconds / full_seconds:.3f} |")
    print(f"| full rebuild (11 files) | {rebuilt.num_chunks:,} | {full_seconds:.1f} | 1.000 |")
    print(f"| build-shards over the grown index (every shard) | {rebuilt.num_chunks:,} | {shards_seconds:.1f} | |")
    print(
        f"neighbours equal to the full rebuild in the same trained lists: {neighbours['equal']:,} of "
        f"{neighbours['slots']:,} slots ({neighbours['share']:.4f}; ties within {tolerance:g}); new vectors' "
        f"recall {latest.new_vector_recall:.3f}, the base build's {appended.recall_at_k.value:.3f}"
    )


if __name__ == "__main__":
    main()
