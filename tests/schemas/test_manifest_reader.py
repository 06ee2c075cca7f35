"""`schemas.manifest.read_manifest`, the one reader of a manifest, and `pipeline.common.fileio`'s
reading of a committed directory's manifest through it."""

import json

import pytest

from schemas.arrow import SCHEMA_VERSION, SchemaVersionError
from schemas.manifest import (
    MANIFEST_FILE,
    IndexManifest,
    ManifestError,
    ShardsManifest,
    VectorIndexManifest,
    read_manifest,
)
from tests import helpers

pytestmark = pytest.mark.unit

WHERE = "out/shards/manifest.json"


def shards_manifest(**changes) -> dict:
    """The helpers' manifest as JSON data, with `changes` made to the data (valid or not)."""
    return {**helpers.shards_manifest().model_dump(mode="json"), **changes}


def text(manifest: dict) -> str:
    return json.dumps(manifest, indent=2, sort_keys=True) + "\n"


@pytest.mark.parametrize("version", [1, 2, "1", "2"])
def test_reads_schema_versions_1_and_2(version):
    manifest = read_manifest(text(shards_manifest(schema_version=version)), WHERE, ShardsManifest)
    assert isinstance(manifest, ShardsManifest) and manifest.num_sequences == 10
    assert manifest.schema_version == int(version)


def test_takes_text_bytes_or_a_reader_and_keeps_unknown_fields():
    data = text(shards_manifest(a_later_field=[1, 2]))
    for source in (data, data.encode(), lambda: data, lambda: data.encode()):
        manifest = read_manifest(source, WHERE, ShardsManifest)
        assert manifest.a_later_field == [1, 2] and manifest.shards[0].neighbour_slots_filled == 80


def test_without_a_model_the_parsed_object_with_its_version_checked():
    assert read_manifest(text(shards_manifest()), WHERE) == shards_manifest()
    with pytest.raises(SchemaVersionError):
        read_manifest(text(shards_manifest(schema_version=SCHEMA_VERSION + 1)), WHERE)


def test_a_function_may_pick_the_model_from_the_parsed_object():
    def pick(raw):
        return ShardsManifest if "shards" in raw else IndexManifest

    assert isinstance(read_manifest(text(shards_manifest()), WHERE, pick), ShardsManifest)
    with pytest.raises(ManifestError, match=r"^x/manifest.json: not an index manifest \(\d+ problems: "):
        read_manifest(text({"schema_version": 2}), "x/manifest.json", pick)


@pytest.mark.parametrize("source", [None, lambda: open("/nonexistent/ratrain/manifest.json").read()])
def test_a_missing_manifest_names_the_file(source):
    with pytest.raises(ManifestError, match=rf"^{WHERE}: no manifest \(the shard stage has not committed\)$"):
        read_manifest(source, WHERE, ShardsManifest)
    with pytest.raises(ManifestError, match=rf"^{WHERE}: no manifest \(the stage has not committed\)$"):
        read_manifest(source, WHERE)


@pytest.mark.parametrize("data", ["", "{", "not json", '{"schema_version": 2,}'])
def test_text_that_is_not_json_names_the_file(data):
    with pytest.raises(ManifestError, match=rf"^{WHERE}: not valid JSON \("):
        read_manifest(data, WHERE, ShardsManifest)


@pytest.mark.parametrize(
    "manifest, shown",
    [
        ({**shards_manifest(), "schema_version": 99}, "99"),
        ({**shards_manifest(), "schema_version": 0}, "0"),
        ({**shards_manifest(), "schema_version": None}, "None"),
        ({k: v for k, v in shards_manifest().items() if k != "schema_version"}, "None"),
        ([1, 2], "None"),
        ("a string", "None"),
    ],
)
def test_an_unknown_schema_version_names_the_file(manifest, shown):
    with pytest.raises(SchemaVersionError, match=rf"^{WHERE}: schema_version {shown} is not supported"):
        read_manifest(json.dumps(manifest), WHERE, ShardsManifest, error=KeyError)  # whatever `error` is


def test_a_manifest_of_another_kind_names_the_file_and_the_first_problem():
    with pytest.raises(
        ManifestError,
        match=rf"^{WHERE}: not an index manifest \(\d+ problems: \('\w+',\) Field "
        "required\\)$",
    ):
        read_manifest(text(shards_manifest()), WHERE, IndexManifest)
    with pytest.raises(ManifestError, match=rf"^{WHERE}: not a vector index manifest \("):
        read_manifest(text(shards_manifest()), WHERE, VectorIndexManifest)
    with pytest.raises(ManifestError, match=rf"^{WHERE}: not a shards manifest \(1 problems: \('num_sequences',\) "):
        read_manifest(text(shards_manifest(num_sequences="ten")), WHERE, ShardsManifest)


def test_the_caller_chooses_the_error_type():
    class MyError(ValueError):
        pass

    for source in (None, "{", text(shards_manifest(pad_id=None))):
        with pytest.raises(MyError, match=rf"^{WHERE}: "):
            read_manifest(source, WHERE, ShardsManifest, error=MyError)
    assert not issubclass(MyError, ManifestError)


def test_a_committed_directory_through_fileio(tmp_path):
    from pipeline.common import fileio

    with pytest.raises(ManifestError, match=rf"^{tmp_path}/manifest.json: no manifest"):
        fileio.committed_manifest(str(tmp_path), ShardsManifest)
    (tmp_path / MANIFEST_FILE).write_text(text(shards_manifest(schema_version=1)))
    manifest = fileio.committed_manifest(str(tmp_path), ShardsManifest)
    assert manifest.schema_version == 1
    assert fileio.committed_manifest(str(tmp_path))["num_sequences"] == 10
