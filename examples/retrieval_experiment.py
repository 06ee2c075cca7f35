"""Does a model trained on the shards read its neighbours? Facts it cannot memorise, held-out
countries, and a retrieval database edited without retraining.

    .venv/bin/python examples/retrieval_experiment.py [--steps 1500] [--out out/experiment]

The world (generated, deterministic): `--entities` invented countries with made-up names, each
with an emblem (a word no other country has) and three facts: a capital, a river and an
animal, drawn at random from pools of POOL ordinary words. A fact cannot be guessed from the
name or the wording. Every word is one token (a word-level tokenizer of this world, which
keeps the model's output layer small).

- retrieval corpus: one encyclopedia entry per country, four sentences of exactly one chunk (m
  tokens): a preamble naming the country and its emblem, then the capital, the river and the
  animal, each in the first wording of its kind;
- training corpus: one story per country for all but the last `--held-out`: the same four
  sentences, each in one of two wordings drawn at random;
- validation corpus: one story per held-out country. No training story mentions it, so its
  facts are only in the encyclopedia.

Every sentence is padded to m tokens with the country's name and emblem, so each chunk of a
story retrieves its country's entry. RETRO's chunked cross-attention lets the tokens of chunk
u+1 read the neighbours retrieved for chunk u: the entry's chunk and its continuation, which
is the entry's next sentence, the one chunk u+1 states in its own wording. A model that
learned to read neighbours copies a held-out country's fact from there. One without them can
only guess among the pool.

The pipeline builds the index over the encyclopedia and shards for both story sets against it.
`ratrain-train` trains the same small model for the same steps and seed, with retrieval and
with `--no-retrieval`. Greedy predictions of the held-out stories' fact tokens are scored:
- accuracy with the retrieved neighbours, with them blanked, and of the model trained without
  retrieval, plus the share whose neighbours hold the fact at all (retrieval's ceiling);
- ratrain-eval's full JSON for the retrieval model on the held-out shards;
- the edit: the held-out countries' facts are replaced by new ones in the encyclopedia: their
  entries, with new text under the same ids, are appended to the index, each replacing the
  indexed entry of its id (nothing else re-embedded), and the held-out shards rebuilt (the
  model unchanged). Reported: the
  share of predictions that follow the new facts, the share that still give the old ones, and
  the share of `ratrain-generate` continuations of "<preamble> the capital of <name> is"
  (live retrieval) that write the new capital.
Results print as a table and go to `<out>/results.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

ENTITIES, HELD_OUT = 6000, 300
POOL = 600  # values per fact kind
FACTS = ("capital", "river", "animal")
SYLLABLES = "ka lo mir ven tas or bel dun ri sa tho gal ne vor pel ist ur am ko zen fa lis mon dra".split()
PREAMBLES = (
    "this is the story of {name} , the land of the {emblem} .",
    "travellers often speak of {name} , land of the {emblem} .",
)
SENTENCES = {
    "capital": ("the capital of {name} is {value} .", "in {name} the capital city is {value} ."),
    "river": ("the great river of {name} is the {value} .", "boats in {name} sail on the {value} ."),
    "animal": ("the national animal of {name} is the {value} .", "in {name} people love the {value} ."),
}
CHUNK_TOKENS, SEQUENCE_TOKENS, NEIGHBOURS = 16, 64, 2
TOKENIZER_FILE = "tokenizer.json"  # beside the corpora


@dataclass(frozen=True)
class Country:
    name: str
    emblem: str  # a word of its own, in its entry and its stories: what retrieval finds it by
    capital: str
    river: str
    animal: str

    def fact(self, kind: str) -> str:
        return getattr(self, kind)


@dataclass(frozen=True)
class FactScores:
    """Shares of a shard directory's fact tokens (greedy predictions)."""

    tokens: int
    accuracy: float  # the fact as the story tells it, with the shards' neighbours
    blanked: float | None  # the same with every neighbour blanked (None: a model without retrieval)
    in_neighbours: float  # the fact is among the neighbours its position reads (retrieval's ceiling)
    edited: float | None  # the fact as the edited encyclopedia tells it (None: no edit)


