"""Which stage's output each config setting changes, and the stage hashes built from it
(docs/design.md §8).

Every field of every config model carries one tag in its annotation: `Hashed(stage, ...)`,
the stage hashes it is part of, or `NotHashed(reason)`, a setting whose value is in no hash
(where or how a stage runs, what it checks). `stage_settings` collects the settings tagged
with a stage, so a new setting enters the hash of the stage its tag names; a field with no
tag is an error here and in `tests/schemas/test_stage_tags.py`.
"""

from __future__ import annotations

from enum import Enum

from pydantic import BaseModel


class Stage(str, Enum):
    EMBED = "embed"  # chunks and embeddings: embed_hash (and through it index_hash)
    INDEX = "index"  # the faiss index: index_hash
    SHARDS = "shards"  # training shards: shards_hash (the index pinned by its manifest's sha256)
    # what decontaminating a corpus adds to the hash of the stage that reads that corpus
    DECONTAMINATION = "decontamination"


class Hashed:
    """Part of the hash of each of `stages`; a model-valued setting is hashed as its own
    settings tagged with the same stage.

    via: the setting is hashed as this method's value (settings that together decide one
    quantity, e.g. the rows per shard). left_out_at_default: a group name for settings added
    after outputs were built: while every setting of the group is at its default they are left
    out, so those outputs keep their hash."""

    def __init__(self, *stages: Stage, via: str | None = None, left_out_at_default: str | None = None):
        self.stages = frozenset(stages)
        self.via, self.left_out_at_default = via, left_out_at_default

    def __repr__(self) -> str:
        return f"Hashed({', '.join(sorted(s.value for s in self.stages))})"


class NotHashed:
    """In no stage hash as a value; `reason` says why that keeps reuse right."""

    def __init__(self, reason: str):
        self.reason = reason

    def __repr__(self) -> str:
        return f"NotHashed({self.reason!r})"


def field_tag(model: type[BaseModel], name: str) -> Hashed | NotHashed | None:
    """The field's one tag; None when it has none (or, as wrong, several)."""
    tags = [m for m in model.model_fields[name].metadata if isinstance(m, Hashed | NotHashed)]
    return tags[0] if len(tags) == 1 else None


def stage_settings(model: BaseModel, stage: Stage) -> dict:
    """{name: value} of the settings of `model` tagged with `stage`."""
    fields = type(model).model_fields
    tags = {}
    for name in fields:
        tag = field_tag(type(model), name)
        if tag is None:
            raise TypeError(f"{type(model).__name__}.{name} needs exactly one stage tag (schemas/stage_tags.py)")
        tags[name] = tag
    hashed = {name: tag for name, tag in tags.items() if isinstance(tag, Hashed)}
    groups: dict[str, list[str]] = {}
    for name, tag in hashed.items():
        if tag.left_out_at_default:
            groups.setdefault(tag.left_out_at_default, []).append(name)
    left_out = {
        name
        for names in groups.values()
        if all(getattr(model, n) == fields[n].default for n in names)
        for name in names
    }
    settings = {}
    for name, tag in hashed.items():
        if stage not in tag.stages or name in left_out:
            continue
        if tag.via:
            settings[tag.via] = getattr(model, tag.via)()
        else:
            settings[name] = _hashed_value(getattr(model, name), stage)
    return settings


def _hashed_value(value, stage: Stage):
    if isinstance(value, BaseModel):
        return stage_settings(value, stage)
    if isinstance(value, list):
        return [_hashed_value(v, stage) for v in value]
    return value
