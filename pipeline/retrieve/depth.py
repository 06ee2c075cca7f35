"""The searches of build-shards outside its search batches, without Beam: the index files loaded
and checked against the job's index manifest (`load_searched`, `index_version`), an index in
slices searched one slice at a time (`search_slices`, which the online `Retriever` uses too),
the sampled training chunks (probes) searched at a given depth, and the depth build-shards
searches at, tuned on them (`tune_retrieval_depth`).

Apart from `search`, which holds the batched search and the records it moves: this is the
one place an index file is loaded for retrieval, and what the depth is tuned on.
"""

from __future__ import annotations

import numpy as np

from pipeline.chunks.chunk_files import ChunkFileRanges
from pipeline.chunks.committed import CommittedChunkFiles
from pipeline.index.files import load_index, read_owners
from pipeline.index.recall import recall_of
from pipeline.index.routing import search_routed
from pipeline.index.search import search_depth_range, search_each_excluding, set_search_depth
from pipeline.index.tuning import tune_depth
from pipeline.retrieve.recall import Probe, queries_of
from pipeline.retrieve.search import Retrieval, Routing
from schemas.measures import DepthRecall, SearchDepth


class NeighbourRecallTooLow(RuntimeError):
    """recall_below_target: fail, and the index's search depth misses the target."""


def search_probes(index, probes: list[Probe], k: int, depth: int | None) -> np.ndarray:
    """The probes' k neighbour ids [n, k] as the search finds them at `depth`: each probe with
    its own ranges excluded, deepening as the search does."""
    if depth is not None:
        set_search_depth(index, depth)
    return search_each_excluding(index, queries_of(probes), k, [p.excluded for p in probes]).ids


def index_version(chunk_files: ChunkFileRanges | CommittedChunkFiles | None) -> str:
    """What tells generations of a committed index apart (its manifest's sha256; "" for chunk
    files given directly): a change rewrites index files under their names, so what a process
    keeps of them is keyed by it too."""
    return chunk_files.manifest_sha256 if isinstance(chunk_files, CommittedChunkFiles) else ""


def load_searched(chunk_files: ChunkFileRanges | CommittedChunkFiles | None, path: str, depth: int | None = None):
    """`load_index` (a committed index's file checked against its manifest's sha256 first), then,
    for a committed index, the commit the job was built against checked to be still kept: one
    deleted meanwhile fails the job (run it again) rather than leave its chunk lookups to fail
    later."""
    if not isinstance(chunk_files, CommittedChunkFiles):
        return load_index(path, depth, sha256=None)  # files given directly: no manifest to check them by
    stored, sha256 = chunk_files.stored(path)
    index = load_index(stored, depth, sha256=sha256)
    chunk_files.check_kept()
    return index


def stored_path(chunk_files: ChunkFileRanges | CommittedChunkFiles | None, path: str) -> str:
    """Where the committed index's file `path` is stored (its name plus the number of the
    commit that wrote it, if an earlier commit listed the plain name); a file given directly
    is where it is named."""
    return chunk_files.stored(path)[0] if isinstance(chunk_files, CommittedChunkFiles) else path


class _SlicesInTurn:
    """Index slices by number, loaded on access (`load_searched`), the last one kept: a routed
    search takes them in number order, so one is held at a time."""

    def __init__(self, paths, chunk_files):
        self.paths, self.chunk_files, self.number, self.index = paths, chunk_files, None, None

    def __getitem__(self, number: int):
        if number != self.number:
            self.index, self.number = None, None  # the one held goes before the next loads
            self.index, self.number = load_searched(self.chunk_files, self.paths[number]), number
        return self.index


def search_slices(
    routing: Routing, queries: np.ndarray, *, k: int, excluded_each, depth: int | None, chunk_files=None
) -> tuple[np.ndarray, np.ndarray]:
    """`search_routed` over the slices `routing` names, loaded one at a time (`_SlicesInTurn`),
    each query with its own excluded chunk-id ranges: (scores, ids) [q, k], -1 = none. With
    the job's `chunk_files`, each file loaded is checked against the index manifest."""
    found = search_routed(
        load_searched(chunk_files, routing.quantizer),
        _SlicesInTurn([routing.slice_path(n) for n in range(routing.slices)], chunk_files),
        read_owners(stored_path(chunk_files, routing.owners)),
        queries,
        k=k,
        excluded_each=excluded_each,
        depth=depth,
    )
    return found[0], found[1]


def search_probes_routed(spec: Retrieval, probes: list[Probe], depth: int | None) -> np.ndarray:
    """`search_probes` over slices by inverted lists, routed as build-shards searches them."""
    assert spec.routing is not None
    queries = queries_of(probes)
    return search_slices(
        spec.routing,
        queries,
        k=spec.neighbours,
        excluded_each=[p.excluded for p in probes],
        depth=depth,
        chunk_files=spec.chunk_files,
    )[1]


def tune_retrieval_depth(spec: Retrieval, probes: list[Probe], truth) -> SearchDepth:
    """The depth build-shards searches at, from the recall of the probes' neighbours against
    their exact truth, own documents excluded (what the training shards will hold): the index's depth,
    then (recall_below_target: deepen or fail) twice that and so on until `target_recall` is
    met or two doublings gain less than PLATEAU_GAIN (`tune_depth`). fail raises when the index's
    depth misses the target, naming the depth that meets it. -> the manifest's search_depth (it
    travels to the search, and to the manifest, as a side input)."""
    untuned = SearchDepth(
        index_depth=spec.depth,
        depth=spec.depth,
        target=spec.target_recall,
        recall_below_target=spec.recall_below_target,
        curve=[],
        plateau=False,
    )
    if truth is None or not probes:
        return untuned

    first = load_searched(
        spec.chunk_files, spec.routing.quantizer if spec.routing is not None else str(spec.index_path)
    )

    def recall_at(depth):
        if spec.routing is not None:  # slices: loaded one at a time, at each depth measured
            return recall_of(truth, search_probes_routed(spec, probes, depth))
        return recall_of(truth, search_probes(first, probes, spec.neighbours, depth))

    depths = search_depth_range(first)
    if depths is None or spec.recall_below_target == "warn":  # exhaustive, or kept as it is
        return untuned.model_copy(update={"curve": [DepthRecall(depth=spec.depth, recall=recall_at(spec.depth))]})
    start = spec.depth if spec.depth is not None else depths[0]
    curve: list[DepthRecall] = []
    depth, recall, plateau = tune_depth(
        [start] + [d for d in depths if d > start], recall_at, spec.target_recall, curve
    )
    at_index = curve[0].recall
    if spec.recall_below_target == "fail" and at_index < spec.target_recall:
        reached = f"depth {depth} reaches {recall:.3f}" if recall >= spec.target_recall else "no depth reaches it"
        raise NeighbourRecallTooLow(
            f"neighbour recall {at_index:.3f} at the index's search depth {start} is below index.target_recall "
            f"{spec.target_recall} on {len(probes)} sampled training chunks with their own documents excluded; "
            f"{reached} (recall_below_target: fail; 'deepen' searches deeper)"
        )
    return untuned.model_copy(update={"depth": depth, "plateau": plateau, "curve": curve})
