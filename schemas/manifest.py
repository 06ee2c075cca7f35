"""Manifest models of the index and shard directories (docs/design.md §4), and the one reader
of a manifest (`read_manifest`).

A stage's output exists only once its manifest.json is written, and that happens last.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError

from schemas import __version__
from schemas.arrow import SCHEMA_VERSION, check_schema_version

#: The file that commits a directory: written last, and readers refuse a directory without it.
MANIFEST_FILE = "manifest.json"
#: Every manifest's `created_by`.
CREATED_BY = f"ratrain-pipeline {__version__}"
#: A manifest lists at most this many file entries inline; above it they go to its file table.
INLINE_FILE_ENTRIES = 10_000
#: The file table's name, beside manifest.json (schemas/file_table.py writes and reads it).
FILE_TABLE = "files.parquet"


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow")


class FileEntry(_Model):
    path: str = Field(description="Path relative to the manifest's directory.")
    rows: int
    bytes: int
    sha256: str


class ShardEntry(FileEntry):
    neighbour_slots_filled: int | None = Field(
        None, description="Neighbour slots of this shard holding a neighbour (None: an older manifest)."
    )


class FileTable(_Model):
    """Where a manifest's file entries are when there are more than INLINE_FILE_ENTRIES."""

    path: str = Field(description="A Parquet file beside the manifest, one row per entry, in the manifest's order.")
    sha256: str
    entries: int
    bytes: int


#: The inline list of entries (always written: empty when they are in the file table).
ENTRIES_IN_TABLE = Field(description="Empty when `file_table` is set: the entries are in that file.")
FILE_TABLE_FIELD = Field(None, description="The file table holding the entries (None: they are inline).")


class Fingerprint(_Model):
    name: str
    fingerprint: str = Field(description="sha256 over the files that define it.")


class DepthRecall(_Model):
    """One point of a recall curve: the recall measured at one search depth."""

    depth: int | None = Field(description="nprobe or efSearch; None: an exact index, searched whole.")
    recall: float


class OwnDocumentRecall(_Model):
    """The index's recall on the search build-shards makes: each query's whole document excluded."""

    measure: str = Field(
        description="'recall@k with ties within 0.001 (empty slot = miss)': share of the "
        "query sample's k neighbour slots, found with the query's own document excluded "
        "(chunk-id range skipped inside faiss, deepening as build-shards does), that are as "
        "similar as exact search's k-th best outside that document."
    )
    k: int
    value: float = Field(description="At the index's search depth.")
    depth: int | None = Field(description="The depth this measure alone reached the target at (None: exact).")
    plateau: bool = False
    curve: list[DepthRecall] | None = Field(None, description="Recall at each depth measured (None: exact index).")


class Recall(_Model):
    measure: str = Field(
        description="'1-recall@10 with ties within 0.001': share of sampled "
        "indexed vectors for which one of the index's top 10 (self excluded) is "
        "as similar as the exact nearest other vector, within the tolerance."
    )
    value: float
    sample_size: int
    nprobe: int | None = Field(
        None, description="Search depth it was measured at (nprobe for IVF, efSearch for HNSW; None for exact indexes)."
    )
    target: float | None = None
    plateau: bool = Field(
        False,
        description="The tuning stopped below the target because "
        "two doublings of the search depth gained less than 0.005 recall.",
    )
    curve: list[DepthRecall] | None = Field(
        None,
        description="Recall at each search depth the "
        "tuning measured, in the order measured (one point for a "
        "fixed index.nprobe; None: an exact index, or an older "
        "manifest).",
    )
    own_document_excluded: OwnDocumentRecall | None = Field(
        None,
        description="The same queries with their own document excluded (None: documents not "
        "known, e.g. `ratrain-pipeline index`, or an older manifest). The index's depth is the "
        "deeper of the two tunings.",
    )

    def summary(self) -> str:
        """'1-recall@10 ... = 0.977, recall@2 with the own document excluded = 0.963, at depth 8'."""
        text = f"{self.measure} = {self.value:.3f}"
        if self.own_document_excluded is not None:
            own = self.own_document_excluded
            text += f", recall@{own.k} with the own document excluded = {own.value:.3f}"
        return text + ("" if self.nprobe is None else f", at depth {self.nprobe}")


class VectorIndex(_Model):
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


class StageTimings(_Model):
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


class _Committed(_Model):
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


class VectorIndexManifest(VectorIndex, _Committed):
    """`ratrain-pipeline index`: a faiss index over embeddings the user already had."""

    num_vectors: int
    inputs: list[dict] = Field(description="Embedding files read: path, bytes.")
    files: list[FileEntry] = ENTRIES_IN_TABLE
    file_table: FileTable | None = FILE_TABLE_FIELD


def setting_name(backend: str, precision: str, quantize: str) -> str:
    """An embedding setting in words, e.g. 'openvino bfloat16 int8'."""
    return " ".join([backend, precision] + (["int8"] if quantize == "int8" else []))


