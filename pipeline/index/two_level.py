"""The steps of two-level k-means over a training sample kept as files, each step reading only
its own files: the sample as `sample/<file>.ids.npy` and `.vectors.npy` (one pair per
embeddings file), the first-level and encoder subsets as `subsets/<name>-NNNNN.ids.npy` and
`.vectors.npy` (files of about SUBSET_FILE_BYTES), the lists' centroids between steps as
`centroids/step-N/block-NNNNN.npy` (LIST_BLOCK lists per file). `TrainIndex` runs them on
workers; the benchmark runs each alone.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from pipeline.common import fileio
from pipeline.common.sampling import TRAIN_SALT, in_sample
from pipeline.index.factory import IndexBuildError
from pipeline.index.files import read_range, write_consecutive, write_index
from pipeline.index.kmeans import (
    assign_first_level,
    first_level_clusters,
    index_from_centroids,
    list_assigner,
    list_sums,
    moved_centroids,
    second_level_centroids,
    spherical_kmeans,
)

# Lists per centroid block: the unit a Lloyd step combines and moves on one worker (6 MB of
# 384-d centroids, 12 MB of their int64 sums), so no worker holds every list's sums.
LIST_BLOCK = 4096
# A Lloyd step's worker folds its sample files' sums per block and sends them on past this many
# bytes (a dense block's sums are 12.6 MB at 384-d).
FOLD_BYTES = 64 * 2**20
CENTROIDS_DIR = "centroids"
# A subset of the sample reaches its trainer as files of about this many bytes. Gathered as one
# Beam value (the encoder's 65,536 384-d vectors: 100 MB; the first level's 262,144 at 2^20
# lists: 400 MB) it was a single element, which Flink's batch sort refused ("Record too large")
# and each runner held whole on the worker gathering it.
SUBSET_FILE_BYTES = 16 * 2**20
SUBSETS_DIR = "subsets"


def _write_npy(path: str, array: np.ndarray) -> None:
    """Streamed to the file, with no second copy of the array in memory."""
    with fileio.open_write(path) as f:
        np.save(f, array)


def _read_npy(path: str) -> np.ndarray:
    """Read in chunks into the array, with no copy of the file's bytes in memory."""
    with fileio.open_read(path) as f:
        return np.load(f)


def write_sample_part(prefix: str, ids: np.ndarray, vectors: np.ndarray) -> None:
    _write_npy(f"{prefix}.ids.npy", np.asarray(ids, np.int64))
    _write_npy(f"{prefix}.vectors.npy", np.asarray(vectors, np.float32))


def read_ids(prefix: str) -> np.ndarray:
    return _read_npy(f"{prefix}.ids.npy")


def read_vectors(prefix: str) -> np.ndarray:
    return _read_npy(f"{prefix}.vectors.npy")


def sample_paths(prefix: str) -> list[str]:
    return [f"{prefix}.ids.npy", f"{prefix}.vectors.npy"]


@dataclass(frozen=True)
class SampleRows:
    """Some rows of the training sample: chunk ids and their vectors."""

    ids: np.ndarray
    vectors: np.ndarray


def subset_of_file(prefix: str, size: int, population: int) -> list[SampleRows]:
    """One sample file's rows in the subset of `size` drawn by chunk id out of `population`
    (as `train_two_level` draws it); its vectors are read only where a row is chosen."""
    ids = read_ids(prefix)
    keep = in_sample(ids, size, population, TRAIN_SALT)
    return [SampleRows(ids[keep], read_vectors(prefix)[keep])] if keep.any() else []


def subset_files(size: int, dim: int) -> int:
    """How many files a subset of `size` vectors is written as (about SUBSET_FILE_BYTES each)."""
    return max(1, math.ceil(size * (dim * 4 + 8) / SUBSET_FILE_BYTES))


def subset_file_of(prefix: str, files: int) -> int:
    """The subset file a sample file's chosen rows go to."""
    return zlib.crc32(prefix.encode()) % files


def write_subset_file(directory: str, name: str, number: int, parts: Iterable[SampleRows]) -> str:
    """Sample files' chosen rows written as one subset file, in chunk-id order (a retry writes
    the same bytes). Its path prefix."""
    parts = list(parts)
    rows = in_id_order(parts, parts[0].vectors.shape[1])
    prefix = fileio.join(directory, SUBSETS_DIR, f"{name}-{number:05d}")
    write_sample_part(prefix, rows.ids, rows.vectors)
    return prefix


def read_subset(prefixes: Iterable[str]) -> Iterator[SampleRows]:
    """A subset's files (`write_subset_file`), one at a time."""
    for prefix in sorted(prefixes):
        yield SampleRows(read_ids(prefix), read_vectors(prefix))


