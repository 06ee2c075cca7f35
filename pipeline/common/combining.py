"""`MergedBy`: Beam's CombineFn for values merged two at a time by an associative function
(top-k lists of the same queries, exact truths): one definition, whichever step merges."""

from __future__ import annotations

from collections.abc import Callable

import apache_beam as beam


class MergedBy(beam.CombineFn):
    """The inputs merged by `merge(a, b)` (associative); None when there were none."""

    def __init__(self, merge: Callable):
        self.merge = merge

    def create_accumulator(self):
        return None

    def add_input(self, acc, value):
        return value if acc is None else self.merge(acc, value)

    def merge_accumulators(self, accs):
        result = None
        for acc in accs:
            if acc is not None:
                result = self.add_input(result, acc)
        return result

    def extract_output(self, acc):
        return acc