class PrecisionCheck(_Model):
    """The embed stage's check of its setting (backend, arithmetic, quantisation) against torch
    float32, on sampled chunks."""

    precision: str = Field(description="What the encoder ran in: float32, bfloat16 or float16.")
    backend: str = Field(
        "torch", description="What ran the encoder: torch, onnx or openvino (torch: an older manifest)."
    )
    quantize: str = Field("none", description="none, or int8 weight products (none: an older manifest).")
    sample_size: int = Field(description="Chunks embedded again by torch in float32 (chosen by id hash).")
    top2_agreement: float = Field(
        description="Share of the sample's top-2 neighbours (within the "
        "sample) equal to float32's, ties within 0.001 counted equal."
    )
    agreement_upper_bound: float | None = Field(
        None,
        description="Wilson 99% upper confidence bound of the agreement given the sample "
        "(None: an older manifest); the build fails when it is below min_agreement.",
    )
    min_cosine: float = Field(description="Least cosine between a chunk's stored embedding and its float32 one.")
    min_agreement: float = Field(
        description="The agreement below which the build fails (when the upper bound is below it)."
    )

    def summary(self) -> str:
        """One line for inspect and the report."""
        setting = setting_name(self.backend, self.precision, self.quantize)
        if (self.backend, self.precision) == ("torch", "float32"):
            return "torch float32 (the reference itself: nothing to check)"
        bound = "" if self.agreement_upper_bound is None else f", at most {self.agreement_upper_bound:.3f} at 99%"
        return (
            f"{setting}: top-2 neighbours of {self.sample_size} sampled chunks agree with torch float32 on "
            f"{self.top2_agreement:.3f}{bound} (fails below {self.min_agreement}), least cosine {self.min_cosine:.4f}"
        )


PRECISION_CHECK = Field(
    None, description="The precision check of the embed stage (None: nothing embedded, or an older manifest)."
)


ENCODER_THREADS = Field(
    None,
    description="Intra-op threads of every CPU encoder process (None: "
    "a GPU, or nothing embedded). Embedding bytes are reproducible for the same "
    "config, hardware and this count.",
)


class InputFile(_Model):
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


class Generation(_Model):
    """What one build-index run added to an index directory: the first build is generation 0,
    each append the next (docs/design.md §8, "Appending")."""

    number: int
    inputs: list[InputFile] = Field(description="The corpus files this generation read (new, or changed since).")
    removed_inputs: list[str] = Field(
        default_factory=list,
        description="Corpus files gone since an earlier generation read them: their documents deleted.",
    )
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


class NeighbourRecall(_Model):
    measure: str = Field(
        description="Share of sampled training chunks' neighbour slots whose "
        "neighbour is as near as exact search's k-th best (within tolerance), "
        "exact search applying the same own-document exclusion; an empty slot "
        "is a miss unless the database has fewer than k chunks to offer."
    )
    value: float
    sample_size: int = Field(description="Training chunks sampled (deterministically by id).")
    slots: int = Field(description="Neighbour slots that exact search fills for them.")
    tolerance: float


class SearchDepth(_Model):
    """How build-shards chose its search depth: from the neighbour recall of its sampled
    training chunks (own documents excluded, as in the search), before searching."""

    index_depth: int | None = Field(description="The depth the index stage tuned (nprobe, efSearch; None: exact).")
    depth: int | None = Field(description="The depth build-shards searched at.")
    target: float = Field(description="index.target_recall.")
    recall_below_target: str = Field(description="The policy: deepen, warn or fail.")
    curve: list[DepthRecall] = Field(
        description="{depth, recall} measured, index depth first (recall as neighbour_recall measures it)."
    )
    plateau: bool = Field(description="Deepening stopped because two doublings of the depth gained less than 0.005.")


class ShardsManifest(_Committed):
    index_manifest_sha256: str
    index_generation: int | None = Field(
        None, description="The index's newest generation when the neighbours were searched (None: none recorded)."
    )
    training_corpus: str = Field(
        description="'same' (sequences packed from the index's own "
        "chunks, seq s = chunks s*L ... s*L+L-1) or 'separate'."
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
    neighbour_fill: float | None = Field(
        None, description="Neighbour slots filled / all slots, counted in the shards written."
    )
    neighbour_recall: NeighbourRecall | None = Field(
        None, description="The neighbour-quality check (None when neighbour_recall_sample is 0)."
    )
    search_depth: SearchDepth | None = Field(
        None, description="The search depth and how it was chosen (None: no sample, or an older manifest)."
    )
    overlap: dict[str, int] = Field(
        description="Leakage audit, RETRO's chunk overlap r(C) = "
        "longest common token run between a training chunk and its "
        "neighbours / m: training chunks per threshold t, counting "
        "those with r(C) <= t and above the threshold before."
    )

    def neighbour_summary(self) -> str:
        """'neighbour fill 1.000, neighbour recall 0.990 against exact search on 200 sampled
        chunks' (the stage's log, validate, inspect)."""
        text = "neighbour fill " + ("not recorded" if self.neighbour_fill is None else f"{self.neighbour_fill:.3f}")
        if self.neighbour_recall is not None:
            text += (
                f", neighbour recall {self.neighbour_recall.value:.3f} against exact search on "
                f"{self.neighbour_recall.sample_size} sampled chunks"
            )
        depth = self.search_depth
        if depth is not None and depth.depth is not None:
            deeper = "" if depth.depth == depth.index_depth else f", deeper than the index's {depth.index_depth}"
            text += f", searched at depth {depth.depth}{deeper}"
        return text


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
        first = err.errors()[0]
        raise error(f"{where}: not {kind} ({err.error_count()} problems: {first['loc']} {first['msg']})") from None
