"""`ratrain-generate`: continue a prompt with a trained RETRO model, retrieving from a committed
index as the text grows.

    ratrain-generate --checkpoint ckpt.pt --index out/quickstart/index --prompt "Python is" \
        --max-tokens 64 --show-neighbours

The prompt is tokenized with the index's tokenizer. Retrieval is RETRO's, chunk by chunk: each
time a chunk of m tokens completes (in the prompt or in the continuation) its neighbours are
retrieved (`pipeline.retrieve.online.Retriever`, nothing excluded), and from then on the model
sees them at that chunk's place in neighbours [1, c, k, 2m] (the chunk still being written gets
padding): chunked cross-attention gives chunk u's neighbours to positions (u+1)·m - 1 onwards
(trainer/model.py). Greedy by default; --top-p samples from the smallest set of tokens whose
probability reaches P, at --temperature, seeded by --seed. pad_id is never generated.

Beyond the model's sequence_tokens the window slides by whole chunks: the input is the last
chunks that fit (positions restart at 0 with the window, as in training, where a sequence
starts at a chunk boundary), so the chunks and their neighbours stay aligned.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import numpy as np
import torch

from trainer.checkpoint import CheckpointError, load_model
from trainer.model import Retro, RetroConfig


class GenerateError(ValueError):
    """A model and an index that do not fit together, or a prompt that cannot be continued;
    main prints it as one line."""


@dataclass(frozen=True)
class Retrieved:
    """One chunk of the text and the neighbours retrieved for it."""

    chunk: int  # its number in the text (prompt + continuation), from 0
    tokens: np.ndarray  # int32 [m]
    neighbours: np.ndarray  # int32 [k, 2m]
    ids: np.ndarray  # int64 [k], -1 = absent
    scores: np.ndarray  # float32 [k]


@dataclass(frozen=True)
class Generation:
    prompt: list[int]
    continuation: list[int]
    retrieved: list[Retrieved]  # every chunk completed before the last token was chosen, in order


def check_fits(config: RetroConfig, retriever) -> None:
    """The model reads the index's tokens in the index's chunks, or GenerateError naming both."""
    if config.chunk_tokens != retriever.chunk_tokens:
        raise GenerateError(
            f"the model takes chunks of {config.chunk_tokens} tokens, the index holds chunks of "
            f"{retriever.chunk_tokens}: generate with an index of the shards the model was trained on"
        )
    if retriever.vocab_size > config.vocab_size:
        raise GenerateError(
            f"the index's tokenizer has {retriever.vocab_size} tokens, the model's vocabulary {config.vocab_size}"
        )
    if config.pad_id != retriever.pad_id:
        raise GenerateError(f"the model's pad_id is {config.pad_id}, the index's {retriever.pad_id}")


def window_start(length: int, sequence_tokens: int, chunk_tokens: int) -> int:
    """The first token of the input window: 0 while the text fits, else the first chunk boundary
    that leaves at most sequence_tokens."""
    over = max(0, length - sequence_tokens)
    return chunk_tokens * -(-over // chunk_tokens)


def choose_token(logits: torch.Tensor, top_p: float | None, temperature: float, generator) -> int:
    """Greedy (top_p None), or a sample from the smallest set of most probable tokens whose
    probability reaches top_p (the most probable always in it)."""
    if top_p is None:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    ordered, order = torch.sort(probs, descending=True)
    ordered = ordered * (torch.cumsum(ordered, dim=0) - ordered < top_p)
    return int(order[torch.multinomial(ordered / ordered.sum(), 1, generator=generator)])


def generate(
    model: Retro,
    retriever,
    prompt: list[int],
    *,
    max_tokens: int,
    top_p: float | None = None,
    temperature: float = 1.0,
    seed: int = 0,
) -> Generation:
    """`max_tokens` tokens after `prompt` (module docstring: retrieval, sampling, the window)."""
    if not prompt:
        raise GenerateError("the prompt holds no tokens")
    config = model.config
    check_fits(config, retriever)
    m, k, pad = config.chunk_tokens, retriever.neighbours, config.pad_id
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    tokens, retrieved = list(prompt), list[Retrieved]()
    for _ in range(max_tokens):
        while (len(retrieved) + 1) * m <= len(tokens):  # chunks completed since the last token
            number = len(retrieved)
            chunk = np.array(tokens[number * m : (number + 1) * m], np.int32)
            found = retriever.retrieve(chunk)
            retrieved.append(Retrieved(number, chunk, found.tokens[0], found.ids[0], found.scores[0]))
        start = window_start(len(tokens), config.sequence_tokens, m)
        window = tokens[start:]
        chunks = -(-len(window) // m)
        inputs = torch.full((1, chunks * m), pad, dtype=torch.long)
        inputs[0, : len(window)] = torch.tensor(window)
        neighbours = torch.full((1, chunks, k, 2 * m), pad, dtype=torch.long)
        for done in retrieved[start // m :]:
            neighbours[0, done.chunk - start // m] = torch.from_numpy(done.neighbours.astype(np.int64))
        with torch.no_grad():
            logits = model(inputs.to(device), neighbours.to(device))[0, len(window) - 1].cpu()
        logits[pad] = float("-inf")
        tokens.append(choose_token(logits, top_p, temperature, generator))
    return Generation(list(prompt), tokens[len(prompt) :], retrieved)


def neighbour_lines(generation: Generation, retriever) -> list[str]:
    """Per retrieved chunk, its text and the texts of the neighbours the model was given."""
    lines = []
    for done in generation.retrieved:
        lines.append(f"chunk {done.chunk}: {retriever.decode(done.tokens)}")
        for slot, (chunk_id, score, tokens) in enumerate(zip(done.ids, done.scores, done.neighbours)):
            text = retriever.decode(tokens) if chunk_id >= 0 else "(none)"
            lines.append(f"  neighbour {slot} (chunk {chunk_id}, score {score:.4f}): {text}")
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ratrain-generate", description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="a ratrain-train checkpoint")
    parser.add_argument("--index", required=True, help="a committed index directory (<output>/index)")
    parser.add_argument(
        "--index-commit", type=int, metavar="N", help="read commit N of --index, while it is kept (default: its newest)"
    )
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default: 64)")
    parser.add_argument("--top-p", type=float, default=None, help="sample from this top-p mass (default: greedy)")
    parser.add_argument("--temperature", type=float, default=None, help="with --top-p (default: 1.0)")
    parser.add_argument("--seed", type=int, default=None, help="with --top-p (default: 0)")
    parser.add_argument("--show-neighbours", action="store_true", help="print each retrieved chunk's neighbours")
    parser.add_argument("--device", default="cpu", help="torch device of the model and the encoder (default: cpu)")
    args = parser.parse_args(argv)
    if args.max_tokens < 0:
        parser.error("--max-tokens must be at least 0")
    if args.top_p is None and (args.temperature is not None or args.seed is not None):
        parser.error("--temperature and --seed apply to sampling: give --top-p too")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        parser.error("--top-p must be in (0, 1]")
    if args.temperature is not None and args.temperature <= 0:
        parser.error("--temperature must be above 0")
    return args


def main(argv: list[str] | None = None) -> None:
    from pipeline.common.errors import StageError
    from pipeline.retrieve.online import IndexNotUsable, Retriever

    args = parse_args(argv)
    try:
        model = load_model(args.checkpoint, args.device)
        retriever = Retriever.open(args.index, device=args.device, commit=args.index_commit)
        prompt = retriever.tokenize(args.prompt).tolist()
        generation = generate(
            model,
            retriever,
            prompt,
            max_tokens=args.max_tokens,
            top_p=args.top_p,
            temperature=1.0 if args.temperature is None else args.temperature,
            seed=0 if args.seed is None else args.seed,
        )
    except (CheckpointError, GenerateError, IndexNotUsable, StageError) as err:
        sys.exit(f"ratrain-generate: error: {err}")
    print(retriever.decode(generation.continuation))
    if args.show_neighbours:
        print("\n".join(neighbour_lines(generation, retriever)))


if __name__ == "__main__":
    main()
