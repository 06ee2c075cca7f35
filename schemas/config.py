"""Typed pipeline configuration (docs/design.md §3), validated on load.

Unknown keys and wrong types are errors that name the field; `load_config` turns pydantic's
report into one line per problem so the CLI can print it without a traceback. The sections
(corpus, embedding, index, decontamination) are in `schemas/stage_config.py`; here they are put
together into `PipelineConfig`, with the stage hashes and the loaders.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import Discriminator, Field, Tag, ValidationError, field_validator, model_validator

from schemas.shard_columns import ShardDims, row_bytes
from schemas.stage_config import (
    CorpusConfig,
    DecontaminationConfig,
    EmbeddingConfig,
    IndexConfig,
    StrictModel,
    TrainingSource,
    parse_size,
)
from schemas.stage_tags import Hashed, NotHashed, Stage, stage_settings

# Stage tags (schemas/stage_tags.py). The shards hash pins the index by its manifest's sha256,
# so settings tagged embed or index reach the shards too.
_EMBED = Hashed(Stage.EMBED)
_SHARDS = Hashed(Stage.SHARDS)
# shard_rows and shard_bytes decide the rows per shard together: it is hashed, not they
_ROWS_PER_SHARD = Hashed(Stage.SHARDS, via="rows_per_shard")
_DECONTAMINATION = Hashed(Stage.DECONTAMINATION)


MAX_SOURCES = 127  # a blend's sources: the shards' source column is dictionary-encoded in int8


class ConfigError(ValueError):
    """A config that cannot be used; the message is one line that names the field."""


def _training_corpus_form(value) -> str:
    """Which form a training_corpus takes, so an error names that form's problem alone."""
    if isinstance(value, list | tuple):
        return "blend"
    return "same" if isinstance(value, str) else "corpus"


