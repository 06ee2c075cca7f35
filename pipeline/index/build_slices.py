"""The index build's slices (`index.slice_bytes`) as Beam's steps take them: the filled parts
(`FilledPart`, what `BuildIndex`'s fill step yields) and their list sizes summed
(`SumListSizes`); the lists shared out among slices (`plan_slices`, a `ListSlicing`); each
part cut into one block per slice (`split_part`); a slice's blocks from a run of files
assembled into a piece (`AssemblePiece`: no group through the shuffle is a whole slice); each
slice merged from its pieces by its own worker and searched at every depth
(`assemble_slice`); the slices' results merged as they come (`AssembledSlices`), the one
nprobe tuned, and quantizer.faiss and list_owners.npy written (`tune_slices`). `BuildIndex`
(`pipeline.index.build`) wires them.
"""

from __future__ import annotations

import logging
import time
import types
import zlib
from dataclasses import dataclass

import apache_beam as beam
import faiss
import numpy as np

from pipeline.common import fileio
from pipeline.common.names import file_name, file_number
from pipeline.index.build_info import write_build_info
from pipeline.index.factory import IndexBuildError, IndexPlan
from pipeline.index.files import (
    LIST_OWNERS_FILE,
    QUANTIZER_FILE,
    EmptiedTrained,
    read_index,
    write_index,
    write_owners,
)
from pipeline.index.recall import RECALL_K, one_recall_at_k, recall_of
from pipeline.index.routing import list_blocks, list_owners, read_block, slice_count, write_blocks
from pipeline.index.search import search_depth_range, search_each_at, set_search_depth
from pipeline.index.slices import files_per_piece, merge_slice_results, vectors_per_slice
from pipeline.index.train import merge_pieces, write_piece
from pipeline.index.tuning import QuerySample, Truth, tune_index_depth
from schemas.stage_config import IndexConfig

log = logging.getLogger("ratrain")


@dataclass(frozen=True)
class FilledPart:
    """One embeddings file's vectors added to a copy of the trained index, written as a part;
    the sizes of the lists it fills, sparse: a file of 65,536 vectors fills at most as many of
    2^20 lists (512 KB, where a dense array of every list's size is 8 MiB)."""

    embeddings: str  # the embeddings file it was filled from
    path: str  # its part-<file>.faiss
    nlist: int  # the index's inverted lists
    lists: np.ndarray  # int32 [filled] the lists it holds vectors in, ascending
    counts: np.ndarray  # int32 [filled] how many in each

    @classmethod
    def of(cls, embeddings: str, path: str, list_sizes: np.ndarray) -> FilledPart:
        """From the part's dense list sizes [nlist]."""
        lists = np.flatnonzero(list_sizes)
        return cls(embeddings, path, len(list_sizes), lists.astype(np.int32), list_sizes[lists].astype(np.int32))


@dataclass(frozen=True)
class ListSlicing:
    """How the lists of a filled IVF index are shared out among its slices."""

    owner: np.ndarray  # [nlist] the slice of each list; -1 for an empty list
    parts: int  # filled parts: each is cut into blocks, one per slice it has vectors for
    files_per_piece: int  # a slice's blocks from this many consecutive files make one piece


class SumListSizes(beam.CombineFn):
    """Filled parts -> (vectors per list [nlist] over all of them, parts): one array, not a
    list of every part, so what the planning step holds does not grow with the files."""

    def create_accumulator(self):
        return None, 0

    def add_input(self, acc, part: FilledPart):
        sizes, parts = acc
        if sizes is None:
            sizes = np.zeros(part.nlist, np.int64)
        sizes[part.lists] += part.counts  # each list once in a part
        return sizes, parts + 1

    def merge_accumulators(self, accs):
        total, parts = None, 0
        for sizes, count in accs:
            if sizes is not None:
                total = sizes.copy() if total is None else total + sizes
            parts += count
        return total, parts

    def extract_output(self, acc):
        return acc


