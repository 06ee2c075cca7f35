"""Manifest models of the index and shard directories (docs/design.md §4), and the one reader
of a manifest (`read_manifest`).

A stage's output exists only once its manifest.json is written, and that happens last. The
measurements they record (recall, the precision check, the search depth) are in
`schemas/measures.py`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from pydantic import AliasChoices, Field, ValidationError

from schemas import __version__
from schemas.arrow import SCHEMA_VERSION, check_schema_version
from schemas.measures import (
    ManifestModel,
    NeighbourRecall,
    PrecisionCheck,
    Recall,
    SearchDepth,
    ShardsRefresh,
    SourceShare,
)

#: A copy of the newest commit's manifest, for people and outside tools, and where the trainer
#: starts looking for the newest commit (its `commit` names it); an output from before commits
#: were numbered has only this.
MANIFEST_FILE = "manifest.json"
#: Each commit of a directory writes its manifest once, as manifest-NNNNNN.json, with a
#: put-if-absent; the newest complete one is the directory's current commit.
COMMIT_MANIFEST = re.compile(r"manifest-(\d{6,})\.json")
#: A file a commit adds under a name an earlier commit's manifest still lists gets the commit's
#: number before its extension (`versioned`): no committed file is ever overwritten.
_VERSION = re.compile(r"\.c(\d{6,})(?=\.[^./]+$|$)")
#: Every manifest's `created_by`.
CREATED_BY = f"ratrain-pipeline {__version__}"
#: A manifest lists at most this many file entries inline; above it they go to its file table.
INLINE_FILE_ENTRIES = 10_000
#: The file table's name, beside manifest.json (schemas/file_table.py writes and reads it).
FILE_TABLE = "files.parquet"
#: What a path a manifest lists must be: relative to the manifest's directory and inside it
#: (segments joined by "/", none of them "", "." or "..", no "\\" or ":"), so a manifest read
#: from elsewhere cannot point a reader outside the output. One pattern for pydantic's check of
#: an entry and Arrow's of a file table's path column (neither regex engine has lookarounds).
_SEGMENT = r"(?:[^/\\:.][^/\\:]*|\.[^/\\:.][^/\\:]*|\.\.[^/\\:]+)"
INSIDE_PATH = rf"^{_SEGMENT}(?:/{_SEGMENT})*$"
INSIDE_PATH_RULE = "a path inside the output (relative, no '..', '.', empty segment, '\\' or ':')"


def commit_manifest(number: int) -> str:
    """The manifest file of commit `number` of a directory."""
    return f"manifest-{number:06d}.json"


def chosen_manifest(names, number: int | None = None) -> tuple[int, str] | None:
    """(commit number, name) of the manifest a reader reads among a directory's file `names`:
    commit `number`'s, or with None the newest; an output from before commits were numbered
    has only manifest.json, read as commit 0. None: no such commit."""
    numbered = sorted((int(m.group(1)), name) for name in names if (m := COMMIT_MANIFEST.fullmatch(name)))
    if not numbered:
        return (0, MANIFEST_FILE) if number in (None, 0) and MANIFEST_FILE in names else None
    chosen = [(n, name) for n, name in numbered if number is None or n == number]
    return chosen[-1] if chosen else None


def commit_number(path: str) -> int:
    """The commit a manifest's path names (manifest.json of an output from before commits were
    numbered: 0)."""
    found = COMMIT_MANIFEST.fullmatch(path.rstrip("/").rsplit("/", 1)[-1])
    return int(found.group(1)) if found else 0


def commit_table(number: int) -> str:
    """The file table of commit `number` (when its entries are not inline)."""
    return f"files-{number:06d}.parquet"


def versioned(path: str, number: int) -> str:
    """`path` as commit `number` writes it when an earlier commit lists the plain name:
    chunks/chunks-00000.parquet -> chunks/chunks-00000.c000002.parquet."""
    plain = unversioned(path)
    stem, dot, extension = plain.rpartition(".")
    return f"{stem}.c{number:06d}.{extension}" if dot and "/" not in extension else f"{plain}.c{number:06d}"


def unversioned(path: str) -> str:
    """The name a file has whatever commit wrote it: what a reader looks a file up by."""
    return _VERSION.sub("", path)


def by_name(entries) -> dict:
    """File entries (anything with a `.path`) by the name a reader looks them up by, whatever
    commit numbered them (`unversioned`)."""
    return {unversioned(e.path): e for e in entries}


class FileEntry(ManifestModel):
    path: str = Field(
        pattern=INSIDE_PATH, description=f"Path relative to the manifest's directory: {INSIDE_PATH_RULE}."
    )
    rows: int
    bytes: int
    sha256: str


class ShardEntry(FileEntry):
    neighbour_slots_filled: int | None = Field(
        None, description="Neighbour slots of this shard holding a neighbour (None: an older manifest)."
    )
    source_rows: list[int] | None = Field(
        None, description="A blend's rows of each source in this shard, in the sources' order (None: no blend)."
    )


class FileTable(ManifestModel):
    """Where a manifest's file entries are when there are more than INLINE_FILE_ENTRIES."""

    path: str = Field(
        pattern=INSIDE_PATH,
        description="A Parquet file beside the manifest, one row per entry, in the manifest's order.",
    )
    sha256: str
    entries: int
    bytes: int