class PipelineConfig(StrictModel):
    """One pipeline run: corpora, tokenisation, retrieval and output (docs/design.md §3)."""

    output: Annotated[str, NotHashed("where the outputs are written, not what they hold")] = Field(
        description="Output directory or gs:// prefix (docs/design.md §4)."
    )
    retrieval_corpus: Annotated[CorpusConfig, _EMBED]
    training_corpus: Annotated[
        Annotated[Literal["same"], Tag("same")]
        | Annotated[CorpusConfig, Tag("corpus")]
        | Annotated[list[TrainingSource], Tag("blend")],
        Discriminator(_training_corpus_form),
        _SHARDS,
    ] = Field(
        "same",
        description="'same' packs training sequences from the retrieval corpus's chunks "
        "(their embeddings are reused); otherwise a corpus of its own, or a blend: a list of "
        "sources, each a corpus with a name and a weight.",
    )
    blend_seed: Annotated[int, Hashed(Stage.SHARDS, left_out_at_default="blend")] = Field(
        0,
        ge=0,
        lt=2**63,
        description="Seeds which sequences a blend draws from each source and the order it interleaves them in.",
    )
    tokenizer: Annotated[str | None, _EMBED] = Field(
        None, description="Path of a HF tokenizer.json; default: the default encoder's tokenizer."
    )
    chunk_tokens: Annotated[int, _EMBED] = Field(64, ge=2, le=8192, description="m: tokens per chunk.")
    sequence_tokens: Annotated[int, _SHARDS] = Field(
        2048, ge=2, description="n: tokens per training sequence, a multiple of chunk_tokens."
    )
    neighbours: Annotated[int, _SHARDS] = Field(2, ge=1, le=256, description="k: neighbours kept per chunk.")
    neighbour_candidates: Annotated[int, _SHARDS] = Field(
        20,
        ge=1,
        le=4096,
        description="With dedupe_neighbours: "
        "hits searched per chunk, of which the k best with distinct "
        "tokens are kept. (The search itself skips the sequence's own "
        "documents, so without deduplication exactly k are searched.)",
    )
    neighbour_recall_sample: Annotated[int, _SHARDS] = Field(
        200,
        ge=0,
        le=100_000,
        description="Training chunks whose "
        "neighbours build-shards checks against an exact search "
        "(one scan of the embedding files); 0 skips the check.",
    )
    recall_below_target: Annotated[Literal["deepen", "warn", "fail"], _SHARDS] = Field(
        "deepen",
        description="What build-shards does when the neighbour recall of its sampled training "
        "chunks (own documents excluded, measured before the search) is below "
        "index.target_recall at the index's search depth: 'deepen' doubles the depth until it "
        "is met or stops improving; 'warn' searches at the index's depth and warns; 'fail' "
        "commits nothing and names the depth that meets it.",
    )
    dedupe_neighbours: Annotated[bool, _SHARDS] = Field(
        False,
        description="Drop a candidate whose m tokens equal "
        "those of a neighbour already kept for the same chunk "
        "(boilerplate repeated across documents).",
    )
    keep_commits: Annotated[int, NotHashed("how many earlier commits stay readable, not what a commit writes")] = Field(
        1,
        ge=1,
        description="Commits of a directory kept once a new one is complete (1: only the new one). A kept "
        "commit can still be read (validate --commit N), and its files stay; gc deletes older ones.",
    )
    max_rejected_fraction: Annotated[float, NotHashed("whether a stage commits, not what it writes")] = Field(
        0.5,
        ge=0,
        le=1,
        description="Fail a stage (and commit "
        "nothing) when more than this share of its input records "
        "is rejected: most often a wrong text_field or format.",
    )
    shard_rows: Annotated[int, _ROWS_PER_SHARD] = Field(1024, ge=1, description="Training sequences per Arrow shard.")
    shard_bytes: Annotated[int | None, _ROWS_PER_SHARD] = Field(
        None,
        gt=0,
        description="Target bytes per Arrow shard "
        "(e.g. '256MB'); when set it decides the rows per shard "
        "(rows have a fixed size) instead of shard_rows.",
    )
    chunk_file_rows: Annotated[int, _EMBED] = Field(65536, ge=1, description="Rows per chunks/embeddings Parquet file.")
    embedding: Annotated[EmbeddingConfig, _EMBED] = EmbeddingConfig()
    index: Annotated[IndexConfig, Hashed(Stage.INDEX)] = IndexConfig()
    evaluation_corpus: Annotated[list[CorpusConfig], _DECONTAMINATION] = Field(
        [],
        description="Evaluation documents (one corpus or several): documents of the corpora in "
        "decontamination.apply_to that are near-duplicates of one are removed (rejected/, reason "
        "near_duplicate_of_evaluation). Empty: no decontamination.",
    )
    decontamination: Annotated[DecontaminationConfig, _DECONTAMINATION] = DecontaminationConfig()

    @field_validator("evaluation_corpus", mode="before")
    @classmethod
    def _one_corpus_is_a_list(cls, v):
        return [v] if isinstance(v, dict) else v

    @model_validator(mode="after")
    def _one_name_per_source(self):
        if isinstance(self.training_corpus, list):
            if not self.training_corpus:
                raise ValueError("training_corpus: a blend needs at least one source")
            names = [source.name for source in self.training_corpus]
            repeated = sorted({name for name in names if names.count(name) > 1})
            if repeated:
                raise ValueError(f"training_corpus: each source needs a name of its own ({', '.join(repeated)} twice)")
            if len(names) > MAX_SOURCES:
                raise ValueError(f"training_corpus: at most {MAX_SOURCES} sources, not {len(names)}")
        return self

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

    @property
    def shard_dims(self) -> ShardDims:
        return ShardDims(n=self.sequence_tokens, m=self.chunk_tokens, k=self.neighbours)

    def rows_per_shard(self) -> int:
        """shard_rows, or the rows that fill shard_bytes (rows have a fixed size but for their
        doc ids: `row_bytes`)."""
        if self.shard_bytes is None:
            return self.shard_rows
        return max(1, self.shard_bytes // row_bytes(self.shard_dims))

    @property
    def blended(self) -> bool:
        """Whether the training corpus is a blend of named sources."""
        return isinstance(self.training_corpus, list)

    def training(self) -> CorpusConfig:
        """The one training corpus (not a blend's: `training_sources`)."""
        if isinstance(self.training_corpus, list):
            raise TypeError("a blended training corpus has several corpora: training_sources()")
        return self.retrieval_corpus if self.training_corpus == "same" else self.training_corpus

    def training_sources(self) -> list[TrainingSource]:
        """A blend's sources, in config order (their order in the shards' source column)."""
        return list(self.training_corpus) if isinstance(self.training_corpus, list) else []

    def source_names(self) -> tuple[str, ...]:
        """The values of the shards' source column: a blend's source names; else one source,
        `retrieval` (training_corpus: same) or `training` (a corpus of its own)."""
        if isinstance(self.training_corpus, list):
            return tuple(source.name for source in self.training_corpus)
        return ("retrieval",) if self.training_corpus == "same" else ("training",)

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
        settings = stage_settings(self, Stage.DECONTAMINATION)
        # laid out as it was first hashed: the section's settings beside the evaluation corpora
        return {"decontamination": {**settings.pop("decontamination"), **settings}}

    def _embed_settings(self) -> dict:
        return {**stage_settings(self, Stage.EMBED), **self._decontamination_hash("retrieval")}

    def embed_hash(self) -> str:
        """Hash of what the chunks and embeddings depend on: the settings tagged embed."""
        return stable_hash(self._embed_settings())

    def encoding_hash(self) -> str:
        """`embed_hash` without the retrieval corpus's paths: how any document becomes chunks
        and embeddings. An index directory can take more files (an append) only while it holds."""
        settings = self._embed_settings()
        del settings["retrieval_corpus"]["paths"]
        return stable_hash(settings)

    def index_hash(self) -> str:
        """Hash of everything the index directory depends on: embeddings and the faiss index."""
        return self.index_hash_over(self.embed_hash())

    def index_hash_over(self, embed_hash: str) -> str:
        """The index hash of these index settings over embeddings of `embed_hash`."""
        return stable_hash({"embed": embed_hash, **stage_settings(self, Stage.INDEX)})

    def shards_hash(self) -> str:
        """Hash of the shard stage's own settings, those tagged shards (the index is pinned by
        its manifest hash)."""
        return stable_hash({**stage_settings(self, Stage.SHARDS), **self._decontamination_hash("training")})


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
