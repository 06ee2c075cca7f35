"""This process's place in a run (rank, world size, device: one process alone, or one rank of a
torchrun launch) and the collectives the trainer uses: a sum over ranks, a gather to rank 0."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainer.options import TrainError


@dataclass
class Process:
    """This process's place in the run: rank 0 of 1 when launched alone."""

    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def start_process(device_name: str) -> Process:
    """Rank and world size from torchrun's environment; with more than one rank, join the
    process group (NCCL on CUDA, gloo on CPU)."""
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device = torch.device(device_name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise TrainError(f"--device {device_name}: CUDA is not available")
        if world_size > 1:
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))  # one GPU per process
        torch.cuda.set_device(device)
    if world_size > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world_size)
    return Process(rank, world_size, device)


def sum_over_ranks(values: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(values)
    return values


def gather_to_main(item, process: Process) -> list | None:
    """Every rank's `item`, in rank order, on rank 0 (None elsewhere)."""
    if not dist.is_initialized():
        return [item]
    items = [None] * process.world_size if process.is_main else None
    dist.gather_object(item, items, dst=0)
    return items
