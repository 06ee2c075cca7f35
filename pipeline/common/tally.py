"""Counts computed as data: what a manifest says it holds comes from the elements themselves,
combined by Beam, never from metrics (a retried bundle counts twice in attempted metrics, and
a job that commits itself on a worker has no driver to read them).

A tally is a PCollection of (name, count) pairs; `Tally` sums them by name into one
PCollection that a later step reads as a dict side input.
"""

from __future__ import annotations

from collections.abc import Callable

import apache_beam as beam


def counted(name: str, pcoll, amount: Callable | None = None, label: str | None = None):
    """(name, 1) per element of `pcoll`, or (name, amount(element))."""
    return pcoll | (label or f"Tally_{name}") >> beam.Map(
        lambda element: (name, 1 if amount is None else int(amount(element)))
    )


class Tally(beam.PTransform):
    """Tallies -> (name, total) per name (a name no element counted is absent)."""

    def expand(self, tallies):
        return tuple(tallies) | "FlattenTallies" >> beam.Flatten() | "SumByName" >> beam.CombinePerKey(sum)
