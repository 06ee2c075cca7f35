"""The trainer as 2 ranks on CPU (gloo): partition, gradient averaging, rank-0 output, per-rank resume.

The uninterrupted run is launched with torch.multiprocessing (each process sets the variables
torchrun would, calls `train` and saves its replica); the interrupted and resumed runs with
torchrun itself, as people launch it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.helpers import REPO, free_port
from tests.trainer_fixtures import write_shard_dir
from trainer import ShardDataset
from trainer.model import Retro, RetroConfig
from trainer.options import parse_args
from trainer.train import accumulate_gradients, main, train

pytestmark = pytest.mark.e2e  # 2 training processes (torch.multiprocessing, torchrun)

SEQUENCES = 121  # rank streams of 60 and 61: the ranks reach an epoch's end at different steps
MODEL = ["--vocab-size", "64", "--dim", "32", "--depth", "2", "--heads", "2", "--encoder-depth", "1"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("shards")
    write_shard_dir(directory, shard_rows=[41, 40, 40], vocab_size=64, pad_tails=True)  # target counts differ
    return directory


def arguments(shards: Path, steps: int, *extra: str) -> list[str]:
    # 2 ranks × 2 micro-batches × 2 sequences per step: rank 0's epoch ends at step 15, rank 1's
    # 61st sequence and its next epoch's first two make up its step 16.
    return [
        "--shards",
        str(shards),
        "--steps",
        str(steps),
        "--batch-size",
        "2",
        "--grad-accum",
        "2",
        "--lr",
        "1e-2",
        "--log-every",
        "1",
        "--seed",
        "4",
        *MODEL,
        *extra,
    ]


def losses(output: str) -> dict[int, float]:
    return {int(step): float(loss) for step, loss in re.findall(r"step=(\d+) loss=(\S+) tok/s=\S+", output)}


def run_rank(rank: int, world_size: int, port: int, argv: list[str], out: Path) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    with open(out / f"rank{rank}.log", "w") as log, redirect_stdout(log):
        model = train(parse_args(argv))
    torch.save(model.state_dict(), out / f"rank{rank}.pt")


def torchrun(argv: list[str]) -> str:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "trainer.train",
            *argv,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.fixture(scope="module")
def uninterrupted(shards, tmp_path_factory) -> Path:
    """20 steps on 2 ranks, checkpointed at the end: rank{r}.log, rank{r}.pt, ckpt.pt, metrics.jsonl."""
    out = tmp_path_factory.mktemp("uninterrupted")
    argv = arguments(shards, 20, "--checkpoint", str(out / "ckpt.pt"), "--metrics", str(out / "metrics.jsonl"))
    mp.spawn(run_rank, args=(2, free_port(), argv, out), nprocs=2)
    return out


def test_rank_0_alone_prints_one_line_per_step_and_writes_one_checkpoint(uninterrupted):
    output = (uninterrupted / "rank0.log").read_text()
    assert sorted(losses(output)) == list(range(1, 21))
    assert len(re.findall(r"^step=\d+ loss=", output, re.M)) == 20
    assert len(re.findall(r"^checkpoint: ", output, re.M)) == 1
    assert (uninterrupted / "rank1.log").read_text() == ""
    assert sorted(p.name for p in uninterrupted.glob("ckpt*")) == ["ckpt.pt"]


def test_gradients_are_averaged_so_the_replicas_stay_equal(uninterrupted):
    replicas = [torch.load(uninterrupted / f"rank{r}.pt") for r in (0, 1)]
    assert replicas[0].keys() == replicas[1].keys()
    for name in replicas[0]:  # each rank saw other data: without averaging they would part
        assert torch.equal(replicas[0][name], replicas[1][name]), name
    checkpoint = torch.load(uninterrupted / "ckpt.pt")["model"]
    assert all(torch.equal(checkpoint[name], replicas[0][name]) for name in checkpoint)


def test_a_step_on_2_ranks_is_one_step_on_both_ranks_micro_batches(uninterrupted, shards):
    """Loss and gradient norm of step 1 equal one process's over the 4 micro-batches the 2 ranks
    read: the loss is normalised by the target count of every rank, not averaged per rank."""
    micro_batches = []
    for rank in (0, 1):
        batches = iter(ShardDataset(shards, rank=rank, world_size=2, seed=4, batch_size=2, batched=True))
        micro_batches += [next(batches), next(batches)]
    torch.manual_seed(4)  # the trainer's --seed, so the same initial model
    model = Retro(
        RetroConfig(vocab_size=64, sequence_tokens=16, chunk_tokens=4, dim=32, depth=2, heads=2, encoder_depth=1)
    )
    loss_sum, targets = accumulate_gradients(
        model,
        micro_batches,
        pad_id=0,
        retrieval=True,
        device=torch.device("cpu"),
        precision="fp32",
        scaler=torch.amp.GradScaler("cpu", enabled=False),
    )
    grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    step_1 = json.loads((uninterrupted / "metrics.jsonl").read_text().splitlines()[0])
    assert step_1["step"] == 1
    assert step_1["loss"] == pytest.approx(float(loss_sum / targets), rel=1e-5)
    assert step_1["grad_norm"] == pytest.approx(float(grad_norm), rel=1e-4)
    per_rank = [sum(int((b["tokens"][:, 1:] != 0).sum()) for b in micro_batches[i : i + 2]) for i in (0, 2)]
    assert per_rank[0] != per_rank[1]  # so a mean of per-rank means would differ


def test_ranks_read_disjoint_slices_covering_the_epoch(uninterrupted, shards):
    states = [rank["dataset"] for rank in torch.load(uninterrupted / "ckpt.pt")["ranks"]]
    assert [(s["rank"], s["world_size"]) for s in states] == [(0, 2), (1, 2)]
    # 20 steps of 4 sequences: rank 0 read its 60, then 20 of epoch 1; rank 1 its 61, then 18
    # (its step 16 takes 1 + 2).
    assert [(s["epoch"], s["position"]) for s in states] == [(1, 20), (1, 18)]
    epoch_0 = []
    for state in states:
        dataset = ShardDataset(shards, rank=state["rank"], world_size=2, seed=state["seed"])
        epoch_0.append([int(sample["seq_id"]) for sample in dataset])
    assert [len(ids) for ids in epoch_0] == [60, 61]
    assert not set(epoch_0[0]) & set(epoch_0[1])
    assert sorted(epoch_0[0] + epoch_0[1]) == list(range(1000, 1000 + SEQUENCES))


def test_a_resumed_2_rank_run_gives_the_uninterrupted_losses(uninterrupted, shards, tmp_path):
    checkpoint = tmp_path / "ckpt.pt"
    first = losses(torchrun(arguments(shards, 16, "--decay-steps", "20", "--checkpoint", str(checkpoint))))
    states = [rank["dataset"] for rank in torch.load(checkpoint)["ranks"]]
    assert [(s["epoch"], s["position"]) for s in states] == [(1, 4), (1, 2)]  # each rank resumes its own
    second = losses(torchrun(arguments(shards, 20, "--resume", str(checkpoint))))
    assert sorted(first) == list(range(1, 17)) and sorted(second) == list(range(17, 21))
    expected = losses((uninterrupted / "rank0.log").read_text())
    for step, loss in {**first, **second}.items():
        assert loss == pytest.approx(expected[step], abs=1e-4), step


def test_resuming_with_another_number_of_ranks_is_refused(uninterrupted, shards):
    with pytest.raises(SystemExit, match="written by 2 ranks, this run has 1: launch as many"):
        main(arguments(shards, 21, "--resume", str(uninterrupted / "ckpt.pt")))
