"""A manifest's numbered files (`chunks/chunks-NNNNN.parquet`, ...) in number order, held as runs
of consecutive numbers whose files hold the same row count and whose names follow one pattern.
What a process looks a chunk id's file up in without an entry per file: the index stage writes
full files of `chunk_file_rows` and one shorter last file, so a generation is two runs, and
457,764 chunk files at 3·10^10 chunks are a handful (an estimate from the layout, ~100 B a run).
A name outside the pattern (hand-given, unnumbered) is a run of its own. Imports no Beam."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.common.names import file_number

# `<head>NNNNN<tail>`: what `names.file_number` reads (RE2, in Arrow), NNNNN as `file_name` writes it
_NAME = r"^(?P<head>.*-)(?P<digits>\d+)(?P<tail>(?:\.[\w.]+)?)$"


def _regular(digits: str) -> bool:
    """Whether a name's digits are a number as `file_name` writes it (five, or more without a
    leading zero) that an int64 holds: the rule `FileRunsBuilder.add` applies in Arrow."""
    return (len(digits) == 5 or (len(digits) > 5 and not digits.startswith("0"))) and len(digits) <= 18


@dataclass(frozen=True)
class _Run:
    number: int  # of the run's first file; -1: an unnumbered file
    count: int
    rows: int  # of each of its files
    head: str  # a file's name: f"{head}{number:05d}{tail}"; with tail None, head is the one file's name
    tail: str | None

    def follows(self, other: _Run) -> bool:
        """Whether `other`'s files carry this run's on: the next numbers, rows and pattern."""
        return (
            self.tail is not None
            and (other.head, other.tail, other.rows) == (self.head, self.tail, self.rows)
            and other.number == self.number + self.count
        )


def _coalesced(runs: list[_Run]) -> list[_Run]:
    out: list[_Run] = []
    for run in runs:
        if out and out[-1].follows(run):
            last = out[-1]
            out[-1] = _Run(last.number, last.count + run.count, last.rows, last.head, last.tail)
        else:
            out.append(run)
    return out


def _array(values, kind: pa.DataType) -> pa.Array:
    if isinstance(values, pa.ChunkedArray):
        return values.combine_chunks()
    return values if isinstance(values, pa.Array) else pa.array(values, kind)


class FileRunsBuilder:
    """FileRuns from (paths, rows) batches in any order (a file table's row groups, as Arrow
    arrays or lists): each batch is folded into runs as it comes, in Arrow and numpy (a name
    outside the pattern alone in Python), so building holds one batch plus the runs."""

    def __init__(self):
        self._runs: list[_Run] = []

    def add(self, paths, rows) -> None:
        paths, rows = _array(paths, pa.string()), _array(rows, pa.int64())
        if paths.null_count or rows.null_count:
            raise ValueError("a file without a path or a row count")
        parts = pc.extract_regex(paths, _NAME)  # null where a name does not match
        digits = pc.struct_field(parts, "digits")
        width = pc.utf8_length(digits)
        five_or_no_leading_zero = pc.or_(
            pc.equal(width, 5), pc.and_(pc.greater(width, 5), pc.invert(pc.starts_with(digits, "0")))
        )
        # as `file_name` writes a number, and one an int64 holds
        regular = pc.fill_null(pc.and_(five_or_no_leading_zero, pc.less_equal(width, 18)), False)
        odd = pc.invert(regular)
        for path, count in zip(paths.filter(odd).to_pylist(), rows.filter(odd).to_pylist()):
            number = file_number(path)  # past an int64: taken as unnumbered
            self._runs.append(_Run(number if number < 2**62 else -1, 1, count, path, None))
        numbers = pc.cast(digits.filter(regular), pa.int64()).to_numpy()
        if not len(numbers):
            return
        heads = pc.dictionary_encode(pc.struct_field(parts, "head").filter(regular))
        tails = pc.dictionary_encode(pc.struct_field(parts, "tail").filter(regular))
        columns = (numbers, rows.filter(regular).to_numpy(), heads.indices.to_numpy(), tails.indices.to_numpy())
        order = np.argsort(numbers, kind="stable")
        numbers, counts, head_codes, tail_codes = (column[order] for column in columns)
        steps = np.diff(numbers) != 1
        for column in (counts, head_codes, tail_codes):
            steps |= np.diff(column) != 0
        firsts = np.concatenate([[0], np.flatnonzero(steps) + 1]).tolist()
        head_names, tail_names = heads.dictionary.to_pylist(), tails.dictionary.to_pylist()
        for first, end in zip(firsts, [*firsts[1:], len(numbers)]):
            head, tail = head_names[head_codes[first]], tail_names[tail_codes[first]]
            self._runs.append(_Run(int(numbers[first]), end - first, int(counts[first]), head, tail))

    def build(self) -> FileRuns:
        runs = _coalesced(sorted(self._runs, key=lambda run: run.number))  # stable: unnumbered files keep their order
        for before, after in zip(runs, runs[1:]):
            if after.number >= 0 and after.number < before.number + before.count:
                raise ValueError(f"file number {after.number} is listed twice ({after.head}...)")
        counts = np.array([run.count for run in runs], np.int64)
        rows = np.array([run.rows for run in runs], np.int64)
        return FileRuns(
            numbers=np.array([run.number for run in runs], np.int64),
            rows=rows,
            positions=np.concatenate([[0], np.cumsum(counts)]),
            starts=np.concatenate([[0], np.cumsum(counts * rows)]),
            heads=tuple(run.head for run in runs),
            tails=tuple(run.tail for run in runs),
        )


@dataclass(frozen=True, eq=False, kw_only=True)
class FileRuns:
    """Files at positions 0 … num_files - 1 in number order; file f holds rows start(f) …
    start(f + 1) - 1 of them all (chunk ids, for chunk files)."""

    numbers: np.ndarray  # int64 [runs]: the number of each run's first file
    rows: np.ndarray  # int64 [runs]: rows in each file of the run
    positions: np.ndarray  # int64 [runs + 1]: each run's first position, then num_files
    starts: np.ndarray  # int64 [runs + 1]: each run's first row, then num_rows
    heads: tuple[str, ...]  # [runs]: the names' pattern (_Run)
    tails: tuple[str | None, ...]

    @classmethod
    def of(cls, paths: Iterable[str], rows: Iterable[int]) -> FileRuns:
        builder = FileRunsBuilder()
        builder.add(paths, rows)
        return builder.build()

    @property
    def num_files(self) -> int:
        return int(self.positions[-1])

    @property
    def num_rows(self) -> int:
        return int(self.starts[-1])

    def __len__(self) -> int:
        return len(self.heads)

    def _run(self, position: int) -> int:
        if not 0 <= position < self.num_files:
            raise IndexError(f"file {position} of {self.num_files}")
        return int(np.searchsorted(self.positions, position, side="right")) - 1

    def start(self, position: int) -> int:
        """The first row of file `position`; num_rows for position num_files (where a last file ends)."""
        if position == self.num_files:
            return self.num_rows
        run = self._run(position)
        return int(self.starts[run] + (position - self.positions[run]) * self.rows[run])

    def path(self, position: int) -> str:
        run = self._run(position)
        head, tail = self.heads[run], self.tails[run]
        if tail is None:
            return head
        return f"{head}{int(self.numbers[run] + position - self.positions[run]):05d}{tail}"

    def number(self, position: int) -> int:
        run = self._run(position)  # a run of a name outside the pattern is one file
        return int(self.numbers[run] + position - self.positions[run])

    def positions_of(self, rows: np.ndarray) -> np.ndarray:
        """The position of the file holding each of these rows (each in 0 … num_rows - 1: unchecked)."""
        rows = np.asarray(rows, np.int64)
        run = np.searchsorted(self.starts[:-1], rows, side="right") - 1
        return self.positions[run] + (rows - self.starts[run]) // np.maximum(self.rows[run], 1)

    def position_of(self, path: str) -> int:
        """The position of the file named `path`; ValueError where no run holds it."""
        parts = re.match(_NAME, path, re.ASCII)  # RE2 (Arrow) reads \w as ASCII
        if parts and parts["tail"] is not None and _regular(parts["digits"]):
            number = int(parts["digits"])
            run = int(np.searchsorted(self.numbers, number, side="right")) - 1
            count = int(self.positions[run + 1] - self.positions[run]) if run >= 0 else 0
            if (
                run >= 0
                and number < self.numbers[run] + count
                and (self.heads[run], self.tails[run]) == (parts["head"], parts["tail"])
            ):
                return int(self.positions[run] + number - self.numbers[run])
        if path in self._odd_names:  # a name outside the pattern
            return self._odd_names[path]
        raise ValueError(f"{path}: not one of these files")

    @functools.cached_property
    def _odd_names(self) -> dict[str, int]:
        return {
            head: int(self.positions[run])
            for run, (head, tail) in enumerate(zip(self.heads, self.tails))
            if tail is None
        }

    def paths(self) -> Iterable[str]:
        return (self.path(position) for position in range(self.num_files))
