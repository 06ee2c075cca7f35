"""The shard rules `validate` checks: a shard (its bytes, metadata, rows, neighbours), the
references it makes into the chunk files, each chunk file read once to check them (and, when
sampled, against `pipeline.check.rules`), and that no sequence is in two shards
(docs/design.md §5).
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from pipeline.check.chunk_reads import ChunkRowsRead, read_row_groups, read_whole
from pipeline.check.facts import ChunkFileChecked, ChunkFileUnit, IndexFacts, ShardsFacts
from pipeline.check.problems import ValidationFailed, of_kind, read_checked, require
from pipeline.check.rules import check_chunk_rules
from pipeline.chunks.chunk_files import ChunkFileRanges
from pipeline.common import fileio
from pipeline.common.arrays import ranges_of
from pipeline.shards.rows import input_tokens, rows_per_source
from schemas.arrow import check_schema_version, read_shard_table, shard_column, shard_column_problems, shard_sources
from schemas.manifest import ShardEntry
from schemas.shard_columns import ShardDims

REFERENCE = np.dtype(
    [
        ("chunk_id", "<i8"),
        ("seq_id", "<i8"),
        ("own", "?"),
        ("docs_start", "<i8"),
        ("docs_count", "<i4"),
        ("tokens_hash", "<u8"),  # `token_hash` of its tokens (an own chunk: its m; a neighbour: its 2m)
    ]
)


@functools.lru_cache(maxsize=4)
def _weights(width: int) -> np.ndarray:
    return np.random.default_rng(0x5EED).integers(0, 2**63, width, dtype=np.uint64) * np.uint64(2) + np.uint64(1)


def token_hash(tokens: np.ndarray) -> np.ndarray:
    """8 bytes per row of tokens [r, w], what a reference carries instead of its tokens (512
    bytes at m = 64): each token times an odd weight of its position, summed mod 2^64, so rows
    that differ in one token always differ in hash (odd weights are invertible mod 2^64)."""
    return (tokens.astype(np.uint64) * _weights(tokens.shape[1])).sum(axis=1, dtype=np.uint64)


def _reference_hash(tokens: np.ndarray, own: np.ndarray, m: int) -> np.ndarray:
    """A reference's `tokens_hash` from its row [r, 2m]: an own chunk's m tokens, a neighbour's 2m."""
    return np.where(own, token_hash(tokens[:, :m]), token_hash(tokens))


@dataclass(frozen=True)
class ReferenceBlock:
    """References into one chunk file: which chunk, which sequence, neighbour or the
    sequence's own chunk, where its doc ids are in `docs`, the hash of its tokens; the doc ids."""

    refs: np.ndarray
    docs: np.ndarray


@dataclass(frozen=True)
class ShardResult:
    path: str
    first_seq: int
    last_seq: int
    references: dict = field(repr=False)  # chunk file number -> ReferenceBlock
    source_counts: tuple[tuple[int, int], ...] = ()  # (rows, input tokens not padding) per source

    @property
    def summary(self) -> tuple:
        """What `check_shards_together` takes of it."""
        return self.first_seq, self.last_seq, self.path, self.source_counts