def in_id_order(parts: Iterable[SampleRows], dim: int) -> SampleRows:
    """The parts' rows in chunk-id order, in one pair of arrays."""
    parts = list(parts)
    ids = np.concatenate([p.ids for p in parts] or [np.zeros(0, np.int64)])
    vectors = np.concatenate([p.vectors for p in parts] or [np.zeros((0, dim), np.float32)])
    order = np.argsort(ids, kind="stable")
    return SampleRows(ids[order], np.ascontiguousarray(vectors[order], dtype=np.float32))


def stacked(parts: Iterable[SampleRows], dim: int) -> np.ndarray:
    """The parts' vectors in chunk-id order, in one array."""
    return in_id_order(parts, dim).vectors


def train_first_level(parts: Iterable[SampleRows], dim: int, nlist: int) -> np.ndarray:
    vectors = stacked(parts, dim)
    if not len(vectors):
        raise IndexBuildError("two-level k-means: the first-level subset of the training sample is empty")
    return spherical_kmeans(vectors, first_level_clusters(nlist))


def clusters_of_file(prefix: str, first: np.ndarray) -> list[tuple[int, SampleRows]]:
    """One sample file's rows keyed by their first-level cluster."""
    ids, vectors = read_ids(prefix), read_vectors(prefix)
    cluster = assign_first_level(first, vectors)
    return [(int(c), SampleRows(ids[cluster == c], vectors[cluster == c])) for c in np.unique(cluster)]


@dataclass(frozen=True)
class CentroidPiece:
    """Consecutive lists' centroids inside one block, the first being list `first_list`."""

    first_list: int
    centroids: np.ndarray


def second_level_pieces(
    cluster: int, parts: Iterable[SampleRows], lists: np.ndarray, dim: int
) -> list[tuple[int, CentroidPiece]]:
    """One first-level cluster (all its training vectors) -> its lists' centroids, keyed by
    the block they fall in (its lists follow those of the clusters before it)."""
    return cut_into_blocks(
        int(np.sum(lists[:cluster])), second_level_centroids(stacked(parts, dim), int(lists[cluster]))
    )


