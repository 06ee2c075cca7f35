"""Which units `validate` checks: the manifest's totals against its entries, and with
`sample` < 1 the hash-chosen shards, chunk files and embedding files (`plan_validation`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import posixpath
from dataclasses import dataclass, field

import numpy as np

from pipeline.build_shards.manifest import neighbour_summary
from pipeline.check.facts import (
    ChunkFiles,
    ChunkFileUnit,
    EmbeddingFileUnit,
    FaissFacts,
    IndexFacts,
    ShardsFacts,
    removed_documents,
)
from pipeline.check.problems import manifest_problem, require
from pipeline.check.rules import check_generations
from pipeline.chunks.chunk_files import in_file_order
from pipeline.chunks.deleted import DeletedRanges, deleted_files, read_deleted
from pipeline.common import fileio
from pipeline.common.rejected import NEAR_DUPLICATE
from pipeline.retrieve.committed import change_since, generation_spans
from schemas.arrow import (
    SHARD_METADATA_KEYS,
)
from schemas.file_table import entries_field
from schemas.manifest import (
    MANIFEST_FILE,
    IndexManifest,
    ShardsManifest,
    VectorIndexManifest,
    commit_number,
    read_manifest,
)

INDEX_PROBES = 64  # embeddings searched for themselves in the faiss index


def _entries(manifest) -> list:
    """The files a manifest lists (`FileEntry`; a shards manifest: its shards, `ShardEntry`); the
    one place they are read."""
    return getattr(manifest, entries_field(manifest))


def _name_hash(path: str) -> bytes:
    return hashlib.sha256(posixpath.basename(path).encode()).digest()


def sampled(entries: list, fraction: float, path_of=lambda entry: entry.path) -> list:
    """The ceil(fraction x len) entries (at least one) whose file names (`path_of(entry)`) hash
    lowest, in their own order: the same sample on every run, whatever else the directory holds."""
    if fraction >= 1 or not entries:
        return list(entries)
    count = max(1, math.ceil(fraction * len(entries) - 1e-9))  # 0.07 x 100 is 7.000000000000001
    chosen = set(sorted(range(len(entries)), key=lambda i: _name_hash(path_of(entries[i])))[:count])
    return [entry for i, entry in enumerate(entries) if i in chosen]


@dataclass(kw_only=True)
class ValidationPlan:
    """What a validation reads, decided from the manifests (whose own checks it runs): the
    facts every check needs (small), and the units, one a file (`facts()` leaves them out)."""

    path: str
    sample: float
    index_directory: str | None = None  # as given to `plan_validation`
    commits: dict[str, int] = field(default_factory=dict)  # directory -> the commit read there (pinned)
    hash_all: bool = False  # a sample also hashes every listed file it does not read
    manifests_read: dict = field(default_factory=dict, repr=False)  # directory -> (path, bytes), while planning
    index: IndexFacts | None = None  # the index whose chunk files are checked by the rules
    shards: ShardsFacts | None = None
    faiss_index: FaissFacts | None = None
    chunks: ChunkFiles | None = None  # the chunk database read (the index's, or the shards')
    deleted: DeletedRanges | None = None  # the documents deleted from that index
    probes_per_file: int = INDEX_PROBES
    lines: list = field(default_factory=list)  # what a passing validation prints
    shard_entries: list = field(default_factory=list)  # shards checked
    chunk_files: list[ChunkFileUnit] = field(default_factory=list)  # every chunk file, in chunk-id order
    embedding_files: list[EmbeddingFileUnit] = field(default_factory=list)  # checked
    listed_files: list = field(default_factory=list)  # (directory, entry) checked by size (and sha256: `hashed`)

    @property
    def complete(self) -> bool:
        return self.sample >= 1

    @property
    def hashed(self) -> bool:
        """Whether the listed files no check reads are hashed (else their sizes are checked)."""
        return self.complete or self.hash_all

    def facts(self) -> ValidationPlan:
        """The plan without its units: what a check of one unit needs besides the unit."""
        return dataclasses.replace(self, shard_entries=[], chunk_files=[], embedding_files=[], listed_files=[])


def _listed_note(plan: ValidationPlan, listed: int, files: str = "files") -> str:
    return f"{'sizes and sha256' if plan.hashed else 'sizes'} of all {listed} {files}"


def _sample_note(plan: ValidationPlan, parts: list[str], listed: int) -> str:
    if plan.complete:
        return ""
    return f" (a sample: {', '.join(parts)}; {_listed_note(plan, listed)})"


def _read(plan: ValidationPlan, directory: str) -> tuple[str, bytes | None]:
    """(path, bytes) of the manifest of `directory`'s pinned commit (`plan.commits`), or of its
    current one, which is then pinned; bytes None: nothing committed there."""
    if directory in plan.manifests_read:
        return plan.manifests_read[directory]
    number = plan.commits.get(directory)
    found = fileio.current_manifest(directory, number)
    if found is None:
        if number is not None:
            raise manifest_problem(fileio.no_commit(directory, number))
        return fileio.join(directory, MANIFEST_FILE), None
    plan.commits[directory] = commit_number(found[0])
    plan.manifests_read[directory] = found
    return found


def _manifest(plan: ValidationPlan, directory: str, model):
    path, data = _read(plan, directory)
    return fileio.whole(read_manifest(data, path, model, error=manifest_problem), directory, error=manifest_problem)


def _plan_index(plan: ValidationPlan, directory: str) -> None:
    manifest = _manifest(plan, directory, IndexManifest)
    entries = _entries(manifest)
    chunk_entries = in_file_order(entries, "chunks")
    chunks = ChunkFiles.of(directory, chunk_entries)
    require(
        chunks.num_chunks == manifest.num_chunks,
        f"{directory}: {chunks.num_chunks} chunk rows, manifest says {manifest.num_chunks}",
        "manifest",
    )
    embeddings = in_file_order(entries, "embeddings")
    embedded = int(sum(entry.rows for entry in embeddings))
    require(
        embedded == manifest.num_chunks,
        f"{directory}: {embedded} embeddings for {manifest.num_chunks} chunks",
        "manifest",
    )
    check_generations(directory, manifest.generations, chunks, manifest.num_documents)
    plan.chunks = chunks
    plan.deleted = deleted = read_deleted(deleted_files(directory, entries))
    require(
        (len(deleted), deleted.num_chunks) == (manifest.deleted_documents, manifest.deleted_chunks),
        f"{directory}: {len(deleted)} deleted documents of {deleted.num_chunks} chunks listed in deleted/, "
        f"manifest says {manifest.deleted_documents} of {manifest.deleted_chunks}",
        "manifest",
    )
    removed = removed_documents(directory, "build-index", manifest.counters.get(f"rejected_{NEAR_DUPLICATE}", 0))
    plan.index = IndexFacts(
        directory=directory,
        chunk_tokens=manifest.chunk_tokens,
        pad_id=manifest.pad_id,
        num_documents=manifest.num_documents - manifest.deleted_documents,
        chunks=chunks,
        dim=manifest.dim,
        removed_doc_ids=removed,
        deleted=deleted,
        generation_starts=tuple(g.first_chunk_id for g in manifest.generations),
    )
    if plan.complete:  # a sample does not search it: loading it reads it whole (or every slice probed)
        plan.faiss_index = FaissFacts.of(
            directory, manifest, entries, manifest.num_chunks - manifest.deleted_chunks, deleted
        )
    chosen = {entry.path for entry in sampled(chunk_entries, plan.sample)}
    plan.chunk_files = [ChunkFileUnit(i, entry, entry.path in chosen) for i, entry in enumerate(chunk_entries)]
    read = set(chosen)  # read whole, their sha256 checked on the bytes read
    chosen = {entry.path for entry in sampled(embeddings, plan.sample)}
    starts = np.cumsum([0] + [e.rows for e in embeddings])
    plan.embedding_files = [
        EmbeddingFileUnit(i, entry, int(starts[i])) for i, entry in enumerate(embeddings) if entry.path in chosen
    ]
    plan.probes_per_file = max(1, INDEX_PROBES // max(1, len(plan.embedding_files)))
    read |= chosen
    plan.listed_files += [(directory, entry) for entry in entries if entry.path not in read]
    note = _sample_note(
        plan,
        [
            f"{sum(unit.sampled for unit in plan.chunk_files)} of {len(chunk_entries)} chunk files "
            "(and the row groups of others that sampled shards reference)",
            f"{len(plan.embedding_files)} of {len(embeddings)} embedding files",
            "no search of the faiss index",
        ],
        len(entries),
    )
    history = ""
    if len(manifest.generations) > 1 or manifest.deleted_documents:
        history = (
            f" ({len(manifest.generations)} generations; {manifest.deleted_documents} documents of "
            f"{manifest.deleted_chunks} chunks deleted, in no search)"
        )
    plan.lines.append(
        f"OK index {directory}{note}: {manifest.num_chunks} chunks from {manifest.num_documents} "
        f"documents{history}, {manifest.index_factory}, {manifest.recall_at_k.summary()}"
    )


def _check_shard_totals(directory: str, manifest: ShardsManifest, entries: list, chunks_per_sequence: int) -> None:
    """The manifest's totals against the sums of its shard entries (which `check_shard` holds
    each shard to)."""
    rows = sum(entry.rows for entry in entries)
    require(
        rows == manifest.num_sequences,
        f"{directory}: {rows} rows in the shards, manifest says {manifest.num_sequences}",
        "manifest",
    )
    _check_source_totals(directory, manifest)
    counts = [n for entry in entries if (n := entry.neighbour_slots_filled) is not None]
    if manifest.neighbour_fill is None or len(counts) < len(entries):
        return
    filled, slots = sum(counts), rows * chunks_per_sequence * manifest.neighbours
    require(
        abs(manifest.neighbour_fill - (filled / slots if slots else 1.0)) < 1e-9,
        f"{directory}: neighbour_fill {manifest.neighbour_fill} disagrees with the shards ({filled}/{slots})",
        "manifest",
    )


def _check_source_totals(directory: str, manifest: ShardsManifest) -> None:
    """A blend's sources against its totals: their rows are the shards', their shares their tokens'."""
    sources = manifest.sources
    require(
        bool(sources) == (manifest.training_corpus == "blend"),
        f"{directory}: training_corpus {manifest.training_corpus!r} with {len(sources)} sources listed",
        "manifest",
    )
    if not sources:
        return
    rows, tokens = sum(s.sequences for s in sources), sum(s.tokens for s in sources)
    require(
        rows == manifest.num_sequences,
        f"{directory}: the sources hold {rows} rows, manifest says {manifest.num_sequences}",
        "manifest",
    )
    for source in sources:
        require(
            source.sequences_available - source.left_out + source.repeats == source.sequences,
            f"{directory}: source {source.name}'s {source.sequences} rows are not its {source.sequences_available} "
            f"sequences less {source.left_out} left out plus {source.repeats} repeats",
            "manifest",
        )
        require(
            abs(source.share - (source.tokens / tokens if tokens else 0.0)) < 1e-9,
            f"{directory}: source {source.name}'s share {source.share} is not its {source.tokens} of {tokens} tokens",
            "manifest",
        )


