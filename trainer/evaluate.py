"""`ratrain-eval`: score a checkpoint on a shard directory, per next-token target.

    ratrain-eval --checkpoint ckpt.pt --shards out/val/shards --json out/eval.json

Reads the shards in manifest order (no shuffling) and scores every target that is not pad
(position p predicts token p + 1) twice: with the shards' neighbours, and with every neighbour
blanked (all pad: the model attends to none; a model without retrieval has no blanked pass).
Mean loss (nats) and accuracy (argmax = target) are reported for all targets; for the
*copyable* targets (the target occurs among the neighbour tokens the position attends to) and
the rest; and by r(C), the chunk-overlap bucket of the chunk that contains the target token.
The loss to report for a model is the one on low-overlap chunks (r(C) <= 0.125): there the
neighbours do not hold the chunk's own text, so the score is not inflated by leakage (RETRO,
Borgeaud et al. 2021, section 2.6). The JSON's fields are schemas/evaluation.py's.

`token_scores(model, batch, blank)` gives the per-position scores behind these numbers, for
scoring chosen positions from a script:

    trained = read_checkpoint("ckpt.pt")
    dataset = ShardDataset("shards", shuffle=False, batch_size=8, batched=True)
    facts = Tally()
    for batch in dataset:
        scores = token_scores(trained.model, batch, blank=False)
        facts.add(scores, my_positions(batch))  # bool [b, n]: True where tokens[:, p + 1] is a fact token
    print(facts.score())  # GroupScore(tokens=..., mean_loss=..., accuracy=...)
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field

import torch

from pipeline.shards.rows import OVERLAP_BUCKETS, chunk_overlap, overlap_bucket, overlap_ranges
from schemas.arrow import SchemaVersionError
from schemas.evaluation import (
    NO_CHUNK,
    BucketScore,
    Evaluation,
    GroupScore,
    RetrievalGain,
    ScoreRow,
    SourceScore,
    VariantScores,
    evaluation_json,
    score_rows,
)
from trainer.checkpoint import CheckpointError, read_checkpoint
from trainer.dataset import ShardDataError, ShardDataset
from trainer.model import Retro
from trainer.train import next_token_loss

#: The low-overlap chunks whose loss a model is reported by: r(C) at most this (8 of 64 tokens).
LOW_OVERLAP = OVERLAP_BUCKETS[1]
#: `TokenScores.overlap_bucket` of a target in no chunk of its sequence (the last one, token n).
NO_CHUNK_INDEX = len(OVERLAP_BUCKETS)
_BUCKET_INDEX = {overlap_bucket(threshold): i for i, threshold in enumerate(OVERLAP_BUCKETS)}

BLANKED = "every neighbour replaced by pad: the model attends to none"
NOT_BLANKED = (
    "the model has no retrieval (trained with --no-retrieval, or without CCA blocks): it reads no "
    "neighbours, so there is no blanked variant"
)


class EvaluateError(ValueError):
    """Shards the checkpoint's model cannot score; main prints it as one line."""


@dataclass(frozen=True, kw_only=True)
class TokenScores:
    """Scores of a batch per position p, whose target is tokens[:, p + 1]; all [b, n], on the CPU."""

    loss: torch.Tensor  # float32: cross-entropy of the target (0 where the target is pad)
    predicted: torch.Tensor  # int64: the logits' argmax, the token a greedy reader would write
    correct: torch.Tensor  # bool: the logits' argmax is the target (False where the target is pad)
    scored: torch.Tensor  # bool: the target is not pad
    copyable: torch.Tensor  # bool: the target occurs in the shard's neighbours the position attends to
    overlap_bucket: torch.Tensor  # int64: index in OVERLAP_BUCKETS of the r(C) of the chunk holding the target


def copyable_mask(targets: torch.Tensor, neighbours: torch.Tensor, chunk_tokens: int, pad_id: int) -> torch.Tensor:
    """targets [b, n], neighbours [b, n/m, k, 2m] -> bool [b, n]: whether the target of position
    p occurs among the neighbour tokens (pad excluded) that p attends to through CCA. Position p
    sees the neighbours of chunk u = (p + 1) // m - 1 (window u is positions (u+1)·m - 1 ...
    (u+2)·m - 2, trainer/model.py ChunkedCrossAttention); positions below m - 1 see none."""
    (b, n), m, shift = targets.shape, chunk_tokens, chunk_tokens - 1
    chunks = neighbours.shape[1]
    # Window u holds the targets of positions u·m + shift ... u·m + shift + m - 1; the last one
    # runs past the end and is filled with pad, which matches nothing.
    windows = torch.cat([targets[:, shift:], targets.new_full((b, shift), pad_id)], dim=1).reshape(b, chunks, m)
    seen = neighbours.reshape(b, chunks, 1, -1)  # [b, c, 1, k·2m]
    # A non-pad target never equals a pad neighbour token, so pad is left out by the second term.
    found = (windows[..., None] == seen).any(dim=-1) & (windows != pad_id)  # [b, c, m]
    return torch.cat([found.new_zeros((b, shift)), found.reshape(b, n)[:, : n - shift]], dim=1)


