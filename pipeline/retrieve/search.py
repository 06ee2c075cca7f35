"""The search of build-shards without Beam: query batches, the search with each sequence's own
documents excluded inside faiss, merging hits of index slices, picking distinct neighbours,
and the search depth tuned on sampled training chunks.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from pipeline.chunks.chunk_files import ChunkFileRanges, CommittedChunkFiles
from pipeline.common import fileio
from pipeline.common.names import file_name
from pipeline.index.files import LIST_OWNERS_FILE, QUANTIZER_FILE, load_index, read_owners
from pipeline.index.recall import recall_of
from pipeline.index.routing import search_routed
from pipeline.index.sampling import sample_keys
from pipeline.index.search import search_depth_range, search_each_excluding, search_excluding, set_search_depth
from pipeline.index.tuning import tune_depth
from pipeline.retrieve.recall import Probe
from pipeline.retrieve.sequences import merge_ranges
from schemas.manifest import DepthRecall, SearchDepth

SEQUENCES_PER_SEARCH = 64  # fixed search batches: faiss scores depend on batch shape
# With dedupe_neighbours, search hits travel in numpy blocks, one per (search batch, chunk
# file), not one tuple each; token_key is filled from the hit's chunk file.
CANDIDATE = np.dtype(
    [("seq_id", "<i8"), ("j", "<i4"), ("rank", "<i4"), ("chunk_id", "<i8"), ("score", "<f4"), ("token_key", "<i8")]
)

PROBE_SALT = 3


def select_distinct(candidates: np.ndarray, k: int) -> tuple[list[tuple], int]:
    """Per chunk j, the k best-ranked CANDIDATE rows whose tokens differ from those already
    kept for j: ([(j, slot, chunk_id, score)], candidates dropped as duplicates)."""
    c = candidates[np.lexsort((candidates["rank"], candidates["j"]))]
    picks: list[tuple] = []
    kept: dict[int, list[int]] = {}
    dropped = 0
    for j, chunk_id, score, key in zip(
        c["j"].tolist(), c["chunk_id"].tolist(), c["score"].tolist(), c["token_key"].tolist()
    ):
        keys = kept.setdefault(j, [])
        if len(keys) >= k:
            continue
        if key in keys:
            dropped += 1
            continue
        picks.append((j, len(keys), chunk_id, score))
        keys.append(key)
    return picks, dropped


def token_key(tokens: np.ndarray) -> int:
    """A 63-bit hash of a chunk's tokens, equal for equal tokens."""
    return (
        int.from_bytes(
            hashlib.blake2b(np.ascontiguousarray(tokens, np.int32).tobytes(), digest_size=8).digest(), "little"
        )
        >> 1
    )


def neighbour_values(chunk_files, number: int, chunk_ids: np.ndarray) -> np.ndarray:
    """What a neighbour slot holds for each of `chunk_ids` (all in chunk file `number`): the
    chunk's tokens + its continuation, int32 [len(chunk_ids), 2m], from one read of that file's
    two token columns (only the rows asked for are kept)."""
    rows = chunk_files.read(number, ["tokens", "continuation"])
    local = np.asarray(chunk_ids, np.int64) - chunk_files.starts[number]
    return np.concatenate([rows["tokens"][local], rows["continuation"][local]], axis=1).astype(np.int32)


@dataclass(frozen=True)
class Routing:
    """An index in slices by inverted lists (slice-NNNNN.faiss, 0 … slices-1, beside the files
    that route each query to the slices owning its probed lists); named by its directory, so
    what travels with the steps does not grow with the slices."""

    directory: str  # the faiss directory
    slices: int
    nlist: int  # inverted lists: the deepest a query is searched

    @property
    def quantizer(self) -> str:
        return fileio.join(self.directory, QUANTIZER_FILE)

    @property
    def owners(self) -> str:
        return fileio.join(self.directory, LIST_OWNERS_FILE)

    def slice_path(self, number: int) -> str:
        return fileio.join(self.directory, file_name("slice", number, "faiss"))


@dataclass(frozen=True)
class Retrieval:
    """What `RetrieveNeighbours` needs (small and picklable: it travels with the transforms)."""

    index_path: str | None  # index.faiss; None for an index in slices (`routing`)
    depth: int | None  # search depth the index was tuned to (nprobe, efSearch)
    chunk_files: ChunkFileRanges | CommittedChunkFiles  # the chunk database
    chunks_per_seq: int  # L
    chunk_tokens: int  # m
    neighbours: int  # k
    candidates: int  # hits searched per chunk when deduplicating
    pad_id: int
    dedupe: bool = False
    probes: int = 0  # training chunks sampled for the neighbour-recall check and the depth tuning
    embeddings: str = ""  # the embedding files (a glob): the probes' exact search
    target_recall: float = 0.95  # index.target_recall: what the depth is tuned to
    recall_below_target: str = "deepen"  # deepen | warn | fail (PipelineConfig.recall_below_target)
    routing: Routing | None = None  # an index in slices by inverted lists: how queries reach them

    def __post_init__(self):
        if (self.index_path is None) == (self.routing is None):
            raise ValueError("Retrieval searches one index file (index_path) or slices by lists (routing), one of them")


LOST_DATA = "the runner lost data"  # build_shards retries a stage that failed with this, once


def _excluded_ranges(keyed):
    """(doc_id, its span and the sequences holding it) -> (seq_id, span) per sequence, span
    None for a document not in the database (a separate training corpus: it excludes
    nothing), so every sequence can count that each of its documents answered."""
    _, grouped = keyed
    spans = list(grouped["span"])
    for seq_id in grouped["seq"]:
        yield seq_id, spans[0] if spans else None


