"""Does retrieval help? The reference RETRO model trained with and without its neighbours on a
corpus whose facts recur across documents in different wording.

    .venv/bin/python examples/retrieval_experiment.py [--steps 400] [--out out/experiment]

The corpus (generated, deterministic): 500 invented countries, each with a capital, a founder
and a river, all made-up names.

- retrieval corpus: one encyclopedia entry per country, in one wording;
- training corpus: three travel stories per country for countries 0-399, in other wordings;
- validation corpus: one story per country for countries 400-499, which no training story
  mentions: their facts are only in the retrieval corpus.

The pipeline builds the index over the encyclopedia, shards for the training stories and, against
the same index, shards for the validation stories (`training_corpus` with its own paths). Then
`ratrain-train` trains the same small model twice for the same steps and seed, with retrieval
and with `--no-retrieval`, scoring the validation shards as it goes. A model without neighbours
can only guess a held-out country's capital; one that learned to read its neighbours can copy
it from the encyclopedia entry its chunk retrieved. The script prints both validation losses
and writes them to `<out>/results.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from contextlib import redirect_stdout
from io import StringIO
from pathlib import Path

import numpy as np

COUNTRIES, TRAIN_COUNTRIES = 500, 400
SYLLABLES = [
    "ka",
    "lo",
    "mir",
    "ven",
    "tas",
    "or",
    "bel",
    "dun",
    "ri",
    "sa",
    "tho",
    "gal",
    "ne",
    "vor",
    "pel",
    "ist",
    "ur",
    "am",
    "ko",
    "zen",
    "fa",
    "lis",
    "mon",
    "dra",
]
ENCYCLOPEDIA = (
    "{country} is a small country. The capital of {country} is {capital}. "
    "{country} was founded by {founder}. The main river of {country} is the {river}."
)
STORIES = [
    "A traveller came to {country} in spring. In {country} she first visited the capital, {capital}, "
    "and heard that {country} was founded by {founder}. Later she sailed down the {river}.",
    "Every child in {country} knows the old songs. They sing of {founder}, who founded {country}, "
    "of the streets of {capital}, the capital, and of boats on the {river}.",
    "The merchants of {country} trade along the {river}. Their guild meets in {capital}, the capital "
    "of {country}, under a statue of {founder}, the founder.",
]


def invent(rng: np.random.Generator, parts: int) -> str:
    return "".join(rng.choice(SYLLABLES, parts)).capitalize()


def facts() -> list[dict]:
    rng = np.random.default_rng(2026)
    seen, rows = set(), []
    while len(rows) < COUNTRIES:
        row = {
            "country": invent(rng, 3),
            "capital": invent(rng, 3),
            "founder": f"{invent(rng, 2)} {invent(rng, 2)}",
            "river": invent(rng, 2),
        }
        if row["country"] not in seen:
            seen.add(row["country"])
            rows.append(row)
    return rows


def write_corpora(root: Path) -> dict[str, Path]:
    rows = facts()
    corpora = {
        "retrieval": [{"id": f"encyclopedia/{i}", "text": ENCYCLOPEDIA.format(**row)} for i, row in enumerate(rows)],
        "train": [
            {"id": f"story/{i}/{t}", "text": template.format(**row)}
            for i, row in enumerate(rows[:TRAIN_COUNTRIES])
            for t, template in enumerate(STORIES)
        ],
        "val": [
            {"id": f"story/{i}/0", "text": STORIES[0].format(**row)}
            for i, row in enumerate(rows)
            if i >= TRAIN_COUNTRIES
        ],
    }
    paths = {}
    for name, docs in corpora.items():
        path = root / "corpus" / f"{name}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(d) + "\n" for d in docs))
        paths[name] = path
    return paths


def pipeline_config(output: Path, corpora: dict[str, Path], training: str) -> dict:
    return {
        "output": str(output),
        "retrieval_corpus": {"paths": [str(corpora["retrieval"])], "id_field": "id"},
        "training_corpus": {"paths": [str(corpora[training])], "id_field": "id"},
        "chunk_tokens": 16,
        "sequence_tokens": 64,
        "neighbours": 2,
        "neighbour_candidates": 8,
        "shard_rows": 256,
        "embedding": {"batch_size": 64},
        "index": {"type": "Flat"},
    }


def build(out: Path, corpora: dict[str, Path]) -> tuple[Path, Path]:
    from pipeline.jobs.index_job import build_index
    from pipeline.jobs.shards_job import build_shards
    from schemas.config import config_from_dict

    train_cfg = config_from_dict(pipeline_config(out / "train", corpora, "train"))
    build_index(train_cfg, [])
    build_shards(train_cfg, [])
    val_out = out / "val"  # the same committed index, other training corpus
    shutil.rmtree(val_out / "index", ignore_errors=True)
    shutil.copytree(out / "train" / "index", val_out / "index")
    build_shards(config_from_dict(pipeline_config(val_out, corpora, "val")), [])
    return out / "train" / "shards", val_out / "shards"


class _Tee(StringIO):
    """Keeps what the trainer prints and shows it as it comes."""

    def __init__(self, through):
        super().__init__()
        self.through = through

    def write(self, text: str) -> int:
        self.through.write(text)
        self.through.flush()
        return super().write(text)


def train(shards: Path, val: Path, steps: int, retrieval: bool) -> dict:
    from trainer.train import main

    args = [
        "--shards",
        str(shards),
        "--val-shards",
        str(val),
        "--steps",
        str(steps),
        "--val-every",
        str(max(1, steps // 4)),
        "--batch-size",
        "16",
        "--lr",
        "2e-3",
        "--seed",
        "0",
        "--dim",
        "128",
        "--depth",
        "4",
        "--heads",
        "4",
        "--encoder-depth",
        "1",
        "--log-every",
        str(max(1, steps // 8)),
    ] + ([] if retrieval else ["--no-retrieval"])
    captured = _Tee(sys.stdout)
    with redirect_stdout(captured):
        main(args)
    output = captured.getvalue()
    val_losses = {int(s): float(v) for s, v in re.findall(r"step=(\d+) val_loss=(\S+)", output)}
    train_losses = {int(s): float(v) for s, v in re.findall(r"step=(\d+) loss=(\S+)", output)}
    return {"val_loss": val_losses, "train_loss": train_losses}


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--out", default="out/experiment")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = Path(args.out)
    corpora = write_corpora(out)
    shards, val = build(out, corpora)
    results = {"steps": args.steps, "command": " ".join([Path(sys.executable).name, *sys.argv])}
    for name, retrieval in (("retrieval", True), ("no_retrieval", False)):
        print(f"== training {name}", flush=True)
        results[name] = train(shards, val, args.steps, retrieval)
    on = results["retrieval"]["val_loss"][args.steps]
    off = results["no_retrieval"]["val_loss"][args.steps]
    results["final_val_loss"] = {"retrieval": on, "no_retrieval": off}
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print(
        f"\nvalidation loss after {args.steps} steps (held-out countries, facts only in the "
        f"retrieval corpus): retrieval {on:.4f}, no retrieval {off:.4f} "
        f"({'retrieval better' if on < off else 'retrieval NOT better'} by {off - on:+.4f})"
    )


if __name__ == "__main__":
    main()
