"""Every config setting is tagged with the stage hashes it belongs to, or with why it is in
none (schemas/stage_tags.py), and the stage hashes built from the tags are those committed
outputs carry.

stage_hashes.json holds the embed, encoding, index and shards hashes of 26 varied configs (the
quickstart, the suite's small config in each precision, every decontamination case, slices, the
onnx and openvino backends, a training corpus of its own, placement hints, ...) as the code
before the tags computed them, from hand-kept lists (schemas/config.py at commit 655ac09): if
one changes, outputs built before would no longer be reused. Do not record it again from newer
code: a hash that changes is a fault to fix, or a rebuild of every output to decide on. One was
decided on: `index.accelerator`, in no hash before though it changes how an IVF index is
clustered, is now part of the index hash when set, and was taken out of the `placement` case."""

import json
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from schemas.config import PipelineConfig, config_from_dict
from schemas.stage_config import StrictModel
from schemas.stage_tags import Hashed, NotHashed, Stage, field_tag, stage_settings

pytestmark = pytest.mark.unit

GOLDEN = json.loads((Path(__file__).parent / "stage_hashes.json").read_text())["cases"]


def _models_in(annotation) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def config_models(root: type[BaseModel]) -> list[type[BaseModel]]:
    """`root` and every model its fields hold (in unions and lists too), holders first."""
    found = [root]
    for model in found:
        for field in model.model_fields.values():
            found += [m for m in _models_in(field.annotation) if m not in found]
    return found


def untagged_fields(root: type[BaseModel]) -> list[str]:
    """Model.field of every field of `root`'s models that has no stage tag (or several)."""
    return [
        f"{m.__name__}.{name}" for m in config_models(root) for name in m.model_fields if field_tag(m, name) is None
    ]


def test_every_config_field_is_tagged_with_its_stage_or_why_it_is_in_no_hash():
    assert len(config_models(PipelineConfig)) == 6  # the config, its four sections and a blend's source
    assert untagged_fields(PipelineConfig) == []
    reasons = [field_tag(m, n) for m in config_models(PipelineConfig) for n in m.model_fields]
    assert all(tag.reason for tag in reasons if isinstance(tag, NotHashed))


def test_every_stage_a_field_names_is_one_its_model_is_hashed_into():
    # the hash functions read PipelineConfig's own fields; a section's fields, through the
    # fields that hold the section, for the stages those are tagged with
    reach: dict[type[BaseModel], set[Stage]] = {PipelineConfig: set(Stage)}
    unreached = []
    for model in config_models(PipelineConfig):
        for name, field in model.model_fields.items():
            tag = field_tag(model, name)
            if not isinstance(tag, Hashed):
                continue
            # a field a model inherits is hashed wherever the model that declares it is
            declared = next(base for base in model.__mro__ if name in getattr(base, "__annotations__", {}))
            if not tag.stages <= reach.get(model, set()) | reach.get(declared, set()):
                unreached.append(f"{model.__name__}.{name}")
            for held in _models_in(field.annotation):
                reach.setdefault(held, set()).update(tag.stages & reach.get(model, set()))
    assert unreached == []


@pytest.mark.parametrize("case", GOLDEN, ids=[case["name"] for case in GOLDEN])
def test_stage_hashes_are_those_committed_outputs_carry(case):
    cfg = config_from_dict(case["config"])
    hashes = {
        "embed": cfg.embed_hash(),
        "encoding": cfg.encoding_hash(),
        "index": cfg.index_hash(),
        "shards": cfg.shards_hash(),
    }
    assert hashes == case["hashes"]


class _Section(StrictModel):
    a: typing.Annotated[int, Hashed(Stage.EMBED, Stage.SHARDS)] = 1
    hint: typing.Annotated[str, NotHashed("where it runs")] = "x"


class _Settings(StrictModel):
    size: typing.Annotated[int, Hashed(Stage.SHARDS, via="doubled")] = 2
    new: typing.Annotated[str, Hashed(Stage.EMBED, left_out_at_default="g")] = "old"
    newer: typing.Annotated[str, Hashed(Stage.EMBED, left_out_at_default="g")] = "old"
    sections: typing.Annotated[list[_Section], Hashed(Stage.EMBED)] = [_Section()]

    def doubled(self) -> int:
        return 2 * self.size


def test_settings_are_collected_by_their_tags():
    assert stage_settings(_Settings(), Stage.EMBED) == {"sections": [{"a": 1}]}  # the group at its defaults
    assert stage_settings(_Settings(newer="x"), Stage.EMBED) == {"new": "old", "newer": "x", "sections": [{"a": 1}]}
    assert stage_settings(_Settings(size=5), Stage.SHARDS) == {"doubled": 10}
    assert stage_settings(_Settings(), Stage.INDEX) == {}


def test_hashing_a_setting_with_no_tag_fails():
    class Untagged(StrictModel):
        a: int = 1

    with pytest.raises(TypeError, match=r"Untagged\.a"):
        stage_settings(Untagged(), Stage.EMBED)


def test_an_index_accelerator_is_part_of_the_index_hash():
    """With clustering auto, an accelerator trains the lists in one k-means instead of two-level: a
    different index, so an index built without one is not reused for it (and unset, the hash is
    the one committed indexes carry)."""
    case = next(c for c in GOLDEN if c["name"] == "quickstart")
    plain = config_from_dict(case["config"])
    hinted = config_from_dict(
        {**case["config"], "index": {**case["config"].get("index", {}), "accelerator": "type:nvidia-l4;count:1"}}
    )
    assert plain.index_hash() == case["hashes"]["index"]
    assert hinted.index_hash() != plain.index_hash()
    assert hinted.embed_hash() == plain.embed_hash() and hinted.shards_hash() == plain.shards_hash()