def batch_queries(grouped, L: int):
    """A joined search batch -> per sequence (seq id order): (sequence, its queries [L, d], its
    documents' chunk-id ranges, merged). A sequence whose documents did not all answer (a
    lost range would let its own chunks through as neighbours) fails the job: nothing is
    committed."""
    vectors = dict(grouped["embeddings"])
    excluded: dict[int, list] = {}
    for seq_id, span in grouped["excluded"]:
        excluded.setdefault(seq_id, []).append(span)
    for s in sorted(grouped["sequences"], key=lambda s: s.seq_id):
        answered = excluded.get(s.seq_id, [])
        if len(answered) != len(s.doc_ids):
            raise RuntimeError(
                f"sequence {s.seq_id}: {len(answered)} of its {len(s.doc_ids)} documents' chunk-id ranges "
                f"arrived: {LOST_DATA}; nothing is committed"
            )
        queries = np.stack([vectors[s.seq_id * L + j] for j in range(L)])  # [L, d]
        yield s, queries, merge_ranges([span for span in answered if span is not None])


def batch_probes(keyed, spec: Retrieval) -> list[Probe]:
    """A joined search batch -> its training chunks in the probe sample's running: the
    `spec.probes` smallest by (key, seq_id, j), keys a hash of the chunk's position."""
    _, grouped = keyed
    L, probes = spec.chunks_per_seq, []
    for s, queries, ranges in batch_queries(grouped, L):
        keys = sample_keys(s.seq_id * L + np.arange(L), PROBE_SALT)
        probes += [Probe(int(key), s.seq_id, j, queries[j], tuple(ranges)) for j, key in enumerate(keys)]
    return sorted(probes, key=lambda p: p[:3])[: spec.probes]


def search_batch(index, grouped, spec: Retrieval):
    """One search batch (sequences, their query embeddings, their excluded chunk-id ranges) ->
    (sequences, CANDIDATE hits with the best `width` per query outside the ranges, seq ids
    whose search went deeper)."""
    L = spec.chunks_per_seq
    width = spec.candidates if spec.dedupe else spec.neighbours
    blocks, sequences, deeper_seqs = [np.zeros(0, CANDIDATE)], [], set()
    for s, queries, ranges in batch_queries(grouped, L):
        sequences.append(s)
        scores, found, deeper = search_excluding(index, queries, width, ranges)  # [L, width]
        if deeper:
            deeper_seqs.add(s.seq_id)
        blocks.append(candidate_rows(np.full(L, s.seq_id), scores, found, L))
    return sequences, np.concatenate(blocks), deeper_seqs


def candidate_rows(seq_ids: np.ndarray, scores: np.ndarray, ids: np.ndarray, chunks_per_seq: int) -> np.ndarray:
    """Search results [r, width] of query rows r (row r is chunk r % L of the sequence
    `seq_ids[r // L]`) -> CANDIDATE records, rank = slot, the empty slots (-1) left out."""
    rows, width = ids.shape
    block = np.zeros(ids.size, CANDIDATE)
    row = np.repeat(np.arange(rows), width)
    block["seq_id"], block["j"] = seq_ids[row // chunks_per_seq], row % chunks_per_seq
    block["rank"] = np.tile(np.arange(width), rows)
    block["chunk_id"], block["score"] = ids.ravel(), scores.ravel()
    return block[block["chunk_id"] >= 0]  # -1: fewer than `width` reachable


def check_in_database(hits: np.ndarray, num_chunks: int) -> None:
    """CANDIDATE hits whose chunk ids the chunk database holds, or an error naming one that is not."""
    unknown = hits["chunk_id"][hits["chunk_id"] >= num_chunks]
    if len(unknown):
        raise ValueError(
            f"the index returned chunk id {unknown[0]}, which is not in the chunk "
            f"database ({num_chunks} chunks): index and chunks disagree"
        )


class NeighbourRecallTooLow(RuntimeError):
    """recall_below_target: fail, and the index's search depth misses the target."""


def search_probes(index, probes: list[Probe], k: int, depth: int | None) -> np.ndarray:
    """The probes' k neighbour ids [n, k] as the search finds them at `depth`: each probe with
    its own ranges excluded, deepening as the search does."""
    if depth is not None:
        set_search_depth(index, depth)
    return search_each_excluding(index, np.stack([p.query for p in probes]), k, [p.excluded for p in probes])[1]


class _SlicesInTurn:
    """Index slices by number, loaded on access, the last one kept: a routed search takes them
    in number order, so one is held at a time."""

    def __init__(self, paths):
        self.paths, self.number, self.index = paths, None, None

    def __getitem__(self, number: int):
        if number != self.number:
            self.index, self.number = None, None  # the one held goes before the next loads
            self.index, self.number = load_index(self.paths[number]), number
        return self.index


def search_slices(
    routing: Routing, queries: np.ndarray, k: int, excluded_each, depth: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """`search_routed` over the slices `routing` names, loaded one at a time (`_SlicesInTurn`),
    each query with its own excluded chunk-id ranges: (scores, ids) [q, k], -1 = none."""
    found = search_routed(
        load_index(routing.quantizer),
        _SlicesInTurn([routing.slice_path(n) for n in range(routing.slices)]),
        read_owners(routing.owners),
        queries,
        k,
        excluded_each,
        depth,
    )
    return found[0], found[1]


def search_probes_routed(spec: Retrieval, probes: list[Probe], depth: int | None) -> np.ndarray:
    """`search_probes` over slices by inverted lists, routed as build-shards searches them."""
    assert spec.routing is not None
    queries = np.stack([p.query for p in probes])
    return search_slices(spec.routing, queries, spec.neighbours, [p.excluded for p in probes], depth)[1]


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

    first = load_index(spec.routing.quantizer if spec.routing is not None else str(spec.index_path))

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