#: The inline list of entries (always written: empty when they are in the file table).
ENTRIES_IN_TABLE = Field(description="Empty when `file_table` is set: the entries are in that file.")
FILE_TABLE_FIELD = Field(None, description="The file table holding the entries (None: they are inline).")


class Fingerprint(ManifestModel):
    name: str
    fingerprint: str = Field(description="sha256 over the files that define it.")


class VectorIndex(ManifestModel):
    """What a faiss build records, in an index manifest and in a stand-alone one."""

    index_factory: str
    nprobe: int | None
    dim: int
    metric: str
    recall_at_k: Recall
    index_bytes: int
    memory_budget: int
    training_vectors: int
    clustering: str = Field(
        "flat",
        description="How the IVF lists were trained: 'flat' (one k-means) or 'two_level' (faiss's two-level k-means).",
    )
    queries_per_second: float | None
    slice_bytes: int | None = Field(
        None,
        validation_alias=AliasChoices("slice_bytes", "shard_bytes"),  # as manifests before the rename wrote it
        description="The index's faiss files are slices of at "
        "most this size (faiss/slice-NNNNN.faiss, each owning a group of "
        "nearby inverted lists, plus faiss/quantizer.faiss and "
        "faiss/list_owners.npy); None: one file, faiss/index.faiss.",
    )


class StageTimings(ManifestModel):
    """A job's wall time and throughput, for reports and comparisons between runs."""

    stage: str = Field(description="The job: build-index, build-index (faiss only), index or build-shards.")
    started: str = Field(description="UTC time (ISO 8601) the driver built the job's pipeline.")
    committed: str = Field(description="UTC time the job's commit step (on a worker) wrote this manifest.")
    wall_seconds: float = Field(
        description="committed - started: submission, every step and the commit "
        "(with any offset between the driver's and the worker's clocks)."
    )
    records: str = Field(description="The counter the throughput counts (e.g. chunks, sequences).")
    records_per_second: float | None = Field(
        description="None: the two clocks disagree so far that the wall time is not positive."
    )
    job: str | None = Field(
        None, description="The job that committed it (its staging directory): a retried commit knows its own."
    )


class _Committed(ManifestModel):
    """What every committed directory's manifest says about itself."""

    schema_version: int = SCHEMA_VERSION
    config_hash: str = Field(description="Hash of the settings the output depends on (never the output location).")
    counters: dict[str, int] = Field(description="Records read, written and dropped, by reason.")
    created_by: str
    timings: StageTimings | None = Field(
        None,
        description="The job's wall time and throughput (None: "
        "an older manifest). Differs between runs of the same config.",
    )
    commit: int | None = Field(
        None,
        description="The number of the commit that wrote it (manifest-NNNNNN.json): manifest.json, its "
        "copy, says which commit it is. None: from before commits were numbered.",
    )


