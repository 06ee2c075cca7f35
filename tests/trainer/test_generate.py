"""ratrain-generate on a tiny untrained RETRO model against the built sample index: each
completed chunk gets the retriever's neighbours, fed at that chunk's place (checked against the
model run by hand, past the window's slide), greedy is deterministic, and a model whose chunks
differ from the index's is refused."""

from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.retrieve.online import Retriever
from tests.helpers import sample_documents
from trainer.checkpoint import load_model
from trainer.generate import GenerateError, generate, main, window_start
from trainer.model import Retro, RetroConfig

pytestmark = pytest.mark.e2e

PROMPT_TOKENS, MAX_TOKENS = 100, 40  # 140 tokens: past sequence_tokens (128), so the window slides


@pytest.fixture(scope="module")
def retriever(built_output):
    _, config, _ = built_output
    return Retriever.open(str(Path(config["output"]) / "index"))


def tiny_checkpoint(path: Path, retriever, chunk_tokens: int) -> Path:
    """A checkpoint as ratrain-train writes it (model and model_config) of a tiny random model
    whose next token depends on the neighbours it is given."""
    config = RetroConfig(
        vocab_size=retriever.vocab_size,
        sequence_tokens=128,
        chunk_tokens=chunk_tokens,
        dim=16,
        depth=2,
        heads=2,
        cca_layers=(0, 1),
        encoder_depth=1,
        pad_id=retriever.pad_id,
    )
    torch.manual_seed(0)
    model = Retro(config)
    for parameter in model.parameters():  # weights far from init's 0.02: every neighbour token moves the logits
        torch.nn.init.normal_(parameter, std=1.0)
    torch.save({"model": model.state_dict(), "model_config": asdict(config), "step": 0}, path)
    return path


def prompt_text() -> str:
    return sample_documents(1, start=3)[0]["text"]


def by_hand(model, retriever, tokens: list[int]) -> int:
    """The greedy next token after `tokens`, the model run directly: the window of whole chunks
    that fits, each complete chunk with the retriever's neighbours of it, the rest padding."""
    m, n, pad = model.config.chunk_tokens, model.config.sequence_tokens, model.config.pad_id
    start = window_start(len(tokens), n, m)
    window = tokens[start:]
    chunks = -(-len(window) // m)
    inputs = torch.full((1, chunks * m), pad)
    inputs[0, : len(window)] = torch.tensor(window)
    neighbours = torch.full((1, chunks, retriever.neighbours, 2 * m), pad)
    for u in range(len(window) // m):
        neighbours[0, u] = torch.from_numpy(retriever.retrieve(np.array(window[u * m : (u + 1) * m])).tokens[0])
    with torch.no_grad():
        logits = model(inputs, neighbours)[0, len(window) - 1]
    logits[pad] = float("-inf")
    return int(torch.argmax(logits))


def test_generation_retrieves_each_completed_chunk_and_feeds_its_neighbours(retriever, tmp_path):
    model = load_model(str(tiny_checkpoint(tmp_path / "ckpt.pt", retriever, retriever.chunk_tokens)))
    prompt = retriever.tokenize(prompt_text())[:PROMPT_TOKENS].tolist()
    assert len(prompt) == PROMPT_TOKENS
    generation = generate(model, retriever, prompt, max_tokens=MAX_TOKENS)
    text = prompt + generation.continuation
    m = retriever.chunk_tokens
    assert len(generation.continuation) == MAX_TOKENS and retriever.pad_id not in generation.continuation
    assert [r.chunk for r in generation.retrieved] == list(range((len(text) - 1) // m))
    for done in generation.retrieved:
        expected = retriever.retrieve(np.array(text[done.chunk * m : (done.chunk + 1) * m]))
        assert done.tokens.tolist() == text[done.chunk * m : (done.chunk + 1) * m]
        assert np.array_equal(done.ids, expected.ids[0]) and np.array_equal(done.neighbours, expected.tokens[0])
    assert (generation.retrieved[0].ids >= 0).all()
    assert generation.continuation[0] == by_hand(model, retriever, prompt)
    assert window_start(len(text) - 1, model.config.sequence_tokens, m) == m  # the last token came from a slid window
    assert generation.continuation[-1] == by_hand(model, retriever, text[:-1])
    again = generate(model, retriever, prompt, max_tokens=MAX_TOKENS)
    assert again.continuation == generation.continuation  # greedy repeats


def test_a_model_of_other_chunks_than_the_index_is_refused(retriever, tmp_path):
    model = load_model(str(tiny_checkpoint(tmp_path / "ckpt.pt", retriever, retriever.chunk_tokens // 2)))
    with pytest.raises(GenerateError, match=rf"chunks of {retriever.chunk_tokens // 2} tokens.*chunks of 32"):
        generate(model, retriever, [1, 2, 3], max_tokens=4)


def test_ratrain_generate_prints_the_continuation_and_the_neighbours_it_used(retriever, built_output, tmp_path, capsys):
    _, config, _ = built_output
    checkpoint = tiny_checkpoint(tmp_path / "ckpt.pt", retriever, retriever.chunk_tokens)
    argv = ["--checkpoint", str(checkpoint), "--index", str(Path(config["output"]) / "index")]
    main([*argv, "--prompt", prompt_text(), "--max-tokens", "6", "--show-neighbours"])
    lines = capsys.readouterr().out.splitlines()
    prompt = retriever.tokenize(prompt_text()).tolist()
    expected = generate(load_model(str(checkpoint)), retriever, prompt, max_tokens=6)
    assert lines[0] == retriever.decode(expected.continuation)
    m, first = retriever.chunk_tokens, retriever.retrieve(np.array(prompt[: retriever.chunk_tokens]))
    assert lines[1] == f"chunk 0: {retriever.decode(prompt[:m])}"
    for slot in range(retriever.neighbours):
        text = retriever.decode(first.tokens[0, slot])
        assert (
            lines[2 + slot]
            == f"  neighbour {slot} (chunk {first.ids[0, slot]}, score {first.scores[0, slot]:.4f}): {text}"
        )
    assert sum(line.startswith("chunk ") for line in lines) == len(expected.retrieved) == (len(prompt) + 5) // m
    with pytest.raises(SystemExit):
        main([*argv, "--prompt", "x", "--seed", "1"])
    assert "--temperature and --seed apply to sampling: give --top-p too" in capsys.readouterr().err
