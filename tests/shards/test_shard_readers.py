"""Training shards read without this project's code: Hugging Face `datasets`, polars, duckdb,
pandas and plain pyarrow see the right rows and arrays (schema_version 2 and 3: fixed_size_list
columns, each field's per-row shape in its metadata), as the README's examples show."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pytest

from schemas.arrow import read_shard_table, shard_column
from schemas.manifest import ShardsManifest

pytestmark = pytest.mark.e2e  # reads the shards of the built_output fixture

ARRAYS = ("tokens", "neighbours", "neighbour_ids", "neighbour_scores")


@pytest.fixture(scope="module")
def shards(built_output):
    """The built output's shards: (paths, manifest, the columns as the project reads them)."""
    root, _, _ = built_output
    directory = root / "out" / "shards"
    manifest = ShardsManifest.model_validate_json((directory / "manifest.json").read_text())
    paths = [str(directory / entry.path) for entry in manifest.shards]
    tables = [read_shard_table(pa.memory_map(path)) for path in paths]
    expected = {name: np.concatenate([shard_column(t, name) for t in tables]) for name in ARRAYS}
    expected["seq_id"] = np.concatenate([t["seq_id"].to_numpy() for t in tables])
    return paths, manifest, expected


def _shapes(manifest: ShardsManifest) -> dict[str, tuple]:
    n, m, k = manifest.sequence_tokens, manifest.chunk_tokens, manifest.neighbours
    return {
        "tokens": (n + 1,),
        "neighbours": (n // m, k, 2 * m),
        "neighbour_ids": (n // m, k),
        "neighbour_scores": (n // m, k),
    }


def _check(columns: dict, shapes: dict, manifest: ShardsManifest, expected: dict) -> None:
    """Each array column, flat as the tool hands it over, reshaped by the schema's shapes."""
    assert len(columns["seq_id"]) == manifest.num_sequences > 1
    assert shapes == _shapes(manifest)
    for name, shape in shapes.items():
        array = np.asarray(columns[name]).reshape(-1, *shape)
        assert array.shape == (manifest.num_sequences, *shape), name
        assert np.array_equal(array, expected[name]), name
    assert np.array_equal(np.asarray(columns["seq_id"]), expected["seq_id"])


def _schema_shapes(schema: pa.Schema) -> dict[str, tuple]:
    """Per-row shapes as an outside reader finds them: the `shape` field metadata, or the
    list size of a one-dimensional column."""
    return {
        name: tuple(json.loads(schema.field(name).metadata[b"shape"]))
        if schema.field(name).metadata
        else (schema.field(name).type.list_size,)
        for name in ARRAYS
    }


def test_pyarrow_reads_the_shards_as_a_dataset(shards):
    paths, manifest, expected = shards
    table = pads.dataset(paths, format="arrow").to_table()
    assert table.schema.metadata[b"schema_version"] == b"3"
    assert table.schema.field("neighbours").type == pa.list_(
        pa.int32(), manifest.sequence_tokens // manifest.chunk_tokens * manifest.neighbours * 2 * manifest.chunk_tokens
    )
    columns = {name: np.array(table[name].to_pylist()) for name in ARRAYS}
    _check({**columns, "seq_id": table["seq_id"].to_numpy()}, _schema_shapes(table.schema), manifest, expected)


def test_hugging_face_datasets_reads_the_shards(shards, tmp_path):
    datasets = pytest.importorskip("datasets")
    paths, manifest, expected = shards
    loaded = datasets.load_dataset("arrow", data_files=paths, split="train", cache_dir=str(tmp_path))
    schema = pa.ipc.open_file(paths[0]).schema
    _check(loaded.with_format("numpy")[:], _schema_shapes(schema), manifest, expected)
    mapped = datasets.concatenate_datasets(
        [datasets.Dataset(pa.ipc.open_file(pa.memory_map(path)).read_all()) for path in paths]
    )
    _check(mapped.with_format("numpy")[:], _schema_shapes(schema), manifest, expected)
    row = loaded.with_format("torch")[0]
    assert row["neighbours"].reshape(_shapes(manifest)["neighbours"]).shape == _shapes(manifest)["neighbours"]


def test_polars_reads_the_shards(shards):
    polars = pytest.importorskip("polars")
    paths, manifest, expected = shards
    frame = polars.concat([polars.read_ipc(path) for path in paths])
    schema = pa.ipc.open_file(paths[0]).schema
    _check({name: frame[name].to_numpy() for name in ("seq_id", *ARRAYS)}, _schema_shapes(schema), manifest, expected)


def test_duckdb_queries_the_shards(shards):
    duckdb = pytest.importorskip("duckdb")
    paths, manifest, expected = shards
    shards_dataset = pads.dataset(paths, format="arrow")  # noqa: F841 (duckdb finds it by its name)
    rows = duckdb.sql(
        "SELECT seq_id, neighbour_ids[1] AS first_id, len(neighbours) AS width FROM shards_dataset ORDER BY seq_id"
    ).fetchall()
    assert [r[0] for r in rows] == sorted(expected["seq_id"].tolist())
    order = np.argsort(expected["seq_id"])
    assert [r[1] for r in rows] == expected["neighbour_ids"][order, 0, 0].tolist()
    assert {r[2] for r in rows} == {int(np.prod(_shapes(manifest)["neighbours"]))}


def test_pandas_reads_the_shards(shards):
    pandas = pytest.importorskip("pandas")
    paths, manifest, expected = shards
    frame = pandas.concat([pandas.read_feather(path) for path in paths], ignore_index=True)
    assert frame["seq_id"].tolist() == expected["seq_id"].tolist()
    neighbours = np.stack(frame["neighbours"].to_numpy())
    assert np.array_equal(neighbours.reshape(-1, *_shapes(manifest)["neighbours"]), expected["neighbours"])