def _plan_shards(plan: ValidationPlan, directory: str, index_directory: str) -> None:
    manifest = _manifest(plan, directory, ShardsManifest)
    if plan.chunks is None and index_directory not in plan.commits:
        built_against = _built_against(index_directory, manifest.index_manifest_sha256)
        if built_against is not None:
            plan.commits[index_directory] = built_against
    index_path, index_bytes = _read(plan, index_directory)
    if plan.chunks is None:  # else the index was planned (and its manifest read) here
        index_manifest = fileio.whole(
            read_manifest(index_bytes, index_path, IndexManifest, error=manifest_problem),
            index_directory,
            error=manifest_problem,
        )
    assert index_bytes is not None  # read_manifest raised for a missing one, or the index was planned here
    built_on = fileio.sha256_bytes(index_bytes) == manifest.index_manifest_sha256
    require(built_on, "" if built_on else _not_built_on(directory, manifest, index_path, index_bytes), "manifest")
    m = manifest.chunk_tokens
    require(manifest.neighbour_tokens == 2 * m, f"{directory}: neighbour_tokens != 2 x chunk_tokens", "manifest")
    if plan.chunks is None:  # the index is not validated here: its chunk files only read for the references
        chunk_entries = in_file_order(_entries(index_manifest), "chunks")
        plan.chunks = ChunkFiles.of(index_directory, chunk_entries)
        plan.chunk_files = [ChunkFileUnit(i, entry, plan.complete) for i, entry in enumerate(chunk_entries)]
        plan.deleted = read_deleted(deleted_files(index_directory, _entries(index_manifest)))
    plan.shards = ShardsFacts(
        directory=directory,
        sequence_tokens=manifest.sequence_tokens,
        chunk_tokens=m,
        neighbours=manifest.neighbours,
        pad_id=manifest.pad_id,
        same_corpus=manifest.training_corpus == "same",
        metadata=tuple((key, str(getattr(manifest, key))) for key in SHARD_METADATA_KEYS),
        chunks=plan.chunks,
        removed_doc_ids=removed_documents(
            directory, "build-shards", manifest.counters.get(f"rejected_{NEAR_DUPLICATE}", 0)
        ),
        deleted=plan.deleted if plan.deleted is not None else DeletedRanges.none(),
        sources=tuple(source.name for source in manifest.sources),
    )
    entries = _entries(manifest)
    _check_shard_totals(directory, manifest, entries, plan.shards.chunks_per_sequence)
    plan.shard_entries = sampled(entries, plan.sample)
    if manifest.sources and len(plan.shard_entries) == len(entries):
        totals = tuple((source.sequences, source.tokens) for source in manifest.sources)
        plan.shards = dataclasses.replace(plan.shards, source_totals=totals)
    checked = {entry.path for entry in plan.shard_entries}
    plan.listed_files += [(directory, entry) for entry in entries if entry.path not in checked]
    L, k = plan.shards.chunks_per_sequence, manifest.neighbours
    rows = sum(entry.rows for entry in plan.shard_entries)
    counts = [entry.neighbour_slots_filled for entry in plan.shard_entries]
    filled = "" if None in counts else f"{sum(counts)}/{rows * L * k} neighbour slots filled, "
    total = len(entries)
    if plan.complete:
        head = f"OK shards {directory}: {rows} sequences in {total} shards"
    else:
        head = (
            f"OK shards {directory} (a sample: {len(plan.shard_entries)} of {total} shards and the chunk "
            f"rows they reference; {_listed_note(plan, total, 'shards')}): {rows} sequences in the sample"
        )
    shares = ", ".join(f"{s.name} {s.share:.3f} (asked {s.weight:.3f})" for s in manifest.sources)
    plan.lines.append(
        f"{head}, {filled}no same-document neighbour, neighbour tokens equal the chunk "
        f"database; {neighbour_summary(manifest)}" + (f"; token shares by source: {shares}" if shares else "")
    )