def target_overlap_buckets(tokens: torch.Tensor, neighbours: torch.Tensor, chunk_tokens: int, pad_id: int):
    """tokens [b, n + 1], neighbours [b, n/m, k, 2m] -> int64 [b, n]: for position p, the index
    in OVERLAP_BUCKETS of r(C) of the chunk that contains its target token p + 1, chunk
    (p + 1) // m, measured as the shards' overlap audit measures it (the chunk against its own
    neighbours); NO_CHUNK_INDEX for the last position, whose target (token n) is in no chunk."""
    b, chunks, k, r = neighbours.shape
    m = chunk_tokens
    ratios = chunk_overlap(
        tokens[:, : chunks * m].reshape(b * chunks, m).numpy(),
        neighbours.reshape(b * chunks, k, r).numpy(),
        pad_id,
    )
    chunk_bucket = torch.tensor([_BUCKET_INDEX[overlap_bucket(ratio)] for ratio in ratios]).reshape(b, chunks)
    chunk_bucket = torch.cat([chunk_bucket, chunk_bucket.new_full((b, 1), NO_CHUNK_INDEX)], dim=1)
    holder = torch.arange(1, chunks * m + 1) // m  # [n]: chunk of each position's target; n // m = none
    return chunk_bucket[:, holder]


@torch.no_grad()
def token_scores(
    model: Retro, batch: dict[str, torch.Tensor], blank: bool, same_batch: TokenScores | None = None
) -> TokenScores:
    """Score a batch of shard rows (ShardDataset's batched dict: tokens [b, n + 1], neighbours
    [b, n/m, k, 2m]) on the model's device. blank: the model sees every neighbour as pad; the
    copyable mask and the overlap buckets still come from the shard's neighbours, so the two
    passes score the same groups of targets (`same_batch`: another pass's scores of this batch,
    whose groups are taken instead of measured again)."""
    config = model.config
    if blank and not config.uses_retrieval:
        raise ValueError("the model has no retrieval: it reads no neighbours, so there is nothing to blank")
    device = next(model.parameters()).device
    tokens, neighbours = batch["tokens"].cpu(), batch["neighbours"].cpu()  # the masks are made on the CPU
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    seen = None
    if config.uses_retrieval:
        seen = torch.full_like(neighbours, config.pad_id) if blank else neighbours
        seen = seen.to(device)
    logits = model(inputs.to(device), seen)  # [b, n, vocab]
    loss = next_token_loss(logits, targets.to(device), config.pad_id, reduction="none")
    scored = targets != config.pad_id
    predicted = logits.argmax(dim=-1).cpu()
    return TokenScores(
        loss=loss.view(targets.shape).float().cpu(),
        predicted=predicted,
        correct=(predicted == targets) & scored,
        scored=scored,
        copyable=copyable_mask(targets, neighbours, config.chunk_tokens, config.pad_id)
        if same_batch is None
        else same_batch.copyable,
        overlap_bucket=target_overlap_buckets(tokens, neighbours, config.chunk_tokens, config.pad_id)
        if same_batch is None
        else same_batch.overlap_bucket,
    )


@dataclass
class Tally:
    """Sums over batches of the scored targets at chosen positions."""

    tokens: int = 0
    loss_sum: float = 0.0
    correct: int = 0

    def add(self, scores: TokenScores, positions: torch.Tensor) -> None:
        """Count the targets at `positions` (bool [b, n]) that are not pad."""
        chosen = positions & scores.scored
        self.tokens += int(chosen.sum())
        self.loss_sum += float(scores.loss[chosen].double().sum())
        self.correct += int(scores.correct[chosen].sum())

    def score(self) -> GroupScore:
        if not self.tokens:
            return GroupScore(0, None, None)
        return GroupScore(self.tokens, self.loss_sum / self.tokens, self.correct / self.tokens)