def cut_into_blocks(start: int, centroids: np.ndarray) -> list[tuple[int, CentroidPiece]]:
    """Centroids of consecutive lists from list `start`, cut at block boundaries."""
    cuts = [start, *range((start // LIST_BLOCK + 1) * LIST_BLOCK, start + len(centroids), LIST_BLOCK)]
    ends = [*cuts[1:], start + len(centroids)]
    return [
        (lo // LIST_BLOCK, CentroidPiece(lo, centroids[lo - start : hi - start]))
        for lo, hi in zip(cuts, ends)
        if hi > lo
    ]


def step_directory(out_dir: str, step: int) -> str:
    """Where a step's centroid blocks (and a Lloyd step's sums files) are written."""
    return fileio.join(out_dir, CENTROIDS_DIR, f"step-{step}")


@dataclass(frozen=True)
class CentroidBlocks:
    """One step's centroids of `nlist` lists, written in blocks under `directory`; `token`
    tells apart two writings of the same directory (a rerun)."""

    directory: str
    nlist: int
    token: str = ""

    @classmethod
    def of_step(cls, out_dir: str, step: int, nlist: int, token: str = "") -> CentroidBlocks:
        return cls(step_directory(out_dir, step), nlist, token)

    @property
    def block_count(self) -> int:
        return -(-self.nlist // LIST_BLOCK)

    def lists_of(self, block: int) -> range:
        return range(block * LIST_BLOCK, min(self.nlist, (block + 1) * LIST_BLOCK))

    def path(self, block: int) -> str:
        return fileio.join(self.directory, f"block-{block:05d}.npy")

    def read_block(self, block: int) -> np.ndarray:
        return _read_npy(self.path(block))

    def read_all(self) -> np.ndarray:
        """Every list's centroids, read block by block into one array."""
        first = self.read_block(0)
        out = np.empty((self.nlist, first.shape[1]), np.float32)
        out[: len(first)] = first
        del first
        for block in range(1, self.block_count):
            out[self.lists_of(block).start : self.lists_of(block).stop] = self.read_block(block)
        return out

    def check_written(self, blocks: Iterable[int]) -> None:
        if sorted(blocks) != list(range(self.block_count)):
            raise IndexBuildError(f"{self.directory}: {self.block_count} centroid blocks, got {sorted(blocks)}")


def write_block(target: CentroidBlocks, block: int, pieces: Iterable[CentroidPiece]) -> int:
    """The pieces of one block, which must cover its lists exactly once, as its file."""
    pieces = sorted(pieces, key=lambda p: p.first_list)
    lists = target.lists_of(block)
    covered = [lst for p in pieces for lst in range(p.first_list, p.first_list + len(p.centroids))]
    if covered != list(lists):
        raise IndexBuildError(f"centroid block {block}: pieces cover lists {covered[:3]}… not {lists}")
    _write_npy(target.path(block), np.concatenate([p.centroids for p in pieces]))
    return block


@dataclass(frozen=True)
class BlockSums:
    """A Lloyd step's partial sums for some lists of one block: list numbers (ascending,
    unique), their vectors' fixed-point sums [.., d] and counts."""

    lists: np.ndarray
    sums: np.ndarray
    counts: np.ndarray


@dataclass(frozen=True)
class SumsRef:
    """Where one block's sums lie in a sums file (`write_block_sums`): what goes through the
    shuffle to the worker moving the block, which reads the parts one at a time."""

    path: str
    offset: int
    lists: int
    dim: int

    @property
    def nbytes(self) -> int:
        return self.lists * (16 + 8 * self.dim)


def write_block_sums(totals: list[tuple[int, BlockSums]], path: str) -> list[tuple[int, SumsRef]]:
    """Blocks' sums one after another in one file (each: lists and counts, then the sums, all
    int64), each read alone by its range -> (block, where it lies)."""
    offsets = write_consecutive(
        path, ([np.asarray(a, np.int64) for a in (t.lists, t.counts, t.sums)] for _, t in totals)
    )
    return [
        (block, SumsRef(path, offset, len(t.lists), t.sums.shape[1])) for (block, t), offset in zip(totals, offsets)
    ]


def read_block_sums(ref: SumsRef) -> BlockSums:
    numbers = np.frombuffer(read_range(ref.path, ref.offset, ref.nbytes), np.int64)
    b = ref.lists
    return BlockSums(numbers[:b], numbers[2 * b :].reshape(b, ref.dim), numbers[b : 2 * b])


def build_assigner(first: np.ndarray, current: CentroidBlocks):
    """`list_assigner` over the step's centroids (read from their blocks, then dropped: the
    assigner holds its own copy)."""
    return list_assigner(first, current.read_all())


def file_block_sums(assigner, vectors: np.ndarray) -> list[tuple[int, BlockSums]]:
    """One sample file's share of a Lloyd step, keyed by block."""
    touched, sums, counts = list_sums(assigner, vectors)
    block = touched // LIST_BLOCK
    cuts = np.flatnonzero(np.diff(block)) + 1
    return [
        (int(block[lo]), BlockSums(touched[lo:hi], sums[lo:hi], counts[lo:hi]))
        for lo, hi in zip([0, *cuts.tolist()], [*cuts.tolist(), len(touched)])
        if hi > lo
    ]


def fold_block_sums(total: BlockSums | None, part: BlockSums | None) -> BlockSums | None:
    """`part` added to `total`, a fold's own (from an earlier fold, or None): in place where
    `total` already has `part`'s lists, else as a new value holding the union of their lists,
    so it holds only the lists its parts touched, one block's at most. `part` is left as it
    was. Integer sums: the same bits in any order and any grouping."""
    if part is None or not len(part.lists):
        return total
    if total is None:
        return BlockSums(part.lists.copy(), part.sums.astype(np.int64), part.counts.astype(np.int64))
    block, other = int(total.lists[0]) // LIST_BLOCK, int(part.lists[0]) // LIST_BLOCK
    if block != other:
        raise IndexBuildError(f"Lloyd step: sums of block {other} combined with block {block}'s")
    at = np.searchsorted(total.lists, part.lists)
    if not (at < len(total.lists)).all() or not np.array_equal(total.lists[at], part.lists):
        lists = np.union1d(total.lists, part.lists)
        sums = np.zeros((len(lists), total.sums.shape[1]), np.int64)
        counts = np.zeros(len(lists), np.int64)
        here = np.searchsorted(lists, total.lists)
        sums[here], counts[here] = total.sums, total.counts
        total, at = BlockSums(lists, sums, counts), np.searchsorted(lists, part.lists)
    total.sums[at] += part.sums  # lists unique within a part: a plain indexed add
    total.counts[at] += part.counts
    return total


def add_block_sums(parts: Iterable[BlockSums | None]) -> BlockSums | None:
    """The parts' sums per list, all in one block (None: nothing), folded as they stream in."""
    total = None
    for part in parts:
        total = fold_block_sums(total, part)
    return total


def move_block(current: CentroidBlocks, target: CentroidBlocks, block: int, sums: BlockSums | None) -> int:
    """The Lloyd update of one block's centroids, written as the next step's block."""
    centroids = current.read_block(block)
    if sums is not None:
        centroids = moved_centroids(centroids, sums.lists - block * LIST_BLOCK, sums.sums)
    _write_npy(target.path(block), centroids)
    return block


def assemble(final: CentroidBlocks, encoder_parts: Iterable[SampleRows], factory: str, dim: int, path: str) -> str:
    """The lists' centroids into the coarse quantizer, the encoder trained on its subset of the
    sample (in chunk-id order); written to `path`."""
    encoder_sample = stacked(encoder_parts, dim)
    write_index(index_from_centroids(factory, final.read_all(), encoder_sample), path)
    return path
