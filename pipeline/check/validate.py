"""`validate`: check an index or shard directory end to end against docs/design.md §4-5.

Every check is a function of one unit that reads the committed files themselves (never the
pipeline's memory): a listed file, a shard, a chunk file with the references into it, an
embedding file. The in-process check here and the Beam job (`pipeline.check.validate_beam`) run the
same functions, each holding one unit at a time:

- every file a manifest lists: its size and sha256 (streamed, or while it is read below);
- index: each chunk file against the rules, the rows across the boundaries between chunk
  files (continuations), the document runs, each embedding file, then the faiss index
  against probes taken from the embedding files checked;
- shards: each shard; its neighbours (and, for `training_corpus: same`, the sequence's own
  chunks) become references (each with an 8-byte hash of its tokens) grouped by the chunk
  file holding their chunk (on local disk here, a GroupByKey in the job), and each chunk file
  is read once to check them: tokens equal the chunk database, no neighbour from the
  sequence's documents.

With `sample` < 1, ceil(sample x count) shards, chunk files and embedding files are checked,
chosen by a hash of their file names (the same ones every time, at least one of each), plus
the references of the sampled shards against the Parquet row groups they fall in; every other
listed file by its size, a row group of the file table at a time (`fileio.sizes`; with
`hash_all`, by its sha256 too);
the faiss index is not searched.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field

import numpy as np

from pipeline.check.facts import ChunkFileEnds, ChunkFileUnit, EmbeddingFileUnit, IndexFacts, ListedFile, ListedSizes
from pipeline.check.plan import ValidationPlan, plan_validation
from pipeline.check.problems import check_listed_file, check_listed_sizes
from pipeline.check.rules import (
    check_chunk_boundaries,
    check_document_runs,
    check_embedding_file,
    check_faiss_index,
)
from pipeline.check.shard_rules import (
    REFERENCE,
    ReferenceBlock,
    ShardsTogether,
    check_chunk_file,
    check_shard,
    check_shards_together,
)
from pipeline.check.units import units
from schemas.manifest import ShardEntry

PROBLEMS_KEPT = 10  # problems of each kind a failed Beam job reports in full

REFERENCE_BLOCK = 65536  # references checked at a time against a chunk file
DOCUMENTS_PER_BUCKET = 1 << 22  # document starts made unique at a time (32 MB of doc ids)


class _References:
    """Per chunk file, on local disk: the reference blocks of every shard checked, appended
    (refs, the doc ids), read back in blocks of REFERENCE_BLOCK."""

    def __init__(self, root: str):
        self.root = root
        self.docs_written: dict[int, int] = {}  # chunk file number -> doc ids appended

    def _path(self, number: int, kind: str) -> str:
        return os.path.join(self.root, f"{number}.{kind}")

    def add(self, number: int, block: ReferenceBlock) -> None:
        refs = block.refs.copy()
        refs["docs_start"] += self.docs_written.get(number, 0)
        for kind, array in (("refs", refs), ("docs", block.docs)):
            with open(self._path(number, kind), "ab") as f:
                f.write(np.ascontiguousarray(array).tobytes())
        self.docs_written[number] = self.docs_written.get(number, 0) + len(block.docs)

    def of(self, number: int) -> _FileReferences | None:
        return _FileReferences(self, number) if number in self.docs_written else None

    def blocks(self, number: int):
        refs = np.memmap(self._path(number, "refs"), REFERENCE, "r")
        docs = np.memmap(self._path(number, "docs"), np.int64, "r")
        for begin in range(0, len(refs), REFERENCE_BLOCK):
            yield ReferenceBlock(np.array(refs[begin : begin + REFERENCE_BLOCK]), docs)


@dataclass(frozen=True)
class _FileReferences:
    """The references into one chunk file, read from disk each time they are iterated."""

    references: _References
    number: int

    def __iter__(self):
        return self.references.blocks(self.number)


class _DocumentStarts:
    """The doc ids that start a run of chunks, spilled to local disk in buckets by doc id, so
    counting the distinct ones holds one bucket (DOCUMENTS_PER_BUCKET ids) at a time."""

    def __init__(self, root: str, documents: int):
        self.buckets = max(1, -(-documents // DOCUMENTS_PER_BUCKET))
        self.files = [open(os.path.join(root, f"starts.{b}"), "w+b") for b in range(self.buckets)]
        self.runs = 0

    def add(self, doc_ids: np.ndarray) -> None:
        self.runs += len(doc_ids)
        bucket = doc_ids.view(np.uint64) % np.uint64(self.buckets)
        for b in np.unique(bucket):
            self.files[b].write(np.ascontiguousarray(doc_ids[bucket == b]).tobytes())

    def distinct(self) -> int:
        count = 0
        for f in self.files:
            f.flush()
            f.seek(0)
            count += len(np.unique(np.frombuffer(f.read(), np.int64)))
        return count

    def close(self) -> None:
        for f in self.files:
            f.close()


@dataclass(frozen=True)
class InProcessRun:
    lines: list[str]  # the plan's lines
    chunk_bytes_read: int  # chunk-file bytes read to check rows (whole files, row groups), hashing apart


def run_in_process(plan: ValidationPlan) -> InProcessRun:
    """Run the plan in this process, one unit at a time: references and document starts on
    local disk, of the chunk files only the boundary rows not yet matched with a neighbour's
    held. Raises ValidationFailed at the first problem."""
    for listed in units(plan, (ListedFile, ListedSizes)):
        if isinstance(listed, ListedFile):
            check_listed_file(listed.directory, listed.entry)
        else:
            check_listed_sizes(listed.directory, list(listed.entries))
    with tempfile.TemporaryDirectory(prefix="ratrain-validate-") as scratch:
        references = _References(scratch)
        starts = _DocumentStarts(scratch, plan.index.num_documents if plan.index else 0)
        try:
            bytes_read = _check_chunk_files(plan, references, starts)
        finally:
            starts.close()
    probes = [check_embedding_file(plan.index, unit, plan.probes_per_file) for unit in units(plan, EmbeddingFileUnit)]
    if plan.faiss_index is not None:
        check_faiss_index(plan.faiss_index, probes)
    return InProcessRun(list(plan.lines), bytes_read)


class _Boundaries:
    """The check across chunk-file boundaries as the Beam job keys it: boundary b between files
    b - 1 and b (0 and `count`: the first file's start, the last one's end), checked once both
    sides (or its one side) came, whatever order the files come in."""

    def __init__(self, index: IndexFacts):
        self.waiting: dict[int, list[ChunkFileEnds]]
        self.index, self.waiting = index, {}  # boundary -> the one side come

    def add(self, ends: ChunkFileEnds) -> None:
        for boundary in (ends.number, ends.number + 1):
            sides = self.waiting.pop(boundary, []) + [ends]
            if len(sides) == 2 or boundary in (0, self.index.chunks.num_files):
                check_chunk_boundaries(self.index, sides)
            else:
                self.waiting[boundary] = sides


def _check_chunk_files(plan: ValidationPlan, references: _References, starts: _DocumentStarts) -> int:
    """The shards, then the chunk files with the references into them; returns the chunk-file
    bytes read."""
    bytes_read, files = 0, 0
    together = ShardsTogether()
    for entry in units(plan, ShardEntry):
        result = check_shard(plan.shards, entry)
        for number, block in result.references.items():
            references.add(number, block)
        together.add(*result.summary)
    if plan.shards is not None:
        check_shards_together(together, plan.shards)
    boundaries = _Boundaries(plan.index) if plan.index is not None else None
    for unit in units(plan, ChunkFileUnit):
        assert plan.chunks is not None  # a plan with chunk files has their database
        for checked in check_chunk_file(plan.chunks, unit, references.of(unit.number), plan.index):
            bytes_read += checked.bytes_read
            if checked.summary is not None:
                files += 1
                starts.add(checked.summary.doc_starts)
                assert boundaries is not None  # a summary comes from the rules of the index validated
                boundaries.add(checked.summary.ends)
    if plan.index is not None:
        check_document_runs(plan.index, starts.runs, starts.distinct(), files)
    return bytes_read


def check_in_process(plan: ValidationPlan) -> list[str]:
    """`run_in_process`: the plan's lines, or ValidationFailed at the first problem."""
    return run_in_process(plan).lines


