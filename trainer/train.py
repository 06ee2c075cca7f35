"""`ratrain-train`: train the reference RETRO model on a shard directory.

    ratrain-train --shards out/shards --steps 1000 --batch-size 8 --checkpoint ckpt.pt
    ratrain-train --shards out/shards --steps 2000 --resume ckpt.pt --checkpoint ckpt.pt
    torchrun --nproc_per_node=8 --no-python ratrain-train --shards gs://b/shards --steps 1000 \
        --device cuda --precision bf16 --grad-accum 4 --checkpoint /shared/ckpt.pt

Run alone it is one process; under torchrun each process takes its rank from the environment,
reads its own slice of every epoch, and the replicas average gradients (DDP: NCCL on CUDA,
gloo on CPU). Rank 0 alone prints, scores --val-shards and writes checkpoints, which hold every
rank's data position. --steps is the optimizer step to stop at, so a resumed run continues from
the checkpoint's step to --steps; the LR schedule spans --decay-steps (default --steps); the
model's shape comes from the checkpoint. Prints `step=<i> loss=<value> tok/s=<value> lr=<value>`
every --log-every steps: the loss is the mean over every non-pad target of the step (all
micro-batches, all ranks), tok/s counts every rank's input tokens.
"""

from __future__ import annotations

import gc
import math
import os
import sys
import time
import typing
from contextlib import nullcontext
from dataclasses import asdict

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from schemas.arrow import SchemaVersionError
from trainer.checkpoint import rank_states
from trainer.dataset import ShardDataError, ShardDataset
from trainer.distributed import Process, gather_to_main, start_process, sum_over_ranks
from trainer.model import Retro, RetroConfig
from trainer.options import PRECISIONS, TrainConfig, TrainError, parse_args
from trainer.reporting import Reporter


def lr_multiplier(step: int, *, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine decay to min_ratio at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(model: Retro, config: TrainConfig) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": config.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]  # biases, norms
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95))


def epochs(loader: DataLoader, dataset: ShardDataset):
    """Batches forever, each recorded as consumed (`advance`) as it is handed over; each
    exhausted epoch moves the dataset to the next one. An epoch with samples left that yields
    nothing (every shard skipped as bad) is an error, not an endless loop."""
    while True:
        batches, left = 0, len(dataset) - dataset.position  # none when resumed at the epoch's end
        for batch in loader:  # a fresh iterator (and fresh worker copies) per epoch
            batches += 1
            dataset.advance(len(batch["tokens"]))
            yield batch
        if batches == 0 and left:
            raise TrainError(
                f"epoch {dataset.epoch} of {dataset.source} yielded no batch: every shard was "
                "skipped as bad (see the warnings) or the rank got no rows"
            )
        dataset.set_epoch(dataset.epoch + 1)


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor, pad_id: int, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of logits [b, n, vocab] against targets [b, n], pad targets left out."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=pad_id, reduction=reduction)


def check_token_range(batch: dict, vocab_size: int) -> None:
    for name in ("tokens", "neighbours"):
        low, high = int(batch[name].min()), int(batch[name].max())
        if low < 0 or high >= vocab_size:
            raise TrainError(
                f"{name} hold ids in [{low}, {high}], outside the vocabulary [0, {vocab_size}): pass --vocab-size"
            )


def model_inputs(batch: dict, device: torch.device, retrieval: bool):
    """(inputs [b, n], targets [b, n], neighbours [b, n/m, k, 2m] or None) on the device."""
    tokens = batch["tokens"].to(device, non_blocking=True)
    neighbours = batch["neighbours"].to(device, non_blocking=True) if retrieval else None
    return tokens[:, :-1], tokens[:, 1:], neighbours


def autocast(device: torch.device, precision: str):
    return torch.autocast(device.type, dtype=PRECISIONS[precision], enabled=precision != "fp32")


