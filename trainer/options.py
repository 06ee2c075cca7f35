"""`ratrain-train`'s settings: TrainConfig, whose fields are the command-line flags (each declared
once with `option`), parse_args, the autocast dtypes (PRECISIONS), and TrainError, the one-line
error of a run that cannot go on."""

from __future__ import annotations

import argparse
import typing
from dataclasses import MISSING, dataclass, field, fields

import torch

from trainer.model import RetroConfig

#: --help's description: the first line of trainer/train.py's docstring.
DESCRIPTION = "`ratrain-train`: train the reference RETRO model on a shard directory."
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class TrainError(ValueError):
    """A run that cannot go on (bad tokens, missing device); main prints it as one line."""


def option(default=MISSING, help: str = "", **flag):
    """A TrainConfig field and its command-line flag (--field-name), declared once: `help`, and
    argparse's `type` or `choices`, or `minimum` (the least value accepted)."""
    return field(default=default, metadata={"help": help, **flag})


def int_list(text: str) -> tuple[int, ...]:
    return tuple(int(i) for i in text.split(",") if i)


def source_selection(text: str) -> list[str] | dict[str, float]:
    """'web,code' -> those sources as they are; 'web=2,code=1' -> weighted (ShardDataset's `sources`)."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not any("=" in part for part in parts):
        return parts
    try:
        return {name: float(weight) for name, weight in (part.split("=", 1) for part in parts)}
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give every source a weight (web=2,code=1) or none") from None


@dataclass(kw_only=True)
class TrainConfig:
    shards: str = option(help="shard directory (manifest.json + *.arrow), local or gs://")
    sources: list[str] | dict[str, float] | None = option(
        None, "a blend's sources to read: web,code (only those) or web=2,code=1 (weighted)", type=source_selection
    )
    shards_commit: int | None = option(
        None, "commit of --shards to read (default: a resumed run's own, else the newest)", minimum=0
    )
    steps: int = option(help="train until this optimizer step (counting the steps before --resume)", minimum=1)
    decay_steps: int | None = option(None, "length of the LR schedule (default: --steps)", minimum=1)
    batch_size: int = option(8, "sequences per micro-batch on each rank", minimum=1)
    grad_accum: int = option(
        1, "micro-batches per optimizer step; a step takes batch size × this × ranks sequences", minimum=1
    )
    lr: float = option(3e-4, "peak learning rate, after warmup")
    min_lr_ratio: float = option(0.1, "cosine decay ends at lr × this")
    warmup_steps: int | None = option(None, "linear warmup (default: 5% of the schedule)", minimum=0)
    weight_decay: float = option(0.1, "AdamW's, on matrices and embeddings only")
    grad_clip: float = option(1.0, "max global gradient norm")
    seed: int = option(0, "model init and data order")
    device: str = option("cpu", "cpu, cuda or cuda:N (under torchrun, cuda is cuda:LOCAL_RANK)")
    precision: str = option(
        "fp32", "autocast dtype of forward and loss (fp16 adds a gradient scaler)", choices=tuple(PRECISIONS)
    )
    compile: bool = option(False, "torch.compile the model (slow first steps, faster after)")
    retrieval: bool = option(True, "the ablation: train without neighbours (no encoder, no CCA)")
    vocab_size: int = option(RetroConfig.vocab_size, "token ids must be below it", minimum=1)
    dim: int = option(RetroConfig.dim, "model width", minimum=1)
    depth: int = option(RetroConfig.depth, "decoder blocks", minimum=1)
    heads: int = option(RetroConfig.heads, "attention heads", minimum=1)
    encoder_depth: int = option(RetroConfig.encoder_depth, "neighbour encoder blocks", minimum=0)
    cca_layers: tuple[int, ...] | None = option(
        None, "comma-separated 0-based decoder blocks with CCA (default: every third from block 2)", type=int_list
    )
    num_workers: int = option(0, "DataLoader worker processes per rank", minimum=0)
    checkpoint: str | None = option(
        None, "write model, optimizer and data positions here at the end (on storage every node sees)"
    )
    checkpoint_every: int | None = option(None, "also checkpoint every K steps", minimum=1)
    resume: str | None = option(None, "continue from this checkpoint (same number of ranks)")
    log_every: int = option(10, "print (and record) every K steps", minimum=1)
    metrics: str | None = option(None, "append one JSON line per log step to this file")
    tensorboard: str | None = option(
        None, "also write TensorBoard scalars to this directory (needs the tensorboard package)"
    )
    val_shards: str | None = option(None, "held-out shard directory (local or gs://) to score")
    val_every: int = option(50, "score --val-shards every K steps and at the end", minimum=1)
    val_batches: int | None = option(None, "score only this many batches (default: all)", minimum=1)
    verify_shards: bool = option(False, "check each shard's sha256 against the manifest whenever it is opened")
    skip_bad_shards: bool = option(False, "leave out, with a warning, shards that fail their checks (default: refuse)")


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """Flags from TrainConfig's fields: --field-name, a bool that defaults to True is --no-field-name."""
    parser = argparse.ArgumentParser(prog="ratrain-train", description=DESCRIPTION)
    hints = typing.get_type_hints(TrainConfig)
    for spec in fields(TrainConfig):
        flag = {k: v for k, v in spec.metadata.items() if k != "minimum"}
        flag["help"] = flag["help"].replace("%", "%%")
        name = spec.name.replace("_", "-")
        if hints[spec.name] is bool:
            parser.add_argument(
                f"--no-{name}" if spec.default else f"--{name}",
                dest=spec.name,
                action="store_false" if spec.default else "store_true",
                **flag,
            )
            continue
        if spec.default not in (MISSING, None):
            flag["help"] += f" (default: {spec.default})"
        scalar = [t for t in typing.get_args(hints[spec.name]) if t is not type(None)] or [hints[spec.name]]
        flag.setdefault("type", scalar[0])
        parser.add_argument(
            f"--{name}",
            dest=spec.name,
            required=spec.default is MISSING,
            default=None if spec.default is MISSING else spec.default,
            **flag,
        )
    args = parser.parse_args(argv)
    for spec in fields(TrainConfig):
        value, minimum = getattr(args, spec.name), spec.metadata.get("minimum")
        if minimum is not None and value is not None and value < minimum:
            parser.error(f"--{spec.name.replace('_', '-')} must be at least {minimum}")
    return TrainConfig(**vars(args))