def validate_index(directory: str) -> str:
    return check_in_process(plan_validation(directory))[0]


def validate_shards(directory: str, index_directory: str | None = None) -> str:
    return check_in_process(plan_validation(directory, index_directory=index_directory))[0]


def validate_path(
    path: str, sample: float = 1.0, commits: dict[str, int] | None = None, *, hash_all: bool = False
) -> list[str]:
    """Validate an index dir, a shards dir, or an output dir holding both, in this process
    (`commits`, `hash_all`: as `plan_validation`'s)."""
    return check_in_process(plan_validation(path, sample, commits=commits, hash_all=hash_all))


@dataclass
class Problems:
    """Problems counted by kind, keeping the PROBLEMS_KEPT first of each in sorted order (the
    same report however the work was split)."""

    counts: dict = field(default_factory=dict)
    kept: dict = field(default_factory=dict)

    def add(self, kind: str, message: str) -> Problems:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        self.kept[kind] = sorted(self.kept.get(kind, []) + [message])[:PROBLEMS_KEPT]
        return self

    def merge(self, other: Problems) -> Problems:
        for kind, count in other.counts.items():
            self.counts[kind] = self.counts.get(kind, 0) + count
            self.kept[kind] = sorted(self.kept.get(kind, []) + other.kept[kind])[:PROBLEMS_KEPT]
        return self

    def verdict(self, path: str, passed_lines: list[str]) -> Verdict:
        return Verdict(not self.counts, tuple(self.report(path) if self.counts else passed_lines))

    def report(self, path: str) -> list[str]:
        """'FAILED path: 3 problems (2 reference, 1 file)' and one line per problem kept."""
        total = sum(self.counts.values())
        kinds = ", ".join(f"{count} {kind}" for kind, count in sorted(self.counts.items()))
        lines = [f"FAILED {path}: {total} problem{'s' if total != 1 else ''} ({kinds})"]
        for kind in sorted(self.counts):
            lines += [f"  {kind}: {message}" for message in self.kept[kind]]
            if self.counts[kind] > len(self.kept[kind]):
                lines.append(f"  {kind}: ... and {self.counts[kind] - len(self.kept[kind])} more")
        return lines


@dataclass(frozen=True)
class Verdict:
    passed: bool
    lines: tuple  # the plan's lines, or the report of the problems found
