"""Streaming dataset over a shard directory (docs/design.md §4): manifest.json + Arrow IPC shards.

Order of an epoch. The epoch's *global order* is fixed by (seed, epoch): the shards in a
permuted order, each shard's rows in a permuted order (manifest order when shuffle=False). It is
never materialised: only the shard order (one entry per shard) and the row permutation of the
shard being read are held, so memory stays flat however many shards or sequences there are.

Partition. Rank r takes the contiguous slice [r·N/W, (r+1)·N/W) of the global order (its *rank
stream*; lengths differ by at most one), so a rank reads only about 1/W of the shards.
DataLoader workers split the rank stream into blocks of `batch_size` consecutive samples and
take the blocks round-robin (worker w: blocks w, w + num_workers, ...). A DataLoader fetches
batches from its workers round-robin in worker order, so with the same batch size it hands the
trainer the rank stream in order, whatever num_workers is, and every sequence exactly once
per epoch across world_size × num_workers.

Checks. Building the dataset reads the manifest and nothing else: shard sizes and row counts
come from it (from its file table's path, rows and bytes columns when it has one, held as Arrow
arrays), so a trainer starts in the same time whatever the number of shards. Each shard is
checked against its manifest entry when an epoch reaches it.

Sources. A local directory (shards memory-mapped) or a gs:// URL (pyarrow's GCS client, which
finds credentials as Google's libraries do; with STORAGE_EMULATOR_HOST set, an anonymous client
of that emulator). A remote shard is fetched whole with one sequential read while the shard
before it is being consumed (read-ahead of one shard), so memory stays at two shards.

Resume. The state is (seed, epoch, position): position = samples of this rank's stream the
trainer has consumed this epoch. The dataset object in the trainer's process never sees what
worker copies yield, so the trainer reports consumption with `advance(n)` after each batch.
A resumed dataset yields the rank stream from `position` on, re-blocking from there, so the
result is exact with any num_workers before and after (and any batch size after).
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import warnings
from collections.abc import Mapping, Sequence

import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import IterableDataset, get_worker_info

from schemas.arrow import SHARD_METADATA_KEYS, check_schema_version, read_shard, shard_schema
from schemas.file_table import entry_columns
from schemas.manifest import MANIFEST_FILE, FileEntry, ShardsManifest, commit_manifest, read_manifest
from trainer.shard_files import OpenShard, files_for
from trainer.source_mix import SourceMix, SourceMixError, checked_sources


class ShardDataError(ValueError):
    """A shard directory that disagrees with its manifest; the message names the file."""


def to_tensors(rows: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Gathered rows -> the trainer's tensors, sharing their memory."""
    return {name: torch.from_numpy(array) for name, array in rows.items()}


