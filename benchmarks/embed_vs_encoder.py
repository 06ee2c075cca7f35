"""Embed stage and whole pipeline against the raw encoder, on the same chunks, in one run.

    .venv/bin/python benchmarks/embed_vs_encoder.py [--config examples/quickstart.yaml]
        [--precision auto|float32|bfloat16|float16]

1. build-index (stages 1-3) into a fresh directory, timed end to end, in the config's
   `embedding.precision` (or --precision);
2. the raw floors: `SentenceTransformer.encode` of exactly the texts the pipeline embedded
   (its chunks, decoded), same batch size and threads, model already loaded, in float32 and
   in the precision the stage used (torch autocast, as the stage does);
3. the embed stage alone: a Beam job reading those chunks and running `EmbedChunks`
   (its precision check included);
4. build-shards, so that `run` = build-index + build-shards can be set against both floors.
Prints the times and the ratios; writes them as JSON to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import apache_beam as beam
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
from benchmarks.report import timed, write_results  # noqa: E402
from pipeline.chunks.chunking import load_tokenizer
from pipeline.common.models import resolve_tokenizer
from pipeline.embed.beam import EmbedChunks
from pipeline.embed.encoder import chunk_texts, encode_texts, load_encoder, torch_threads
from pipeline.jobs.index_job import build_index
from pipeline.jobs.options import new_pipeline
from pipeline.jobs.shards_job import _chunks_from_table, build_shards
from schemas.config import load_config


def time_embed_stage(cfg, chunks, threads) -> float:
    """Seconds of a Beam job (in-process) that runs `EmbedChunks` over these chunks."""

    def embed_stage():
        with new_pipeline([]) as p:
            embedded, _ = (
                p
                | beam.Create(chunks, reshuffle=False)
                | EmbedChunks(cfg.embedding, resolve_tokenizer(cfg.tokenizer), threads)
            )
            _ = embedded | beam.combiners.Count.Globally()

    return timed(embed_stage)[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="examples/quickstart.yaml")
    parser.add_argument("--precision", help="override embedding.precision")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(args.config).model_copy(update={"output": out})
        if args.precision:
            cfg = cfg.model_copy(update={"embedding": cfg.embedding.model_copy(update={"precision": args.precision})})
        manifest, t_index = timed(lambda: build_index(cfg, []))
        _, t_shards = timed(lambda: build_shards(cfg, []))
        chunk_files = sorted(Path(out, "index", "chunks").glob("*.parquet"))
        chunks = [c for f in chunk_files for c in _chunks_from_table(pq.read_table(f))]
        texts = chunk_texts(load_tokenizer(resolve_tokenizer(cfg.tokenizer)), chunks)
        model, t_load = timed(lambda: load_encoder(cfg.embedding))
        precision = manifest.embedding_precision.precision
        with torch_threads(manifest.encoder_threads):  # the threads the stage used
            _, t_raw = timed(lambda: encode_texts(model, texts, cfg.embedding.batch_size))
            _, t_reduced = timed(lambda: encode_texts(model, texts, cfg.embedding.batch_size, precision))

        t_embed = time_embed_stage(cfg, chunks, manifest.encoder_threads)
    result = {
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
        "embed_stage_s": round(t_embed, 2),
        "build_index_s": round(t_index, 2),
        "build_shards_s": round(t_shards, 2),
        "run_s": round(t_index + t_shards, 2),
        "embed_stage_vs_raw": round(t_embed / t_raw, 3),
        "build_index_vs_raw": round(t_index / t_raw, 3),
        "run_vs_raw": round((t_index + t_shards) / t_raw, 3),
        f"run_vs_raw_{precision}": round((t_index + t_shards) / t_reduced, 3),
        "encoder_threads": manifest.encoder_threads,
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
    }
    write_results(result, "benchmarks/results/embed_vs_encoder.json")
    width = max(map(len, result))
    for key, value in result.items():
        print(f"{key:<{width}}  {value}")


if __name__ == "__main__":
    main()
