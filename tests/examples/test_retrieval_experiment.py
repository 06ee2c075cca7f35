"""The retrieval experiment's generated world (examples/retrieval_experiment.py): what makes it
decisive is that every sentence is one chunk, the facts are where the stories say, and an edit
changes every held-out fact."""

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.unit

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "retrieval_experiment.py"
spec = importlib.util.spec_from_file_location("retrieval_experiment", SCRIPT)
experiment = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = experiment  # dataclasses look their module up while the script loads
spec.loader.exec_module(experiment)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("experiment")
    countries = experiment.invent_countries(60, np.random.default_rng(1))
    tokenizer = experiment.write_tokenizer(root / experiment.TOKENIZER_FILE, countries)
    corpora = experiment.write_corpora(root, countries, held_out=10)
    return countries, tokenizer, corpora


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_sentence_is_one_chunk_and_every_word_one_token(world):
    from tokenizers import Tokenizer

    countries, tokenizer_path, corpora = world
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    for name in ("retrieval", "train", "val"):
        for doc in read(corpora[name]):
            ids = tokenizer.encode(doc["text"]).ids
            assert len(ids) == experiment.SEQUENCE_TOKENS  # four chunks of m: one sequence per story
            assert tokenizer.token_to_id("[UNK]") not in ids and tokenizer.token_to_id("[PAD]") == 0


def test_held_out_facts_are_only_in_the_encyclopedia_and_each_story_states_its_country(world):
    countries, _, corpora = world
    held = {c.name for c in countries[-10:]}
    train = read(corpora["train"])
    assert len(train) == 50 and not any(doc["id"].split("/")[1] in held for doc in train)
    for doc, country in zip(read(corpora["val"]), countries[-10:]):
        chunks = [doc["text"].split()[i : i + experiment.CHUNK_TOKENS] for i in range(0, 64, experiment.CHUNK_TOKENS)]
        assert country.name in chunks[0] and not {country.capital, country.river, country.animal} & set(chunks[0])
        for chunk, kind in zip(chunks[1:], experiment.FACTS):  # a fact per chunk, in FACTS order
            assert country.fact(kind) in chunk and country.name in chunk
    entries = {doc["id"]: doc["text"].split() for doc in read(corpora["retrieval"])}
    assert all(c.capital in entries[f"entry/{c.name}"] for c in countries)


def test_an_edit_changes_every_fact_and_keeps_name_and_emblem(world):
    countries, _, _ = world
    edited = experiment.edited(countries[-10:], np.random.default_rng(2))
    for old, new in zip(countries[-10:], edited):
        assert (new.name, new.emblem) == (old.name, old.emblem)
        assert all(new.fact(kind) != old.fact(kind) for kind in experiment.FACTS)
