"""Progress on long work: pass-through counters that log records, elapsed time and rate.

State is per process (module level), so every DoFn instance of a stage in one worker adds to
the same line; each worker of a multi-process runner reports its own share.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import apache_beam as beam

log = logging.getLogger("ratrain")


REPORT_EVERY_S = 10.0


_state: dict[str, list] = {}  # label -> [count, first seen, last report]


def observe(label: str, unit: str, count: int = 1) -> None:
    now = time.monotonic()
    state = _state.setdefault(label, [0, now, now])
    state[0] += count
    if now - state[2] >= REPORT_EVERY_S:
        state[2] = now
        elapsed = now - state[1]
        log.info(
            "[%s] %s %s, %.0f s, %.1f %s/s", label, f"{state[0]:,}", unit, elapsed, state[0] / max(elapsed, 1e-9), unit
        )


class ReportProgress(beam.PTransform):
    """Elements pass through unchanged; every 10 s the stage logs how far it is, counting
    `size(element)` units per element (one by default)."""

    def __init__(self, stage: str, unit: str, size: Callable[[Any], int] | None = None):
        super().__init__()
        self.stage, self.unit, self.size = stage, unit, size  # not `label`: PTransform owns that attribute

    def expand(self, pcoll):
        stage, unit, size = self.stage, self.unit, self.size

        def count(element):
            observe(stage, unit, 1 if size is None else size(element))
            return element

        return pcoll | "Count" >> beam.Map(count)


class StageTimer:
    """Logs a stage's start and, at the end, its elapsed time and counters."""

    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        self.start = time.monotonic()
        log.info("== %s: started", self.name)
        return self

    def done(self, counters: dict[str, int], main: str | None = None) -> float:
        elapsed = time.monotonic() - self.start
        rate = f", {counters.get(main, 0) / max(elapsed, 1e-9):.1f} {main}/s" if main else ""
        log.info("== %s: done in %.1f s%s", self.name, elapsed, rate)
        return elapsed

    def __exit__(self, *exc):
        return False