class VectorIndexManifest(VectorIndex, _Committed):
    """`ratrain-pipeline index`: a faiss index over embeddings the user already had."""

    num_vectors: int
    inputs: list[dict] = Field(description="Embedding files read: path, bytes.")
    files: list[FileEntry] = ENTRIES_IN_TABLE
    file_table: FileTable | None = FILE_TABLE_FIELD


PRECISION_CHECK = Field(
    None, description="The precision check of the embed stage (None: nothing embedded, or an older manifest)."
)


ENCODER_THREADS = Field(
    None,
    description="Intra-op threads of every CPU encoder process (None: "
    "a GPU, or nothing embedded). Embedding bytes are reproducible for the same "
    "config, hardware and this count.",
)


class InputFile(ManifestModel):
    """A corpus file as read: where, and its size and modification time then (a file listed
    with another size or time is not the one read)."""

    path: str = Field(description="As the corpus glob matched it.")
    bytes: int
    modified: float | None = Field(
        default=None, description="Last modified, seconds since the epoch, as the filesystem listed it."
    )

    @classmethod
    def listed(cls, listed) -> InputFile:
        """From a corpus listing (`pipeline.corpus.parse.ListedFile`)."""
        return cls(path=listed.path, bytes=listed.size, modified=listed.modified)

    def changed_in(self, now: InputFile) -> bool:
        """Whether the file listed `now` is not this one as read: another size, or (both known)
        another modification time, as rsync's quick check decides."""
        if self.bytes != now.bytes:
            return True
        return self.modified is not None and now.modified is not None and self.modified != now.modified


class Generation(ManifestModel):
    """What one build-index run added to an index directory: the first build is generation 0,
    each append the next (docs/design.md §8, "Appending")."""

    number: int
    inputs: list[InputFile] = Field(description="The corpus files this generation read (new, or changed since).")
    removed_inputs: list[str] = Field(
        default_factory=list,
        description="Corpus files gone since an earlier generation read them: their documents deleted.",
    )
    based_on: str | None = Field(None, description="The sha256 of the index manifest it changed (None: a build).")
    first_chunk_id: int = Field(description="Its chunks are first_chunk_id ... first_chunk_id + num_chunks - 1.")
    num_chunks: int
    num_documents: int
    deleted_documents: int = Field(0, description="Documents this generation deleted (replaced ones included).")
    deleted_chunks: int = Field(0, description="Their chunks: removed from the faiss index, still in the chunk files.")
    new_vector_recall: float | None = Field(
        None,
        description="1-recall@10 at the index's depth of sampled vectors of this generation, against "
        "exact search over all vectors (appends only: how far the trained lists have drifted).",
    )
    embedding_precision: PrecisionCheck | None = Field(
        None, description="The embed check of this generation's chunks (appends; generation 0's is the manifest's)."
    )
    timings: StageTimings | None = Field(
        None, description="Its job's timings (None for the newest generation: the manifest's `timings` are its)."
    )


class IndexManifest(VectorIndex, _Committed):
    embed_config_hash: str = Field(
        description="Hash of what chunks and embeddings depend on: when only index.* changes, they are reused."
    )
    encoding_config_hash: str | None = Field(
        None,
        description="embed_config_hash without the corpus's paths: an append needs it equal "
        "(None: an older manifest, which cannot be appended to).",
    )
    generations: list[Generation] = Field(
        default_factory=list, description="What each build-index run added, oldest first (empty: an older manifest)."
    )
    tokenizer: Fingerprint
    embedding_model: Fingerprint
    encoder_threads: int | None = ENCODER_THREADS
    embedding_precision: PrecisionCheck | None = PRECISION_CHECK
    num_documents: int = Field(description="Documents in the chunk files (deleted ones included).")
    num_chunks: int = Field(description="Chunks in the chunk files (deleted ones included: ids are never reused).")
    deleted_documents: int = Field(0, description="Documents deleted (deleted/*.parquet lists them).")
    deleted_chunks: int = Field(0, description="Their chunks: in no search (the faiss index holds the others).")
    chunk_tokens: int
    pad_id: int
    files: list[FileEntry] = ENTRIES_IN_TABLE
    file_table: FileTable | None = FILE_TABLE_FIELD


