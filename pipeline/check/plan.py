"""What `validate` checks, decided from the manifests (`plan_validation`): the manifests' totals
against their entries, streamed from the file tables a row group at a time, the facts every check
needs, and the row groups whose entries become the units (`pipeline.check.units`); with `sample`
< 1 the hash-chosen shards, chunk files and embedding files (`pipeline.check.sample`). Nothing
here holds an entry per file: chunk and embedding files as runs (`FileRuns`), totals as sums.
"""

from __future__ import annotations

import dataclasses
import posixpath
from dataclasses import dataclass, field

from pipeline.build_shards.manifest import neighbour_summary
from pipeline.check.facts import (
    EntryGroup,
    FaissFacts,
    IndexFacts,
    ShardsFacts,
    removed_documents,
)
from pipeline.check.problems import manifest_problem, require
from pipeline.check.rules import check_generations
from pipeline.check.sample import Sample
from pipeline.check.tallies import IndexFiles, ShardTotals
from pipeline.chunks.chunk_files import EMBEDDINGS_DIR, ChunkFileRanges
from pipeline.chunks.deleted import DeletedRanges, read_deleted
from pipeline.chunks.file_runs import FileRuns
from pipeline.common import fileio
from pipeline.common.rejected import NEAR_DUPLICATE
from pipeline.retrieve.committed import change_since, generation_spans
from schemas.arrow import (
    SHARD_METADATA_KEYS,
)
from schemas.manifest import (
    MANIFEST_FILE,
    FileEntry,
    IndexManifest,
    ShardsManifest,
    VectorIndexManifest,
    commit_number,
    read_manifest,
)

INDEX_PROBES = 64  # embeddings searched for themselves in the faiss index


@dataclass(kw_only=True)
class ValidationPlan:
    """What a validation reads, decided from the manifests (whose own checks it runs): the
    facts every check needs and the file tables' row groups whose entries become the units
    (`pipeline.check.units`), nothing per file."""

    path: str
    sample: float
    index_directory: str | None = None  # as given to `plan_validation`
    commits: dict[str, int] = field(default_factory=dict)  # directory -> the commit read there (pinned)
    hash_all: bool = False  # a sample also hashes every listed file it does not read
    manifests_read: dict = field(default_factory=dict, repr=False)  # directory -> (path, bytes), while planning
    manifests: dict = field(default_factory=dict)  # directory -> its manifest (entries in its file table)
    entry_groups: list[EntryGroup] = field(default_factory=list)  # whose entries become the units
    index: IndexFacts | None = None  # the index whose chunk files are checked by the rules
    shards: ShardsFacts | None = None
    faiss_index: FaissFacts | None = None
    chunks: ChunkFileRanges | None = None  # the chunk database read (the index's, or the shards'), as runs
    deleted: DeletedRanges | None = None  # the documents deleted from that index
    samples: dict[str, Sample] = field(default_factory=dict)  # "chunks", "embeddings", "shards": those checked
    probes_per_file: int = INDEX_PROBES
    lines: list = field(default_factory=list)  # what a passing validation prints

    @property
    def complete(self) -> bool:
        return self.sample >= 1

    @property
    def hashed(self) -> bool:
        """Whether the listed files no check reads are hashed (else their sizes are checked)."""
        return self.complete or self.hash_all


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
    """The manifest of `directory`, its entries left in its file table where it has one (read
    a row group at a time: `_add_groups`, the tallies), kept in the plan for the units' makers."""
    path, data = _read(plan, directory)
    manifest = read_manifest(data, path, model, error=manifest_problem)
    plan.manifests[directory] = manifest
    return manifest


def _add_groups(plan: ValidationPlan, directory: str, role: str) -> None:
    groups = fileio.entry_groups(plan.manifests[directory], directory, error=manifest_problem)
    plan.entry_groups += [EntryGroup(directory, role, group) for group in range(groups)]


def _names(manifest, directory: str, prefix: str | None):
    """The file names (under `prefix/`; all with None), a row group at a time, for a `Sample`'s passes."""
    return lambda: (t["path"].to_pylist() for t in fileio.entry_batches(manifest, directory, ["path"], prefix))


def _chunk_files(directory: str, files: IndexFiles) -> ChunkFileRanges:
    require(files.ranges.num_files, f"{directory}: manifest lists no chunk files", "manifest")
    return files.ranges