def accumulate_gradients(
    model: torch.nn.Module,
    micro_batches: list[dict],
    *,
    pad_id: int,
    retrieval: bool,
    device: torch.device,
    precision: str,
    scaler: torch.amp.GradScaler,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Backward over one step's micro-batches for the loss sum(token losses) ÷ the count of
    non-pad targets over every micro-batch of every rank, so the gradient is the same however
    the step's sequences are split (not a mean of per-batch means). Returns this rank's sum of
    token losses and the global target count."""
    local_targets = sum(int((batch["tokens"][:, 1:] != pad_id).sum()) for batch in micro_batches)
    targets = sum_over_ranks(torch.tensor(float(local_targets), dtype=torch.float64, device=device)).clamp(min=1)
    scale = (dist.get_world_size() if dist.is_initialized() else 1) / targets  # DDP averages over ranks
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for i, batch in enumerate(micro_batches):
        inputs, batch_targets, neighbours = model_inputs(batch, device, retrieval)
        last = i == len(micro_batches) - 1
        # all-reduce gradients once, after the last micro-batch
        with model.no_sync() if isinstance(model, DistributedDataParallel) and not last else nullcontext():
            with autocast(device, precision):
                logits = model(inputs, neighbours)  # [b, n, vocab]
                token_losses = next_token_loss(logits, batch_targets, pad_id, reduction="sum")
            scaler.scale(token_losses * scale).backward()
        loss_sum += token_losses.detach()
    return loss_sum, targets


@torch.no_grad()
def validation_loss(
    model: Retro, loader: DataLoader, *, device: torch.device, precision: str, pad_id: int, max_batches: int | None
) -> float:
    """Mean next-token loss over the held-out shards (every non-pad target counts once)."""
    model.eval()
    total, count = 0.0, 0
    for i, batch in enumerate(loader):
        if max_batches is not None and i == max_batches:
            break
        inputs, targets, neighbours = model_inputs(batch, device, model.config.uses_retrieval)
        with autocast(device, precision):
            total += next_token_loss(model(inputs, neighbours), targets, pad_id, reduction="sum").item()
        count += int((targets != pad_id).sum())
    model.train()
    return total / max(count, 1)


def train(config: TrainConfig) -> Retro:
    """Train (as one rank of a torchrun launch, or alone) and return this rank's model."""
    process = start_process(config.device)
    retro = train_process(config, process)  # after an error, no teardown: the other ranks may be mid-collective
    if dist.is_initialized():
        gc.collect()  # free the DDP wrapper (held in reference cycles) first, or gloo can abort the exit
        dist.destroy_process_group()
    return retro


def train_process(config: TrainConfig, process: Process) -> Retro:
    device = process.device
    torch.manual_seed(config.seed)  # every rank builds the same model
    if config.resume and not os.path.isfile(config.resume):
        raise TrainError(f"--resume {config.resume}: no such checkpoint")
    checkpoint = torch.load(config.resume, map_location="cpu", weights_only=True) if config.resume else None
    commit = config.shards_commit  # a resumed run reads the commit its data position counts in, unless told
    if commit is None and checkpoint is not None:
        commit = rank_states(checkpoint)[0]["dataset"].get("commit")
    dataset = ShardDataset(
        config.shards,
        rank=process.rank,
        world_size=process.world_size,
        shuffle=True,
        seed=config.seed,
        batch_size=config.batch_size,
        batched=True,
        verify=config.verify_shards,
        skip_bad_shards=config.skip_bad_shards,
        commit=commit,
        sources=config.sources,
    )
    if len(dataset) == 0:
        raise TrainError(f"{config.shards}: no sequences for rank {process.rank} of {process.world_size}")
    if checkpoint is not None:
        model_config = RetroConfig(**checkpoint["model_config"])
    else:
        model_config = RetroConfig(
            vocab_size=config.vocab_size,
            sequence_tokens=dataset.sequence_tokens,
            chunk_tokens=dataset.chunk_tokens,
            dim=config.dim,
            depth=config.depth,
            heads=config.heads,
            cca_layers=config.cca_layers,
            encoder_depth=config.encoder_depth,
            pad_id=dataset.pad_id,
            retrieval=config.retrieval,
        )
    if (model_config.sequence_tokens, model_config.chunk_tokens) != (dataset.sequence_tokens, dataset.chunk_tokens):
        raise TrainError(
            f"model takes n={model_config.sequence_tokens}, m={model_config.chunk_tokens}; "
            f"the shards hold n={dataset.sequence_tokens}, m={dataset.chunk_tokens}"
        )
    retro = Retro(model_config).to(device)
    optimizer = build_optimizer(retro, config)
    decay_steps = config.decay_steps or config.steps
    warmup = config.warmup_steps if config.warmup_steps is not None else max(1, decay_steps // 20)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_multiplier(step, warmup=warmup, total=decay_steps, min_ratio=config.min_lr_ratio)
    )
    scaler = torch.amp.GradScaler(device.type, enabled=config.precision == "fp16")  # bf16 needs no scaling
    step = (
        restore(
            checkpoint,
            config.resume,
            process=process,
            retro=retro,
            optimizer=optimizer,
            scheduler=scheduler,
            scaler=scaler,
            dataset=dataset,
        )
        if checkpoint is not None and config.resume
        else 0
    )
    model = typing.cast(torch.nn.Module, torch.compile(retro)) if config.compile else retro
    if process.world_size > 1:  # averages gradients over ranks during backward
        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)

    report = Reporter(config, enabled=process.is_main)
    report.line(
        f"model: {retro.num_parameters():,} parameters, retrieval={model_config.uses_retrieval}, "
        f"n={dataset.sequence_tokens} m={dataset.chunk_tokens} k={dataset.neighbours}, "
        f"{len(dataset)} sequences per epoch and rank, steps of {process.world_size} ranks × "
        f"{config.grad_accum} micro-batches × {config.batch_size} sequences, {config.precision}, "
        f"starting at step {step}"
    )
    loader = DataLoader(
        dataset,
        batch_size=None,
        num_workers=config.num_workers,  # batched by the dataset
        pin_memory=device.type == "cuda",
    )
    val_loader = (
        validation_loader(config.val_shards, config, dataset) if config.val_shards and process.is_main else None
    )
    batches = epochs(loader, dataset)
    model.train()
    tokens_since_log, last_log = 0, time.perf_counter()
    try:
        while step < config.steps:
            micro_batches = [next(batches) for _ in range(config.grad_accum)]
            for batch in micro_batches:
                check_token_range(batch, model_config.vocab_size)
            optimizer.zero_grad(set_to_none=True)
            loss_sum, targets = accumulate_gradients(
                model,
                micro_batches,
                pad_id=dataset.pad_id,
                retrieval=model_config.uses_retrieval,
                device=device,
                precision=config.precision,
                scaler=scaler,
            )
            scaler.unscale_(optimizer)  # clip the true gradients
            grad_norm = torch.nn.utils.clip_grad_norm_(retro.parameters(), config.grad_clip)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            step += 1
            tokens_since_log += sum(len(batch["tokens"]) for batch in micro_batches) * dataset.sequence_tokens
            record = {}
            if step % config.log_every == 0 or step == config.steps:
                loss_total, tokens = sum_over_ranks(
                    torch.stack(
                        [  # one all-reduce per log step
                            loss_sum,
                            torch.tensor(float(tokens_since_log), dtype=torch.float64, device=device),
                        ]
                    )
                ).tolist()
                now = time.perf_counter()
                record = {
                    "step": step,
                    "loss": loss_total / targets.item(),
                    "lr": scheduler.get_last_lr()[0],
                    "tokens_per_s": tokens / (now - last_log),
                    "grad_norm": grad_norm.item(),
                }
                report.line(
                    f"step={step} loss={record['loss']:.4f} tok/s={record['tokens_per_s']:.0f} lr={record['lr']:.3g}"
                )
                tokens_since_log, last_log = 0, now
            if val_loader is not None and (step % config.val_every == 0 or step == config.steps):
                record = {
                    "step": step,
                    **record,
                    "val_loss": validation_loss(
                        retro,
                        val_loader,
                        device=device,
                        precision=config.precision,
                        pad_id=dataset.pad_id,
                        max_batches=config.val_batches,
                    ),
                }
                report.line(f"step={step} val_loss={record['val_loss']:.4f}")
                last_log = time.perf_counter()  # tok/s counts training only
            if record:
                report.record(record)
            if config.checkpoint and (
                step == config.steps or (config.checkpoint_every and step % config.checkpoint_every == 0)
            ):
                ranks = gather_to_main({"dataset": dataset.state_dict(), "rng": torch.get_rng_state()}, process)
                if process.is_main:
                    save_checkpoint(
                        config.checkpoint,
                        {
                            "model": retro.state_dict(),
                            "optimizer": optimizer.state_dict(),
                            "scheduler": scheduler.state_dict(),
                            "scaler": scaler.state_dict(),
                            "ranks": ranks,
                            "step": step,
                            "model_config": asdict(model_config),
                            "train_config": asdict(config),
                        },
                    )
                    report.line(f"checkpoint: {config.checkpoint} (step {step})")
    finally:
        report.close()
    return retro


