"""What the manifests record as measured: the index's recall (`Recall`, its curve of
`DepthRecall` points, `OwnDocumentRecall`), the embed stage's `PrecisionCheck`, and
build-shards' `NeighbourRecall`, `SearchDepth` and `ShardsRefresh`; with `ManifestModel`, the base of every
manifest model (schemas/manifest.py holds the manifests themselves).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from schemas.backends import REFERENCE_BACKEND, REFERENCE_PRECISION

# ann-benchmarks' epsilon: similarities this close are a tie, in every recall measured here and in
# the embed stage's precision check
TIE_TOLERANCE = 1e-3


class ManifestModel(BaseModel):
    # every manifest model: keys it does not know are kept (a newer writer's fields survive)
    model_config = ConfigDict(extra="allow")


class DepthRecall(ManifestModel):
    """One point of a recall curve: the recall measured at one search depth."""

    depth: int | None = Field(description="nprobe or efSearch; None: an exact index, searched whole.")
    recall: float


class OwnDocumentRecall(ManifestModel):
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


class Recall(ManifestModel):
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


def setting_name(backend: str, precision: str, quantize: str) -> str:
    """An embedding setting in words, e.g. 'openvino bfloat16 int8'."""
    return " ".join([backend, precision] + ([quantize] if quantize != "none" else []))


class PrecisionCheck(ManifestModel):
    """The embed stage's check of its setting (backend, arithmetic, quantisation) against torch
    float32, on sampled chunks."""

    precision: str = Field(description="What the encoder ran in: float32, bfloat16 or float16.")
    backend: str = Field(
        "torch",
        description="What ran the encoder: a registered backend's name, e.g. torch, onnx or openvino "
        "(torch: an older manifest).",
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
        if (self.backend, self.precision) == (REFERENCE_BACKEND, REFERENCE_PRECISION):
            return f"{setting} (the reference itself: nothing to check)"
        bound = "" if self.agreement_upper_bound is None else f", at most {self.agreement_upper_bound:.3f} at 99%"
        return (
            f"{setting}: top-2 neighbours of {self.sample_size} sampled chunks agree with torch float32 on "
            f"{self.top2_agreement:.3f}{bound} (fails below {self.min_agreement}), least cosine {self.min_cosine:.4f}"
        )


class NeighbourRecall(ManifestModel):
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


class SearchDepth(ManifestModel):
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


class ShardsRefresh(ManifestModel):
    """One refresh of the shards after their index changed: the shards it started from and what
    it wrote (a shard whose rows did not change kept its file)."""

    from_generation: int = Field(description="The index generation the refreshed shards were built from.")
    to_generation: int = Field(description="The index generation they were brought up to.")
    shards_manifest_sha256: str = Field(description="The sha256 of the shards manifest refreshed.")
    rewritten: list[tuple[int, int]] = Field(
        description="The shard numbers whose files this refresh wrote, as [first, last] runs."
    )
    kept: int = Field(description="Shards whose files it kept as they were.")
    removed: int = Field(description="Shards it left out: every sequence in them was dropped.")


class SourceShare(ManifestModel):
    """One source of a blended training corpus: what it held, what the shards took of it."""

    name: str
    weight: float = Field(description="The share of the training tokens asked: its weight over the weights' sum.")
    documents: int = Field(description="Documents read and kept (not rejected).")
    sequences_available: int = Field(description="Sequences its documents packed into.")
    tokens_available: int = Field(description="Their input tokens, padding not counted.")
    sequences: int = Field(description="Rows of the shards from this source, counted in the shards.")
    repeats: int = Field(description="Of those, rows repeating a sequence drawn already (a source upsampled).")
    left_out: int = Field(description="Its sequences in no row (a source subsampled).")
    tokens: int = Field(description="Input tokens of those rows, padding not counted, counted in the shards.")
    share: float = Field(description="tokens / all rows' tokens: the share got, against weight asked.")

    def summary(self) -> str:
        """'pydocs: 0.601 of the tokens (asked 0.600), 318 rows of its 318 sequences (0 repeats, 0 left
        out), 60 documents'."""
        return (
            f"{self.name}: {self.share:.3f} of the tokens (asked {self.weight:.3f}), {self.sequences:,} rows of its "
            f"{self.sequences_available:,} sequences ({self.repeats:,} repeats, {self.left_out:,} left out), "
            f"{self.documents:,} documents"
        )
