"""Decontamination: precision and recall against exact Jaccard on real text with planted
evaluation documents, its cost against the embed stage, and its largest worker as the corpus
grows 4x.

    .venv/bin/python benchmarks/decontamination.py [--workdir DIR] [--skip-embed]

Corpora (real text): the sample corpus (examples/corpus, 346 documents), and the docstrings of
the Python standard library and the installed packages (examples/stdlib_docstrings.py
--site-packages), of which 2,000 and 8,000 documents (hash-chosen) are used.

1. Evaluation documents planted from 40 hash-chosen documents of each corpus: an exact copy, a
   copy with 5% and with 15% of its words replaced, its first half; and 40 unrelated documents
   (from the other corpus). Truth: every corpus document's exact 13-gram Jaccard with every
   evaluation document (`minhash.jaccard`); a document is a near-duplicate at >= 0.8. The
   stage's removals against it: precision, recall, unrelated documents removed, per planted kind.
2. Cost (sample corpus): three in-process Beam jobs over the same JSONL, each a subprocess:
   read only; read + decontaminate; read + chunk + embed (torch, the default precision). A
   stage's cost is its job's wall time less the read-only job's.
3. Memory: the decontamination job with 2 worker processes on 2,000 and on 8,000 docstring
   documents; the peak RSS of the largest worker (VmHWM, polled), which must stay flat.
Results: tables on stdout, JSON in benchmarks/results/decontamination.json.
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
from benchmarks.retrieve_join import WorkerPeak  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "decontamination.json"
PLANTED, UNRELATED = 40, 40
KINDS = ("copy", "5% changed", "15% changed", "first half")
SIZES = (2000, 8000)
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


def replaced(text: str, share: float, seed: int) -> str:
    words = text.split()
    rng = np.random.default_rng(seed)
    for i in rng.choice(len(words), int(len(words) * share), replace=False):
        words[i] = f"planted{seed}x{i}"
    return " ".join(words)


def planted(corpus: list[dict], other: list[dict]) -> list[dict]:
    """The evaluation documents: 4 kinds from PLANTED corpus documents, UNRELATED from `other`."""
    made = []
    for n, doc in enumerate(chosen(corpus, PLANTED, "planted")):
        words = doc["text"].split()
        texts = (
            doc["text"],
            replaced(doc["text"], 0.05, n),
            replaced(doc["text"], 0.15, n),
            " ".join(words[: len(words) // 2]),
        )
        made += [{"id": f"eval/{kind}/{doc['id']}", "text": t, "kind": kind} for kind, t in zip(KINDS, texts)]
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

            documents, _ = p | ReadCorpus(cfg.retrieval_corpus)
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
            documents, _ = p | ReadCorpus(cfg.retrieval_corpus)
            chunks, _ = documents | ChunkDocuments(tokenizer, cfg.chunk_tokens, 0)
            threads = encoder_threads(cfg.embedding.cpu_threads, cfg.embedding.device, p.options)
            embedded, _ = chunks | EmbedChunks(cfg.embedding, tokenizer, threads)
            _ = embedded | beam.combiners.Count.Globally()
    Path(out, "workers.json").write_text(json.dumps({"peak_kb": workers.stop()}))


def run_job(kind: str, corpus: Path, evaluation: Path, out: Path, beam_args: list[str] = ()) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(out / "log.txt", "w") as log:
        done = subprocess.run(
            [sys.executable, __file__, "_job", kind, str(corpus), str(evaluation), str(out), *beam_args],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
    if done.returncode:
        raise SystemExit(f"the {kind} job failed: see {out / 'log.txt'}")
    wall = time.perf_counter() - start
    workers = json.loads((out / "workers.json").read_text())["peak_kb"] * 1024 / MB
    removed = json.loads((out / "removed.json").read_text()) if (out / "removed.json").exists() else None
    return {"wall_s": wall, "worker_peak_rss_mb": workers or None, "removed": removed}


def quality(name: str, corpus: list[dict], evaluation: list[dict], removed_ids: list[int]) -> dict:
    from pipeline.corpus.records import doc_id_for

    best = exact_best(corpus, evaluation, 13)
    removed = {d["id"] for d in corpus if doc_id_for(d["id"]) in set(removed_ids)}
    truth = {i for i, (j, _) in best.items() if j >= 0.8}
    rows = []
    for kind in (*KINDS, "unrelated"):
        ids = [i for i, (_, k) in best.items() if k == kind and best[i][0] > 0]
        near = [i for i in ids if i in truth]
        rows.append(
            {
                "kind": kind,
                "documents_closest_to_it": len(ids),
                "at_jaccard_0.8": len(near),
                "removed": len([i for i in ids if i in removed]),
                "removed_at_0.8": len([i for i in near if i in removed]),
            }
        )
    precision = len(removed & truth) / len(removed) if removed else 1.0
    recall = len(removed & truth) / len(truth) if truth else 1.0
    print(f"\n== {name}: {len(corpus):,} documents, {len(evaluation)} evaluation documents")
    print(f"{'closest evaluation kind':<24} {'documents':>9} {'J>=0.8':>7} {'removed':>8}")
    for r in rows:
        print(f"{r['kind']:<24} {r['documents_closest_to_it']:>9} {r['at_jaccard_0.8']:>7} {r['removed']:>8}")
    print(f"precision {precision:.3f}, recall {recall:.3f} (against exact Jaccard >= 0.8; {len(truth)} such documents)")
    return {
        "documents": len(corpus),
        "rows": rows,
        "precision": precision,
        "recall": recall,
        "near_duplicates": len(truth),
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_job":
        return job_main(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6:])
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--workdir", help="kept (the docstring corpus is made once); default: a temp dir")
    parser.add_argument("--skip-embed", action="store_true", help="leave out the cost comparison")
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
    docstrings = chosen(load_jsonl(docstrings_path), max(SIZES), "corpus")
    results = {"cpu": cpu_summary(), "corpora": {}}
    print(f"CPU: {cpu_summary()}")
    corpora = {"sample corpus": sample, **{f"docstrings {n:,}": docstrings[:n] for n in SIZES}}
    for name, corpus in corpora.items():
        other = docstrings if name == "sample corpus" else sample
        evaluation = planted(corpus, other)
        slug = name.replace(" ", "-").replace(",", "")
        corpus_path = write_jsonl(work / slug / "corpus.jsonl", corpus)
        eval_path = write_jsonl(
            work / slug / "evaluation.jsonl", [{"id": e["id"], "text": e["text"]} for e in evaluation]
        )
        two = name != "sample corpus"
        beam_args = ["--direct_num_workers=2", "--direct_running_mode=multi_processing"] if two else []
        run = run_job("decontaminate", corpus_path, eval_path, work / slug / "decontaminate", beam_args)
        entry = quality(name, corpus, evaluation, run["removed"])
        entry["decontaminate_wall_s"] = run["wall_s"]
        entry["worker_peak_rss_mb"] = run["worker_peak_rss_mb"]
        if not two and not args.skip_embed:
            read = run_job("read", corpus_path, eval_path, work / slug / "read")
            embed = run_job("embed", corpus_path, eval_path, work / slug / "embed")
            stage, embedding = run["wall_s"] - read["wall_s"], embed["wall_s"] - read["wall_s"]
            entry.update(read_wall_s=read["wall_s"], embed_wall_s=embed["wall_s"], cost_vs_embed=stage / embedding)
            print(
                f"cost: read {read['wall_s']:.1f} s, read + decontaminate {run['wall_s']:.1f} s, read + chunk + "
                f"embed {embed['wall_s']:.1f} s: the stage {stage:.1f} s = {stage / embedding:.3f}x the "
                f"embedding's {embedding:.1f} s"
            )
        results["corpora"][name] = entry
    small, large = (results["corpora"][f"docstrings {n:,}"]["worker_peak_rss_mb"] for n in SIZES)
    results["worker_rss_growth"] = large / small
    print(
        f"\nlargest worker, 2 processes: {small:.0f} MB at {SIZES[0]:,} documents, {large:.0f} MB at "
        f"{SIZES[1]:,} (x{large / small:.2f})"
    )
    write_results(results, args.output)
    if temp is not None:
        temp.cleanup()


if __name__ == "__main__":
    main()
