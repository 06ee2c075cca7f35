"""A manifest's file entries (docs/design.md §4): inline in manifest.json while there are at most
INLINE_FILE_ENTRIES of them, else in a Parquet file table beside it (FILE_TABLE: one row per
entry, in the manifest's order, row groups of TABLE_ROW_GROUP entries) that the manifest names
with its sha256, entry count and size.

Its one writer is `schemas/table_writer.py`; the one reader is here: `whole_manifest` (every
entry as a model: what the benchmarks compare with; no step of a job reads that), `entry_columns` (some columns as
Arrow arrays, no object per entry: the trainer) and `entry_column_batches` (a row group at a
time), and `EntriesByNumber` (an entry by its file's number, a row group read when asked). In
memory a manifest model always holds its entries inline; only the file written splits them off.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pydantic import TypeAdapter, ValidationError

from schemas.manifest import (
    INSIDE_PATH,
    INSIDE_PATH_RULE,
    FileEntry,
    FileTable,
    ManifestError,
    ShardEntry,
    ShardsManifest,
    first_problem,
)

#: Entries per row group: a reader of one entry decodes at most this many.
TABLE_ROW_GROUP = 65_536

#: A function opening a file (its full path or URL) as a seekable binary file; FileNotFoundError if missing.
Opener = Callable[[str], Any]
Manifest = TypeVar("Manifest")


def entries_field(manifest) -> str:
    """The manifest's field listing its entries: `shards` of a shards manifest, else `files`."""
    return "shards" if isinstance(manifest, ShardsManifest) else "files"


def entry_count(manifest) -> int:
    """How many file entries a manifest lists, inline or in its file table (read or not)."""
    table = manifest.file_table
    return table.entries if table is not None else len(getattr(manifest, entries_field(manifest)))


def entry_model(manifest) -> type[FileEntry]:
    """The model of a manifest's entries (a manifest, or a manifest model)."""
    kind = manifest if isinstance(manifest, type) else type(manifest)
    return ShardEntry if issubclass(kind, ShardsManifest) else FileEntry


def entry_fields(manifest) -> list[str]:
    """The fields of the manifest's entries: the file table's columns."""
    return list(entry_model(manifest).model_fields)


def table_schema(model: type[FileEntry]) -> pa.Schema:
    """The file table's columns: an entry's fields."""
    types = {"path": pa.string(), "sha256": pa.string(), "source_rows": pa.list_(pa.int64())}
    return pa.schema([pa.field(name, types.get(name, pa.int64())) for name in model.model_fields])


def _entries_table(manifest) -> pa.Table:
    """The manifest's inline entries as a file table."""
    return entries_arrow(getattr(manifest, entries_field(manifest)), entry_model(manifest))


@functools.lru_cache(maxsize=4)
def _list_of(model: type[FileEntry]) -> TypeAdapter:
    return TypeAdapter(list[model])  # type: ignore[valid-type]


def entries_of(table: pa.Table, model: type[FileEntry]) -> list:
    """File table rows as entries (`model`), validated in pydantic's core a table at a time:
    faster than constructing each entry in Python. ValidationError where a row is not one."""
    return _list_of(model).validate_python(table.to_pylist())


def entries_arrow(entries, model: type[FileEntry]) -> pa.Table:
    """Entries (models of `model`) as file table rows."""
    schema = table_schema(model)
    return pa.table({name: [getattr(e, name) for e in entries] for name in schema.names}, schema=schema)


def _open_local(path: str):
    return open(path, "rb")


def _table_path(directory: str, reference: FileTable) -> str:
    return f"{str(directory).rstrip('/')}/{reference.path}"


def _open_table(path: str, open_file: Opener, error: Callable[[str], Exception]):
    try:
        return open_file(path)
    except FileNotFoundError:
        raise error(f"{path}: the file table the manifest names is missing") from None


def _checked(table: pq.ParquetFile, reference: FileTable, path: str, columns, error) -> None:
    if table.metadata.num_rows != reference.entries:
        raise error(f"{path}: {table.metadata.num_rows} entries, the manifest says {reference.entries}")
    missing = [name for name in columns if name not in table.schema_arrow.names]
    if missing:
        raise error(f"{path}: no column {', '.join(missing)} in the file table")


def _hashed_table(path: str, reference: FileTable, open_file: Opener, error) -> bytes:
    """The file table's bytes, their size and sha256 checked against the manifest's reference."""
    with _open_table(path, open_file, error) as f:
        data = f.read()
    if len(data) != reference.bytes:
        raise error(f"{path}: {len(data)} bytes, the manifest says {reference.bytes}")
    digest = hashlib.sha256(data).hexdigest()
    if digest != reference.sha256:
        raise error(f"{path}: sha256 {digest} differs from the manifest's {reference.sha256}")
    return data


