"""`ratrain-train`: train the reference RETRO model on a shard directory.

    ratrain-train --shards out/shards --steps 1000 --batch-size 8 --checkpoint ckpt.pt
    ratrain-train --shards out/shards --steps 2000 --resume ckpt.pt --checkpoint ckpt.pt

Single process. --steps is the optimizer step to stop at, so a resumed run continues from the
checkpoint's step to --steps; the LR schedule spans --decay-steps (default --steps); the model's
shape comes from the checkpoint. Prints
`step=<i> loss=<value> tok/s=<value> lr=<value>` every --log-every steps.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from schemas.arrow import SchemaVersionError
from trainer.dataset import ShardDataError, ShardDataset
from trainer.model import Retro, RetroConfig


class TrainError(ValueError):
    """A run that cannot go on (bad tokens, missing device); main prints it as one line."""


@dataclass
class TrainConfig:
    shards: str                          # shard directory (manifest.json + *.arrow)
    steps: int                           # train until this optimizer step (counts steps before --resume)
    decay_steps: int | None = None       # the schedule's length; None: steps (set it to stop early on purpose)
    batch_size: int = 8                  # sequences per step
    lr: float = 3e-4                     # peak learning rate, after warmup
    min_lr_ratio: float = 0.1            # cosine decay ends at lr × min_lr_ratio
    warmup_steps: int | None = None      # linear warmup; None: 5% of steps
    weight_decay: float = 0.1            # AdamW, on matrices and embeddings only
    grad_clip: float = 1.0               # max global gradient norm
    seed: int = 0                        # model init and data order
    device: str = "cpu"                  # cpu | cuda | cuda:N
    retrieval: bool = True               # False: the no-retrieval ablation (no encoder, no CCA)
    vocab_size: int = RetroConfig.vocab_size  # token ids must be below it
    dim: int = RetroConfig.dim
    depth: int = RetroConfig.depth
    heads: int = RetroConfig.heads
    encoder_depth: int = RetroConfig.encoder_depth
    cca_layers: tuple[int, ...] | None = None  # None: RetroConfig's default for depth
    num_workers: int = 0                 # DataLoader worker processes
    checkpoint: str | None = None        # written at the end (and every checkpoint_every steps)
    checkpoint_every: int | None = None
    resume: str | None = None            # checkpoint to continue from
    log_every: int = 10
    val_shards: str | None = None        # held-out shard directory, scored every val_every steps
    val_every: int = 50                  # and at the last step
    val_batches: int | None = None       # score only this many batches of it; None: all
    verify_shards: bool = False          # check each shard's sha256 against the manifest when opened
    skip_bad_shards: bool = False        # leave out (with a warning) shards that fail their checks


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    parser = argparse.ArgumentParser(prog="ratrain-train", description=__doc__.splitlines()[0])
    parser.add_argument("--shards", required=True, help="shard directory (manifest.json + *.arrow)")
    parser.add_argument("--steps", type=int, required=True, help="train until this step")
    parser.add_argument("--decay-steps", type=int, default=None,
                        help="length of the LR schedule (default: --steps)")
    parser.add_argument("--batch-size", type=int, default=TrainConfig.batch_size)
    parser.add_argument("--lr", type=float, default=TrainConfig.lr, help="peak learning rate")
    parser.add_argument("--warmup-steps", type=int, default=None, help="default: 5%% of --steps")
    parser.add_argument("--seed", type=int, default=TrainConfig.seed)
    parser.add_argument("--device", default=TrainConfig.device, help="cpu, cuda or cuda:N")
    parser.add_argument("--no-retrieval", dest="retrieval", action="store_false",
                        help="ablation: train without neighbours (no encoder, no CCA)")
    parser.add_argument("--vocab-size", type=int, default=TrainConfig.vocab_size)
    parser.add_argument("--dim", type=int, default=TrainConfig.dim)
    parser.add_argument("--depth", type=int, default=TrainConfig.depth)
    parser.add_argument("--heads", type=int, default=TrainConfig.heads)
    parser.add_argument("--encoder-depth", type=int, default=TrainConfig.encoder_depth)
    parser.add_argument("--cca-layers", type=lambda s: tuple(int(i) for i in s.split(",") if i),
                        default=None, help="comma-separated 0-based decoder blocks with CCA")
    parser.add_argument("--num-workers", type=int, default=TrainConfig.num_workers)
    parser.add_argument("--checkpoint", help="write model, optimizer and data state here at the end")
    parser.add_argument("--checkpoint-every", type=int, default=None, help="also checkpoint every K steps")
    parser.add_argument("--resume", help="continue from this checkpoint")
    parser.add_argument("--log-every", type=int, default=TrainConfig.log_every)
    parser.add_argument("--val-shards", help="held-out shard directory (local or gs://) to score")
    parser.add_argument("--val-every", type=int, default=TrainConfig.val_every,
                        help="score --val-shards every K steps and at the end")
    parser.add_argument("--val-batches", type=int, default=None, help="score only this many batches")
    parser.add_argument("--verify-shards", action="store_true",
                        help="check each shard's sha256 against the manifest whenever it is opened")
    parser.add_argument("--skip-bad-shards", action="store_true",
                        help="leave out, with a warning, shards that fail their checks (default: refuse)")
    args = parser.parse_args(argv)
    if min(args.steps, args.batch_size, args.log_every, args.decay_steps or 1, args.checkpoint_every or 1,
           args.val_every, args.val_batches or 1) < 1:
        parser.error("--steps, --decay-steps, --batch-size, --log-every, --checkpoint-every, "
                     "--val-every and --val-batches must be at least 1")
    return TrainConfig(**vars(args))


def lr_multiplier(step: int, *, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine decay to min_ratio at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(model: Retro, config: TrainConfig) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": config.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]  # biases, norms
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95))


def epochs(loader: DataLoader, dataset: ShardDataset):
    """Batches forever; each exhausted epoch moves the dataset to the next one. An epoch that
    yields nothing (every shard skipped as bad) is an error, not an endless loop."""
    while True:
        batches = 0
        for batch in loader:  # a fresh iterator (and fresh worker copies) per epoch
            batches += 1
            yield batch
        if batches == 0:
            raise TrainError(f"epoch {dataset.epoch} of {dataset.source} yielded no batch: every shard was "
                             "skipped as bad (see the warnings) or the rank got no rows")
        dataset.set_epoch(dataset.epoch + 1)


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor, pad_id: int,
                    reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of logits [b, n, vocab] against targets [b, n], pad targets left out."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=pad_id, reduction=reduction)


def check_token_range(batch: dict, vocab_size: int) -> None:
    for name in ("tokens", "neighbours"):
        low, high = int(batch[name].min()), int(batch[name].max())
        if low < 0 or high >= vocab_size:
            raise TrainError(f"{name} hold ids in [{low}, {high}], outside the vocabulary "
                             f"[0, {vocab_size}): pass --vocab-size")


def model_inputs(batch: dict, device: torch.device, retrieval: bool):
    """(inputs [b, n], targets [b, n], neighbours [b, n/m, k, 2m] or None) on the device."""
    tokens = batch["tokens"].to(device, non_blocking=True)
    neighbours = batch["neighbours"].to(device, non_blocking=True) if retrieval else None
    return tokens[:, :-1], tokens[:, 1:], neighbours


@torch.no_grad()
def validation_loss(model: Retro, loader: DataLoader, device: torch.device, pad_id: int,
                    max_batches: int | None) -> float:
    """Mean next-token loss over the held-out shards (every non-pad target counts once)."""
    model.eval()
    total, count = 0.0, 0
    for i, batch in enumerate(loader):
        if max_batches is not None and i == max_batches:
            break
        inputs, targets, neighbours = model_inputs(batch, device, model.config.uses_retrieval)
        logits = model(inputs, neighbours)
        total += next_token_loss(logits, targets, pad_id, reduction="sum").item()
        count += int((targets != pad_id).sum())
    model.train()
    return total / max(count, 1)


def resolve_device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise TrainError(f"--device {name}: CUDA is not available")
    return device


def log(line: str) -> None:
    print(line, flush=True)  # visible as it happens when stdout is a pipe or a file


def train(config: TrainConfig) -> None:
    device = resolve_device(config.device)
    torch.manual_seed(config.seed)
    dataset = ShardDataset(config.shards, shuffle=True, seed=config.seed, batch_size=config.batch_size,
                           batched=True, verify=config.verify_shards, skip_bad_shards=config.skip_bad_shards)
    if len(dataset) == 0:
        raise TrainError(f"{config.shards}: no sequences")
    if config.resume and not os.path.isfile(config.resume):
        raise TrainError(f"--resume {config.resume}: no such checkpoint")
    checkpoint = torch.load(config.resume, map_location="cpu", weights_only=True) if config.resume else None
    if checkpoint is not None:
        model_config = RetroConfig(**checkpoint["model_config"])
    else:
        model_config = RetroConfig(
            vocab_size=config.vocab_size, sequence_tokens=dataset.sequence_tokens,
            chunk_tokens=dataset.chunk_tokens, dim=config.dim, depth=config.depth, heads=config.heads,
            cca_layers=config.cca_layers, encoder_depth=config.encoder_depth, pad_id=dataset.pad_id,
            retrieval=config.retrieval)
    if (model_config.sequence_tokens, model_config.chunk_tokens) != (dataset.sequence_tokens, dataset.chunk_tokens):
        raise TrainError(f"model takes n={model_config.sequence_tokens}, m={model_config.chunk_tokens}; "
                         f"the shards hold n={dataset.sequence_tokens}, m={dataset.chunk_tokens}")
    model = Retro(model_config).to(device)
    optimizer = build_optimizer(model, config)
    decay_steps = config.decay_steps or config.steps
    warmup = config.warmup_steps if config.warmup_steps is not None else max(1, decay_steps // 20)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(
        step, warmup=warmup, total=decay_steps, min_ratio=config.min_lr_ratio))
    step = 0
    if checkpoint is not None:
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        dataset.load_state_dict(checkpoint["dataset"])
        torch.set_rng_state(checkpoint["rng"])
        step = checkpoint["step"]
    log(f"model: {model.num_parameters():,} parameters, retrieval={model_config.uses_retrieval}, "
        f"n={dataset.sequence_tokens} m={dataset.chunk_tokens} k={dataset.neighbours}, "
        f"{len(dataset)} sequences per epoch, starting at step {step}")

    loader = DataLoader(dataset, batch_size=None, num_workers=config.num_workers,  # batched by the dataset
                        pin_memory=device.type == "cuda")
    val_loader = None
    if config.val_shards:
        val_set = ShardDataset(config.val_shards, shuffle=False, batch_size=config.batch_size, batched=True,
                               verify=config.verify_shards)
        if (val_set.sequence_tokens, val_set.chunk_tokens, val_set.neighbours) != \
                (dataset.sequence_tokens, dataset.chunk_tokens, dataset.neighbours):
            raise TrainError(f"--val-shards {config.val_shards}: shapes differ from the training shards")
        val_loader = DataLoader(val_set, batch_size=None, num_workers=config.num_workers)
    batches = epochs(loader, dataset)
    model.train()
    tokens_since_log, last_log = 0, time.perf_counter()
    while step < config.steps:
        batch = next(batches)
        check_token_range(batch, model_config.vocab_size)
        inputs, targets, neighbours = model_inputs(batch, device, model_config.uses_retrieval)
        logits = model(inputs, neighbours)                                 # [b, n, vocab]
        loss = next_token_loss(logits, targets, dataset.pad_id)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        scheduler.step()
        dataset.advance(len(inputs))
        step += 1
        tokens_since_log += inputs.numel()
        if step % config.log_every == 0 or step == config.steps:
            now = time.perf_counter()
            log(f"step={step} loss={loss.item():.4f} tok/s={tokens_since_log / (now - last_log):.0f} "
                f"lr={scheduler.get_last_lr()[0]:.3g}")
            tokens_since_log, last_log = 0, now
        if val_loader is not None and (step % config.val_every == 0 or step == config.steps):
            log(f"step={step} val_loss={validation_loss(model, val_loader, device, dataset.pad_id, config.val_batches):.4f}")
            last_log = time.perf_counter()  # tok/s counts training only
        if config.checkpoint and (step == config.steps or
                                  (config.checkpoint_every and step % config.checkpoint_every == 0)):
            save_checkpoint(config.checkpoint, {
                "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "dataset": dataset.state_dict(),
                "rng": torch.get_rng_state(), "step": step,
                "model_config": asdict(model_config), "train_config": asdict(config)})
            log(f"checkpoint: {config.checkpoint} (step {step})")


def save_checkpoint(path: str, state: dict) -> None:
    partial = f"{path}.partial"
    torch.save(state, partial)
    os.replace(partial, path)  # a crash mid-write never leaves a half-written checkpoint


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    try:
        train(config)
    except (ShardDataError, SchemaVersionError, TrainError) as err:
        sys.exit(f"ratrain-train: error: {err}")


if __name__ == "__main__":
    main()
