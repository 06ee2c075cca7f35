"""The faiss files of a committed index changed by an append or a delete, in Beam's steps
(`ChangeFaissFiles`): an index in one file on the one worker that must hold it; an index in
slices by lists one slice per worker, so no worker holds more than a slice, its new vectors and
its pieces. Either way the new vectors' recall is measured as the build measures it, its exact
truth a scan of every embedding file spread over workers (Beam-free parts:
`pipeline.index.append`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import apache_beam as beam
import faiss
import numpy as np

from pipeline.chunks.chunk_files import EMBEDDINGS_DIR
from pipeline.chunks.committed import CommittedFiles, CommittedIndexManifest
from pipeline.chunks.deleted import DeletedRanges
from pipeline.common import fileio
from pipeline.common.combining import MergedBy
from pipeline.common.names import file_name, file_number
from pipeline.index.append import (
    SEARCHED,
    NewQueries,
    NewVectorRecall,
    add_in_file_order,
    adopting_owners,
    change_slice,
    merged_hits,
    new_blocks,
    owners_after,
    probed_slices,
    remove_deleted,
    renumbered,
    truth_in_file,
)
from pipeline.index.build_slices import AssemblePiece, piece_of
from pipeline.index.exact import merge_nearest
from pipeline.index.factory import estimated_bytes
from pipeline.index.files import (
    INDEX_FILE,
    LIST_OWNERS_FILE,
    QUANTIZER_FILE,
    EmptiedTrained,
    read_index,
    read_owners,
    write_index,
    write_owners,
)
from pipeline.index.recall import one_recall_of_found
from pipeline.index.routing import write_blocks
from pipeline.index.search import set_search_depth
from pipeline.index.slices import files_per_piece, vectors_per_slice
from schemas.manifest import FileEntry, IndexManifest, by_name

PIECE, SLICE = "piece", "slice"  # CoGroupByKey tags: a piece of a slice's new vectors; a slice of the index
PIECES_DIR = "faiss/pieces"  # a cut slice's pieces past the first, in staging until numbered


@dataclass(frozen=True)
class Changed:
    """What the change did to the faiss files."""

    files: list[FileEntry]  # the faiss files written anew (index.faiss, or the slices changed)
    vectors: int  # the index holds, after
    recall: NewVectorRecall
    removed: int  # vectors removed (deleted documents' chunks)


@dataclass(frozen=True)
class ChangedSlice:
    """One slice's change, as its worker wrote it: its pieces (one unless it was cut; a piece
    past the first under PIECES_DIR until `renumbered` numbers it), the lists each holds when
    cut, and the lists without owner before that its new vectors went to."""

    number: int
    pieces: list[FileEntry]
    piece_lists: list[np.ndarray | None]
    adopted: np.ndarray
    removed: int


def is_sliced(faiss_entries: list[FileEntry]) -> bool:
    return f"faiss/{QUANTIZER_FILE}" in by_name(faiss_entries)


def _read_stored(directory: str, entry: FileEntry):
    return read_index(fileio.join(directory, entry.path), sha256=entry.sha256)


@functools.lru_cache(maxsize=1)
def _stored_of(directory: str, path: str, sha256: str):
    return read_index(fileio.join(directory, path), sha256=sha256)


@functools.lru_cache(maxsize=1)
def _owners_of(directory: str, path: str) -> np.ndarray:
    return read_owners(fileio.join(directory, path))


def _trained(committed: CommittedIndexManifest, directory: str):
    """The trained index (quantizer.faiss), read once per process and shared by its threads:
    only read from (searched, cloned), never filled."""
    entry = by_name(committed.faiss_entries())[f"faiss/{QUANTIZER_FILE}"]
    return _stored_of(directory, entry.path, entry.sha256)


def _owners(committed: CommittedIndexManifest, directory: str) -> np.ndarray:
    """The list owners before the change, read once per process."""
    return _owners_of(directory, by_name(committed.faiss_entries())[f"faiss/{LIST_OWNERS_FILE}"].path)


@functools.lru_cache(maxsize=1)
def _adopting_of(committed: CommittedIndexManifest, directory: str) -> np.ndarray:
    return adopting_owners(_trained(committed, directory), _owners(committed, directory))


def _depth(previous: IndexManifest, trained) -> int:
    """The depth the index is searched at: its tuned nprobe, else the one its files carry."""
    return previous.nprobe if previous.nprobe is not None else int(faiss.extract_index_ivf(trained).nprobe)


def _searched(index, queries: NewQueries, depth: int | None):
    if depth is not None:
        set_search_depth(index, depth)
    return index.search(queries.vectors, SEARCHED) if len(queries.ids) else None


class ChangeFaissFiles(beam.PTransform):
    """(this generation's new embedding files (FileEntry, staged), its deleted documents) ->
    one `Changed`. The committed index is read on the workers (`committed`)."""

    def __init__(self, committed: CommittedIndexManifest, previous: IndexManifest, *, directory, staging, sample: int):
        super().__init__()
        self.committed, self.directory, self.staging, self.sample = committed, directory, staging, sample
        entries = committed.faiss_entries()  # the faiss files alone, from the manifest's file table
        self.sliced = is_sliced(entries)
        if self.sliced:  # what pieces are cut by, from the manifest the launcher read
            faiss_files = by_name(entries)
            quantizer = faiss_files[f"faiss/{QUANTIZER_FILE}"]
            self.trained = (fileio.join(directory, quantizer.path), quantizer.sha256)
            self.slice_count = sum(name.startswith("faiss/slice-") for name in faiss_files)
            self.vector_bytes = estimated_bytes(previous.index_factory, 1, previous.dim) - estimated_bytes(
                previous.index_factory, 0, previous.dim
            )  # a code and its id

    def expand(self, inputs):
        new_files, deleted_now = inputs
        committed, directory, staging = self.committed, self.directory, self.staging
        pipeline = new_files.pipeline
        now = deleted_now | "ToListDeleted" >> beam.combiners.ToList() | "DeletedNow" >> beam.Map(DeletedRanges.of)
        every_deleted = now | "EveryDeleted" >> beam.Map(
            lambda ranges: DeletedRanges.concatenate([committed.deleted(), ranges])
        )
        population = new_files | "NewRows" >> beam.Map(lambda e: e.rows) | "AllNewRows" >> beam.CombineGlobally(sum)
        queries = (
            new_files
            | "SampleNewVectors"
            >> beam.Map(
                lambda e, total: NewQueries.of_file(fileio.join(staging, e.path), self.sample, total),
                beam.pvalue.AsSingleton(population),
            )
            | "NewQueries" >> beam.combiners.ToList()
            | "JoinNewQueries" >> beam.Map(NewQueries.joined)
        )
        truth = (
            (
                pipeline
                | "CommittedIndex" >> beam.Create([committed])
                | "IndexedEmbeddings"
                >> beam.FlatMap(lambda c: CommittedFiles(c.directory, c.manifest_sha256, EMBEDDINGS_DIR).paths()),
                new_files | "NewEmbeddings" >> beam.Map(lambda e: fileio.join(staging, e.path)),
            )
            | "EmbeddingFiles" >> beam.Flatten()
            | "SpreadEmbeddingFiles" >> beam.Reshuffle()
            | "TruthInFile"
            >> beam.FlatMap(
                _truth_of_file,
                beam.pvalue.AsSingleton(queries),
                beam.pvalue.AsSingleton(every_deleted),
            )
            | "MergeTruth" >> beam.CombineGlobally(MergedBy(merge_nearest))
        )
        if self.sliced:
            changed, hits = self._change_slices(new_files, now, queries, population)
            made = changed | "ChangedSlices" >> beam.combiners.ToList()
            finish = functools.partial(_finish_slices, committed=committed, directory=directory, staging=staging)
        else:
            made, hits = self._change_one_file(pipeline, new_files, now, queries)
            finish = _finish_one_file
        return made | "Changed" >> beam.Map(
            lambda done, q, found, t: finish(done, recall=_recall(q, found, t)),
            beam.pvalue.AsSingleton(queries),
            beam.pvalue.AsSingleton(hits),
            beam.pvalue.AsSingleton(truth),
        )

    def _change_one_file(self, pipeline, new_files, now, queries):
        """One worker: the index read, this generation's deleted vectors removed, the new ones
        added in chunk-id order, written to staging, the new vectors' sample searched."""
        committed, directory, staging = self.committed, self.directory, self.staging

        def change(_, entries, deleted, q):
            previous = committed.summary()
            index = _read_stored(directory, by_name(committed.faiss_entries())[f"faiss/{INDEX_FILE}"])
            removed = remove_deleted(index, deleted)
            add_in_file_order(
                index, [fileio.join(staging, e.path) for e in sorted(entries, key=lambda e: file_number(e.path))]
            )
            found = _searched(index, q, previous.nprobe)
            size, sha256 = write_index(index, fileio.join(staging, "faiss", INDEX_FILE))
            entry = FileEntry(path=f"faiss/{INDEX_FILE}", rows=int(index.ntotal), bytes=size, sha256=sha256)
            return (entry, removed, found)

        changed = (
            pipeline
            | "OneWorker" >> beam.Create([None])
            | "ChangeIndex"
            >> beam.Map(
                change,
                beam.pvalue.AsList(new_files),
                beam.pvalue.AsSingleton(now),
                beam.pvalue.AsSingleton(queries),
            )
        )
        return changed, changed | "HitsOfIndex" >> beam.MapTuple(lambda _e, _r, found: found)

    def _change_slices(self, new_files, now, queries, population):
        """Each new file encoded where it is read and cut into blocks by slice; a slice's blocks
        from a run of consecutive new files made a piece (`AssemblePiece`, as the build's); each
        slice that takes new vectors, may hold deleted ones (every slice, when documents are
        deleted) or owns a list the sample probes, read by one worker, its pieces merged one at
        a time, written if it changed, and searched for the sample."""
        committed, directory, staging = self.committed, self.directory, self.staging
        files = new_files | "CountNewFiles" >> beam.combiners.Count.Globally()
        pieces_by = files | "FilesPerPiece" >> beam.Map(  # (files per piece, new files)
            lambda count, total: (files_per_piece(total, count, self.slice_count, self.vector_bytes), count),
            beam.pvalue.AsSingleton(population),
        )
        pieces = (
            new_files
            | "EncodeNewFiles"
            >> beam.ParDo(
                _EncodeNewFile(committed, directory, staging, self.trained),
                beam.pvalue.AsSingleton(pieces_by),
            )
            | "GroupNewPieces" >> beam.GroupByKey()
            | "AssembleNewPieces" >> beam.ParDo(AssemblePiece(fileio.join(staging, "faiss")), *self.trained)
        )
        probed = queries | "ProbedSlices" >> beam.Map(_probed, committed, directory)
        slices = (
            new_files.pipeline
            | "IndexSlices" >> beam.Create([committed])
            | "SliceNumbers" >> beam.FlatMap(lambda c: [(n, None) for n in range(len(_slice_entries(c)))])
        )
        results = (
            {PIECE: pieces, SLICE: slices}
            | "PiecesBySlice" >> beam.CoGroupByKey()
            | "ChangeSlice"
            >> beam.ParDo(
                _ChangeSlice(committed, directory, self.staging),
                beam.pvalue.AsSingleton(now),
                beam.pvalue.AsSingleton(queries),
                beam.pvalue.AsSingleton(probed),
            ).with_outputs("hits", main="changed")
        )
        hits = results.hits | "MergeHits" >> beam.CombineGlobally(MergedBy(merged_hits))
        return results.changed, hits


def _probed(queries: NewQueries, committed, directory) -> frozenset[int]:
    trained = _trained(committed, directory)
    return probed_slices(
        trained, queries.vectors, _depth(committed.summary(), trained), _adopting_of(committed, directory)
    )


def _truth_of_file(path: str, queries: NewQueries, deleted: DeletedRanges):
    if len(queries.ids) and (truth := truth_in_file(path, queries, deleted)) is not None:
        yield truth


def _slice_entries(committed: CommittedIndexManifest) -> list[FileEntry]:
    return sorted(
        (e for e in committed.faiss_entries() if e.path.startswith("faiss/slice-")), key=lambda e: file_number(e.path)
    )


class _EncodeNewFile(beam.DoFn):
    """A new embedding file -> ((slice, piece), BlockRef) per slice owning some of its lists, its
    piece the run of `files_per_piece` consecutive files it falls in. Each DoFn instance (a
    worker thread) encodes on its own trained index, emptied before each file, as the build's
    parts are filled."""

    def __init__(self, committed, directory, staging, trained: tuple[str, str]):
        self.committed, self.directory, self.staging, self.trained = committed, directory, staging, trained
        self._trained = EmptiedTrained()

    def teardown(self):
        self._trained.drop()

    def process(self, entry: FileEntry, pieces_by: tuple[int, int]):
        emptied = self._trained(*self.trained)
        adopting = _adopting_of(self.committed, self.directory)
        piece = piece_of(entry.path, *pieces_by)
        blocks = new_blocks(emptied, fileio.join(self.staging, entry.path), adopting)
        path = fileio.join(self.staging, "faiss", "new-blocks", entry.path.replace("/", "--") + ".blocks")
        for ref in write_blocks(blocks, path):
            yield (ref.index_slice, piece), ref


class _ChangeSlice(beam.DoFn):
    """(slice number, its pieces of new codes) -> a `ChangedSlice` when it changed, and its hits
    for the new vectors' sample (tagged "hits") when it was searched."""

    def __init__(self, committed, directory, staging):
        self.committed, self.directory, self.staging = committed, directory, staging

    def process(self, keyed, now: DeletedRanges, queries: NewQueries, probed: frozenset[int]):
        number, joined = keyed
        pieces = list(joined[PIECE])  # (piece, path): a few paths
        if not pieces and not len(now) and number not in probed:
            return
        previous = self.committed.summary()
        fits = None
        if previous.slice_bytes is not None:
            fits = vectors_per_slice(previous.index_factory, previous.dim, previous.slice_bytes)
        index_slice = _read_stored(self.directory, _slice_entries(self.committed)[number])
        cut, removed, adopted = change_slice(
            index_slice,
            pieces=pieces,
            deleted=now,
            fits=fits,
            trained_of=lambda: _trained(self.committed, self.directory),
            owner=_owners(self.committed, self.directory),
        )
        if number in probed:  # only a slice owning a probed list can hold a hit
            found = None
            for part in [index for _, index in cut] or [index_slice]:
                found = merged_hits(found, _searched(part, queries, previous.nprobe))
            yield beam.pvalue.TaggedOutput("hits", found)
        if not cut:
            return
        entries = []
        for at, (_, part) in enumerate(cut):
            path = f"faiss/{file_name('slice', number, 'faiss')}" if at == 0 else _piece_path(number, at)
            size, sha256 = write_index(part, fileio.join(self.staging, path))
            entries.append(FileEntry(path=path, rows=int(part.ntotal), bytes=size, sha256=sha256))
        yield ChangedSlice(number, entries, [lists for lists, _ in cut], adopted, removed)


def _piece_path(number: int, at: int) -> str:
    return f"{PIECES_DIR}/{file_name('slice', number, 'faiss').removesuffix('.faiss')}-{at}.faiss"


def _recall(queries: NewQueries, found, truth) -> NewVectorRecall:
    if not len(queries.ids) or truth is None or found is None:
        return NewVectorRecall(1.0, 0)
    return NewVectorRecall(one_recall_of_found(queries.ids, found[1], truth), len(queries.ids))


def _finish_one_file(changed, *, recall: NewVectorRecall) -> Changed:
    entry, removed, _ = changed
    return Changed([entry], entry.rows, recall, removed)


def _finish_slices(changed: list[ChangedSlice], *, recall: NewVectorRecall, committed, directory, staging) -> Changed:
    """One worker, once every slice is done: the pieces of cut slices numbered after the last
    slice in slice order (their files renamed in staging), the list owners written anew when
    one changed, and the index's vectors counted from the slice files' rows."""
    slices = _slice_entries(committed)
    numbers = renumbered({c.number: len(c.pieces) for c in changed}, len(slices))
    owner = _owners(committed, directory)
    files, pieces_lists = [], {}
    for c in sorted(changed, key=lambda c: c.number):
        for at, (entry, lists) in enumerate(zip(c.pieces, c.piece_lists)):
            if at:
                final = f"faiss/{file_name('slice', numbers[(c.number, at)], 'faiss')}"
                source = fileio.join(staging, entry.path)
                if fileio.exists(source):  # a retried step finds it moved already
                    fileio.move(source, fileio.join(staging, final))
                entry = entry.model_copy(update={"path": final})
            if lists is not None:
                pieces_lists[(c.number, at)] = lists
            files.append(entry)
    after = owners_after(owner, {c.number: c.adopted for c in changed if len(c.adopted)}, pieces_lists, numbers)
    if not np.array_equal(after, owner):
        size, sha256 = write_owners(after, fileio.join(staging, "faiss", LIST_OWNERS_FILE))
        files.append(FileEntry(path=f"faiss/{LIST_OWNERS_FILE}", rows=0, bytes=size, sha256=sha256))
    rewritten = {c.number for c in changed}
    vectors = sum(e.rows for n, e in enumerate(slices) if n not in rewritten)
    vectors += sum(e.rows for e in files if e.path.startswith("faiss/slice-"))
    return Changed(files, vectors, recall, sum(c.removed for c in changed))