def whole_manifest(
    manifest: Manifest,
    directory: str,
    open_file: Opener = _open_local,
    error: Callable[[str], Exception] = ManifestError,
) -> Manifest:
    """The manifest with every entry inline: read from its file table (size, sha256 and entry
    count checked; `error` makes the error, naming the table) when it has one, else as it is."""
    reference = manifest.file_table  # type: ignore[attr-defined]
    if reference is None:
        return manifest
    path = _table_path(directory, reference)
    data = _hashed_table(path, reference, open_file, error)
    model = entry_model(manifest)
    names = list(model.model_fields)
    try:
        parquet = pq.ParquetFile(pa.BufferReader(data))
    except pa.ArrowInvalid as err:
        raise error(f"{path}: not a Parquet file table ({err})") from None
    _checked(parquet, reference, path, names, error)
    try:  # validated in pydantic's core: faster than constructing each entry in Python
        entries = entries_of(parquet.read(columns=names), model)
    except ValidationError as err:
        raise error(f"{path}: entries not as a manifest's ({first_problem(err)})") from None
    return manifest.model_copy(update={entries_field(manifest): entries, "file_table": None})  # type: ignore[attr-defined]


def entry_columns(
    manifest,
    directory: str,
    columns: list[str],
    *,
    open_file: Opener = _open_local,
    error: Callable[[str], Exception] = ManifestError,
    hashed: bool = False,
) -> pa.Table:
    """Only these columns of the manifest's entries (in its order), read from its file table
    (entry count checked; with `hashed`, the whole table read and its size and sha256 checked
    too, as a reader that verifies files against the table must) or made from its inline
    entries: no Python object per entry."""
    reference = manifest.file_table
    if reference is None:
        return _entries_table(manifest).select(columns)
    path = _table_path(directory, reference)
    f = (
        pa.BufferReader(_hashed_table(path, reference, open_file, error))
        if hashed
        else _open_table(path, open_file, error)
    )
    try:
        parquet = pq.ParquetFile(f)
        _checked(parquet, reference, path, columns, error)
        table = parquet.read(columns=columns).combine_chunks()
    except pa.ArrowInvalid as err:
        raise error(f"{path}: not a Parquet file table ({err})") from None
    finally:
        f.close()
    return _paths_inside(table, path, error)


def entry_column_batches(
    manifest,
    directory: str,
    columns: list[str],
    *,
    open_file: Opener = _open_local,
    error: Callable[[str], Exception] = ManifestError,
    batch_entries: int = TABLE_ROW_GROUP,
) -> Iterator[pa.Table]:
    """`entry_columns` `batch_entries` at a time, for a step that goes through a
    manifest's files one by one: it never holds a column of all of them (457,764 chunk files'
    paths at 3·10^10 chunks)."""
    reference = manifest.file_table
    if reference is None:
        yield _entries_table(manifest).select(columns)
        return
    path = _table_path(directory, reference)
    f = _open_table(path, open_file, error)
    try:
        parquet = pq.ParquetFile(f)
        _checked(parquet, reference, path, columns, error)
        for batch in parquet.iter_batches(batch_size=batch_entries, columns=columns):
            yield _paths_inside(pa.Table.from_batches([batch]), path, error)
    except pa.ArrowInvalid as err:
        raise error(f"{path}: not a Parquet file table ({err})") from None
    finally:
        f.close()


def _paths_inside(table: pa.Table, path: str, error) -> pa.Table:
    """The table, its paths checked to stay inside the directory: read without the entry
    model, they are checked here as the model checks them."""
    if "path" in table.column_names:
        inside = pc.match_substring_regex(table["path"], INSIDE_PATH)
        if not pc.all(inside).as_py():
            outside = table["path"].filter(pc.invert(inside))[0].as_py()
            raise error(f"{path}: entry path {outside!r} is not {INSIDE_PATH_RULE}")
    return table


_FILE_NUMBER = r"-(?P<number>\d+)(?:\.[\w.]+)?$"  # as `pipeline.common.names.file_number` reads it


def _numbers(paths) -> np.ndarray:
    """Each path's file number (-1 where it has none, or one past an int64)."""
    digits = pc.struct_field(pc.extract_regex(paths, _FILE_NUMBER), "number")
    fits = pc.fill_null(pc.less_equal(pc.utf8_length(digits), 18), False)
    return pc.fill_null(pc.cast(pc.if_else(fits, digits, None), pa.int64()), -1).to_numpy()


def _hashed_streamed(path: str, reference: FileTable, open_file: Opener, error) -> None:
    """The file table's size and sha256 checked against the manifest, read a block at a time."""
    digest, size = hashlib.sha256(), 0
    with _open_table(path, open_file, error) as f:
        while block := f.read(1 << 20):
            digest.update(block)
            size += len(block)
    if size != reference.bytes:
        raise error(f"{path}: {size} bytes, the manifest says {reference.bytes}")
    if digest.hexdigest() != reference.sha256:
        raise error(f"{path}: sha256 {digest.hexdigest()} differs from the manifest's {reference.sha256}")


