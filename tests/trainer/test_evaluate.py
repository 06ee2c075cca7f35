"""`ratrain-eval`: the copyable mask and overlap buckets per target (hand-made batches), the
scores' groups on synthetic and built shards, and a model trained to read its neighbours
losing its edge on the copyable targets when they are blanked."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.shards.rows import OVERLAP_BUCKETS, chunk_overlap, overlap_bucket
from schemas.evaluation import NO_CHUNK, VariantScores, evaluation_json, read_evaluation
from tests.trainer_fixtures import source_rows, write_checkpoint, write_shard_dir
from trainer import ShardDataset
from trainer.checkpoint import load_model
from trainer.evaluate import (
    NO_CHUNK_INDEX,
    NOT_BLANKED,
    Tally,
    copyable_mask,
    evaluate,
    main,
    target_overlap_buckets,
    token_scores,
)
from trainer.train import main as train_main
from trainer.train import next_token_loss

TINY = {"dim": 16, "depth": 2, "heads": 2, "encoder_depth": 1, "cca_layers": (1,)}


# -- per target: hand-made batches (m = 2, n = 6, k = 2, pad 0) --------------------------------

# Position p predicts token p + 1. Windows: p = 0 sees no neighbour; p = 1, 2 see chunk 0's;
# p = 3, 4 chunk 1's; p = 5 chunk 2's.
TOKENS = torch.tensor(
    [
        [10, 11, 12, 13, 14, 15, 16],
        [20, 21, 22, 0, 0, 0, 0],  # a pad tail: targets from p = 2 on are pad
    ]
)
NEIGHBOURS = torch.tensor(
    [
        [  # chunk 0 = [10, 11]; chunk 1 = [12, 13]; chunk 2 = [14, 15]
            [[12, 99, 0, 0], [0, 0, 0, 0]],  # 12: the target of p = 1
            [[13, 14, 0, 0], [15, 0, 0, 0]],  # 14, 15: targets of p = 3, 4; 13 (p = 2's) is in no window of p = 2
            [[11, 0, 0, 0], [0, 0, 0, 0]],  # 11: the target of p = 0, which sees no neighbour
        ],
        [
            [[21, 22, 0, 0], [0, 0, 0, 0]],  # 21: p = 0's target (sees none), 22: p = 1's
            [[0, 0, 0, 0], [0, 0, 0, 0]],  # pad neighbours match no pad target
            [[20, 21, 22, 0], [0, 0, 0, 0]],
        ],
    ]
)


@pytest.mark.unit
def test_a_target_is_copyable_when_it_is_in_the_neighbours_its_position_attends_to():
    copyable = copyable_mask(TOKENS[:, 1:], NEIGHBOURS, chunk_tokens=2, pad_id=0)
    assert copyable.tolist() == [
        [False, True, False, True, True, False],
        [False, True, False, False, False, False],
    ]


@pytest.mark.unit
def test_each_target_takes_the_overlap_bucket_of_the_chunk_that_holds_it():
    # r(C) against each chunk's own neighbours: row 0's chunk 1 = [12, 13] shares 13 (0.5), its
    # chunks 0 and 2 share nothing (0); row 1's chunk 0 = [20, 21] shares 21 (0.5), chunk 1 =
    # [22, 0] has pad neighbours only and chunk 2 is all pad (0). Target p + 1 is in chunk
    # (p + 1) // m; the last one (token n) is in none.
    buckets = target_overlap_buckets(TOKENS, NEIGHBOURS, chunk_tokens=2, pad_id=0)
    index = {overlap_bucket(t): i for i, t in enumerate(OVERLAP_BUCKETS)}
    zero, half = index["0.0"], index["0.5"]
    assert buckets.tolist() == [
        [zero, half, half, zero, zero, NO_CHUNK_INDEX],
        [half, zero, zero, zero, zero, NO_CHUNK_INDEX],
    ]


@pytest.mark.unit
def test_token_scores_are_the_training_loss_per_target(tmp_path):
    config = {"vocab_size": 100, "sequence_tokens": 6, "chunk_tokens": 2, **TINY}
    model = load_model(str(write_checkpoint(tmp_path / "ckpt.pt", **config)))
    batch = {"tokens": TOKENS, "neighbours": NEIGHBOURS}
    scores = token_scores(model, batch, blank=False)
    with torch.no_grad():
        logits = model(TOKENS[:, :-1], NEIGHBOURS)
    targets = TOKENS[:, 1:]
    assert scores.scored.tolist() == (targets != 0).tolist()
    assert float(scores.loss.sum() / scores.scored.sum()) == pytest.approx(
        float(next_token_loss(logits, targets, pad_id=0)), rel=1e-5
    )
    assert scores.correct.tolist() == ((logits.argmax(-1) == targets) & (targets != 0)).tolist()
    blanked = token_scores(model, batch, blank=True)
    assert torch.allclose(blanked.loss, token_scores_without_neighbours(model, batch), atol=1e-5)
    assert torch.equal(blanked.copyable, scores.copyable)  # the groups come from the shard, not the pass
    assert torch.equal(blanked.loss[:, :1], scores.loss[:, :1])  # p < m - 1 sees no neighbour either way

    facts = Tally()  # a script's own choice of positions
    facts.add(scores, torch.tensor([[False, True, False, False, False, True], [True, True, True, False, False, False]]))
    chosen = [(0, 1), (0, 5), (1, 0), (1, 1)]  # (1, 2) has a pad target
    assert facts.score().tokens == 4
    assert facts.score().mean_loss == pytest.approx(float(sum(scores.loss[i, p] for i, p in chosen)) / 4, rel=1e-6)


@torch.no_grad()
def token_scores_without_neighbours(model, batch) -> torch.Tensor:
    logits = model(batch["tokens"][:, :-1], None)
    targets = batch["tokens"][:, 1:]
    return next_token_loss(logits, targets, pad_id=0, reduction="none").view(targets.shape)


# -- a whole evaluation ---------------------------------------------------------------------


def assert_groups_add_up(variant: VariantScores, threshold: float) -> None:
    """copyable + not copyable = all; the buckets (NO_CHUNK included) = all; low overlap = the
    buckets at or below its threshold; each mean is the count-weighted mean of its parts."""
    assert variant.copyable.tokens + variant.not_copyable.tokens == variant.all.tokens > 0
    names = [b.bucket for b in variant.overlap_buckets]
    assert names == [overlap_bucket(t) for t in OVERLAP_BUCKETS] + [NO_CHUNK]
    assert sum(b.score.tokens for b in variant.overlap_buckets) == variant.all.tokens
    low = [b.score.tokens for b in variant.overlap_buckets if b.bucket != NO_CHUNK and float(b.bucket) <= threshold]
    assert variant.low_overlap.tokens == sum(low)
    for whole, parts in (
        (variant.all, [variant.copyable, variant.not_copyable]),
        (variant.all, [b.score for b in variant.overlap_buckets]),
    ):
        assert whole.mean_loss == pytest.approx(weighted_mean([(p.tokens, p.mean_loss) for p in parts]), rel=1e-9)
        assert whole.accuracy == pytest.approx(weighted_mean([(p.tokens, p.accuracy) for p in parts]), rel=1e-9)
    for score in (variant.all, variant.copyable, variant.not_copyable, *(b.score for b in variant.overlap_buckets)):
        assert (score.mean_loss is None) == (score.accuracy is None) == (score.tokens == 0)


def weighted_mean(parts: list[tuple[int, float | None]]) -> float:
    """The mean over every target of (count, mean) parts; an empty part has no mean."""
    present = [(count, mean) for count, mean in parts if count]
    return sum(count * mean for count, mean in present) / sum(count for count, _ in present)


@pytest.fixture(scope="module")
def padded_shards(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("padded")
    write_shard_dir(directory, shard_rows=[7, 6], vocab_size=64, pad_tails=True, seed=5)
    return directory


@pytest.mark.unit
def test_the_json_holds_every_group_and_its_counts_add_up(padded_shards, tmp_path, capsys):
    checkpoint = write_checkpoint(
        tmp_path / "ckpt.pt", step=12, vocab_size=64, sequence_tokens=16, chunk_tokens=4, **TINY
    )
    out = tmp_path / "scores" / "eval.json"
    main(["--checkpoint", str(checkpoint), "--shards", str(padded_shards), "--json", str(out), "--batch-size", "5"])
    printed = capsys.readouterr().out
    assert "low overlap: r ≤ 0.125 (report this)" in printed and f"scores: {out}" in printed
    evaluation = read_evaluation(out.read_text())
    assert (evaluation.step, evaluation.sequences, evaluation.retrieval) == (12, 13, True)
    assert (evaluation.checkpoint, evaluation.shards) == (str(checkpoint), str(padded_shards))
    rows = source_rows(padded_shards)
    targets = sum(int((row["tokens"][1:] != 0).sum()) for row in rows.values())
    for variant in (evaluation.with_neighbours, evaluation.blanked):
        assert variant is not None and variant.all.tokens == targets
        assert_groups_add_up(variant, evaluation.low_overlap_threshold)
    blanked = evaluation.blanked
    assert [b.score.tokens for b in blanked.overlap_buckets] == [
        b.score.tokens for b in evaluation.with_neighbours.overlap_buckets
    ]
    gain = evaluation.retrieval_gain
    assert gain.all == pytest.approx(blanked.all.mean_loss - evaluation.with_neighbours.all.mean_loss)
    # the shards' neighbour 0 is the next chunk: every non-pad target after the first window is copyable
    assert evaluation.with_neighbours.copyable.tokens == sum(
        int((row["tokens"][4:] != 0).sum()) for row in rows.values()
    )

    main(["--checkpoint", str(checkpoint), "--shards", str(padded_shards), "--max-sequences", "6", "--batch-size", "4"])
    assert "6 sequences of" in capsys.readouterr().out


@pytest.mark.unit
def test_a_model_without_retrieval_has_no_blanked_variant_and_says_so(padded_shards, tmp_path):
    checkpoint = write_checkpoint(
        tmp_path / "ckpt.pt", vocab_size=64, sequence_tokens=16, chunk_tokens=4, retrieval=False, **TINY
    )
    evaluation = evaluate(str(checkpoint), str(padded_shards))
    assert not evaluation.retrieval and evaluation.blanked is None and evaluation.retrieval_gain is None
    assert evaluation.blanked_note == NOT_BLANKED and "no blanked variant" in NOT_BLANKED
    assert_groups_add_up(evaluation.with_neighbours, evaluation.low_overlap_threshold)
    assert json.loads(evaluation_json(evaluation))["blanked"] is None
    with pytest.raises(ValueError, match="nothing to blank"):
        token_scores(load_model(str(checkpoint)), {"tokens": TOKENS, "neighbours": NEIGHBOURS}, blank=True)


@pytest.mark.unit
def test_shards_the_model_cannot_read_stop_with_one_line(padded_shards, tmp_path):
    other_chunks = write_checkpoint(tmp_path / "m8.pt", vocab_size=64, sequence_tokens=16, chunk_tokens=8, **TINY)
    with pytest.raises(SystemExit, match=r"ratrain-eval: error: .*hold n=16, m=4; the model takes m=8"):
        main(["--checkpoint", str(other_chunks), "--shards", str(padded_shards)])
    small_vocabulary = write_checkpoint(tmp_path / "v30.pt", vocab_size=30, sequence_tokens=16, chunk_tokens=4, **TINY)
    with pytest.raises(SystemExit, match=r"token id \d+ is outside the model's vocabulary of 30"):
        main(["--checkpoint", str(small_vocabulary), "--shards", str(padded_shards)])
    with pytest.raises(SystemExit, match="no such checkpoint"):
        main(["--checkpoint", str(tmp_path / "missing.pt"), "--shards", str(padded_shards)])


@pytest.mark.e2e
def test_on_built_shards_every_target_is_grouped_as_a_reference_loop_groups_it(built_output, tmp_path):
    root, _, _ = built_output
    shards = root / "out" / "shards"
    dataset = ShardDataset(str(shards), shuffle=False, batch_size=16, batched=True)
    m, pad = dataset.chunk_tokens, dataset.pad_id
    checkpoint = write_checkpoint(
        tmp_path / "ckpt.pt", vocab_size=30522, sequence_tokens=dataset.sequence_tokens, chunk_tokens=m, **TINY
    )
    out = tmp_path / "eval.json"
    # the first 16 sequences: enough for several r(C) buckets, and a 30522-token head is slow on a CPU
    main(["--checkpoint", str(checkpoint), "--shards", str(shards), "--json", str(out), "--max-sequences", "16"])
    evaluation = read_evaluation(out.read_text())
    first = next(iter(dataset))
    rows = list(zip(first["tokens"].numpy(), first["neighbours"].numpy()))
    assert evaluation.sequences == len(rows) == 16

    # The reference: position by position, the neighbours of chunk (p + 1) // m - 1 and the r(C)
    # of chunk (p + 1) // m.
    copyable, buckets = 0, dict.fromkeys([*(overlap_bucket(t) for t in OVERLAP_BUCKETS), NO_CHUNK], 0)
    for tokens, neighbours in rows:
        chunks = len(neighbours)
        ratios = chunk_overlap(tokens[: chunks * m].reshape(chunks, m), neighbours, pad)
        for p in range(chunks * m):
            target = tokens[p + 1]
            if target == pad:
                continue
            seen = set(neighbours[(p + 1) // m - 1].ravel().tolist()) - {pad} if p >= m - 1 else set()
            copyable += int(target) in seen
            holder = (p + 1) // m
            buckets[NO_CHUNK if holder == chunks else overlap_bucket(ratios[holder])] += 1
    for variant in (evaluation.with_neighbours, evaluation.blanked):
        assert variant is not None
        assert_groups_add_up(variant, evaluation.low_overlap_threshold)
        assert variant.copyable.tokens == copyable
        assert {b.bucket: b.score.tokens for b in variant.overlap_buckets} == buckets
    assert 0 < copyable < evaluation.with_neighbours.all.tokens
    assert sum(count > 0 for name, count in buckets.items() if name != NO_CHUNK) >= 2  # real shards: several buckets


@pytest.mark.e2e
def test_blanking_the_neighbours_of_a_model_trained_to_read_them_raises_the_loss_on_copyable_targets(tmp_path, capsys):
    """Random tokens: nothing before a target predicts it, and neighbour 0 of each chunk is the
    next chunk with its continuation. A tiny model trained 200 steps learns to copy from its
    neighbours; on held-out shards, blanking them costs the copyable targets nats, and the
    first window's targets (which see no neighbour) nothing."""
    train, held_out = tmp_path / "train", tmp_path / "held_out"
    vocab = 32
    write_shard_dir(train, shard_rows=[256, 256], vocab_size=vocab, random_tokens=True, seed=3)
    write_shard_dir(held_out, shard_rows=[32], vocab_size=vocab, random_tokens=True, seed=4, first_seq_id=5000)
    checkpoint = tmp_path / "ckpt.pt"
    train_main(
        ["--shards", str(train), "--steps", "200", "--batch-size", "32", "--lr", "1e-2", "--log-every", "200"]
        + ["--vocab-size", str(vocab), "--dim", "32", "--depth", "2", "--heads", "2", "--encoder-depth", "1"]
        + ["--cca-layers", "0,1", "--checkpoint", str(checkpoint)]
    )
    out = tmp_path / "eval.json"
    main(["--checkpoint", str(checkpoint), "--shards", str(held_out), "--json", str(out)])
    evaluation = read_evaluation(out.read_text())
    with_, blanked, gain = evaluation.with_neighbours, evaluation.blanked, evaluation.retrieval_gain
    assert blanked is not None and gain is not None and evaluation.step == 200
    chance = math.log(vocab - 1)
    assert with_.copyable.mean_loss < chance - 0.5, with_.copyable  # it reads its neighbours
    assert gain.copyable > 1.0, (with_.copyable, blanked.copyable)
    assert with_.copyable.accuracy > blanked.copyable.accuracy + 0.1
    # the not-copyable targets are the first window's (p < m - 1), the same logits either way
    assert with_.not_copyable.tokens == 32 * 3 and gain.not_copyable == pytest.approx(0.0, abs=1e-5)
    assert np.isfinite(with_.not_copyable.mean_loss)