def _not_built_on(directory: str, manifest: ShardsManifest, index_path: str, index_bytes: bytes) -> str:
    """Shards built against another manifest than the index's current one: what the index's
    generations since changed, where they go through the one the shards record."""
    problem = f"{directory}: built against a different index than {index_path}"
    current = read_manifest(index_bytes, index_path, IndexManifest, error=manifest_problem)
    change = change_since(generation_spans(current), (), manifest.index_generation, manifest.index_manifest_sha256)
    if change is None:
        return problem
    return f"{problem}: its generation {change.since}, which has changed since ({change}); run build-shards again"


def _built_against(index_directory: str, index_manifest_sha256: str) -> int | None:
    """The commit of the index whose manifest shards were built against, the newest such that
    is kept (shards built before an append are checked against the index they read); None:
    none kept, so the current one (whose mismatch is then the problem named)."""
    found = fileio.kept_commit_of(index_directory, index_manifest_sha256)
    return None if found is None else commit_number(found[0])


def _plan_vector_index(plan: ValidationPlan, directory: str) -> None:
    manifest = _manifest(plan, directory, VectorIndexManifest)
    entries = _entries(manifest)
    plan.listed_files += [(directory, entry) for entry in entries]
    if plan.complete:  # a sample does not search it, as for a pipeline's index
        plan.faiss_index = FaissFacts.of(directory, manifest, entries, manifest.num_vectors, DeletedRanges.none())
    plan.lines.append(
        f"OK vector index {directory}: {manifest.num_vectors} vectors, {manifest.index_factory}, "
        f"{manifest.recall_at_k.measure} = {manifest.recall_at_k.value:.3f} at depth {manifest.nprobe}"
    )