def plan_slices(summed, trained_path, plan: IndexPlan, slice_bytes: int | None) -> ListSlicing | None:
    """The lists shared out among slices of at most `slice_bytes` (`routing.list_owners` over
    the lists' sizes summed over the filled parts); None when the index is one file: no slice
    size, not an IVF index, or everything fits one slice."""
    sizes, parts = summed
    if slice_bytes is None:
        return None
    if not plan.mergeable:
        log.warning("index.slice_bytes applies to IVF indexes; %s is built as one file", plan.factory)
        return None
    if sizes is None:  # no vectors
        return None
    count = slice_count(sizes, vectors_per_slice(plan.factory, plan.dim, slice_bytes))
    if count == 1:
        return None
    trained = read_index(trained_path, sha256=None)
    ivf = faiss.extract_index_ivf(trained)  # a view: `trained` keeps it alive
    owner = list_owners(ivf.quantizer.reconstruct_n(0, ivf.nlist), sizes, count)
    owner[sizes == 0] = -1  # nothing to search: no slice holds it
    _, owner[sizes > 0] = np.unique(owner[sizes > 0], return_inverse=True)  # slices numbered 0 … S-1
    vector_bytes = ivf.code_size + 8  # a code and its id
    return ListSlicing(owner, parts, files_per_piece(int(sizes.sum()), parts, int(owner.max()) + 1, vector_bytes))


