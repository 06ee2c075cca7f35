"""Decontamination: precision and recall against exact Jaccard on real text with planted
evaluation documents, its cost against the embed stage, and its largest worker as the corpus
grows 4x.

    .venv/bin/python benchmarks/decontamination.py [--workdir DIR] [--skip-embed] [--skip-memory]
        [--memory-only | --bundles-only]

Corpora (real text): the sample corpus (examples/corpus, 346 documents), and the docstrings of
the Python standard library and the installed packages (examples/stdlib_docstrings.py
--site-packages), of which 2,000 and 8,000 documents (hash-chosen) are used.

1. Evaluation documents planted from hash-chosen documents of each corpus, 40 of each kind,
   each from a document of its own: exact copies, copies with 1%, 5% and 15% of their words
   replaced, first halves; and 40 unrelated documents (from the other corpus). Per kind: the
   exact 13-gram Jaccard (`minhash.jaccard`) of each planted document with its source, and
   whether the source was removed. Over the whole corpus: every document's largest exact
   Jaccard with an evaluation document (>= 0.8: a near-duplicate) against the removals:
   precision, recall, documents removed for an unrelated one.
2. Cost (the sample corpus and the 2,000 docstring documents): three in-process Beam jobs
   over the same JSONL, each a subprocess: read only; read + decontaminate; read + chunk +
   embed (the default embedding settings). A stage's cost is its job's wall time less the
   read-only job's (the short two: the median of 3 runs each).
3. Memory: the read-only job and the decontamination job with 2 worker processes on 2,000,
   8,000 and 32,000 docstring documents (there are about 12,000: the 32,000 repeat them, each
   copy under an id of its own), evaluation documents planted as in 1: the peak RSS of the
   largest worker (VmHWM, polled), the median of REPEATS runs. Beam's local runner hands a
   worker half a stage's input as one bundle, so what grows with the corpus in the read-only
   job is the runner's; the stage's own memory is the difference.
4. `--bundles-only`: the same two jobs at the same sizes, once each, with every bundle of
   Beam's worker processes recorded (`benchmarks/bundle_peaks/sitecustomize.py`: how far each
   bundle raised its process's resident memory); the largest rise among the stage's own
   bundles (no step of the read in them), among bundles that fuse its steps with the read's,
   and in the read-only job.
Results: tables on stdout, JSON in benchmarks/results/decontamination.json
(decontamination-bundles.json for part 4).
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
from itertools import cycle
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
from benchmarks.report import write_results  # noqa: E402
from benchmarks.retrieve_join import WorkerPeak  # noqa: E402
from benchmarks.synthetic import words_replaced  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "decontamination.json"
PLANTED, UNRELATED = 40, 40
KINDS = ("copy", "1% changed", "5% changed", "15% changed", "first half")
SIZES = (2000, 8000)
MEMORY_SIZES = (2000, 8000, 32000)
REPEATS = 3  # memory runs per job and size: their peaks vary by some tens of MB
COST_REPEATS = 3  # runs of the read and decontaminate jobs timed for the cost
MB = 1e6


def load_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_jsonl(path: Path, docs: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return path


def chosen(docs: list[dict], count: int, salt: str) -> list[dict]:
    """`count` documents chosen by a hash of their ids (the same whatever the order)."""
    from pipeline.corpus.records import doc_id_for

    return sorted(docs, key=lambda d: doc_id_for(salt + d["id"]))[:count]


def enlarged(docs: list[dict], count: int) -> list[dict]:
    """`count` documents: `docs` in order, then again as copies under ids of their own."""
    return [
        d if n < len(docs) else {**d, "id": f"{d['id']}#copy{n // len(docs)}"}
        for n, d in zip(range(count), cycle(docs))
    ]


def planted(corpus: list[dict], other: list[dict]) -> list[dict]:
    """The evaluation documents: PLANTED of each kind, each from a corpus document of its own,
    and UNRELATED documents from `other`."""
    sources = chosen(corpus, PLANTED * len(KINDS), "planted")
    made = []
    for n, doc in enumerate(sources):
        kind = KINDS[n // PLANTED]
        words = doc["text"].split()
        text = {
            "copy": doc["text"],
            "1% changed": words_replaced(doc["text"], 0.01, n),
            "5% changed": words_replaced(doc["text"], 0.05, n),
            "15% changed": words_replaced(doc["text"], 0.15, n),
            "first half": " ".join(words[: len(words) // 2]),
        }[kind]
        made.append({"id": f"eval/{kind}/{doc['id']}", "text": text, "kind": kind})
    made += [
        {"id": f"eval/unrelated/{d['id']}", "text": d["text"], "kind": "unrelated"}
        for d in chosen(other, UNRELATED, "u")
    ]
    return made


def exact_best(corpus: list[dict], evaluation: list[dict], ngram: int) -> dict[str, tuple[float, str]]:
    """Per corpus document: (its largest exact Jaccard with an evaluation document, that one's
    kind). The evaluation shingles sorted once; each document's found in them by searchsorted."""
    from pipeline.decontaminate.minhash import shingles

    sets = [shingles(e["text"], ngram) for e in evaluation]
    sizes = np.array([len(s) for s in sets])
    every = np.concatenate(sets)
    owner = np.repeat(np.arange(len(sets)), sizes)
    order = np.argsort(every, kind="stable")
    every, owner = every[order], owner[order]
    best = {}
    for doc in corpus:
        own = shingles(doc["text"], ngram)
        lo, hi = np.searchsorted(every, own, "left"), np.searchsorted(every, own, "right")
        hits = np.concatenate([owner[a:b] for a, b in zip(lo.tolist(), hi.tolist()) if b > a] or [np.zeros(0, int)])
        common = np.bincount(hits, minlength=len(sets))
        jaccard = common / np.maximum(len(own) + sizes - common, 1)
        at = int(np.argmax(jaccard))
        best[doc["id"]] = (float(jaccard[at]), evaluation[at]["kind"])
    return best