@dataclass
class VariantTally:
    """The tallies of one pass (with neighbours, or blanked)."""

    all: Tally = field(default_factory=Tally)
    copyable: Tally = field(default_factory=Tally)
    not_copyable: Tally = field(default_factory=Tally)
    low_overlap: Tally = field(default_factory=Tally)
    buckets: list[Tally] = field(default_factory=lambda: [Tally() for _ in range(NO_CHUNK_INDEX + 1)])

    def add(self, scores: TokenScores, rows: torch.Tensor | None = None) -> None:
        """Count the targets of these scores (of `rows` alone, bool [b], where given)."""
        kept = scores.scored if rows is None else scores.scored & rows[:, None]
        self.all.add(scores, kept)
        self.copyable.add(scores, kept & scores.copyable)
        self.not_copyable.add(scores, kept & ~scores.copyable)
        self.low_overlap.add(scores, kept & (scores.overlap_bucket <= _BUCKET_INDEX[overlap_bucket(LOW_OVERLAP)]))
        for index, tally in enumerate(self.buckets):
            tally.add(scores, kept & (scores.overlap_bucket == index))

    def scores(self) -> VariantScores:
        names = [overlap_bucket(threshold) for threshold in OVERLAP_BUCKETS]
        ranges = overlap_ranges(names) + ["none: the target after the last chunk"]
        return VariantScores(
            all=self.all.score(),
            copyable=self.copyable.score(),
            not_copyable=self.not_copyable.score(),
            low_overlap=self.low_overlap.score(),
            overlap_buckets=[
                BucketScore(name, r_range, tally.score())
                for name, r_range, tally in zip([*names, NO_CHUNK], ranges, self.buckets)
            ],
        )


def retrieval_gain(with_neighbours: VariantScores, blanked: VariantScores) -> RetrievalGain:
    def gain(with_: GroupScore, blank: GroupScore) -> float | None:
        return ScoreRow("", with_, blank).gain

    return RetrievalGain(
        all=gain(with_neighbours.all, blanked.all),
        copyable=gain(with_neighbours.copyable, blanked.copyable),
        not_copyable=gain(with_neighbours.not_copyable, blanked.not_copyable),
        low_overlap=gain(with_neighbours.low_overlap, blanked.low_overlap),
    )


def _check_fits(model: Retro, dataset: ShardDataset) -> None:
    config = model.config
    if dataset.chunk_tokens != config.chunk_tokens or dataset.sequence_tokens > config.sequence_tokens:
        raise EvaluateError(
            f"{dataset.source}: the shards hold n={dataset.sequence_tokens}, m={dataset.chunk_tokens}; the model "
            f"takes m={config.chunk_tokens} and at most n={config.sequence_tokens}"
        )
    if dataset.pad_id != config.pad_id:
        raise EvaluateError(f"{dataset.source}: the shards pad with {dataset.pad_id}, the model with {config.pad_id}")


def _check_vocabulary(batch: dict[str, torch.Tensor], model: Retro, source: str) -> None:
    highest = max(int(batch["tokens"].max()), int(batch["neighbours"].max()))
    if highest >= model.config.vocab_size:
        raise EvaluateError(
            f"{source}: token id {highest} is outside the model's vocabulary of {model.config.vocab_size}"
        )


def evaluate(
    checkpoint: str,
    shards: str,
    *,
    batch_size: int = 8,
    max_sequences: int | None = None,
    device: str = "cpu",
    shards_commit: int | None = None,
) -> Evaluation:
    """Score the checkpoint's model on the shards (their newest commit, or `shards_commit`) in
    manifest order; the first `max_sequences`."""
    trained = read_checkpoint(checkpoint, device)
    model = trained.model
    dataset = ShardDataset(shards, shuffle=False, batch_size=batch_size, batched=True, commit=shards_commit)
    _check_fits(model, dataset)
    retrieval = model.config.uses_retrieval
    with_tally = VariantTally()
    blanked_tally = VariantTally() if retrieval else None
    names = [source.name for source in dataset.manifest.sources]  # a blend's: each scored on its own too
    by_source = [(VariantTally(), VariantTally() if retrieval else None) for _ in names]
    per_source = [0] * len(names)
    sequences = 0
    for batch in dataset:
        if max_sequences is not None:
            batch = {name: column[: max_sequences - sequences] for name, column in batch.items()}
        _check_vocabulary(batch, model, shards)
        scores = token_scores(model, batch, blank=False)
        with_tally.add(scores)
        blanked_scores = None
        if blanked_tally is not None:
            blanked_scores = token_scores(model, batch, blank=True, same_batch=scores)
            blanked_tally.add(blanked_scores)
        for number, (with_source, blanked_source) in enumerate(by_source):
            rows = batch["source"] == number
            per_source[number] += int(rows.sum())
            with_source.add(scores, rows)
            if blanked_source is not None and blanked_scores is not None:
                blanked_source.add(blanked_scores, rows)
        sequences += len(batch["tokens"])
        if sequences == max_sequences:
            break
    with_neighbours = with_tally.scores()
    blanked = None if blanked_tally is None else blanked_tally.scores()
    return Evaluation(
        checkpoint=checkpoint,
        step=trained.step,
        shards=shards,
        sequences=sequences,
        retrieval=retrieval,
        chunk_tokens=dataset.chunk_tokens,
        neighbours=dataset.neighbours,
        low_overlap_threshold=LOW_OVERLAP,
        with_neighbours=with_neighbours,
        blanked=blanked,
        retrieval_gain=None if blanked is None else retrieval_gain(with_neighbours, blanked),
        blanked_note=BLANKED if retrieval else NOT_BLANKED,
        sources=[
            SourceScore(
                name=name,
                sequences=count,
                with_neighbours=with_source.scores(),
                blanked=None if blanked_source is None else blanked_source.scores(),
            )
            for name, count, (with_source, blanked_source) in zip(names, per_source, by_source)
        ],
    )


