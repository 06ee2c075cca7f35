"""The embed stage's batching against the alternatives, on the same chunks, alternated in one
process so that a loaded machine slows all three alike.

    .venv/bin/python benchmarks/embed_batching.py [--config examples/quickstart.yaml] [--rounds 2]

Builds the config's index into a fresh directory (for its chunks), then encodes all chunk texts
in the precision the stage used, with the stage's threads, `--rounds` times each way:
- stage: groups of batch_size * BATCHES_PER_GROUP chunks by id, `encode_texts` (batches of
  similar token counts);
- chunk-id batches: one `SentenceTransformer.encode` call per batch_size chunks by id;
- raw: one `SentenceTransformer.encode` call over all texts (its own sort by characters).
Prints each time and the least per way; writes them to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
from benchmarks.embed_vs_encoder import raw_encode  # noqa: E402
from benchmarks.report import timed, write_results  # noqa: E402
from pipeline.build_index.job import build_index  # noqa: E402
from pipeline.build_shards.job import chunks_from_table  # noqa: E402
from pipeline.chunks.chunking import load_tokenizer  # noqa: E402
from pipeline.common.models import resolve_tokenizer  # noqa: E402
from pipeline.embed.beam import BATCHES_PER_GROUP  # noqa: E402
from pipeline.embed.encoder import chunk_texts, encode_texts, load_encoder, torch_threads  # noqa: E402
from schemas.config import load_config  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="examples/quickstart.yaml")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(args.config).model_copy(update={"output": out})
        manifest = build_index(cfg, [])
        files = sorted(Path(out, "index", "chunks").glob("*.parquet"))
        chunks = [c for f in files for c in chunks_from_table(pq.read_table(f))]  # in chunk-id order
    texts = chunk_texts(load_tokenizer(resolve_tokenizer(cfg.tokenizer)), chunks)
    model, size = load_encoder(cfg.embedding), cfg.embedding.batch_size
    precision, group = manifest.embedding_precision.precision, size * BATCHES_PER_GROUP
    ways = {
        "stage": lambda: [
            encode_texts(model, texts[i : i + group], size, precision) for i in range(0, len(texts), group)
        ],
        "chunk_id_batches": lambda: [
            raw_encode(model, texts[i : i + size], size, precision) for i in range(0, len(texts), size)
        ],
        "raw": lambda: raw_encode(model, texts, size, precision),
    }
    seconds: dict[str, list[float]] = {way: [] for way in ways}
    with torch_threads(manifest.encoder_threads):
        for round_ in range(args.rounds):
            for way, encode in ways.items():
                seconds[way].append(timed(encode)[1])
                print(f"round {round_} {way}: {seconds[way][-1]:.2f} s", flush=True)
    result = {"chunks": len(texts), "precision": precision, "encoder_threads": manifest.encoder_threads}
    result |= {f"{way}_s": [round(s, 2) for s in times] for way, times in seconds.items()}
    result |= {f"{way}_least_s": round(min(times), 2) for way, times in seconds.items()}
    write_results(result, "benchmarks/results/embed_batching.json")
    for key, value in result.items():
        print(f"{key:<24}  {value}")


if __name__ == "__main__":
    main()