def validation_loader(source: str, config: TrainConfig, dataset: ShardDataset) -> DataLoader:
    val_set = ShardDataset(
        source, shuffle=False, batch_size=config.batch_size, batched=True, verify=config.verify_shards
    )
    if (val_set.sequence_tokens, val_set.chunk_tokens, val_set.neighbours) != (
        dataset.sequence_tokens,
        dataset.chunk_tokens,
        dataset.neighbours,
    ):
        raise TrainError(f"--val-shards {config.val_shards}: shapes differ from the training shards")
    return DataLoader(val_set, batch_size=None, num_workers=config.num_workers)


def restore(
    checkpoint: dict,
    path: str,
    *,
    process: Process,
    retro: Retro,
    optimizer,
    scheduler,
    scaler,
    dataset: ShardDataset,
) -> int:
    """Load a checkpoint's states, this rank's data position and RNG among them; the step it was taken at."""
    ranks = rank_states(checkpoint)
    if len(ranks) != process.world_size:
        raise TrainError(
            f"--resume {path}: written by {len(ranks)} ranks, this run has {process.world_size}: launch as many"
        )
    retro.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    scheduler.load_state_dict(checkpoint["scheduler"])
    if checkpoint.get("scaler"):  # empty unless written by an fp16 run
        scaler.load_state_dict(checkpoint["scaler"])
    try:
        dataset.load_state_dict(ranks[process.rank]["dataset"])
    except ValueError as err:
        raise TrainError(f"--resume {path}: {err}") from None
    torch.set_rng_state(ranks[process.rank]["rng"])
    return checkpoint["step"]


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