def piece_of(embeddings: str, files_per_piece: int, files: int) -> int:
    """The piece an embeddings file's blocks go to: the run of `files_per_piece` consecutive
    files it falls in, so pieces in number order hold chunk ids in order. A file without a
    number (given to `index` directly) goes to one of files // files_per_piece pieces, numbered
    below 0, by a hash of its path: a slice's lists are sorted by chunk id after the merge
    whatever the order."""
    number = file_number(embeddings)
    if number >= 0:
        return number // files_per_piece
    return -1 - zlib.crc32(embeddings.encode()) % max(1, files // files_per_piece)


def split_part(part: FilledPart, slicing: ListSlicing | None):
    """A filled part -> ((slice, piece), BlockRef) for each slice owning some of its lists: the
    part's blocks written beside it, one after another (`routing.write_blocks`), and only where
    each lies sent on. Sent whole, the codes went through the shuffle, and a runner that hands a
    worker its whole share of a stage at once (the local runner) made the step assembling the
    pieces hold them all."""
    if slicing is None:
        return
    piece = piece_of(part.embeddings, slicing.files_per_piece, slicing.parts)
    blocks = list_blocks(read_index(part.path, sha256=None), slicing.owner)
    for ref in write_blocks(blocks, part.path.removesuffix(".faiss") + ".blocks"):
        yield (ref.index_slice, piece), ref


class AssemblePiece(beam.DoFn):
    """A piece of a slice: its blocks (`BlockRef`, each read by its range when it is added) added
    to the trained index's lists (sorted by chunk id), written without the coarse quantizer as a
    part is (`write_part`) -> (slice, (piece, path)).
    The trained index is read once per DoFn instance and emptied before each piece, as the
    fill's (at 2^20 lists it is 2-3.7 GB, and a slice has many pieces)."""

    def __init__(self, out_dir):
        self.out_dir = out_dir
        self._trained = EmptiedTrained()

    def teardown(self):
        self._trained.drop()

    def process(self, keyed, trained_path, trained_sha256=None):
        (number, piece), refs = keyed
        path = fileio.join(self.out_dir, "slice-pieces", f"slice-{number:05d}-piece-{piece:06d}.faiss")
        blocks = (read_block(ref) for ref in sorted(refs, key=lambda r: (r.path, r.offset)))
        write_piece(self._trained(trained_path, trained_sha256), blocks, path)
        yield number, (piece, path)


@dataclass(frozen=True)
class AssembledSlices:
    """Slices written, with the query sample's search of them at every depth measured and
    merged as one index holding them all ranks its hits (`merge_slice_results`): what tuning
    needs, merged as the slices come (`merged`), so the step gathering them holds the same
    however many slices there are, not every slice's results (~1 MB a slice measured)."""

    files: tuple[dict, ...]  # their file entries (path relative to faiss/, rows, bytes, sha256)
    results: dict[int, tuple[np.ndarray, np.ndarray, float]]  # depth -> (scores, ids, seconds), plain search
    own: dict[int, tuple[np.ndarray, np.ndarray]]  # depth -> (scores, ids), own document excluded

    def merged(self, other: AssembledSlices) -> AssembledSlices:
        """Both as one: the hits of each depth merged (as wide as each side's, best first, the
        one tie rule: any order of merging gives the same), their seconds summed."""

        def best(a, b):
            return merge_slice_results([a[:2], b[:2]], a[1].shape[1])

        results = {d: (*best(r, other.results[d]), r[2] + other.results[d][2]) for d, r in self.results.items()}
        own = {d: best(o, other.own[d]) for d, o in self.own.items()}
        files = tuple(sorted(self.files + other.files, key=lambda f: file_number(f["path"])))
        return AssembledSlices(files, results, own)


def merged_pieces(trained_path, pieces):
    """A slice: its pieces ((piece, path)) merged into the trained index in piece order, one
    read at a time."""
    index_slice = read_index(trained_path, sha256=None)
    if faiss.extract_index_ivf(index_slice).ntotal:
        raise IndexBuildError("an index slice is assembled from the trained index without vectors")
    merge_pieces(index_slice, pieces)
    return index_slice


def assemble_slice(
    keyed, *, trained_path, queries: QuerySample, cfg: IndexConfig, out_dir, neighbours: int
) -> AssembledSlices:
    """One worker per slice: its pieces ((piece, path), `AssemblePiece`) merged into a copy of
    the trained index in piece order (chunk-id order: each list sorted, as one index filled in
    file order holds it), one piece read at a time, written as slice-NNNNN.faiss; then the
    query sample searched at every depth the tuning may pick (plainly, and with each query's
    own document excluded, not deepened: the merged result decides that), for the merge step
    to combine with the other slices' results. A slice searched at depth d probes the d lists
    one index probes, its own holding vectors."""
    number, pieces = keyed
    index_slice = merged_pieces(trained_path, pieces)
    name = file_name("slice", number, "faiss")
    slice_bytes, sha256 = write_index(index_slice, fileio.join(out_dir, name))
    depths = [cfg.nprobe] if cfg.nprobe is not None else search_depth_range(index_slice)
    if depths is None:
        raise IndexBuildError(f"{name}: an index slice must be an IVF index, with lists to probe")
    results: dict[int, tuple[np.ndarray, np.ndarray, float]] = {}
    own: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for depth in depths:
        set_search_depth(index_slice, depth)
        start = time.perf_counter()
        scores, ids = index_slice.search(np.ascontiguousarray(queries.vectors, np.float32), RECALL_K + 1)
        results[depth] = (scores, ids, time.perf_counter() - start)
        if queries.documents is not None:
            own[depth] = search_each_at(index_slice, queries.vectors, neighbours, queries.documents, depth)
    entry = {"path": name, "rows": int(index_slice.ntotal), "bytes": slice_bytes, "sha256": sha256}
    return AssembledSlices((entry,), results, own)


def _routing_files(trained_path, slicing: ListSlicing, out_dir) -> list[dict]:
    """quantizer.faiss (the trained index) and list_owners.npy written beside the slices."""
    quantizer_bytes, quantizer_sha = write_index(
        read_index(trained_path, sha256=None), fileio.join(out_dir, QUANTIZER_FILE)
    )
    owners_bytes, owners_sha = write_owners(slicing.owner, fileio.join(out_dir, LIST_OWNERS_FILE))
    return [
        {"path": QUANTIZER_FILE, "rows": 0, "bytes": quantizer_bytes, "sha256": quantizer_sha},
        {"path": LIST_OWNERS_FILE, "rows": 0, "bytes": owners_bytes, "sha256": owners_sha},
    ]


def tune_slices(
    slices: AssembledSlices,
    *,
    trained_path,
    slicing: ListSlicing,
    plan: IndexPlan,
    queries: QuerySample,
    truth: Truth,
    cfg: IndexConfig,
    out_dir,
    k: int,
):
    """One worker: the one nprobe of all slices tuned on their merged results as on one index
    (the same lists are probed, so the same recall)."""

    def plain_at(depth):
        merged = slices.results[depth][:2]
        searcher = types.SimpleNamespace(search=lambda q, width: merged)
        return one_recall_at_k(searcher, queries.ids, queries.vectors, truth.nearest_other)

    def own_at(depth):
        return recall_of(truth.outside_document, slices.own[depth][1])

    measured = own_at if truth.outside_document is not None else None
    tuned, curve, own = tune_index_depth(sorted(slices.results), plain_at, measured, cfg, k)
    assert tuned[0] is not None  # slices are IVF indexes, searched at a depth (`assemble_slice`)
    seconds = slices.results[tuned[0]][2]
    info = write_build_info(
        plan,
        cfg,
        out_dir=out_dir,
        parts=slicing.parts,
        files=[*slices.files, *_routing_files(trained_path, slicing, out_dir)],
        tuned=(*tuned, len(queries.ids)),
        rate=len(queries.ids) / seconds if seconds else 0.0,
        curve=curve,
        own=own,
    )
    return info  # the parts and the trained index stay for a retry: the commit discards them with the staging