# --- the jobs, each run as `decontamination.py _job KIND CORPUS EVAL OUT [beam args]` ---------------


def job_main(kind: str, corpus: str, evaluation: str, out: str, beam_args: list[str]) -> None:
    import apache_beam as beam

    from pipeline.jobs.options import new_pipeline
    from schemas.config import config_from_dict

    cfg = config_from_dict(
        {
            "output": out,
            "retrieval_corpus": {"paths": [corpus], "id_field": "id"},
            "evaluation_corpus": {"paths": [evaluation], "id_field": "id"},
        }
    )
    workers = WorkerPeak()
    with new_pipeline(beam_args) as p:
        if kind == "read":
            from pipeline.corpus.read import ReadCorpus

            documents, _, _ = p | ReadCorpus(cfg.retrieval_corpus)
            _ = documents | beam.combiners.Count.Globally()
        elif kind == "decontaminate":
            from pipeline.decontaminate.beam import ReadCorpusKeptClean

            read = p | ReadCorpusKeptClean(cfg, "retrieval")
            removed = read.rejected | beam.Filter(lambda r: r.reason == "near_duplicate_of_evaluation")
            _ = (
                removed
                | beam.Map(lambda r: dict(r.details)["doc_id"])
                | beam.combiners.ToList()
                | beam.Map(lambda ids: Path(out, "removed.json").write_text(json.dumps(sorted(ids))))
            )
        else:
            from pipeline.chunks.beam import ChunkDocuments
            from pipeline.common.models import resolve_tokenizer
            from pipeline.corpus.read import ReadCorpus
            from pipeline.embed.beam import EmbedChunks
            from pipeline.jobs.options import encoder_threads

            tokenizer = resolve_tokenizer(cfg.tokenizer)
            documents, _, _ = p | ReadCorpus(cfg.retrieval_corpus)
            chunks, _ = documents | ChunkDocuments(tokenizer, cfg.chunk_tokens, 0)
            threads = encoder_threads(cfg.embedding.cpu_threads, cfg.embedding.device, p.options)
            embedded, _ = chunks | EmbedChunks(cfg.embedding, tokenizer, threads)
            _ = embedded | beam.combiners.Count.Globally()
    Path(out, "workers.json").write_text(json.dumps({"peak_kb": workers.stop()}))


