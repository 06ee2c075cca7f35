"""build-shards' refresh: shards brought up to date with an index that changed since they were
built, from what changed (`pipeline.retrieve.refresh` says how, per shard), in the same job
and commit as a full build.

Each shard is refreshed where its first chunk's file is read: shards are grouped by that file,
so a process reads a chunk file (and, with new vectors, its embedding file) about once. The
stored rows that stay go on as they are (those of a shard that keeps its file go no further
than their neighbour ids and tallies); the sequences that must be searched go through
`RetrieveNeighbours` as a full build's do, with every kept sequence offered to its probe sample,
so the probes, the depth tuned on them and the recall measured are a full build's. A changed
shard's kept and searched rows meet by shard and are written; a shard none of whose rows
changed keeps its file and its entry.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import apache_beam as beam
import numpy as np

from pipeline.chunks.chunk_files import TrainingChunks
from pipeline.chunks.committed import CommittedChunkFiles
from pipeline.chunks.deleted import DeletedFiles
from pipeline.common import fileio
from pipeline.common.models import embedding_dim
from pipeline.common.names import file_number
from pipeline.retrieve.committed import CommittedIndex, IndexChange
from pipeline.retrieve.file_queries import FileQueries
from pipeline.retrieve.refresh import NewVectors, heads_of, refresh_budget, refresh_shard, with_searched
from pipeline.retrieve.search import LOST_DATA, SEQUENCES_PER_SEARCH
from pipeline.retrieve.sequences import pack_batch
from pipeline.shards.rows import NeighbourIds, RowBatch, Sequence, SequenceBatch, row_tally, rows_of_table
from schemas.arrow import SCHEMA_VERSION, read_shard_table
from schemas.file_table import EntriesByNumber
from schemas.manifest import ShardEntry, ShardsManifest, read_manifest, unversioned
from schemas.measures import ShardsRefresh

log = logging.getLogger("ratrain")

UNCHANGED, SEARCHED, NARROWED, PROBED, IDS = "unchanged", "searched", "narrowed", "probed", "neighbour_ids"
REWRITTEN = "rewritten"  # a changed shard none of whose rows is searched: its RowBatch, written as it is
TALLY = "tally"


@dataclass(frozen=True)
class Refresh:
    """What a refresh starts from: the committed shards (their manifest's fields, its entries
    left in its file table where it has one, and its sha256) and what changed in the index since
    they were built."""

    previous: ShardsManifest
    previous_sha256: str
    change: IndexChange

    def summary(self, to_generation: int | None) -> RefreshSummary:
        assert to_generation is not None  # a refresh follows generations
        return RefreshSummary(self.change.since, self.previous_sha256, to_generation, tuple(self.previous.refreshes))


def committed_refresh(directory: str, index: CommittedIndex, cfg, full: bool) -> Refresh | None:
    """A `Refresh` of the shards committed in `directory` where they can be brought up to date
    with `index`, else None (and why, logged, where they were built from an earlier generation
    of it): none committed, other shard settings, built from no ancestor of the index, a
    rebuild asked for (`full`), or one the refresh cannot do."""
    found = fileio.current_manifest(directory)  # read once: the manifest and its sha256 agree
    if found is None:
        return None
    try:
        # its fields alone: its shard entries (~1 GB of objects at 915,528 shards, an estimate)
        # are looked up by the refreshing workers, by number (`EntriesByNumber`)
        previous = read_manifest(found[1], found[0], ShardsManifest)
    except ValueError:  # an older or foreign manifest: nothing to refresh
        return None
    change = index.change_since(previous.index_generation, previous.index_manifest_sha256)
    if previous.config_hash != cfg.shards_hash() or change is None:
        return None
    added = sum(end - start for start, end in change.new_chunks)
    budget_name = next(
        f"index.{name}" for name in ("min_ram", "slice_bytes", "memory_budget") if getattr(cfg.index, name)
    )
    held = NewVectors.held_bytes(added, embedding_dim(cfg.embedding.model) or 384, cfg.chunk_tokens, index.nlist)
    cannot = (
        "--full asks for it"
        if full
        else f"they were written in schema_version {previous.schema_version}, and kept shards would stay in it"
        if previous.schema_version != SCHEMA_VERSION
        else "a separate training corpus's query embeddings are not kept"
        if cfg.training_corpus != "same"
        else "dedupe_neighbours picks among candidates no shard keeps"
        if cfg.dedupe_neighbours
        else f"the {added:,} new vectors ({held:,} B in each refreshing process) exceed {budget_name}"
        if held > refresh_budget(cfg.index)
        else None
    )
    log.info(
        "build-shards: the shards were built from generation %d of the index, which has changed since (%s): %s",
        change.since,
        change,
        f"every shard is built again ({cannot})" if cannot else "the shards are refreshed from what changed",
    )
    return None if cannot else Refresh(previous, fileio.sha256_bytes(found[1]), change)


@dataclass(frozen=True, kw_only=True)
class RefreshPlan:
    """What each refreshing process needs (small and picklable)."""

    shards_directory: str
    shards_manifest_sha256: str
    chunk_files: CommittedChunkFiles
    deleted: DeletedFiles
    new_chunks: tuple[tuple[int, int], ...]  # the chunk ids the change added
    trained_index: str | None  # an IVF index's file (or its slices' quantizer): the new vectors go in its lists
    depth: int | None  # the depth the new vectors are searched at in those lists
    chunks_per_seq: int
    chunk_tokens: int
    pad_id: int
    shard_rows: int

    @property
    def chunks_per_shard(self) -> int:
        return self.shard_rows * self.chunks_per_seq

    def shards(self) -> int:
        """How many shard numbers the changed database's chunk ids span."""
        return -(-self.chunk_files.num_chunks // self.chunks_per_shard)


@functools.lru_cache(maxsize=1)
def _stored_entries(directory: str, sha256: str) -> EntriesByNumber:
    """The refreshed commit's shard entries by shard number (its manifest, checked by sha256),
    read a row group of its file table at a time: a worker never holds every shard's entry."""
    found = fileio.kept_commit_of(directory, sha256)
    if found is None:
        raise ValueError(f"{directory}: the shards commit being refreshed is no longer kept; run build-shards again")
    return EntriesByNumber(read_manifest(found[1], found[0], ShardsManifest), directory, open_file=fileio.open_read)


@functools.lru_cache(maxsize=1)
def _new_vectors(plan: RefreshPlan) -> NewVectors:
    return NewVectors.read(
        plan.chunk_files, plan.new_chunks, plan.deleted.ranges(), trained=plan.trained_index, depth=plan.depth
    )


def _no_chunks() -> TrainingChunks:
    return TrainingChunks(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros((0, 1), np.int32))


class _TrainingChunkReader:
    """Training chunks (heads) of a chunk-id range, the deleted left out, from the chunk files,
    the last file read kept: a process refreshing a file's shards in order reads it once."""

    def __init__(self, chunk_files: CommittedChunkFiles, deleted):
        self.chunk_files, self.deleted, self.number, self.rows = chunk_files, deleted, -1, _no_chunks()

    def read(self, first: int, end: int) -> TrainingChunks:
        end = min(end, self.chunk_files.num_chunks)
        parts = []
        for number in range(self.chunk_files.file_of(first), self.chunk_files.file_of(end - 1) + 1):
            if number != self.number:
                self.rows, self.number = _no_chunks(), -1  # one file held at a time
                columns = self.chunk_files.read(number, ["doc_id", "tokens"])
                start = self.chunk_files.start(number)
                ids = np.arange(start, start + len(columns["doc_id"]), dtype=np.int64)
                self.rows, self.number = TrainingChunks(ids, columns["doc_id"], columns["tokens"][:, :1]), number
            at = np.flatnonzero((self.rows.chunk_id >= first) & (self.rows.chunk_id < end))
            parts.append(self.rows.take(at))
        chunks = TrainingChunks.concatenate(parts)
        return chunks.take(np.flatnonzero(~self.deleted.contains(chunks.chunk_id)))


def _by_search_batch(sequences: list[Sequence]):
    """The sequences (seq id order) as a SequenceBatch per search batch they fall in."""
    return (batch for _, batch in SequenceBatch(sequences).in_shards(SEQUENCES_PER_SEARCH))


class _RefreshShards(beam.DoFn):
    """(chunk file, the shard numbers whose first chunk it holds) -> per shard: a changed
    shard's kept rows and the seq ids it sends to the search (main: (shard, ("kept",
    RowBatch)), (shard, ("searched", seq ids))), or all its rows where none is searched
    (REWRITTEN); an unchanged one's entry (UNCHANGED) and its
    rows' neighbour ids (IDS) and tallies, its rows staying here; the sequences to search
    (SEARCHED), which of their chunks where not all (NARROWED), the kept sequences searched in
    no part (PROBED), and counters (TALLY)."""

    def __init__(self, plan: RefreshPlan):
        self.plan = plan

    def process(self, keyed):
        plan = self.plan
        C, L, R, m = plan.chunks_per_shard, plan.chunks_per_seq, plan.shard_rows, plan.chunk_tokens
        deleted = plan.deleted.ranges()
        entries = _stored_entries(plan.shards_directory, plan.shards_manifest_sha256)
        new = _new_vectors(plan) if plan.new_chunks else None
        chunks, queries = _TrainingChunkReader(plan.chunk_files, deleted), FileQueries(plan.chunk_files)
        for shard in sorted(keyed[1]):
            entry = entries.get(shard)
            stored = [] if entry is None else rows_of_table(_read_shard(plan.shards_directory, entry))
            training = chunks.read(shard * C, (shard + 1) * C + 1)  # and the chunk after: the last target
            packed = list(pack_batch(shard, [training], L, R, plan.pad_id))
            done = refresh_shard(
                stored,
                packed,
                new=new,
                deleted=deleted,
                queries=lambda ids: queries.block(ids).vectors,
                m=m,
                pad_id=plan.pad_id,
            )
            in_shard = int(np.sum(training.chunk_id < (shard + 1) * C))
            yield beam.pvalue.TaggedOutput(TALLY, ("training_chunks", in_shard))
            for name, count in done.counts.items():
                yield beam.pvalue.TaggedOutput(TALLY, (name, count))
            if entry is not None and not done.changed:
                yield beam.pvalue.TaggedOutput(UNCHANGED, entry)
                kept = RowBatch(done.rows)
                yield beam.pvalue.TaggedOutput(IDS, NeighbourIds.of(kept))
                for name, count in row_tally(kept, m, plan.pad_id):
                    yield beam.pvalue.TaggedOutput(TALLY, (name, count))
            elif done.rows and not done.searched:  # no row to wait for: written without a shuffle to its join
                yield beam.pvalue.TaggedOutput(REWRITTEN, RowBatch(done.rows))
            elif done.rows:
                yield shard, ("kept", RowBatch(done.rows))
            elif entry is not None and not done.searched:  # every sequence of it dropped
                yield beam.pvalue.TaggedOutput(TALLY, ("shards_removed", 1))
            if done.searched:  # each must come back from the search, checked where the shard is assembled
                yield shard, ("searched", np.array([s.seq_id for s in done.searched], np.int64))
            narrowed = set() if done.narrowed is None else set(done.narrowed.seq_ids.tolist())
            probed = [heads_of(row, m) for row in done.rows if row.seq_id not in narrowed]
            for batch in _by_search_batch(probed):
                yield beam.pvalue.TaggedOutput(PROBED, batch)
            for batch in _by_search_batch(done.searched):
                yield beam.pvalue.TaggedOutput(SEARCHED, batch)
            if done.narrowed is not None:
                for _, part in done.narrowed.in_shards(SEQUENCES_PER_SEARCH):  # one per search batch
                    yield beam.pvalue.TaggedOutput(NARROWED, part)


def _read_shard(directory: str, entry: ShardEntry):
    with fileio.open_read(fileio.join(directory, entry.path)) as f:
        return read_shard_table(f)


def _merged_rows(keyed):
    """(shard, its kept rows and the seq ids it sent to the search, the rows searched and which
    of their chunks were searched where not all) -> its RowBatch, in seq id order. A searched
    row that did not come back fails the job (its interim row would be written): nothing is
    committed."""
    shard, grouped = keyed
    parts = list(grouped["refreshed"])
    rows = {row.seq_id: row for kind, batch in parts if kind == "kept" for row in batch.rows}
    sent = sorted(int(i) for kind, ids in parts if kind == "searched" for i in ids)
    came = sorted(row.seq_id for batch in grouped["searched"] for row in batch.rows)
    if came != sent:
        raise RuntimeError(
            f"shard {shard}: {len(came)} searched rows arrived, {len(sent)} were sent: {LOST_DATA}; "
            "nothing is committed"
        )
    narrowed = {
        seq_id: chunks for part in grouped["narrowed"] for seq_id, chunks in zip(part.seq_ids.tolist(), part.chunks)
    }
    for batch in grouped["searched"]:
        for row in batch.rows:
            chunks = narrowed.get(row.seq_id)
            rows[row.seq_id] = row if chunks is None else with_searched(rows[row.seq_id], row, chunks)
    if rows:
        yield RowBatch([rows[seq_id] for seq_id in sorted(rows)])


@dataclass
class Refreshed:
    """What `RefreshShards` gives the job."""

    rows: beam.PCollection  # a RowBatch per changed shard: to write
    unchanged: beam.PCollection  # the ShardEntry of each shard that keeps its file
    neighbour_ids: beam.PCollection  # `NeighbourIds` of the unchanged shards' rows: the recall check's
    retrieved: object  # `Retrieved` of the sequences searched
    tallies: beam.PCollection  # the unchanged shards' rows' tallies among them


class RefreshShards(beam.PTransform):
    """(document spans of the database) -> `Refreshed`: the committed shards brought up to date
    (`plan`), the sequences that need it searched by `RetrieveNeighbours` (`retrieve`)."""

    def __init__(self, plan: RefreshPlan, retrieve: beam.PTransform):
        super().__init__()
        self.plan, self.retrieve = plan, retrieve

    def expand(self, spans):
        plan = self.plan
        C, R, files = plan.chunks_per_shard, plan.shard_rows, plan.chunk_files
        done = (
            spans.pipeline
            | "Once" >> beam.Create([None])
            | "ShardNumbers" >> beam.FlatMap(lambda _: range(plan.shards()))
            | "ByFirstChunkFile" >> beam.Map(lambda shard: (files.file_of(shard * C), shard))
            | "GroupByChunkFile" >> beam.GroupByKey()
            | "Refresh"
            >> beam.ParDo(_RefreshShards(plan)).with_outputs(
                UNCHANGED, SEARCHED, NARROWED, PROBED, IDS, REWRITTEN, TALLY, main="kept"
            )
        )
        searching = {
            "sequences": done[SEARCHED],
            "spans": spans,
            "probed": done[PROBED],
            "searched_chunks": done[NARROWED],
        }
        retrieved = searching | "RetrieveNeighbours" >> self.retrieve
        rows = (
            {
                "refreshed": done.kept,
                "searched": retrieved.rows | "SearchedByShard" >> beam.Map(lambda b: (b.rows[0].seq_id // R, b)),
                "narrowed": done[NARROWED] | "NarrowedByShard" >> beam.Map(lambda c: (int(c.seq_ids[0]) // R, c)),
            }
            | "JoinByShard" >> beam.CoGroupByKey()
            | "MergeRows" >> beam.FlatMap(_merged_rows)
        )
        rows = (rows, done[REWRITTEN]) | "ChangedShards" >> beam.Flatten()
        return Refreshed(rows, done[UNCHANGED], done[IDS], retrieved, done[TALLY])


@dataclass(frozen=True)
class RefreshSummary:
    """What the manifest's record of a refresh needs, small enough for the job's graph: the
    shards refreshed (their generation, their manifest's sha256 and their refreshes), the
    generation they are brought up to."""

    since: int
    shards_sha256: str
    to_generation: int
    earlier: tuple[ShardsRefresh, ...]

    def record(self, rewritten: list[tuple[int, int]], kept: int, removed: int) -> ShardsRefresh:
        """This refresh's record: the numbers of the shards written (`RewrittenRuns`), how many
        were kept and how many removed."""
        return ShardsRefresh(
            from_generation=self.since,
            to_generation=self.to_generation,
            shards_manifest_sha256=self.shards_sha256,
            rewritten=rewritten,
            kept=kept,
            removed=removed,
        )


def number_runs(runs) -> list[tuple[int, int]]:
    """Runs of consecutive numbers (first, last), merged and in order."""
    merged: list[tuple[int, int]] = []
    for first, last in sorted(runs):
        if merged and first <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], last))
        else:
            merged.append((first, last))
    return merged


class RewrittenRuns(beam.CombineFn):
    """The file numbers of the shards a refresh wrote (their entries), as runs of consecutive
    numbers: what its record lists, with no list of the entries."""

    def create_accumulator(self) -> tuple[list[tuple[int, int]], int]:
        return [], 1024  # the runs, and the length at which they are merged next

    def add_input(self, accumulator, entry: ShardEntry):
        runs, merge_at = accumulator
        number = file_number(unversioned(entry.path))
        runs.append((number, number))
        if len(runs) >= merge_at:  # merged when doubled: scattered numbers stay n log n
            runs = number_runs(runs)
            merge_at = 2 * max(len(runs), 512)
        return runs, merge_at

    def merge_accumulators(self, accumulators):
        runs = number_runs(run for runs, _ in accumulators for run in runs)
        return runs, 2 * max(len(runs), 512)

    def extract_output(self, accumulator):
        return number_runs(accumulator[0])