def _contains(docs: np.ndarray, starts: np.ndarray, counts: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """Per reference r: is wanted[r] among docs[starts[r] : starts[r] + counts[r]]?"""
    owner = np.repeat(np.arange(len(starts)), counts)
    hits = np.asarray(docs[ranges_of(starts, counts)]) == wanted[owner]
    return np.bincount(owner, weights=hits, minlength=len(starts)) > 0


def _shard_references(
    shards: ShardsFacts,
    table: pa.Table,
    *,
    present: np.ndarray,
    ids: np.ndarray,
    neighbours: np.ndarray,
    tokens: np.ndarray,
) -> dict[int, ReferenceBlock]:
    """A shard's references, grouped by the chunk file holding their chunk."""
    m, pad, L = shards.chunk_tokens, shards.pad_id, shards.chunks_per_sequence
    seq_ids = table["seq_id"].to_numpy()
    doc_lists = table["doc_ids"].combine_chunks()
    doc_offsets = doc_lists.offsets.to_numpy()
    doc_values = doc_lists.values.to_numpy()
    row, j, slot = np.nonzero(present)
    chunk_id, value, own = ids[row, j, slot], neighbours[row, j, slot], np.zeros(len(row), bool)
    if shards.same_corpus:  # sequence s holds chunks s·L ... s·L + L - 1
        own_row, own_j = np.divmod(np.arange(len(seq_ids) * L), L)
        own_value = np.full((len(own_row), 2 * m), pad, np.int32)
        own_value[:, :m] = tokens[:, : L * m].reshape(-1, m)  # row-major: (own_row, own_j)
        row, chunk_id = np.concatenate([row, own_row]), np.concatenate([chunk_id, seq_ids[own_row] * L + own_j])
        value, own = np.concatenate([value, own_value]), np.concatenate([own, np.ones(len(own_row), bool)])
    numbers = shards.chunks.files_of(chunk_id)
    blocks = {}
    for number in np.unique(numbers):
        here = numbers == number
        rows_here = np.unique(row[here])
        counts = doc_offsets[rows_here + 1] - doc_offsets[rows_here]
        docs = doc_values[ranges_of(doc_offsets[rows_here], counts)]
        local_start = np.cumsum(counts) - counts
        where = np.searchsorted(rows_here, row[here])
        refs = np.zeros(int(here.sum()), REFERENCE)
        refs["chunk_id"], refs["seq_id"], refs["own"] = chunk_id[here], seq_ids[row[here]], own[here]
        refs["docs_start"], refs["docs_count"] = local_start[where], counts[where]
        refs["tokens_hash"] = _reference_hash(value[here], own[here], m)
        blocks[int(number)] = ReferenceBlock(refs, docs.astype(np.int64))
    return blocks


@of_kind("shard")
def check_shard(shards: ShardsFacts, entry: ShardEntry) -> ShardResult:
    """One shard: its bytes, schema metadata, rows, shapes, sequence ids, absent neighbours;
    returns its references for the chunk files to check."""
    n, m, k, pad, L = (
        shards.sequence_tokens,
        shards.chunk_tokens,
        shards.neighbours,
        shards.pad_id,
        shards.chunks_per_sequence,
    )
    path = fileio.join(shards.directory, entry.path)
    table = read_shard_table(pa.BufferReader(read_checked(shards.directory, entry)))
    meta = {key.decode(): value.decode() for key, value in (table.schema.metadata or {}).items()}
    version = check_schema_version(meta.get("schema_version"), path)
    for key, value in shards.metadata:
        require(meta.get(key) == value, f"{path}: metadata {key}={meta.get(key)} disagrees with the manifest")
    require(table.num_rows == entry.rows, f"{path}: {table.num_rows} rows, manifest says {entry.rows}")
    columns = shard_column_problems(table.schema, ShardDims(n, m, k), version)
    require(not columns, f"{path}: with n={n} m={m} k={k}, {'; '.join(columns)}")
    seq_ids = table["seq_id"].to_numpy()
    tokens = shard_column(table, "tokens")
    neighbours = shard_column(table, "neighbours")
    ids = shard_column(table, "neighbour_ids")
    scores = shard_column(table, "neighbour_scores")
    require(len(seq_ids) > 0 and (np.diff(seq_ids) > 0).all(), f"{path}: seq_ids are not sorted and unique")
    require(
        not shards.same_corpus or (seq_ids[0] >= 0 and (seq_ids[-1] + 1) * L <= shards.chunks.num_chunks),
        f"{path}: seq_ids point outside the chunk database (training_corpus: same)",
    )
    row_docs = table["doc_ids"].combine_chunks().flatten().to_numpy()
    removed = row_docs[np.isin(row_docs, np.array(shards.removed_doc_ids, np.int64))]
    require(
        not len(removed),
        f"{path}: a sequence holds document {removed[:1].tolist()}, removed as a near-duplicate of an evaluation "
        "document",
    )
    present = ids >= 0
    require(
        (ids < shards.chunks.num_chunks).all() and (present | (ids == -1)).all(),
        f"{path}: neighbour_ids point outside the chunk database",
    )
    require(
        not shards.deleted.contains(ids[present]).any(),
        f"{path}: a neighbour is a chunk of a document deleted from the index",
    )
    if shards.same_corpus:
        own = (seq_ids[:, None] * L + np.arange(L)).ravel()
        require(
            not shards.deleted.contains(own).any(),
            f"{path}: a sequence holds a chunk of a document deleted from the index (training_corpus: same)",
        )
    require(
        (neighbours[~present] == pad).all() and (scores[~present] == 0).all(),
        f"{path}: an absent neighbour (id -1) is not padding",
    )
    filled = int(present.sum())
    require(
        entry.neighbour_slots_filled in (None, filled),
        f"{path}: {filled} neighbour slots filled, manifest says {entry.neighbour_slots_filled}",
    )
    return ShardResult(
        path,
        int(seq_ids[0]),
        int(seq_ids[-1]),
        _shard_references(shards, table, present=present, ids=ids, neighbours=neighbours, tokens=tokens),
        _source_counts(shards, table, tokens, entry),
    )


def _source_counts(shards: ShardsFacts, table, tokens: np.ndarray, entry: ShardEntry) -> tuple[tuple[int, int], ...]:
    """A shard's source column checked (its dictionary the blend's names, or one name; its rows
    per source those its entry counts) -> its (rows, input tokens not padding) per source."""
    path = fileio.join(shards.directory, entry.path)
    names, sources = shard_sources(table)
    expected = shards.sources or names[:1]
    require(names == expected, f"{path}: source names {list(names)}, the manifest's {list(expected)}")
    require(
        len(sources) == 0 or (sources.min() >= 0 and sources.max() < len(names)),
        f"{path}: a source index outside its {len(names)} names",
    )
    rows = rows_per_source(sources, len(names))
    require(
        entry.source_rows == (rows if shards.sources else None),
        f"{path}: {rows} rows per source, manifest says "
        + ("nothing (a blend's entries count them)" if entry.source_rows is None else str(entry.source_rows)),
    )
    tokens_of = np.bincount(sources.astype(np.int64), weights=input_tokens(tokens, shards.pad_id), minlength=len(names))
    return tuple(zip(rows, tokens_of.astype(np.int64).tolist()))


@of_kind("reference")
def check_references(chunks: ChunkFileRanges, unit: ChunkFileUnit, read: ChunkRowsRead, block: ReferenceBlock) -> None:
    """References into a chunk file (`read`: its rows they point at): a neighbour's tokens are
    the chunk and its continuation and it is from none of the sequence's documents; a
    sequence's own chunks hold its tokens and their documents are among its doc_ids."""
    refs, docs, rows = block.refs, block.docs, read.rows
    m = rows.tokens.shape[1]
    local = read.at[np.searchsorted(read.asked, refs["chunk_id"] - chunks.start(unit.number))]
    path = fileio.join(chunks.directory, unit.entry.path)
    require(
        np.array_equal(rows.chunk_id[local], refs["chunk_id"]),
        f"{path} does not hold the chunk ids its manifest implies",
        "chunk file",
    )
    expected = np.concatenate([rows.tokens[local], rows.continuation[local]], axis=1)
    own = refs["own"]
    wrong = _reference_hash(expected, own, m) != refs["tokens_hash"]
    if wrong.any():
        first = np.flatnonzero(wrong)[0]
        what = "tokens differ from its chunks" if own[first] else "neighbour tokens differ from the chunk database"
        raise ValidationFailed(f"seq {refs['seq_id'][first]}: {what} (chunk {refs['chunk_id'][first]}, {path})")
    chunk_docs = rows.doc_id[local]
    inside = _contains(docs, refs["docs_start"], refs["docs_count"], chunk_docs)
    leak = ~own & inside
    if leak.any():
        first = np.flatnonzero(leak)[0]
        raise ValidationFailed(
            f"seq {refs['seq_id'][first]} has a neighbour from its own "
            f"document {chunk_docs[first]} (chunk {refs['chunk_id'][first]})"
        )
    missing = own & ~inside
    if missing.any():
        first = np.flatnonzero(missing)[0]
        raise ValidationFailed(
            f"seq {refs['seq_id'][first]}: doc_ids miss document {chunk_docs[first]}, which it holds"
        )


def check_chunk_file(chunks: ChunkFileRanges, unit: ChunkFileUnit, blocks, index: IndexFacts | None):
    """A chunk file, read once: whole and against the rules when it is sampled (and `index` is
    the index being validated), else only the row groups the references (`blocks`, iterable
    twice, or None) point into; then against the references. Yields what it read (with the
    summary) before the references are checked, so a caller that gathers problems keeps it for
    the checks across files."""
    if unit.sampled:
        read = read_whole(chunks.directory, unit.entry)
    elif blocks:
        start = chunks.start(unit.number)
        local = np.unique(np.concatenate([block.refs["chunk_id"] for block in blocks]) - start)
        require(
            local[0] >= 0 and local[-1] < unit.entry.rows,
            f"{fileio.join(chunks.directory, unit.entry.path)}: references outside the file",
            "reference",
        )
        read = read_row_groups(chunks.directory, unit.entry, local)
    else:
        return
    rules = index is not None and unit.sampled
    summary = check_chunk_rules(index, unit.number, read.rows) if rules else None
    yield ChunkFileChecked(read.bytes_read, summary)
    for block in blocks or ():
        check_references(chunks, unit, read, block)


SEQ_BLOCK = 1 << 20  # seq ids whose shards the job sums together before it merges the blocks


@dataclass
class ShardsTogether:
    """The shards checked, summed (`add` a `ShardResult.summary`, `merge` another): their seq_id
    ranges as sorted, disjoint intervals with touching ones joined (dense seq ids in shards
    taken in order are one interval however many shards), an overlap found, and rows and tokens
    per source. Taken in random order the intervals are up to a quarter of the shards until the
    gaps close, so the job sums the shards of each SEQ_BLOCK of seq ids apart (about a
    thousand shards) and then merges the blocks' sums."""

    intervals: list = field(default_factory=list)  # [first, last, path at first, path at last]
    overlap: str | None = None
    source_counts: np.ndarray | None = None  # [sources, 2]

    def add(self, first: int, last: int, path: str, counts: tuple) -> ShardsTogether:
        self._insert([first, last, path, path])
        self._count(np.array(counts, np.int64).reshape(-1, 2))
        return self

    def merge(self, other: ShardsTogether) -> ShardsTogether:
        for interval in other.intervals:
            self._insert(list(interval))
        if other.overlap is not None:
            self._overlaps(other.overlap)
        if other.source_counts is not None:
            self._count(other.source_counts)
        return self

    def _count(self, counts: np.ndarray) -> None:
        self.source_counts = counts if self.source_counts is None else self.source_counts + counts

    def _overlaps(self, message: str) -> None:
        self.overlap = message if self.overlap is None else min(self.overlap, message)

    def _insert(self, interval: list) -> None:
        at = bisect.bisect_left(self.intervals, interval[0], key=lambda kept: kept[0])
        for neighbour in self.intervals[max(0, at - 1) : at + 1]:
            if neighbour[0] <= interval[1] and interval[0] <= neighbour[1]:
                first, last, a, b = neighbour
                shards = a if a == b else f"the shards {a} ... {b}"
                return self._overlaps(
                    f"{interval[2]}: seq_ids {interval[0]}..{interval[1]} overlap {first}..{last} of {shards} "
                    "(a duplicate sequence?)"
                )
        before = self.intervals[at - 1] if at > 0 else None
        if before is not None and before[1] + 1 == interval[0]:
            before[1], before[3], interval, at = interval[1], interval[3], before, at - 1
        else:
            self.intervals.insert(at, interval)
        after = self.intervals[at + 1] if at + 1 < len(self.intervals) else None
        if after is not None and interval[1] + 1 == after[0]:
            interval[1], interval[3] = after[1], after[3]
            del self.intervals[at + 1]
        return None


@of_kind("shard")
def check_shards_together(together: ShardsTogether, shards: ShardsFacts) -> None:
    """No sequence in two shards, and (every shard checked) a blend's rows and tokens per source
    those its manifest counts."""
    require(together.overlap is None, str(together.overlap))
    if shards.source_totals is None:
        return
    counted = np.zeros((len(shards.sources), 2), np.int64)
    if together.source_counts is not None:
        counted += together.source_counts
    for name, got, said in zip(shards.sources, counted.tolist(), shards.source_totals):
        require(
            tuple(got) == tuple(said),
            f"{shards.directory}: source {name} has {got[0]} rows and {got[1]} tokens in the shards, "
            f"manifest says {said[0]} and {said[1]}",
        )
