"""A manifest's file table (`schemas.file_table`): entries over the inline limit go to a Parquet
file beside manifest.json and read back equal; inline manifests, old ones included, still read;
a table that disagrees with its manifest is an error naming it."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.common import fileio
from pipeline.jobs.commit import commit_stage, new_staging_dir
from pipeline.jobs.job import StageClock
from schemas.file_table import entry_column_batches, entry_columns, entry_count, whole_manifest
from schemas.manifest import FILE_TABLE, MANIFEST_FILE, ManifestError, ShardEntry, ShardsManifest, read_manifest
from tests import helpers
from tests.trainer_fixtures import split_entries

pytestmark = pytest.mark.unit


def manifest(shards: int) -> ShardsManifest:
    entries = [
        ShardEntry(path=f"shard-{i:05d}.arrow", rows=i + 1, bytes=100 + i, sha256=f"{i:064x}", neighbour_slots_filled=i)
        for i in range(shards)
    ]
    entries[1].neighbour_slots_filled = None  # an older shard without its count
    entries[2].source_rows = [2, 0, 1]  # a blend's rows per source (a list column in the table)
    return helpers.shards_manifest(shards=entries, num_sequences=sum(e.rows for e in entries))


def write(directory, model, inline_entries) -> None:
    data, table = split_entries(model, inline_entries)
    if table is not None:
        (directory / FILE_TABLE).write_bytes(table)
    (directory / MANIFEST_FILE).write_text(json.dumps(data))


def read(directory) -> ShardsManifest:
    return read_manifest((directory / MANIFEST_FILE).read_text(), str(directory), ShardsManifest)


def test_entries_over_the_limit_go_to_the_table_and_read_back_equal(tmp_path):
    model = manifest(7)
    write(tmp_path, model, inline_entries=5)
    written = json.loads((tmp_path / MANIFEST_FILE).read_text())
    assert written["shards"] == [] and written["file_table"]["entries"] == 7
    assert written["file_table"]["bytes"] == (tmp_path / FILE_TABLE).stat().st_size
    assert pq.ParquetFile(tmp_path / FILE_TABLE).schema_arrow.names == [
        "path",
        "rows",
        "bytes",
        "sha256",
        "neighbour_slots_filled",
        "source_rows",
    ]
    whole = whole_manifest(read(tmp_path), str(tmp_path))
    assert whole.shards == model.shards and whole.file_table is None
    assert entry_count(read(tmp_path)) == entry_count(whole) == 7  # counted without reading the table
    columns = entry_columns(read(tmp_path), str(tmp_path), ["rows", "path"])
    assert columns.column("rows").to_pylist() == [e.rows for e in model.shards]
    assert columns.column("path").to_pylist() == [e.path for e in model.shards]
    assert entry_columns(read(tmp_path), str(tmp_path), ["source_rows"]).column(0).to_pylist()[1:4] == [
        None,
        [2, 0, 1],
        None,
    ]


def test_a_table_read_in_batches_is_the_table_a_batch_at_a_time(tmp_path):
    write(tmp_path, manifest(7), inline_entries=5)
    batches = list(entry_column_batches(read(tmp_path), str(tmp_path), ["path", "rows"], batch_entries=3))
    assert [b.num_rows for b in batches] == [3, 3, 1]  # never the whole column at once
    assert pa.concat_tables(batches).equals(entry_columns(read(tmp_path), str(tmp_path), ["path", "rows"]))
    write(tmp_path, manifest(4), inline_entries=5)  # inline: one batch, as the manifest holds them
    assert [b.num_rows for b in entry_column_batches(read(tmp_path), str(tmp_path), ["path"])] == [4]


def test_an_inline_manifest_and_an_old_one_without_a_table_field_read_as_before(tmp_path):
    model = manifest(5)
    write(tmp_path, model, inline_entries=5)
    assert not (tmp_path / FILE_TABLE).exists()
    old = json.loads((tmp_path / MANIFEST_FILE).read_text())
    del old["file_table"]  # as manifests before the table wrote it
    (tmp_path / MANIFEST_FILE).write_text(json.dumps(old))
    assert whole_manifest(read(tmp_path), str(tmp_path)).shards == model.shards
    assert entry_columns(read(tmp_path), str(tmp_path), ["bytes"]).column("bytes").to_pylist() == [
        e.bytes for e in model.shards
    ]


@pytest.mark.parametrize("change", ["one entry fewer", "sha256", "missing"])
def test_a_table_that_disagrees_with_its_manifest_is_an_error_naming_it(tmp_path, change):
    write(tmp_path, manifest(7), inline_entries=5)
    table = tmp_path / FILE_TABLE
    if change == "missing":
        table.unlink()
        expected = "the file table the manifest names is missing"
    elif change == "sha256":  # the manifest's record of it changed: same size, another hash
        data = json.loads((tmp_path / MANIFEST_FILE).read_text())
        data["file_table"]["sha256"] = "0" * 64
        (tmp_path / MANIFEST_FILE).write_text(json.dumps(data))
        expected = "sha256 .* differs from the manifest's 0{64}"
    else:
        _, data = split_entries(manifest(6), 5)
        assert data is not None
        table.write_bytes(data)
        expected = r"\d+ bytes, the manifest says"
    with pytest.raises(ManifestError, match=f"{table}: {expected}"):
        whole_manifest(read(tmp_path), str(tmp_path))
    if change != "sha256":  # the column reader checks the count, and leaves the hash to validate
        expected = (
            "the file table the manifest names is missing" if change == "missing" else "6 entries, the manifest says 7"
        )
        with pytest.raises(ManifestError, match=f"{table}: {expected}"):
            entry_columns(read(tmp_path), str(tmp_path), ["rows"])


def test_the_commit_writes_the_table_over_the_limit_and_drops_it_under(tmp_path):
    final = tmp_path / "shards"
    for shards, has_table in [(7, True), (3, False)]:
        staging = new_staging_dir(str(tmp_path), "shards")
        commit_stage(
            manifest(shards),
            staging=staging,
            output=str(tmp_path),
            final=str(final),
            clock=StageClock("s", "sequences"),
            staged=[],
            max_rejected_fraction=1.0,
            inline_entries=5,
        )
        assert bool(list(final.glob("files-*.parquet"))) == has_table  # the first commit's table goes with it
        assert fileio.committed_manifest(str(final), ShardsManifest).shards == manifest(shards).shards


def test_entries_are_looked_up_by_number_a_row_group_at_a_time(tmp_path):
    """A refresh asks for a shard's entry by its number: from the table's row groups (3 entries
    each here), one read when a number in its range is asked for; inline entries as they are;
    a number nobody lists is None; a table changed since its manifest is an error."""
    from schemas.file_table import EntriesByNumber
    from schemas.manifest import FileTable

    model = manifest(10)
    data, table = split_entries(model, 5)
    rows = pq.read_table(pa.BufferReader(table))
    rows = rows.take([9, 0, 1, 2, 3, 4, 5, 6, 7, 8])  # manifest order is not number order
    sink = pa.BufferOutputStream()
    pq.write_table(rows, sink, row_group_size=3)
    table = sink.getvalue().to_pybytes()
    (tmp_path / FILE_TABLE).write_bytes(table)
    import hashlib

    reference = FileTable(path=FILE_TABLE, sha256=hashlib.sha256(table).hexdigest(), entries=10, bytes=len(table))
    data["file_table"] = reference.model_dump(mode="json")
    (tmp_path / MANIFEST_FILE).write_text(json.dumps(data))

    opened = []

    def counted(path):
        opened.append(path)
        return open(path, "rb")

    entries = EntriesByNumber(read(tmp_path), str(tmp_path), open_file=counted)
    before = len(opened)
    assert [entries.get(n) for n in range(10)] == model.shards and entries.get(10) is None
    assert len(opened) - before == 5  # each row group once, the first (9, 0, 1) twice: not a read each
    inline = EntriesByNumber(model, str(tmp_path))
    assert inline.get(3) == model.shards[3] and inline.get(11) is None
    (tmp_path / FILE_TABLE).write_bytes(table[:-1] + b"x")
    with pytest.raises(ManifestError, match="sha256|bytes"):
        EntriesByNumber(read(tmp_path), str(tmp_path))