def run_job(
    kind: str, corpus: Path, evaluation: Path, out: Path, beam_args: list[str] = (), env: dict | None = None
) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(out / "log.txt", "w") as log:
        done = subprocess.run(
            [sys.executable, __file__, "_job", kind, str(corpus), str(evaluation), str(out), *beam_args],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env=None if env is None else {**os.environ, **env},
        )
    if done.returncode:
        raise SystemExit(f"the {kind} job failed: see {out / 'log.txt'}")
    wall = time.perf_counter() - start
    workers = json.loads((out / "workers.json").read_text())["peak_kb"] * 1024 / MB
    removed = json.loads((out / "removed.json").read_text()) if (out / "removed.json").exists() else None
    return {"wall_s": wall, "worker_peak_rss_mb": workers or None, "removed": removed}


def median_run(kind: str, corpus: Path, evaluation: Path, out: Path) -> dict:
    """`run_job` COST_REPEATS times: the run of median wall time, with every wall time."""
    runs = sorted(
        (run_job(kind, corpus, evaluation, out / str(i)) for i in range(COST_REPEATS)), key=lambda r: r["wall_s"]
    )
    return {**runs[len(runs) // 2], "wall_s_runs": [r["wall_s"] for r in runs]}


def quality(name: str, corpus: list[dict], evaluation: list[dict], removed_ids: list[int]) -> dict:
    """Per planted kind: the exact Jaccard of each planted evaluation document with the corpus
    document it was made from, and whether that one was removed; then precision and recall
    over every corpus document against exact Jaccard >= 0.8 with any evaluation document."""
    from pipeline.corpus.records import doc_id_for
    from pipeline.decontaminate.minhash import jaccard, shingles

    removed = {d["id"] for d in corpus if doc_id_for(d["id"]) in set(removed_ids)}
    by_id = {d["id"]: d for d in corpus}
    rows = []
    for kind in KINDS:
        made = [e for e in evaluation if e["kind"] == kind]
        sources = [e["id"].split("/", 2)[2] for e in made]
        js = [jaccard(shingles(e["text"], 13), shingles(by_id[s]["text"], 13)) for e, s in zip(made, sources)]
        rows.append(
            {
                "kind": kind,
                "planted": len(made),
                "jaccard_min": min(js),
                "jaccard_max": max(js),
                "at_0.8": sum(j >= 0.8 for j in js),
                "source_removed": sum(s in removed for s in sources),
            }
        )
    unrelated = [e for e in evaluation if e["kind"] == "unrelated"]
    best = exact_best(corpus, evaluation, 13)
    truth = {i for i, (j, _) in best.items() if j >= 0.8}
    precision = len(removed & truth) / len(removed) if removed else 1.0
    recall = len(removed & truth) / len(truth) if truth else 1.0
    removed_unrelated = len([i for i in removed if best[i][1] == "unrelated"])
    print(f"\n== {name}: {len(corpus):,} documents, {len(evaluation)} evaluation documents")
    print(f"{'planted kind':<14} {'planted':>7} {'Jaccard with source':>20} {'>= 0.8':>7} {'source removed':>15}")
    for r in rows:
        span = f"{r['jaccard_min']:.2f}-{r['jaccard_max']:.2f}"
        print(f"{r['kind']:<14} {r['planted']:>7} {span:>20} {r['at_0.8']:>7} {r['source_removed']:>15}")
    print(
        f"unrelated: {len(unrelated)} planted, {removed_unrelated} corpus documents removed for them; "
        f"all corpus documents: precision {precision:.3f}, recall {recall:.3f} against exact Jaccard >= 0.8 "
        f"({len(truth)} such documents, {len(removed)} removed)"
    )
    return {
        "documents": len(corpus),
        "rows": rows,
        "precision": precision,
        "recall": recall,
        "near_duplicates": len(truth),
        "removed": len(removed),
        "removed_for_unrelated": removed_unrelated,
    }


TWO_WORKERS = ["--direct_num_workers=2", "--direct_running_mode=multi_processing"]


def _sized_corpus(directory: Path, docstrings: list[dict], sample: list[dict], n: int) -> tuple[Path, Path]:
    """n docstring documents (`enlarged`) and their planted evaluation documents, as JSONL."""
    corpus = enlarged(docstrings, n)
    corpus_path = write_jsonl(directory / "corpus.jsonl", corpus)
    plain = [{"id": e["id"], "text": e["text"]} for e in planted(corpus, sample)]
    return corpus_path, write_jsonl(directory / "evaluation.jsonl", plain)


def memory(work: Path, docstrings: list[dict], sample: list[dict], sizes=MEMORY_SIZES) -> dict:
    """Part 3: per size, the largest worker's peak RSS (MB, the median of REPEATS runs) of the
    read-only job and of the decontamination job, and the stage's own share (the difference)."""
    found = {}
    for n in sizes:
        slug = f"memory-{n}"
        corpus_path, eval_path = _sized_corpus(work / slug, docstrings, sample, n)
        entry = {}
        for kind in ("read", "decontaminate"):
            peaks = [
                run_job(kind, corpus_path, eval_path, work / slug / f"{kind}-{i}", TWO_WORKERS)["worker_peak_rss_mb"]
                for i in range(REPEATS)
            ]
            entry[kind] = {"runs_mb": peaks, "median_mb": float(np.median(peaks))}
        entry["stage_mb"] = entry["decontaminate"]["median_mb"] - entry["read"]["median_mb"]
        found[n] = entry
        print(
            f"{n:>6,} documents: largest worker (median of {REPEATS}), read {entry['read']['median_mb']:.0f} MB, "
            f"read + decontaminate {entry['decontaminate']['median_mb']:.0f} MB: "
            f"the stage's own {entry['stage_mb']:.0f} MB "
            f"(runs: read {[round(p) for p in entry['read']['runs_mb']]}, "
            f"decontaminate {[round(p) for p in entry['decontaminate']['runs_mb']]})",
            flush=True,
        )
    return found


def _labels(transforms: list[str], composite: str) -> set[str]:
    """The step labels of a bundle's transforms directly under `composite` (e.g. `ReadCorpus`)."""
    prefix = composite + "/"
    return {name[len(prefix) :].split("/")[0] for name in transforms if name.startswith(prefix)}


def _largest(group: list[dict]) -> dict:
    """The bundle that raised its worker's memory most: by how much (MB) and its steps."""
    top = max(group, key=lambda bundle: bundle["rise_kb"])
    steps = sorted(_labels(top["transforms"], "ReadCorpusKeptClean/Read") - {"Read"})
    return {"rise_mb": top["rise_kb"] * 1024 / MB, "steps": steps}


def bundles(work: Path, docstrings: list[dict], sample: list[dict], sizes=MEMORY_SIZES) -> dict:
    """Part 4: per size, every bundle of the two jobs recorded in Beam's worker processes
    (benchmarks/bundle_peaks: how far each raised its process's resident memory). A bundle of
    the decontamination job is the stage's own when none of its steps is one of the read's
    (the read-only job's step labels), mixed when it fuses both; the read-only job's largest
    bundle is beside them."""
    found = {}
    for n in sizes:
        slug = f"bundles-{n}"
        corpus_path, eval_path = _sized_corpus(work / slug, docstrings, sample, n)
        recorded = {}
        for kind in ("read", "decontaminate"):
            peaks = work / slug / f"{kind}-bundles"
            shutil.rmtree(peaks, ignore_errors=True)
            peaks.mkdir(parents=True)
            env = {"BUNDLE_PEAKS_DIR": str(peaks), "PYTHONPATH": str(REPO / "benchmarks" / "bundle_peaks")}
            run_job(kind, corpus_path, eval_path, work / slug / kind, TWO_WORKERS, env)
            recorded[kind] = [json.loads(line) for f in sorted(peaks.glob("*.jsonl")) for line in f.open()]
        read_steps = set().union(*(_labels(b["transforms"], "ReadCorpus") for b in recorded["read"]))
        own, mixed = [], []
        for bundle in recorded["decontaminate"]:
            steps = _labels(bundle["transforms"], "ReadCorpusKeptClean/Read") | _labels(
                bundle["transforms"], "ReadCorpusKeptClean"
            ) - {"Read"}
            if steps - read_steps:
                (mixed if steps & read_steps else own).append(bundle)
        entry = {
            "bundles": {kind: len(found_here) for kind, found_here in recorded.items()},
            "stage_own": _largest(own),
            "mixed": _largest(mixed) if mixed else None,
            "read_job": {"rise_mb": max(b["rise_kb"] for b in recorded["read"]) * 1024 / MB},
        }
        found[n] = entry
        print(
            f"{n:>6,} documents: the stage's own bundles raise a worker by at most "
            f"{entry['stage_own']['rise_mb']:.0f} MB ({', '.join(entry['stage_own']['steps'][:4])}); "
            "bundles fused with the read's steps "
            f"{entry['mixed']['rise_mb'] if mixed else 0:.0f} MB; the read-only job's largest "
            f"{entry['read_job']['rise_mb']:.0f} MB",
            flush=True,
        )
    return found


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_job":
        return job_main(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6:])
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--workdir", help="kept (the docstring corpus is made once); default: a temp dir")
    parser.add_argument("--skip-embed", action="store_true", help="leave out the cost comparison")
    parser.add_argument("--memory-only", action="store_true", help="only part 3, the largest worker's memory")
    parser.add_argument("--skip-memory", action="store_true", help="leave out part 3")
    parser.add_argument("--bundles-only", action="store_true", help="only part 4, the stage's bundles' memory")
    parser.add_argument(
        "--memory-sizes", type=int, nargs="+", default=list(MEMORY_SIZES), help="documents, for parts 3 and 4"
    )
    parser.add_argument("--output", default=str(RESULTS))
    args = parser.parse_args()
    from pipeline.embed.encoder import cpu_summary

    temp = None if args.workdir else tempfile.TemporaryDirectory(prefix="decontamination-bench-")
    work = Path(args.workdir or temp.name).resolve()
    work.mkdir(parents=True, exist_ok=True)
    docstrings_path = work / "docstrings.jsonl"
    if not docstrings_path.exists():
        subprocess.run(
            [sys.executable, str(REPO / "examples" / "stdlib_docstrings.py"), str(docstrings_path), "--site-packages"],
            check=True,
        )
    sample = [d for p in sorted((REPO / "examples" / "corpus").glob("*.jsonl")) for d in load_jsonl(p)]
    every = load_jsonl(docstrings_path)
    docstrings = chosen(every, len(every), "corpus")
    results = {"cpu": cpu_summary(), "corpora": {}}
    print(f"CPU: {cpu_summary()}")
    if args.memory_only or args.bundles_only:
        results["memory" if args.memory_only else "bundles"] = (memory if args.memory_only else bundles)(
            work, docstrings, sample, args.memory_sizes
        )
        write_results(results, args.output.replace(".json", "-bundles.json") if args.bundles_only else args.output)
        return
    corpora = {"sample corpus": sample, **{f"docstrings {n:,}": docstrings[:n] for n in SIZES}}
    for name, corpus in corpora.items():
        other = docstrings if name == "sample corpus" else sample
        evaluation = planted(corpus, other)
        slug = name.replace(" ", "-").replace(",", "")
        corpus_path = write_jsonl(work / slug / "corpus.jsonl", corpus)
        plain = [{"id": e["id"], "text": e["text"]} for e in evaluation]
        eval_path = write_jsonl(work / slug / "evaluation.jsonl", plain)
        costed = name != f"docstrings {SIZES[1]:,}" and not args.skip_embed
        # the short jobs' wall times vary by about a second: timed for the cost, medians of runs
        timed = median_run if costed else run_job
        run = timed("decontaminate", corpus_path, eval_path, work / slug / "decontaminate")
        entry = quality(name, corpus, evaluation, run["removed"])
        entry["decontaminate_wall_s"] = run["wall_s"]
        if costed:
            read = median_run("read", corpus_path, eval_path, work / slug / "read")
            embed = run_job("embed", corpus_path, eval_path, work / slug / "embed")
            stage, embedding = run["wall_s"] - read["wall_s"], embed["wall_s"] - read["wall_s"]
            entry.update(read_wall_s=read["wall_s"], embed_wall_s=embed["wall_s"], cost_vs_embed=stage / embedding)
            print(
                f"cost, one process: read {read['wall_s']:.1f} s, read + decontaminate {run['wall_s']:.1f} s, "
                f"read + chunk + embed {embed['wall_s']:.1f} s: the stage {stage:.1f} s = "
                f"{stage / embedding:.3f}x the embedding's {embedding:.1f} s"
            )
        results["corpora"][name] = entry
    if not args.skip_memory:
        results["memory"] = memory(work, docstrings, sample, args.memory_sizes)
    write_results(results, args.output)
    if temp is not None:
        temp.cleanup()


if __name__ == "__main__":
    main()
