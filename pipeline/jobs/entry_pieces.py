"""A stage's file entries on their way to its commit, never gathered on one worker (docs/design.md
§8): workers write them into the job's staging directory as Parquet pieces, each sorted by path
and holding the files of one folder whose numbers fall in one run of PIECE_NUMBERS
(`WriteEntryPieces`); the commit reads the pieces merged in path order, a batch at a time
(`merged_entries`); the manifest's facts about them are sums (`EntryTotals`).
"""

from __future__ import annotations

import functools
import heapq
import posixpath
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import apache_beam as beam
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.chunks.committed import CommittedIndexManifest
from pipeline.common import fileio
from pipeline.common.names import file_number
from pipeline.common.writers import parquet_bytes
from schemas.file_table import entries_arrow, entries_of
from schemas.manifest import FileEntry, unversioned

Entry = TypeVar("Entry", bound=FileEntry)
PIECES_DIR = "_entries"  # in the job's staging directory
#: File numbers a piece spans in one folder: at most this many entries in the one worker writing it.
PIECE_NUMBERS = 65_536
#: Entries of each piece the commit holds while it merges them.
PIECE_READ = 1_024


@dataclass(frozen=True)
class EntryPiece:
    """A written piece: its full path and how many entries it holds."""

    path: str
    entries: int


def sorted_entries(entries: Iterable[Entry]) -> list[Entry]:
    """Manifest entries by path; a path written twice (two elements wrote one file: the last
    write would hide the other's rows) fails the job."""
    ordered = sorted(entries, key=lambda e: e.path)
    for before, after in zip(ordered, ordered[1:]):
        if before.path == after.path:
            raise written_twice(after.path)
    return ordered


def written_twice(path: str) -> RuntimeError:
    return RuntimeError(f"{path} was written twice: nothing is committed")


def piece_name(path: str) -> str:
    """The piece an entry's file goes to: its folder and its number's run (0: no number)."""
    folder = posixpath.dirname(path).replace("/", ".") or "_"
    return f"{folder}-{max(file_number(path), 0) // PIECE_NUMBERS:09d}.parquet"


def write_piece(path: str, entries: Iterable[FileEntry], model: type[FileEntry]) -> EntryPiece:
    """One piece: its entries sorted by path, as file table rows."""
    ordered = sorted_entries(entries)
    fileio.write_bytes(path, parquet_bytes(entries_arrow(ordered, model)))
    return EntryPiece(path, len(ordered))


class WriteEntryPieces(beam.PTransform):
    """File entries (of `model`) → the pieces written under `staging`/_entries (EntryPiece each)."""

    def __init__(self, staging: str, model: type[FileEntry]):
        super().__init__()
        self._directory, self._model = fileio.join(staging, PIECES_DIR), model

    def expand(self, entries):
        directory, model = self._directory, self._model
        return (
            entries
            | "KeyByPiece" >> beam.Map(lambda entry: (piece_name(entry.path), entry))
            | "GroupByPiece" >> beam.GroupByKey()
            | "WritePiece" >> beam.MapTuple(lambda name, group: write_piece(fileio.join(directory, name), group, model))
        )


def _piece_entries(path: str, model: type[FileEntry]) -> Iterator[FileEntry]:
    with fileio.open_read(path) as f:
        for batch in pq.ParquetFile(f).iter_batches(batch_size=PIECE_READ):
            yield from entries_of(pa.Table.from_batches([batch]), model)


@dataclass(frozen=True)
class KeptEntries:
    """The entries of a committed index manifest that a change keeps in place: all but those
    under `dropped_folders` and those whose name without a commit's number is in
    `dropped_names` (what the change rewrites), read from its file table a row group at a time,
    never as a list."""

    index: CommittedIndexManifest
    dropped_folders: tuple[str, ...] = ()
    dropped_names: frozenset[str] = frozenset()

    def _tables(self, columns: list[str]) -> Iterator[pa.Table]:
        manifest, directory = _checked(self.index), self.index.directory
        dropped_folders, dropped_names = self.dropped_folders, self.dropped_names
        for table in fileio.entry_batches(manifest, directory, columns):
            paths = table["path"].to_pylist()
            keep = [top_folder(p) not in dropped_folders and unversioned(p) not in dropped_names for p in paths]
            yield table.filter(pa.array(keep, pa.bool_()))

    def count(self) -> int:
        return sum(table.num_rows for table in self._tables(["path"]))

    def entries(self) -> Iterator[FileEntry]:
        for table in self._tables(list(FileEntry.model_fields)):
            for start in range(0, table.num_rows, PIECE_READ):
                yield from entries_of(table.slice(start, PIECE_READ), FileEntry)


@functools.lru_cache(maxsize=2)
def _checked(index: CommittedIndexManifest):
    """The index manifest's fields, its file table checked against it once a process (streamed)."""
    manifest = index.summary()
    fileio.entry_groups(manifest, index.directory)
    return manifest


def merged_entries(
    pieces: Iterable[EntryPiece],
    model: type[FileEntry],
    held: Iterable[FileEntry] = (),
    kept: KeptEntries | None = None,
    *,
    batch: int,
) -> Iterator[list[FileEntry]]:
    """The entries of `pieces`, of `held` (a few, in memory) and `kept` in path order, `batch`
    at a time; a piece is read PIECE_READ entries at a time. A path listed twice (two elements
    wrote one file: the last write would hide the other's rows) fails: nothing is committed."""
    streams = [_piece_entries(p.path, model) for p in sorted(pieces, key=lambda p: p.path)]
    streams.append(iter(sorted_entries(held)))
    if kept is not None:
        streams.append(kept.entries())
    out: list[FileEntry] = []
    last = None
    for entry in heapq.merge(*streams, key=lambda e: e.path):
        if entry.path == last:
            raise written_twice(entry.path)
        last = entry.path
        out.append(entry)
        if len(out) == batch:
            yield out
            out = []
    if out:
        yield out


def top_folder(path: str) -> str:
    """The folder of the output directory a path is in ("" for a file beside the manifest)."""
    return path.split("/", 1)[0] if "/" in path else ""


class EntryTotals(beam.CombineFn):
    """Sums over file entries by top folder (`top_folder`): {folder: {"entries", "rows", "bytes", and
    "neighbour_slots_filled" of shard entries}}: the manifest's facts about the files, with no
    list of them."""

    SUMMED = ("rows", "bytes", "neighbour_slots_filled")

    def create_accumulator(self) -> dict[str, dict[str, int]]:
        return {}

    def add_input(self, totals, entry):
        folder = totals.setdefault(top_folder(entry.path), {"entries": 0})
        folder["entries"] += 1
        for name in self.SUMMED:
            value = getattr(entry, name, None)
            if value is not None:
                folder[name] = folder.get(name, 0) + value
        return totals

    def merge_accumulators(self, accumulators):
        merged: dict[str, dict[str, int]] = {}
        for totals in accumulators:
            for folder, sums in totals.items():
                into = merged.setdefault(folder, {})
                for name, value in sums.items():
                    into[name] = into.get(name, 0) + value
        return merged

    def extract_output(self, totals):
        return totals