def write_tokenizer(path: Path, countries: list[Country]) -> Path:
    """A word-level tokenizer of this world's words ([PAD] = 0): every word one token, so a
    sentence's tokens are its words, and a vocabulary of a few thousand keeps the model's
    output layer (and the training time) small. The pipeline takes it as `tokenizer`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = sorted(
        {w for text in [*PREAMBLES, *sum(SENTENCES.values(), ())] for w in text.split() if "{" not in w}
        | {v for c in countries for v in (c.name, c.emblem, c.capital, c.river, c.animal)}
    )
    vocab = {word: i for i, word in enumerate(["[PAD]", "[UNK]", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def english_words() -> list[str]:
    """Ordinary words (the default encoder's one-token words), for facts the encoder can read."""
    from pipeline.chunks.chunking import load_tokenizer
    from pipeline.common.models import resolve_tokenizer

    vocab = load_tokenizer(resolve_tokenizer(None)).get_vocab()
    return sorted(w for w in vocab if w.isalpha() and w.isascii() and len(w) >= 4)


def invent_countries(count: int, rng: np.random.Generator) -> list[Country]:
    """`count` countries: made-up names, an emblem each (a word no other country has) and facts
    drawn from disjoint pools of POOL words; no word of the templates is a value."""
    used = {w for text in [*PREAMBLES, *sum(SENTENCES.values(), ())] for w in text.split()}
    words = [w for w in english_words() if w not in used]
    chosen = rng.choice(words, POOL * len(FACTS) + count, replace=False).tolist()
    pools = {kind: chosen[i * POOL : (i + 1) * POOL] for i, kind in enumerate(FACTS)}
    emblems = chosen[POOL * len(FACTS) :]
    names: list[str] = []
    while len(names) < count:
        name = "".join(rng.choice(SYLLABLES, 3))
        if name not in names and name not in words:
            names.append(name)
    return [
        Country(name, emblem, *(str(rng.choice(pools[kind])) for kind in FACTS)) for name, emblem in zip(names, emblems)
    ]


def edited(countries: list[Country], rng: np.random.Generator) -> list[Country]:
    """The same countries with every fact replaced by another value of its pool."""
    pools = {kind: sorted({c.fact(kind) for c in countries}) for kind in FACTS}
    out = []
    for country in countries:
        values = []
        for kind in FACTS:
            value = country.fact(kind)
            while value == country.fact(kind):
                value = str(rng.choice(pools[kind]))
            values.append(value)
        out.append(Country(country.name, country.emblem, *values))
    return out


def sentence(text: str, country: Country) -> str:
    """`text` padded to exactly one chunk of m tokens (a word is a token) with the country's name
    and emblem, so that every chunk of a story retrieves the country's entry (the encoder finds
    an entry by its words; a made-up name alone is too weak a cue among thousands)."""
    words = text.split()
    if len(words) > CHUNK_TOKENS:
        raise ValueError(f"{text!r} is {len(words)} tokens, more than a chunk of {CHUNK_TOKENS}")
    return " ".join([*words, *([country.name, country.emblem] * CHUNK_TOKENS)[: CHUNK_TOKENS - len(words)]])


def story(country: Country, rng: np.random.Generator | None) -> str:
    """A preamble naming the country, then its three facts in FACTS order: a chunk each. With
    `rng`, each sentence in a wording drawn at random; without, in the first wording (the
    encyclopedia entry)."""

    def wording(templates: tuple[str, ...]) -> str:
        return templates[0] if rng is None else str(rng.choice(templates))

    parts = [sentence(wording(PREAMBLES).format(name=country.name, emblem=country.emblem), country)]
    for kind in FACTS:
        parts.append(sentence(wording(SENTENCES[kind]).format(name=country.name, value=country.fact(kind)), country))
    return " ".join(parts)


def encyclopedia(countries: list[Country]) -> list[dict]:
    return [{"id": f"entry/{c.name}", "text": story(c, None)} for c in countries]


def write_jsonl(path: Path, docs: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return path


def write_corpora(root: Path, countries: list[Country], held_out: int) -> dict[str, Path]:
    rng = np.random.default_rng(7)
    training = countries[: len(countries) - held_out]
    return {
        "retrieval": write_jsonl(
            root / "retrieval.jsonl",
            encyclopedia(countries),
        ),
        "train": write_jsonl(
            root / "train.jsonl",
            [{"id": f"story/{c.name}", "text": story(c, rng)} for c in training],
        ),
        "val": write_jsonl(
            root / "val.jsonl",
            [{"id": f"story/{c.name}", "text": story(c, rng)} for c in countries[len(training) :]],
        ),
    }


def pipeline_config(output: Path, retrieval: list[Path], training: Path) -> dict:
    return {
        "output": str(output),
        "tokenizer": str(retrieval[0].parent / TOKENIZER_FILE),
        "retrieval_corpus": {"paths": [str(path) for path in retrieval], "id_field": "id"},
        "training_corpus": {"paths": [str(training)], "id_field": "id"},
        "chunk_tokens": CHUNK_TOKENS,
        "sequence_tokens": SEQUENCE_TOKENS,
        "neighbours": NEIGHBOURS,
        "neighbour_candidates": 8,
        "shard_rows": 1024,
        "embedding": {"batch_size": 128},
        "index": {"type": "Flat"},
    }


def build(output: Path, retrieval: list[Path], training: Path, index_from: Path | None = None) -> Path:
    """Shards of `training` against the index over the `retrieval` files (built in `output`;
    with `index_from`, its committed index copied there first, and only the files it has not
    read appended)."""
    from pipeline.build_index.job import build_index
    from pipeline.build_shards.job import build_shards
    from pipeline.common.fileio import committed
    from pipeline.jobs.job import index_dir
    from pipeline.jobs.reuse import index_action, listed_corpus_files
    from schemas.config import config_from_dict
    from schemas.manifest import IndexManifest

    config = config_from_dict(pipeline_config(output, retrieval, training))
    if index_from is not None:
        shutil.rmtree(output / "index", ignore_errors=True)
        shutil.copytree(index_from / "index", output / "index")
    copied = committed(index_dir(config), IndexManifest)
    if index_action(config, copied, listed_corpus_files(config)) != "reuse":
        build_index(config, [])
    build_shards(config, [])
    return output / "shards"


def train(shards: Path, checkpoint: Path, steps: int, retrieval: bool, vocab_size: int) -> None:
    from trainer.train import main

    main(
        [
            *("--shards", str(shards), "--steps", str(steps), "--batch-size", "16", "--lr", "3e-3"),
            *("--warmup-steps", "50", "--min-lr-ratio", "0.3", "--seed", "0", "--dim", "128", "--depth", "4"),
            *("--cca-layers", "1,2,3"),
            *("--heads", "4", "--encoder-depth", "1", "--log-every", str(max(1, steps // 12))),
            *("--vocab-size", str(vocab_size)),
            *("--checkpoint", str(checkpoint)),
            *([] if retrieval else ["--no-retrieval"]),
        ]
    )


def fact_targets(tokens, by_name: dict[int, Country], vocab: dict[str, int], edits: dict[str, Country]):
    """For a batch of rows (tokens [b, n+1]): bool [b, n], the positions whose target is a fact
    of the row's country (the one its preamble names), and int64 [b, n], the edited value of
    that fact (the target itself without `edits`)."""
    import torch

    targets = tokens[:, 1:]
    is_fact = torch.zeros(targets.shape, dtype=torch.bool)
    edited_value = targets.clone()
    for row, sequence in enumerate(tokens.tolist()):
        country = by_name[next(t for t in sequence[:CHUNK_TOKENS] if t in by_name)]
        for kind in FACTS:
            at = targets[row] == vocab[country.fact(kind)]
            at[: CHUNK_TOKENS - 1] = False  # facts sit after the preamble chunk
            is_fact[row] |= at
            edited_value[row, at] = vocab[edits.get(country.name, country).fact(kind)]
    return is_fact, edited_value


def score_facts(
    checkpoint: Path, shards: Path, vocab: dict[str, int], countries: list[Country], edits: dict[str, Country]
) -> FactScores:
    """A checkpoint's predictions of the fact tokens of held-out stories (`trainer.evaluate`'s
    per-position scores), with the shards' neighbours and blanked."""
    from trainer.checkpoint import read_checkpoint
    from trainer.dataset import ShardDataset
    from trainer.evaluate import Tally, token_scores

    model = read_checkpoint(str(checkpoint)).model
    by_name = {vocab[c.name]: c for c in countries}
    with_neighbours, blanked = Tally(), Tally()
    readable = follow_edit = 0
    for batch in ShardDataset(shards, shuffle=False, batch_size=128, batched=True):
        is_fact, edited_value = fact_targets(batch["tokens"], by_name, vocab, edits)
        scores = token_scores(model, batch, blank=False)
        with_neighbours.add(scores, is_fact)
        readable += int(scores.copyable[is_fact].sum())
        follow_edit += int((scores.predicted[is_fact] == edited_value[is_fact]).sum())
        if model.config.uses_retrieval:
            blanked.add(token_scores(model, batch, blank=True, same_batch=scores), is_fact)
    count = with_neighbours.tokens
    return FactScores(
        tokens=count,
        accuracy=with_neighbours.correct / count,
        blanked=blanked.correct / count if model.config.uses_retrieval else None,
        in_neighbours=readable / count,
        edited=follow_edit / count if edits else None,
    )


def generated_capitals(checkpoint: Path, index: Path, countries: list[Country], edits: dict[str, Country]):
    """Greedy `ratrain-generate` continuations of "<preamble> the capital of <name> is", with
    live retrieval from `index`: the share that write the (edited) capital, and one example."""
    from pipeline.retrieve.online import Retriever
    from trainer.checkpoint import load_model
    from trainer.generate import generate

    model, retriever = load_model(str(checkpoint)), Retriever.open(str(index))
    written, example = 0, ""
    for country in countries:
        preamble = sentence(PREAMBLES[0].format(name=country.name, emblem=country.emblem), country)
        prompt = f"{preamble} the capital of {country.name} is"
        continuation = retriever.decode(
            generate(model, retriever, retriever.tokenize(prompt).tolist(), max_tokens=1).continuation
        )
        capital = edits.get(country.name, country).capital
        written += continuation.strip() == capital
        example = example or f"{prompt} -> {continuation} (the encyclopedia: {capital})"
    return written / len(countries), example


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--entities", type=int, default=ENTITIES)
    parser.add_argument("--held-out", type=int, default=HELD_OUT)
    parser.add_argument("--out", default="out/experiment")
    parser.add_argument(
        "--reuse-checkpoints",
        action="store_true",
        help="Keep the two checkpoints a run with the same settings left in --out instead of training them again.",
    )
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from trainer.evaluate import main as evaluate_main

    out, started = Path(args.out), time.perf_counter()
    seconds: dict[str, float] = {}

    def lap(name: str) -> None:
        seconds[name] = round(time.perf_counter() - started - sum(seconds.values()), 1)
        print(f"== {name}: {seconds[name]:.0f} s", flush=True)

    countries = invent_countries(args.entities, np.random.default_rng(2026))
    vocab = json.loads(write_tokenizer(out / "corpus" / TOKENIZER_FILE, countries).read_text())["model"]["vocab"]
    corpora = write_corpora(out / "corpus", countries, args.held_out)
    shards = build(out / "train", [corpora["retrieval"]], corpora["train"])
    val = build(out / "val", [corpora["retrieval"]], corpora["val"], index_from=out / "train")
    lap("build index and shards")
    model, plain = out / "retrieval.pt", out / "no_retrieval.pt"
    if not (args.reuse_checkpoints and model.exists()):
        train(shards, model, args.steps, retrieval=True, vocab_size=len(vocab))
        lap("train with retrieval")
    if not (args.reuse_checkpoints and plain.exists()):
        train(shards, plain, args.steps, retrieval=False, vocab_size=len(vocab))
        lap("train without retrieval")

    held = countries[len(countries) - args.held_out :]
    retrieval = score_facts(model, val, vocab, held, {})
    no_retrieval = score_facts(plain, val, vocab, held, {})
    evaluation = out / "eval_retrieval.json"  # every number of ratrain-eval, on all held-out targets
    evaluate_main(["--checkpoint", str(model), "--shards", str(val), "--json", str(evaluation)])

    # The edit: new facts for the held-out countries, their entries replaced in the index (a new
    # file of entries with their ids, appended: each replaces the indexed entry of its id).
    edits = {c.name: c for c in edited(held, np.random.default_rng(11))}
    replacements = write_jsonl(out / "corpus" / "retrieval_edits.jsonl", encyclopedia(list(edits.values())))
    edited_val = build(out / "edited", [corpora["retrieval"], replacements], corpora["val"], index_from=out / "train")
    lap("replace the edited entries in the index, rebuild the held-out shards")
    after_edit = score_facts(model, edited_val, vocab, held, edits)
    generated, example = generated_capitals(model, out / "edited" / "index", held, edits)
    lap("score")

    results = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "steps": args.steps,
        "countries": args.entities,
        "held_out": args.held_out,
        "retrieval_model": asdict(retrieval),
        "no_retrieval_model": asdict(no_retrieval),
        "retrieval_model_after_edit": asdict(after_edit),
        "generated_capitals_after_edit": generated,
        "generation_example": example,
        "evaluation": str(evaluation),
        "seconds": seconds,
    }
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print(
        f"\nheld-out fact tokens ({retrieval.tokens}; {args.held_out} countries whose facts are only in the "
        f"encyclopedia), greedy accuracy after {args.steps} steps:\n"
        f"  retrieval model, with its neighbours   {retrieval.accuracy:.3f}"
        f"   (the fact among the neighbours read: {retrieval.in_neighbours:.3f})\n"
        f"  retrieval model, neighbours blanked    {retrieval.blanked:.3f}\n"
        f"  model trained without retrieval        {no_retrieval.accuracy:.3f}\n"
        f"  after the edit (new facts in the encyclopedia, the model unchanged): new facts "
        f"{after_edit.edited:.3f}, old facts {after_edit.accuracy:.3f}\n"
        f"  ratrain-generate after the edit, held-out capitals written as edited: {generated:.3f}\n"
        f"    e.g. {example}\n"
        f"  time: {sum(seconds.values()):.0f} s ({', '.join(f'{k} {v:.0f} s' for k, v in seconds.items())})"
    )


if __name__ == "__main__":
    main()
