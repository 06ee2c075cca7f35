"""Rank 0's output of a training run: printed lines, --metrics JSON lines, --tensorboard scalars."""

from __future__ import annotations

import json

from trainer.options import TrainConfig, TrainError


class Reporter:
    """Rank 0's output: printed lines, and one record per log step appended as a JSON line to
    --metrics and written as scalars to --tensorboard. Other ranks report nothing."""

    def __init__(self, config: TrainConfig, enabled: bool):
        self.enabled = enabled
        self.metrics = open(config.metrics, "a", encoding="utf-8") if enabled and config.metrics else None
        self.tensorboard = None
        if enabled and config.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise TrainError("--tensorboard needs the tensorboard package (pip install tensorboard)") from None
            self.tensorboard = SummaryWriter(config.tensorboard)

    def line(self, text: str) -> None:
        if self.enabled:
            print(text, flush=True)  # visible as it happens when stdout is a pipe or a file

    def record(self, record: dict) -> None:
        if self.metrics:
            self.metrics.write(json.dumps(record) + "\n")
            self.metrics.flush()
        if self.tensorboard:
            for name, value in record.items():
                if name != "step":
                    self.tensorboard.add_scalar(name, value, record["step"])

    def close(self) -> None:
        for sink in (self.metrics, self.tensorboard):
            if sink:
                sink.close()