def plan_validation(
    path: str,
    sample: float = 1.0,
    index_directory: str | None = None,
    *,
    commits: dict[str, int] | None = None,
    hash_all: bool = False,
) -> ValidationPlan:
    """The plan for an index dir, a shards dir (its index: `index_directory`, by default the
    `index` beside it), or an output dir holding both; `sample` in (0, 1]: the files a sample
    does not read are checked by size, and with `hash_all` by sha256 too. `commits`: directory
    -> the commit to read there (default: the current one; shards: the index commit they were
    built against while it is kept). The plan's `commits` are those it read: planning again
    with them reads the same manifests whatever was committed since."""
    if not 0 < sample <= 1:
        raise ValueError(f"sample {sample}: must be in (0, 1]")
    plan = ValidationPlan(
        path=path, sample=sample, index_directory=index_directory, commits=dict(commits or {}), hash_all=hash_all
    )
    _plan_path(plan, path, index_directory)
    plan.manifests_read.clear()  # read once each while planning; not carried to the checks
    return plan


def _plan_path(plan: ValidationPlan, path: str, index_directory: str | None) -> None:
    found_path, data = _read(plan, path)
    if data is not None:
        raw = read_manifest(data, found_path, error=manifest_problem)
        if "shards" in raw:
            index_directory = index_directory or posixpath.join(posixpath.dirname(path.rstrip("/")), "index")
            _plan_shards(plan, path, index_directory)
        elif "inputs" in raw:
            _plan_vector_index(plan, path)
        else:
            _plan_index(plan, path)
        return
    index, shards = fileio.join(path, "index"), fileio.join(path, "shards")
    found = [d for d in (index, shards) if _read(plan, d)[1] is not None]
    require(found, f"{path}: no manifest here, nor in {path}/index or {path}/shards", "manifest")
    if index in found:
        _plan_index(plan, index)
    if shards in found:
        _plan_shards(plan, shards, index)
