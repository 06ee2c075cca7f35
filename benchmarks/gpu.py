"""The GPU benchmark: one run, one table, in a few minutes on a machine with an NVIDIA GPU.

    # the CUDA build of torch first (DEVELOPERS.md, "Install"), then:
    .venv/bin/python benchmarks/gpu.py [--device cuda] [--documents N] [--steps 50]

On the quickstart corpus (or its first N documents), with `embedding.device` = --device:
1. build-index (precision auto: bfloat16 where the GPU has it), timed;
2. the raw encoder, model loaded, on exactly the chunks the stage embedded, in float32,
   float16 and bfloat16 (torch autocast, as the stage runs it): chunks/s each;
3. the embed stage alone on the same device (a Beam job running `EmbedChunks`, its precision
   check included): chunks/s, and its ratio to the raw encoder in the same precision;
4. the committed index's search rate (faiss on the CPU, 10 results per query);
5. build-shards, then the trainer (`ratrain-train --device` on the shards, float32 as it runs
   today): tokens/s from its last log line.
Writes benchmarks/results/gpu.json. `--device cpu --documents 20` runs the same steps on a CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
from benchmarks.embed_vs_encoder import raw_encode, time_embed_stage  # noqa: E402
from benchmarks.report import (
    timed,  # noqa: E402
    write_results,  # noqa: E402
)
from pipeline.build_index.job import build_index  # noqa: E402
from pipeline.build_shards.job import build_shards, chunks_from_table  # noqa: E402
from pipeline.chunks.chunking import load_tokenizer  # noqa: E402
from pipeline.common.models import resolve_tokenizer  # noqa: E402
from pipeline.embed.encoder import chunk_texts, load_encoder, torch_threads  # noqa: E402
from pipeline.index.files import load_index  # noqa: E402
from pipeline.index.search import query_rate  # noqa: E402
from schemas.arrow import tensor_column_to_numpy  # noqa: E402
from schemas.config import load_config  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def corpus(workdir: Path, documents: int | None) -> str:
    if documents is None:
        return str(REPO / "examples" / "corpus" / "*.jsonl")
    lines = [
        line
        for path in sorted((REPO / "examples" / "corpus").glob("*.jsonl"))
        for line in path.read_text().splitlines()
    ][:documents]
    path = workdir / "corpus.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def trainer_tokens_per_s(shards: Path, device: str, steps: int) -> float:
    from trainer.train import main as train

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train(
            ["--shards", str(shards), "--steps", str(steps), "--log-every", str(max(1, steps // 5)), "--device", device]
        )
    rates = re.findall(r"tok/s=(\d+)", out.getvalue())
    return float(rates[-1]) if rates else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--documents", type=int, help="only the first N documents of the corpus")
    parser.add_argument("--steps", type=int, default=50, help="trainer steps")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        workdir = Path(scratch)
        cfg = load_config(REPO / "examples" / "quickstart.yaml")
        cfg = cfg.model_copy(
            update={
                "output": str(workdir / "out"),
                "retrieval_corpus": cfg.retrieval_corpus.model_copy(
                    update={"paths": [corpus(workdir, args.documents)]}
                ),
                "embedding": cfg.embedding.model_copy(update={"device": args.device}),
            }
        )
        manifest, t_index = timed(lambda: build_index(cfg, []))
        files = sorted((workdir / "out" / "index" / "chunks").glob("*.parquet"))
        chunks = [c for f in files for c in chunks_from_table(pq.read_table(f))]
        texts = chunk_texts(load_tokenizer(resolve_tokenizer(cfg.tokenizer)), chunks)
        model = load_encoder(cfg.embedding)
        raw = {}
        with torch_threads(manifest.encoder_threads):
            batch = cfg.embedding.batch_size
            for precision in ("float32", "float16", "bfloat16"):
                raw_encode(model, texts[:256], batch, precision)  # warm-up
                _, seconds = timed(lambda precision=precision: raw_encode(model, texts, batch, precision))
                raw[precision] = len(texts) / seconds

        t_stage = time_embed_stage(cfg, chunks, manifest.encoder_threads)
        precision = manifest.embedding_precision.precision
        index = load_index(str(workdir / "out" / "index" / "faiss" / "index.faiss"), manifest.nprobe, sha256=None)
        vectors = np.concatenate(
            [
                tensor_column_to_numpy(pq.read_table(f)["embedding"])
                for f in sorted((workdir / "out" / "index" / "embeddings").glob("*.parquet"))
            ]
        )
        queries = vectors[np.random.default_rng(0).integers(0, len(vectors), 10_000)]
        _, t_shards = timed(lambda: build_shards(cfg, []))
        tokens_per_s = trainer_tokens_per_s(workdir / "out" / "shards", args.device, args.steps)
    result = {
        "device": args.device,
        "chunks": len(chunks),
        "stage_precision": precision,
        "top2_agreement": manifest.embedding_precision.top2_agreement,
        **{f"raw_{p}_chunks_per_s": round(v, 1) for p, v in raw.items()},
        "embed_stage_chunks_per_s": round(len(chunks) / t_stage, 1),
        "embed_stage_vs_raw_same_precision": round(raw[precision] / (len(chunks) / t_stage), 3),
        "build_index_s": round(t_index, 2),
        "build_shards_s": round(t_shards, 2),
        "index": manifest.index_factory,
        "index_queries_per_s": round(query_rate(index, queries), 1),
        "trainer_tokens_per_s": tokens_per_s,
    }
    write_results(result, REPO / "benchmarks" / "results" / "gpu.json")
    width = max(map(len, result))
    for key, value in result.items():
        print(f"{key:<{width}}  {value}")


if __name__ == "__main__":
    main()