def _plan_index(plan: ValidationPlan, directory: str) -> None:
    manifest = _manifest(plan, directory, IndexManifest)
    _add_groups(plan, directory, "index")
    files = IndexFiles.of(manifest, directory)
    chunks = _chunk_files(directory, files)
    embeddings = chunks.embeddings or FileRuns.of([], [])
    require(
        chunks.num_chunks == manifest.num_chunks,
        f"{directory}: {chunks.num_chunks} chunk rows, manifest says {manifest.num_chunks}",
        "manifest",
    )
    require(
        embeddings.num_rows == manifest.num_chunks,
        f"{directory}: {embeddings.num_rows} embeddings for {manifest.num_chunks} chunks",
        "manifest",
    )
    check_generations(directory, manifest.generations, chunks, manifest.num_documents)
    plan.chunks = chunks
    plan.deleted = deleted = read_deleted(files.deleted)
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
            directory, manifest, files.faiss, manifest.num_chunks - manifest.deleted_chunks, deleted
        )
    for name, prefix, runs in (("chunks", "chunks", chunks.chunks), ("embeddings", EMBEDDINGS_DIR, embeddings)):
        plan.samples[name] = Sample.of(plan.sample, runs.num_files, _names(manifest, directory, prefix))
    plan.probes_per_file = max(1, INDEX_PROBES // max(1, plan.samples["embeddings"].count))
    note = _sample_note(
        plan,
        [
            f"{plan.samples['chunks'].count} of {chunks.num_files} chunk files "
            "(and the row groups of others that sampled shards reference)",
            f"{plan.samples['embeddings'].count} of {embeddings.num_files} embedding files",
            "no search of the faiss index",
        ],
        files.listed,
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


def _check_shard_totals(
    directory: str, manifest: ShardsManifest, totals: ShardTotals, chunks_per_sequence: int
) -> None:
    """The manifest's totals against the sums of its shard entries (which `check_shard` holds
    each shard to)."""
    rows = totals.rows
    require(
        rows == manifest.num_sequences,
        f"{directory}: {rows} rows in the shards, manifest says {manifest.num_sequences}",
        "manifest",
    )
    _check_source_totals(directory, manifest)
    if manifest.neighbour_fill is None or totals.filled is None:
        return
    filled, slots = totals.filled, rows * chunks_per_sequence * manifest.neighbours
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
        index_manifest = _manifest(plan, index_directory, IndexManifest)
    assert index_bytes is not None  # read_manifest raised for a missing one, or the index was planned here
    built_on = fileio.sha256_bytes(index_bytes) == manifest.index_manifest_sha256
    require(built_on, "" if built_on else _not_built_on(directory, manifest, index_path, index_bytes), "manifest")
    m = manifest.chunk_tokens
    require(manifest.neighbour_tokens == 2 * m, f"{directory}: neighbour_tokens != 2 x chunk_tokens", "manifest")
    if plan.chunks is None:  # the index is not validated here: its chunk files only read for the references
        _add_groups(plan, index_directory, "chunks")
        files = IndexFiles.of(index_manifest, index_directory)
        plan.chunks = _chunk_files(index_directory, files)
        plan.deleted = read_deleted(files.deleted)
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
    _add_groups(plan, directory, "shards")
    totals = ShardTotals.of(manifest, directory)
    _check_shard_totals(directory, manifest, totals, plan.shards.chunks_per_sequence)
    sample = plan.samples["shards"] = Sample.of(plan.sample, totals.shards, _names(manifest, directory, None))
    if manifest.sources and sample.complete:
        source_totals = tuple((source.sequences, source.tokens) for source in manifest.sources)
        plan.shards = dataclasses.replace(plan.shards, source_totals=source_totals)
    checked = totals if sample.complete else ShardTotals.of(manifest, directory, sample)
    L, k, rows = plan.shards.chunks_per_sequence, manifest.neighbours, checked.rows
    filled = "" if checked.filled is None else f"{checked.filled}/{rows * L * k} neighbour slots filled, "
    if plan.complete:
        head = f"OK shards {directory}: {rows} sequences in {totals.shards} shards"
    else:
        head = (
            f"OK shards {directory} (a sample: {sample.count} of {totals.shards} shards and the chunk "
            f"rows they reference; {_listed_note(plan, totals.shards, 'shards')}): {rows} sequences in the sample"
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
    _add_groups(plan, directory, "listed")
    if plan.complete:  # a sample does not search it, as for a pipeline's index
        faiss = [FileEntry(**entry) for entry in fileio.entries_under(manifest, directory, "faiss")]
        plan.faiss_index = FaissFacts.of(directory, manifest, faiss, manifest.num_vectors, DeletedRanges.none())
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