class EntriesByNumber:
    """A manifest's entries looked up by their file's number (`<prefix>-NNNNN.<ext>`), without
    an object per entry: the file table checked against the manifest once (streamed), each row
    group's lowest and highest number kept, and the row group holding a number read when it is
    asked for, the last one kept (a reader asking for consecutive numbers reads each row group
    once). Inline entries (at most INLINE_FILE_ENTRIES) are looked up as they are."""

    def __init__(self, manifest, directory: str, *, open_file: Opener = _open_local, error=ManifestError):
        self._model = entry_model(manifest)
        self._inline: dict | None = None
        reference = manifest.file_table
        if reference is None:
            entries = getattr(manifest, entries_field(manifest))
            numbers = _numbers(pa.array([e.path for e in entries], pa.string()))
            self._inline = dict(zip(numbers.tolist(), entries))
            return
        self._path, self._open, self._error = _table_path(directory, reference), open_file, error
        _hashed_streamed(self._path, reference, open_file, error)
        names = list(self._model.model_fields)
        lows, highs = [], []
        with _open_table(self._path, open_file, error) as f:
            parquet = pq.ParquetFile(f)
            _checked(parquet, reference, self._path, names, error)
            for group in range(parquet.num_row_groups):
                numbers = _numbers(parquet.read_row_group(group, columns=["path"])["path"])
                lows.append(numbers.min(initial=np.iinfo(np.int64).max))
                highs.append(numbers.max(initial=-1))
        self._lows, self._highs = np.array(lows, np.int64), np.array(highs, np.int64)
        self._held: tuple[int, pa.Table, np.ndarray] | None = None  # (row group, its table, its numbers)

    def get(self, number: int):
        """The entry whose file has this number (the first listed), or None."""
        if self._inline is not None:
            return self._inline.get(number)
        held = -1 if self._held is None else self._held[0]
        candidates = np.flatnonzero((self._lows <= number) & (number <= self._highs)).tolist()
        # the group held first, then the narrowest: where entries are not listed in number order
        for group in sorted(candidates, key=lambda g: (g != held, self._highs[g] - self._lows[g])):
            table, numbers = self._group(group)
            at = np.flatnonzero(numbers == number)
            if len(at):
                return self._model(**table.slice(int(at[0]), 1).to_pylist()[0])
        return None

    def _group(self, group: int) -> tuple[pa.Table, np.ndarray]:
        if self._held is None or self._held[0] != group:
            self._held = None  # the one held goes before the next is read
            with _open_table(self._path, self._open, self._error) as f:
                table = pq.ParquetFile(f).read_row_group(group, columns=list(self._model.model_fields))
            table = _paths_inside(table, self._path, self._error)
            self._held = (group, table, _numbers(table["path"]))
        return self._held[1], self._held[2]


def entry_groups(
    manifest, directory: str, *, open_file: Opener = _open_local, error: Callable[[str], Exception] = ManifestError
) -> int:
    """How many row groups of entries `entry_group` reads (1 for inline entries), the file table
    checked against the manifest first (size and sha256, streamed): a job that hands each row
    group to a worker checks the table once, where it plans."""
    reference = manifest.file_table
    if reference is None:
        return 1
    path = _table_path(directory, reference)
    _hashed_streamed(path, reference, open_file, error)
    with _open_table(path, open_file, error) as f:
        parquet = pq.ParquetFile(f)
        _checked(parquet, reference, path, entry_fields(manifest), error)
        return parquet.num_row_groups


def entry_group_columns(
    manifest,
    directory: str,
    group: int,
    columns: list[str],
    *,
    open_file: Opener = _open_local,
    error: Callable[[str], Exception] = ManifestError,
) -> pa.Table:
    """These columns of one row group of the manifest's file table (inline entries: group 0),
    its paths checked to stay inside the directory."""
    reference = manifest.file_table
    if reference is None:
        return _entries_table(manifest).select(columns)
    path = _table_path(directory, reference)
    with _open_table(path, open_file, error) as f:
        try:
            table = pq.ParquetFile(f).read_row_group(group, columns=columns)
        except pa.ArrowInvalid as err:
            raise error(f"{path}: not a Parquet file table ({err})") from None
    return _paths_inside(table, path, error)


def entry_group(
    manifest,
    directory: str,
    group: int,
    *,
    open_file: Opener = _open_local,
    error: Callable[[str], Exception] = ManifestError,
) -> list:
    """The entries (`FileEntry`, or `ShardEntry`) of one row group of the manifest's file table
    (of `entry_groups`), validated as a whole manifest's are; inline entries are group 0."""
    reference = manifest.file_table
    if reference is None:
        return list(getattr(manifest, entries_field(manifest)))
    path, model = _table_path(directory, reference), entry_model(manifest)
    with _open_table(path, open_file, error) as f:
        try:
            table = pq.ParquetFile(f).read_row_group(group, columns=list(model.model_fields))
        except pa.ArrowInvalid as err:
            raise error(f"{path}: not a Parquet file table ({err})") from None
    try:
        return entries_of(table, model)
    except ValidationError as err:
        raise error(f"{path}: entries not as a manifest's ({first_problem(err)})") from None
