"""A path a manifest lists stays inside the output: relative, no "..", ".", empty segment, "\\" or
":" (`schemas.manifest.INSIDE_PATH`), checked when an inline manifest is read and when a file
table's path column is, so a tampered manifest cannot point a reader (build-shards, validate,
the trainer) at a file outside its directory."""

import hashlib
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from schemas.file_table import entry_column_batches, entry_columns, whole_manifest
from schemas.manifest import FILE_TABLE, MANIFEST_FILE, ManifestError, ShardsManifest, read_manifest
from tests.trainer_fixtures import split_entries, write_shard_dir
from trainer import ShardDataset
from trainer.dataset import ShardDataError

pytestmark = pytest.mark.unit

OUTSIDE = ["../secret.arrow", "/etc/passwd", "a/../../b", "./shard.arrow", "a//b", "gs://other/x.arrow", "..\\x"]
INSIDE = ["shard-00000.arrow", "faiss/slice-00001.faiss", "rejected/build-index-00007.jsonl", "...", ".cache/x"]


def manifest_with(tmp_path, path: str, inline: bool = True) -> dict:
    manifest = write_shard_dir(tmp_path, shard_rows=[2, 2], inline_entries=10 if inline else 1)
    data, table = split_entries(manifest, 10 if inline else 1)
    if inline:
        data["shards"][1]["path"] = path
    else:
        rows = pq.read_table(pa.BufferReader(table)).to_pylist()
        rows[1]["path"] = path
        written = pa.BufferOutputStream()
        pq.write_table(pa.Table.from_pylist(rows, schema=pq.read_schema(pa.BufferReader(table))), written)
        tampered = written.getvalue().to_pybytes()
        (tmp_path / FILE_TABLE).write_bytes(tampered)
        data["file_table"].update(bytes=len(tampered), sha256=hashlib.sha256(tampered).hexdigest())  # consistently
    (tmp_path / MANIFEST_FILE).write_text(json.dumps(data))
    return data


@pytest.mark.parametrize("path", OUTSIDE)
def test_an_inline_entry_outside_the_output_is_refused_by_name(tmp_path, path):
    data = manifest_with(tmp_path, path)
    with pytest.raises(ManifestError) as refused:
        read_manifest(json.dumps(data), str(tmp_path), ShardsManifest)
    assert f"{path!r} is not a path inside the output" in str(refused.value)


@pytest.mark.parametrize("path", INSIDE)
def test_paths_inside_the_output_read(tmp_path, path):
    data = manifest_with(tmp_path, path)
    assert read_manifest(json.dumps(data), str(tmp_path), ShardsManifest).shards[1].path == path


def test_a_file_table_path_outside_the_output_is_refused_by_each_reader(tmp_path):
    data = manifest_with(tmp_path, "../../home/user/.ssh/id_rsa", inline=False)
    manifest = read_manifest(json.dumps(data), str(tmp_path), ShardsManifest)  # its entries are in the table
    with pytest.raises(ManifestError, match=r"entry path '\.\./\.\./home/user/\.ssh/id_rsa' is not a path inside"):
        entry_columns(manifest, str(tmp_path), ["path", "rows"])
    with pytest.raises(ManifestError, match=r"'\.\./\.\./home/user/\.ssh/id_rsa' is not a path inside"):
        list(entry_column_batches(manifest, str(tmp_path), ["path"]))
    with pytest.raises(ManifestError, match=r"'\.\./\.\./home/user/\.ssh/id_rsa' is not a path inside"):
        whole_manifest(manifest, str(tmp_path))
    assert entry_columns(manifest, str(tmp_path), ["rows"]).num_rows == 2  # no path read, nothing to check


def test_the_trainer_refuses_a_manifest_pointing_outside_its_directory(tmp_path):
    secret = tmp_path / "secret.arrow"
    shards = tmp_path / "shards"
    manifest_with(shards, "../secret.arrow")
    secret.write_bytes((shards / "shard-00001.arrow").read_bytes())  # a real shard: only the path is wrong
    with pytest.raises(ShardDataError, match=r"'\.\./secret\.arrow' is not a path inside the output"):
        list(ShardDataset(shards, shuffle=False))