class ShardsManifest(_Committed):
    index_manifest_sha256: str
    index_generation: int | None = Field(
        None, description="The index's newest generation when the neighbours were searched (None: none recorded)."
    )
    training_corpus: str = Field(
        description="'same' (sequences packed from the index's chunks, seq s = chunks s*L ... s*L+L-1), 'separate' "
        "or 'blend' (sources drawn by weight: `sources`)."
    )
    encoder_threads: int | None = ENCODER_THREADS
    embedding_precision: PrecisionCheck | None = PRECISION_CHECK
    sequence_tokens: int
    chunk_tokens: int
    neighbours: int
    neighbour_tokens: int
    pad_id: int
    num_sequences: int
    shards: list[ShardEntry] = ENTRIES_IN_TABLE
    file_table: FileTable | None = FILE_TABLE_FIELD
    neighbour_fill: float | None = Field(None, description="Neighbour slots filled / all slots, counted in the shards.")
    neighbour_recall: NeighbourRecall | None = Field(
        None, description="The neighbour-quality check (None when neighbour_recall_sample is 0)."
    )
    search_depth: SearchDepth | None = Field(
        None, description="The search depth and how it was chosen (None: no sample, or an older manifest)."
    )
    overlap: dict[str, int] = Field(
        description="Leakage audit, RETRO's chunk overlap r(C) = longest common token run between a training chunk and "
        "its neighbours / m: training chunks per threshold t, counting those with r(C) <= t and above the one below."
    )
    refreshes: list[ShardsRefresh] = Field(
        [], description="The refreshes since the shards were last built whole, oldest first (docs/design.md §8)."
    )
    sources: list[SourceShare] = Field(
        [], description="A blend's sources, in the order of the source column's names (none unless 'blend')."
    )


class ManifestError(ValueError):
    """A manifest that is missing, not JSON or not of the kind expected; the message names the file."""


#: What `read_manifest`'s messages call each kind of manifest, and what commits it.
_KINDS = {
    ShardsManifest: ("a shards manifest", "the shard stage"),
    IndexManifest: ("an index manifest", "the index stage"),
    VectorIndexManifest: ("a vector index manifest", "the index command"),
}


def read_manifest(source, where: str, model=None, *, error: Callable[[str], Exception] = ManifestError):
    """A manifest read, parsed and checked: the one place any reader (pipeline, validate,
    inspect, report, trainer) does so; each keeps its own file access.

    source: the manifest's text (str or bytes); None when there is no manifest; or a function
    returning its text that raises FileNotFoundError when there is none.
    where: the manifest's path or URL, which every error names.
    model: the manifest model to validate into; a function of the parsed JSON object that
    picks the model; None: the parsed object itself (its schema_version checked, nothing else).
    error: called with the message to make the error raised for a missing manifest, one that
    is not JSON or one that is not `model` (ManifestError, or a caller's own error type). An
    unknown schema_version raises schemas.arrow.SchemaVersionError whatever `error` is.
    """
    if callable(source):
        try:
            source = source()
        except FileNotFoundError:
            source = None
    if source is None:
        committer = _KINDS[model][1] if model in _KINDS else "the stage"
        raise error(f"{where}: no manifest ({committer} has not committed)")
    try:
        raw = json.loads(source)
    except json.JSONDecodeError as err:
        raise error(f"{where}: not valid JSON ({err})") from None
    check_schema_version(raw.get("schema_version") if isinstance(raw, dict) else None, where)
    if model is None:
        return raw
    if not isinstance(model, type):  # a function that picks the model
        model = model(raw)
    try:
        return model.model_validate(raw)
    except ValidationError as err:
        kind = _KINDS[model][0] if model in _KINDS else f"a {model.__name__}"
        raise error(f"{where}: not {kind} ({err.error_count()} problems: {first_problem(err)})") from None


def first_problem(err: ValidationError) -> str:
    """Where and what the first problem of a manifest's validation is, a path outside the output
    named as such (not as the pattern it fails)."""
    first = err.errors()[0]
    if first["type"] == "string_pattern_mismatch" and first["loc"][-1] == "path":
        return f"{first['loc']} {first['input']!r} is not {INSIDE_PATH_RULE}"
    return f"{first['loc']} {first['msg']}"
