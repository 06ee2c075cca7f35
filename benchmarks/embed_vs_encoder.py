"""Embed stage and whole pipeline against the raw encoder, on the same chunks, in one run.

    .venv/bin/python benchmarks/embed_vs_encoder.py [--config examples/quickstart.yaml]
        [--precision auto|float32|bfloat16|float16]
        [--docstring-chunks N [--workdir DIR]] [--no-settings]

The chunks: the config's corpus (the quickstart's 4,557 by default), or with --docstring-chunks
about N chunks of real text the sample corpus does not hold: the docstrings of the Python
standard library and the installed packages (examples/stdlib_docstrings.py --site-packages),
documents taken in hash order as benchmarks/append.py takes them, with the config's other
settings. At the quickstart's size the fixed costs (imports, Beam's graph, the check) weigh as
much as a third of the encoder's time; at tens of thousands of chunks what remains is the part
that grows with the corpus. --no-settings leaves out steps 6 and 7 (each setting alone, and the
run with the fastest): the whole run is then the config's own settings, run warm.

1. build-index (stages 1-3) into a fresh directory, timed end to end, in the config's
   `embedding.precision` (or --precision);
2. the raw floors: `SentenceTransformer.encode` of exactly the texts the pipeline embedded
   (its chunks, decoded) in one call (it sorts them by characters and batches them), same batch
   size and threads, model already loaded, in float32 and in the precision the stage used
   (torch autocast, as the stage does); these run warm (imports done, encoder loaded, its
   kernels run before), so the same precision's floor is also taken as a script would run it:
   a fresh process that imports sentence-transformers, loads the encoder and encodes, the
   like of step 1's build-index, the first in its process;
3. the embed stage alone: a Beam job reading those chunks and running `EmbedChunks`
   (its precision check included);
4. build-shards, so that `run` = build-index + build-shards can be set against both floors;
5. two fixed costs inside build-index, alone: the precision check's float32 encode of its
   sample, and importing sentence-transformers (in a fresh process that has imported Beam and
   torch, as this one had when build-index started);
6. every encoder setting alone on the same texts, in the stage's batches and threads (model
   loaded and exported before the clock starts): torch float32 and bfloat16, onnx float32 and
   int8, openvino float32, bfloat16 and int8 (bfloat16 only on a CPU with bfloat16 units),
   each with its top-2 agreement with torch float32 on the precision check's sample, judged
   as the build judges it;
7. the whole run (build-index + build-shards, fresh directory) with the fastest setting that
   passes that check, against the raw float32 floor; then the config's own settings again
   (build-index's time alone is set against the warm floor of its precision). Both run warm
   (imports done and the encoder loaded by the steps before, as in the raw floors), unlike
   step 1's run, which pays them.
Prints the times, the ratios, and the padding of the raw floor's batches and the stage's
(padded tokens over the texts' tokens); writes them as JSON to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import apache_beam as beam
import numpy as np
import pyarrow.parquet as pq
from apache_beam.io.parquetio import ReadAllFromParquetBatched

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
from benchmarks.report import timed, timed_in_process, write_results  # noqa: E402
from pipeline.build_index.job import build_index
from pipeline.build_shards.job import build_shards, chunks_from_table
from pipeline.chunks.chunking import load_tokenizer
from pipeline.common.models import resolve_model, resolve_tokenizer
from pipeline.common.sampling import sample_keys
from pipeline.embed.backends import CALIBRATION_CHUNKS, CALIBRATION_SALT
from pipeline.embed.beam import BATCHES_PER_GROUP, EmbedChunks
from pipeline.embed.embedder import embed_texts, load_embedder, needs_calibration
from pipeline.embed.encoder import (
    Tokenized,
    arithmetic,
    chunk_texts,
    cpu_summary,
    encode_texts,
    has_bfloat16_units,
    length_batches,
    torch_threads,
)
from pipeline.embed.precision import PRECISION_SALT, agreement_upper_bound, setting_name, top2_agreement
from pipeline.jobs.options import new_pipeline
from schemas.config import load_config


def time_embed_stage(cfg, chunk_files: list[Path], threads) -> float:
    """Seconds of a Beam job (in-process) that reads these chunk files and runs `EmbedChunks`
    over their chunks (read, not `beam.Create`d: Create would pickle and compress them all into
    the job's graph, a cost build-index does not have)."""

    def embed_stage():
        with new_pipeline([]) as p:
            embedded, _ = (
                p
                | beam.Create([str(f) for f in chunk_files])
                | ReadAllFromParquetBatched()
                | beam.FlatMap(chunks_from_table)
                | EmbedChunks(cfg.embedding, resolve_tokenizer(cfg.tokenizer), threads)
            )
            _ = embedded | beam.combiners.Count.Globally()

    return timed(embed_stage)[1]


def import_seconds() -> float:
    """Seconds to import sentence-transformers in a fresh process that has Beam and torch."""
    code = "import time, apache_beam, torch; t = time.perf_counter(); import sentence_transformers; "
    code += "print(time.perf_counter() - t)"
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


FRESH_ENCODE = """
import json, sys, time
texts = json.load(open(sys.argv[1]))
start = time.perf_counter()
import torch
from sentence_transformers import SentenceTransformer
torch.set_num_threads(int(sys.argv[4]))
model = SentenceTransformer(sys.argv[2], device="cpu")
with torch.autocast("cpu", dtype=getattr(torch, sys.argv[3]), enabled=sys.argv[3] != "float32"):
    model.encode(texts, batch_size=int(sys.argv[5]), normalize_embeddings=True, convert_to_tensor=True)
print(time.perf_counter() - start)
"""


def fresh_raw_seconds(texts, model: str, precision: str, threads: int, batch_size: int, out: str) -> float:
    """The raw floor as a script would run it, against build-index's first run in a process:
    a fresh process importing sentence-transformers, loading the encoder and encoding the texts
    in one call (reading the texts not counted)."""
    path = Path(out, "texts.json")
    path.write_text(json.dumps(texts))
    command = [sys.executable, "-c", FRESH_ENCODE, str(path), model, precision, str(threads), str(batch_size)]
    env = os.environ | {"HF_HUB_OFFLINE": "1"}
    return float(subprocess.run(command, capture_output=True, text=True, check=True, env=env).stdout.split()[-1])


def raw_encode(model, texts, batch_size, precision="float32") -> np.ndarray:
    """The floor: one `SentenceTransformer.encode` call over all texts, in `precision`, its
    embeddings brought to the CPU as the stage's are."""
    with arithmetic(precision, str(model.device)):
        encoded = model.encode(
            texts, batch_size=batch_size, normalize_embeddings=True, convert_to_tensor=True, show_progress_bar=False
        )
    return encoded.float().cpu().numpy()


# (backend, precision, quantize) of step 6; torch float32 first: the others are compared with it.
SETTINGS = [
    ("torch", "float32", "none"),
    ("torch", "bfloat16", "none"),
    ("onnx", "float32", "none"),
    ("onnx", "float32", "int8"),
    ("openvino", "float32", "none"),
    ("openvino", "bfloat16", "none"),
    ("openvino", "float32", "int8"),
]


def hash_sample(ids: np.ndarray, salt: int, size: int) -> np.ndarray:
    """Positions of the `size` chunks the stage's hash sample with `salt` picks, ascending."""
    return np.sort(np.lexsort((ids, sample_keys(ids, salt)))[:size])


def time_settings(embedding, texts, ids, threads) -> list[dict]:
    """Step 6: each setting's seconds over `texts` and its agreement with torch float32."""
    check = hash_sample(ids, PRECISION_SALT, embedding.precision_sample)
    calibration = [texts[i] for i in hash_sample(ids, CALIBRATION_SALT, CALIBRATION_CHUNKS)]
    rows, reference = [], None
    for backend, precision, quantize in SETTINGS:
        if precision == "bfloat16" and not has_bfloat16_units():
            continue
        setting = embedding.model_copy(update={"backend": backend, "precision": precision, "quantize": quantize})
        model = load_embedder(setting, threads, calibration if needs_calibration(setting) else ())
        embed_texts(setting, model, texts[: setting.batch_size], threads)  # warm-up
        vectors, seconds = timed(lambda setting=setting, model=model: embed_texts(setting, model, texts, threads))
        reference = vectors if reference is None else reference
        agreeing, slots = top2_agreement(reference[check], vectors[check])
        rows.append(
            {
                "setting": setting_name(backend, precision, quantize),
                "backend": backend,
                "precision": precision,
                "quantize": quantize,
                "seconds": round(seconds, 2),
                "chunks_per_s": round(len(texts) / seconds, 1),
                "top2_agreement": round(agreeing / slots, 4),
                "passes_check": agreement_upper_bound(agreeing, slots) >= embedding.min_agreement,
                "min_cosine": round(float(np.min(np.sum(reference * vectors, axis=1))), 4),
            }
        )
    return rows


def padding(counts, batches) -> float:
    """Padded tokens of these batches (each as long as its longest text) over the texts' tokens."""
    return sum(len(b) * int(counts[b].max()) for b in batches) / int(counts.sum())


def docstring_corpus(workdir: Path, chunks: int, m: int) -> list[str]:
    """About `chunks` chunks of docstring documents as JSONL files under `workdir`; their glob."""
    from benchmarks.append import corpus_documents, take, write_files

    directory = workdir / f"docstrings-{chunks}"
    if not directory.exists():
        write_files(directory, "docstrings", take(corpus_documents(workdir), chunks, m)[0], 4)
    return [str(directory / "*.jsonl")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="examples/quickstart.yaml")
    parser.add_argument("--precision", help="override embedding.precision")
    parser.add_argument("--docstring-chunks", type=int, help="embed about this many docstring chunks instead")
    parser.add_argument("--workdir", help="where the docstring corpus is kept (default: a temp dir)")
    parser.add_argument("--no-settings", action="store_true", help="leave out each setting alone (steps 6-7)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(args.config).model_copy(update={"output": out})
        if args.docstring_chunks:
            paths = docstring_corpus(Path(args.workdir or out), args.docstring_chunks, cfg.chunk_tokens)
            corpus = cfg.retrieval_corpus.model_copy(update={"paths": paths, "text_field": "text", "id_field": "id"})
            cfg = cfg.model_copy(update={"retrieval_corpus": corpus})
        if args.precision:
            cfg = cfg.model_copy(update={"embedding": cfg.embedding.model_copy(update={"precision": args.precision})})
        manifest, index_cost = timed_in_process(lambda: build_index(cfg, []))
        t_index = index_cost["seconds"]
        from sentence_transformers import SentenceTransformer  # imported by build-index's embed stage

        _, t_shards = timed(lambda: build_shards(cfg, []))
        chunk_files = sorted(Path(out, "index", "chunks").glob("*.parquet"))
        chunks = [c for f in chunk_files for c in chunks_from_table(pq.read_table(f))]
        texts = chunk_texts(load_tokenizer(resolve_tokenizer(cfg.tokenizer)), chunks)
        device = cfg.embedding.device
        # its own model, as a user would load it (the stage's stays loaded in this process)
        model, t_load = timed(lambda: SentenceTransformer(resolve_model(cfg.embedding.model), device=device))
        precision, size = manifest.embedding_precision.precision, cfg.embedding.batch_size
        with torch_threads(manifest.encoder_threads):  # the threads the stage used
            _, t_raw = timed(lambda: raw_encode(model, texts, size))
            _, reduced_cost = timed_in_process(lambda: raw_encode(model, texts, size, precision))
            t_reduced = reduced_cost["seconds"]
        counts = Tokenized.of(model, texts).counts  # chunks are in chunk-id order, as the stage groups them
        by_characters = np.argsort([-len(t) for t in texts])  # SentenceTransformer.encode's order
        raw_batches = [by_characters[i : i + size] for i in range(0, len(texts), size)]
        group = size * BATCHES_PER_GROUP
        stage_batches = [
            start + batch
            for start in range(0, len(texts), group)
            for batch in length_batches(counts[start : start + group], size)
        ]

        t_fresh = fresh_raw_seconds(
            texts, resolve_model(cfg.embedding.model), precision, manifest.encoder_threads, size, out
        )
        t_embed = time_embed_stage(cfg, chunk_files, manifest.encoder_threads)
        ids = np.array([c.chunk_id for c in chunks])
        sample = hash_sample(ids, PRECISION_SALT, cfg.embedding.precision_sample)  # the check's
        with torch_threads(manifest.encoder_threads):
            _, t_check = timed(lambda: encode_texts(model, [texts[i] for i in sample], size))
        t_import = import_seconds()
        settings, chosen = [], None
        if not args.no_settings:
            settings = time_settings(cfg.embedding, texts, ids, manifest.encoder_threads)
            chosen = min((row for row in settings if row["passes_check"]), key=lambda row: row["seconds"])
            update = {key: chosen[key] for key in ("backend", "precision", "quantize")}
            chosen_cfg = cfg.model_copy(
                update={"output": str(Path(out, "chosen")), "embedding": cfg.embedding.model_copy(update=update)}
            )
            chosen_manifest, t_chosen_index = timed(lambda: build_index(chosen_cfg, []))
            _, t_chosen_shards = timed(lambda: build_shards(chosen_cfg, []))
        # the first run above paid the imports and the encoder load; the chosen one ran warm, so
        # the default settings run again warm, to compare like with like
        warm_cfg = cfg.model_copy(update={"output": str(Path(out, "warm"))})
        warm_manifest, warm_index_cost = timed_in_process(lambda: build_index(warm_cfg, []))
        t_warm_index = warm_index_cost["seconds"]
        _, t_warm_shards = timed(lambda: build_shards(warm_cfg, []))
    result = {
        "cpu": cpu_summary(),
        "chunks": len(chunks),
        "batch_size": cfg.embedding.batch_size,
        "precision": precision,
        "top2_agreement": manifest.embedding_precision.top2_agreement,
        "min_cosine": manifest.embedding_precision.min_cosine,
        "raw_encode_s": round(t_raw, 2),
        "raw_model_load_s": round(t_load, 2),
        "raw_chunks_per_s": round(len(chunks) / t_raw, 1),
        f"raw_{precision}_encode_s": round(t_reduced, 2),
        f"raw_{precision}_vs_float32": round(t_reduced / t_raw, 3),
        "raw_padding": round(padding(counts, raw_batches), 4),
        "stage_padding": round(padding(counts, stage_batches), 4),
        "embed_stage_s": round(t_embed, 2),
        "check_float32_encode_s": round(t_check, 2),
        "sentence_transformers_import_s": round(t_import, 2),
        "build_index_s": round(t_index, 2),
        "build_shards_s": round(t_shards, 2),
        "run_s": round(t_index + t_shards, 2),
        "run_warm_s": round(t_warm_index + t_warm_shards, 2),
        "run_warm_vs_raw": round((t_warm_index + t_warm_shards) / t_raw, 3),
        "embed_stage_vs_raw": round(t_embed / t_raw, 3),
        "build_index_vs_raw": round(t_index / t_raw, 3),
        "run_vs_raw": round((t_index + t_shards) / t_raw, 3),
        f"embed_stage_vs_raw_{precision}": round(t_embed / t_reduced, 3),
        f"build_index_vs_raw_{precision}": round(t_index / t_reduced, 3),
        f"raw_{precision}_fresh_process_s": round(t_fresh, 2),
        f"build_index_vs_raw_{precision}_fresh_process": round(t_index / t_fresh, 3),
        f"run_vs_raw_{precision}": round((t_index + t_shards) / t_reduced, 3),
        "settings": settings,
        "warm_build_index_s": round(t_warm_index, 2),
        f"warm_build_index_vs_raw_{precision}": round(t_warm_index / t_reduced, 3),
        "warm_check": warm_manifest.embedding_precision.summary(),
        # kernel time and page faults: what separates a process's first build from its second
        "in_process_costs": {
            "build_index": index_cost,
            f"raw_{precision}_encode": reduced_cost,
            "warm_build_index": warm_index_cost,
        },
    }
    if chosen:
        result |= {
            "chosen_setting": chosen["setting"],
            "chosen_build_index_s": round(t_chosen_index, 2),
            "chosen_run_s": round(t_chosen_index + t_chosen_shards, 2),
            "chosen_run_vs_raw": round((t_chosen_index + t_chosen_shards) / t_raw, 3),
            "chosen_check": chosen_manifest.embedding_precision.summary(),
        }
    result |= {
        "encoder_threads": manifest.encoder_threads,
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
    }
    name = f"embed_vs_encoder-docstrings-{args.docstring_chunks}" if args.docstring_chunks else "embed_vs_encoder"
    write_results(result, f"benchmarks/results/{name}.json")
    width = max(map(len, result))
    for key, value in result.items():
        if key != "settings":
            print(f"{key:<{width}}  {value}")
    for row in settings:
        print(f"  {row['setting']:<24} " + "  ".join(f"{k} {v}" for k, v in row.items() if k != "setting"))


if __name__ == "__main__":
    main()