class ShardDataset(IterableDataset):
    """Samples of a shard directory for one rank: dicts of the shard spec's array columns
    (`schemas/shard_columns.py`): seq_id, tokens [n+1], neighbours [n/m, k, 2m],
    neighbour_ids [n/m, k], neighbour_scores [n/m, k].

    batch_size: the DataLoader's batch size (None batching = 1). Workers own blocks of this
    many samples; with num_workers > 1 it must match the DataLoader's for the trainer to see
    the rank stream in order, which exact resume relies on.
    verify: check each shard's sha256 against the manifest whenever it is opened (reads the
    whole shard once more; off by default, since sizes, row counts and schemas are always
    checked).
    skip_bad_shards: a shard that fails those checks when an epoch reaches it yields nothing,
    with a warning (`skipped` lists why, in the process that read it), instead of raising
    ShardDataError. Partition and positions still count the manifest's rows: the epoch on that
    rank is shorter by the shard's rows (`__len__` still counts them), every other row keeps its
    place (with several workers, blocks after a wholly skipped one can come out of turn), and
    since the trainer counts only the samples it got, a state saved after a skip resumes up to
    that many samples early, repeating them.
    batched: yield each block as one batch (dicts of [b, ...] tensors, gathered with array
    indexing: several times faster than per-sample reads and collation); use it with
    `DataLoader(dataset, batch_size=None)`. Same order, same partition, same state.
    commit: the shard directory's commit to read (`manifest-NNNNNN.json`; default its newest,
    read once here: a commit made while the dataset is read is not seen). `self.commit` is the
    one read; a state saved from it resumes only on the same commit. A commit's shards stay
    while it is kept (the pipeline's keep_commits).
    """

    def __init__(
        self,
        source: str | os.PathLike,
        *,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        batch_size: int = 1,
        batched: bool = False,
        verify: bool = False,
        skip_bad_shards: bool = False,
        commit: int | None = None,
        sources: Sequence[str] | Mapping[str, float] | None = None,
    ):
        super().__init__()
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self.source = os.fspath(source)
        self.rank, self.world_size = rank, world_size
        self.shuffle, self.seed, self.batch_size, self.batched = shuffle, seed, batch_size, batched
        self.verify, self.skip_bad_shards = verify, skip_bad_shards
        self.epoch = 0
        self.position = 0
        self._files = files_for(self.source)
        self._mix: SourceMix | None = None
        self.manifest = self._read_manifest(commit)
        if sources is not None:
            try:
                self._mix = SourceMix.of_manifest(self.manifest, self.source, sources, self._files.open_random)
            except SourceMixError as err:
                raise ShardDataError(f"{self.source}: {err}") from None
            self._shard_rows = self._mix.shard_rows
        self.sequence_tokens = self.manifest.sequence_tokens
        self.chunk_tokens = self.manifest.chunk_tokens
        self.neighbours = self.manifest.neighbours
        self.pad_id = self.manifest.pad_id
        self._expected_schema = shard_schema(
            self.sequence_tokens, self.chunk_tokens, self.neighbours, self.pad_id, version=self.manifest.schema_version
        )
        self._expected_metadata = {k.decode(): v.decode() for k, v in self._expected_schema.metadata.items()}
        self.skipped: list[str] = []  # the errors of shards left out (skip_bad_shards)

    # -- manifest and shard checks ------------------------------------------------------

    def _path(self, relative: str) -> str:
        return posixpath.join(self.source, relative) if "://" in self.source else os.path.join(self.source, relative)

    def _read_text(self, name: str) -> str | None:
        try:
            return self._files.read_text(self._path(name))
        except FileNotFoundError:
            return None

    @staticmethod
    def _commit_named(text: str | None) -> int:
        """The `commit` a manifest's text records (0: none, or no manifest)."""
        try:
            return int(json.loads(text).get("commit") or 0) if text is not None else 0
        except (ValueError, AttributeError, TypeError):  # not a manifest: read_manifest names the problem
            return 0

    def _copy_commit(self) -> int:
        """The commit manifest.json, the copy of the newest, says it is."""
        return self._commit_named(self._read_text(MANIFEST_FILE))

    def _current(self) -> tuple[int | None, str, str | None]:
        """(commit, name, text) of the newest commit's manifest, by reads alone (an object store
        lists a shard directory only whole): manifest.json, the copy made after each commit,
        names its commit (None: from before commits were numbered); commits after it, if any,
        are read next in turn."""
        text = self._read_text(MANIFEST_FILE)
        number = self._commit_named(text)
        commit, name = number or None, MANIFEST_FILE
        while (newer := self._read_text(commit_manifest(number + 1))) is not None:
            number += 1
            commit, name, text = number, commit_manifest(number), newer
        return commit, name, text

    def _read_manifest(self, commit: int | None) -> ShardsManifest:
        if commit is None:
            self.commit, name, text = self._current()
        else:
            self.commit, name, text = commit, commit_manifest(commit), self._read_text(commit_manifest(commit))
            if text is None and self._copy_commit() == commit:  # a directory copied as manifest.json + shards
                name, text = MANIFEST_FILE, self._read_text(MANIFEST_FILE)
            if text is None:
                raise ShardDataError(f"{self._path(name)}: no commit {commit} of the shards (not made, or not kept)")
        path = self._path(name)
        manifest = read_manifest(text, path, ShardsManifest, error=ShardDataError)
        n, m = manifest.sequence_tokens, manifest.chunk_tokens
        if m < 1 or n % m:
            raise ShardDataError(f"{path}: sequence_tokens {n} is not a multiple of chunk_tokens {m}")
        if manifest.neighbour_tokens != 2 * m:
            raise ShardDataError(f"{path}: neighbour_tokens {manifest.neighbour_tokens} != 2 × chunk_tokens {m}")
        # What opening a shard checks it against, as columns (no object per shard, no request
        # per shard: each is checked when opened); sha256 only when verified.
        columns = ["path", "rows", "bytes"] + (["sha256"] if self.verify else [])
        self._entries = entry_columns(
            manifest, self.source, columns, open_file=self._files.open_random, error=ShardDataError, hashed=self.verify
        )
        self._shard_rows = self._entries.column("rows").to_numpy()
        total = int(self._shard_rows.sum())
        if total != manifest.num_sequences:
            raise ShardDataError(f"{path}: num_sequences {manifest.num_sequences} != {total} rows over its shards")
        return manifest

    def _entry(self, shard: int) -> FileEntry:
        """Shard `shard`'s manifest entry (sha256 empty unless verified)."""
        row = {name: column[shard].as_py() for name, column in zip(self._entries.column_names, self._entries.columns)}
        return FileEntry(**{"sha256": "", **row})

    def _open_checked(self, shard: int) -> tuple[pa.NativeFile, list[pa.RecordBatch], list[np.ndarray]]:
        """Open shard `shard`, refusing it unless size, rows, schema version, shapes and sources
        match the manifest; with each record batch's rows' source numbers."""
        entry = self._entry(shard)
        path = self._path(entry.path)
        try:
            file = self._files.open(path)
        except FileNotFoundError:
            kept = (
                ""
                if self.commit is None
                else " (a later commit deletes what only older ones list: keep_commits keeps more)"
            )
            raise ShardDataError(f"{path}: shard listed in the manifest is missing{kept}") from None
        try:
            if file.size() != entry.bytes:  # the mapping's or the fetched object's size: no request
                raise ShardDataError(f"{path}: {file.size()} bytes on disk, the manifest says {entry.bytes}")
            if self.verify:
                digest = hashlib.sha256(memoryview(file.read_buffer())).hexdigest()  # zero-copy view
                file.seek(0)
                if digest != entry.sha256:
                    raise ShardDataError(f"{path}: sha256 {digest} differs from the manifest's {entry.sha256}")
            try:
                schema, batches = read_shard(file)
            except pa.ArrowInvalid as err:
                raise ShardDataError(f"{path}: not an Arrow shard ({err})") from None
            metadata = {k.decode(): v.decode() for k, v in (schema.metadata or {}).items()}
            check_schema_version(metadata.get("schema_version"), path)
            for key in SHARD_METADATA_KEYS:
                if metadata.get(key) != self._expected_metadata[key]:
                    raise ShardDataError(
                        f"{path}: metadata {key}={metadata.get(key)!r}, the manifest "
                        f"says {self._expected_metadata[key]}"
                    )
            if not schema.remove_metadata().equals(self._expected_schema.remove_metadata()):
                raise ShardDataError(
                    f"{path}: columns do not match the manifest's shapes (n={self.sequence_tokens}, "
                    f"m={self.chunk_tokens}, k={self.neighbours}): {schema.remove_metadata()}"
                )
            rows = sum(batch.num_rows for batch in batches)
            if rows != entry.rows:
                raise ShardDataError(f"{path}: {rows} rows in the file, the manifest says {entry.rows}")
            counted = None if self._mix is None else self._mix.source_rows[shard]
            try:
                sources = checked_sources(tuple(s.name for s in self.manifest.sources), batches, counted)
            except SourceMixError as err:
                raise ShardDataError(f"{path}: {err}") from None
        except BaseException:
            file.close()
            raise
        return file, batches, sources

    def _open_shard(self, shard: int) -> OpenShard | None:
        """Shard `shard`, checked; None (with a warning) for a bad one when bad shards are skipped."""
        try:
            file, batches, sources = self._open_checked(shard)
        except ShardDataError as err:
            if not self.skip_bad_shards:
                raise
            warnings.warn(f"skipping a bad shard: {err}", stacklevel=2)
            if str(err) not in self.skipped:  # met again in later epochs
                self.skipped.append(str(err))
            return None
        if self._mix is None:
            return OpenShard(file, batches, sources, self._row_order(shard))
        rng = self._rng(1 + shard) if self.shuffle else None
        return OpenShard(file, batches, sources, self._mix.rows_of(shard, np.concatenate(sources), rng))

    # -- order --------------------------------------------------------------------------

    def _rng(self, *keys: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, self.epoch, *keys])

    def _shard_order(self) -> tuple[np.ndarray, np.ndarray]:
        """This epoch's shard visiting order, and the global position where each one starts."""
        count = len(self._shard_rows)
        order = self._rng().permutation(count) if self.shuffle else np.arange(count)
        starts = np.concatenate([[0], np.cumsum(self._shard_rows[order])])
        return order, starts

    def _row_order(self, shard: int) -> np.ndarray:
        rows = int(self._shard_rows[shard])
        # Key 1 + shard keeps the row streams apart from the shard-order stream (key-less).
        return self._rng(1 + shard).permutation(rows) if self.shuffle else np.arange(rows)

    def _rank_range(self) -> tuple[int, int]:
        n = int(self._shard_rows.sum())  # the manifest's sequences, or the rows the sources give
        return self.rank * n // self.world_size, (self.rank + 1) * n // self.world_size

    def __len__(self) -> int:
        """Samples this rank yields in a whole epoch."""
        start, stop = self._rank_range()
        return stop - start

    def _worker_blocks(self, worker: int, num_workers: int):
        """[start, stop) rank-stream positions of this worker's blocks, ascending, from `position` on."""
        length, block = len(self), self.batch_size
        for start in range(self.position + worker * block, length, num_workers * block):
            yield start, min(start + block, length)

    def __iter__(self):
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        shard_order, shard_starts = self._shard_order()
        rank_start, rank_stop = self._rank_range()
        slot, shard = -1, None  # shard: the open shard of `slot`, None when it was skipped
        try:
            for start, stop in self._worker_blocks(worker, num_workers):
                pieces = []  # (rows of one shard) making up this block
                index, stop = rank_start + start, rank_start + stop  # in the epoch's global order
                while index < stop:
                    if slot < 0 or index >= shard_starts[slot + 1]:
                        if shard is not None:
                            shard.close()  # one shard mapped at a time
                        slot = int(np.searchsorted(shard_starts, index, side="right")) - 1
                        shard = self._open_shard(int(shard_order[slot]))
                        if slot + 1 < len(shard_order) and shard_starts[slot + 1] < rank_stop:
                            self._files.prefetch(self._path(self._entry(int(shard_order[slot + 1])).path))
                    end = min(stop, int(shard_starts[slot + 1]))
                    if shard is not None:
                        pieces.append(shard.rows(np.arange(index, end) - int(shard_starts[slot])))
                    index = end
                if not pieces:  # the whole block lay in skipped shards
                    continue
                rows = (
                    pieces[0]
                    if len(pieces) == 1
                    else {name: np.concatenate([p[name] for p in pieces]) for name in pieces[0]}
                )
                tensors = to_tensors(rows)
                if self.batched:
                    yield tensors
                else:
                    for i in range(len(tensors["seq_id"])):
                        yield {name: tensor[i] for name, tensor in tensors.items()}
        finally:
            if shard is not None:
                shard.close()

    # -- epochs and resume --------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Start epoch `epoch` from its beginning (call before creating the DataLoader iterator)."""
        self.epoch, self.position = int(epoch), 0

    def advance(self, samples: int) -> None:
        """Record that the trainer consumed `samples` more samples of this rank's stream."""
        if samples < 0 or self.position + samples > len(self):
            raise ValueError(
                f"cannot advance {samples} from position {self.position} of an epoch of {len(self)} samples"
            )
        self.position += samples

    def state_dict(self) -> dict:
        """Where this rank's stream stands (its position counts that rank's own samples). Rank
        streams differ in length by up to one, so ranks stepping in lockstep can reach an epoch's
        end at different steps: resume each rank from its own state."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "rank": self.rank,
            "world_size": self.world_size,
            "num_sequences": self.manifest.num_sequences,
            "commit": self.commit,
            "sources": None if self._mix is None else self._mix.wanted,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue where `state` left off; the stream's shape (data, ranks, shuffle) must match."""
        current = self.state_dict()
        for key in ("world_size", "num_sequences", "shuffle", "commit"):
            if state.get(key) is None or current[key] is None:  # a state or manifest from before commits
                continue
            if state[key] != current[key]:
                raise ValueError(f"cannot resume: state has {key}={state[key]!r}, this dataset {current[key]!r}")
        if state.get("sources") != current["sources"]:  # None both ways: no selection (or a state from before)
            raise ValueError(
                f"cannot resume: state read sources {state.get('sources')!r}, this dataset {current['sources']!r}"
            )
        if not 0 <= state["position"] <= len(self):
            raise ValueError(f"cannot resume: position {state['position']} is outside an epoch of {len(self)} samples")
        self.seed, self.epoch, self.position = state["seed"], state["epoch"], state["position"]