def _number(value: float | None, digits: int = 4) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def summary_lines(evaluation: Evaluation) -> list[str]:
    """The scores as a text table: one line per group of targets."""
    lines = [
        f"checkpoint {evaluation.checkpoint} (step {evaluation.step}), {evaluation.sequences} sequences of "
        f"{evaluation.shards}; blanked: {evaluation.blanked_note}",
        f"{'targets':<36}{'count':>10}{'loss':>10}{'blanked':>10}{'gain':>10}{'acc':>8}{'blanked':>9}",
    ]
    for row in score_rows(evaluation):
        label = row.label + (" (report this)" if row.reported else "")
        lines.append(
            f"{label:<36}{row.with_neighbours.tokens:>10,}{_number(row.with_neighbours.mean_loss):>10}"
            f"{_number(row.blanked_loss):>10}{_number(row.gain):>10}"
            f"{_number(row.with_neighbours.accuracy, 3):>8}{_number(row.blanked_accuracy, 3):>9}"
        )
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="ratrain-eval",
        description="Score a checkpoint on a shard directory per next-token target (pad left out): mean loss and "
        "accuracy with the shards' neighbours and with every neighbour blanked, for all targets, the copyable ones "
        "(the target occurs among the neighbour tokens its position attends to) and the rest, and by r(C) of the "
        "chunk that holds the target token.",
        epilog="Report a model by its loss on low-overlap chunks (the 'low overlap: r ≤ 0.125' line, `low_overlap` "
        "in the JSON): there the neighbours do not hold the chunk's own text, so retrieval cannot win by copying "
        "leaked text. 'gain': loss blanked minus loss with neighbours.",
    )
    parser.add_argument("--checkpoint", required=True, metavar="FILE", help="a ratrain-train checkpoint")
    parser.add_argument(
        "--shards", required=True, metavar="DIR", help="shard directory (manifest.json + *.arrow), local or gs://"
    )
    parser.add_argument(
        "--shards-commit",
        type=int,
        metavar="N",
        help="read commit N of --shards, while it is kept (default: its newest)",
    )
    parser.add_argument("--json", metavar="OUT", help="also write the scores here as JSON (schemas/evaluation.py)")
    parser.add_argument("--batch-size", type=int, default=8, metavar="B", help="sequences per forward pass (default 8)")
    parser.add_argument("--max-sequences", type=int, metavar="N", help="score the first N sequences (default: all)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    args = parser.parse_args(argv)
    for flag, value in (("--batch-size", args.batch_size), ("--max-sequences", args.max_sequences)):
        if value is not None and value < 1:
            parser.error(f"{flag} must be at least 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        evaluation = evaluate(
            args.checkpoint,
            args.shards,
            batch_size=args.batch_size,
            max_sequences=args.max_sequences,
            device=args.device,
            shards_commit=args.shards_commit,
        )
    except (CheckpointError, ShardDataError, SchemaVersionError, EvaluateError) as err:
        sys.exit(f"ratrain-eval: error: {err}")
    for line in summary_lines(evaluation):
        print(line)
    if args.json:
        directory = os.path.dirname(args.json)
        if directory:
            os.makedirs(directory, exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(evaluation_json(evaluation))
        print(f"scores: {args.json}")


if __name__ == "__main__":
    main()
