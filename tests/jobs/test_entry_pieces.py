"""A stage's file entries reach its commit as pieces written by workers: each sorted, read back
merged in path order a batch at a time, a path written twice refused; their sums are the
manifest's facts."""

import pytest

from pipeline.jobs.entry_pieces import (
    PIECE_NUMBERS,
    EntryTotals,
    KeptEntries,
    merged_entries,
    piece_name,
    write_piece,
)
from schemas.manifest import FileEntry, ShardEntry

pytestmark = pytest.mark.unit


def _entry(path: str, rows: int = 1) -> FileEntry:
    return FileEntry(path=path, rows=rows, bytes=10, sha256=path)


def test_a_piece_holds_one_folder_and_one_run_of_file_numbers():
    assert piece_name("chunks/chunks-00007.parquet") == piece_name(f"chunks/chunks-{PIECE_NUMBERS - 1:05d}.parquet")
    assert piece_name("chunks/chunks-00007.parquet") != piece_name(f"chunks/chunks-{PIECE_NUMBERS:05d}.parquet")
    assert piece_name("chunks/chunks-00007.parquet") != piece_name("embeddings/embeddings-00007.parquet")
    assert piece_name("shard-00001.arrow") == "_-000000000.parquet"  # beside the manifest, no folder


def test_pieces_are_read_back_merged_in_path_order_a_batch_at_a_time(tmp_path):
    paths = [f"chunks/chunks-{i:05d}.parquet" for i in range(10)] + ["sources/s-0.parquet", "faiss/index.faiss"]
    pieces = [
        write_piece(str(tmp_path / "b.parquet"), [_entry(p) for p in reversed(paths[5:10])], FileEntry),
        write_piece(str(tmp_path / "a.parquet"), [_entry(p) for p in paths[:5] + paths[10:11]], FileEntry),
    ]
    held = [_entry("faiss/index.faiss")]
    batches = list(merged_entries(pieces, FileEntry, held, batch=5))
    assert [len(b) for b in batches] == [5, 5, 2]
    assert [e.path for b in batches for e in b] == sorted(paths)
    assert all(isinstance(e, FileEntry) for b in batches for e in b)


def test_a_path_in_two_pieces_fails_the_commit(tmp_path):
    one = write_piece(str(tmp_path / "a.parquet"), [_entry("chunks/chunks-00001.parquet", 3)], FileEntry)
    two = write_piece(str(tmp_path / "b.parquet"), [_entry("chunks/chunks-00001.parquet", 4)], FileEntry)
    with pytest.raises(RuntimeError, match="chunks/chunks-00001.parquet was written twice"):
        list(merged_entries([one, two], FileEntry, batch=100))


def test_totals_sum_each_folder_across_bundles():
    totals = EntryTotals()
    left = totals.add_input(totals.create_accumulator(), _entry("chunks/chunks-00000.parquet", 3))
    right = totals.add_input(totals.create_accumulator(), _entry("chunks/chunks-00001.parquet", 4))
    right = totals.add_input(
        right, ShardEntry(path="shard-00000.arrow", rows=2, bytes=5, sha256="x", neighbour_slots_filled=7)
    )
    merged = totals.extract_output(totals.merge_accumulators([left, right]))
    assert merged == {
        "chunks": {"entries": 2, "rows": 7, "bytes": 20},
        "": {"entries": 1, "rows": 2, "bytes": 5, "neighbour_slots_filled": 7},
    }


def test_a_change_keeps_the_previous_commits_entries_but_those_it_drops(tmp_path):
    """Read from the committed file table a row group at a time: the faiss files dropped by
    folder (a faiss-only rebuild), a rewritten slice by its name without a commit's number."""
    from benchmarks.scale_sim import CHUNK_FILE_ROWS, config, index_manifest, write_manifest
    from pipeline.chunks.committed import CommittedIndexManifest
    from pipeline.common import fileio
    from schemas.manifest import versioned

    cfg = config(tmp_path)
    manifest = index_manifest(12_000 * CHUNK_FILE_ROWS, cfg)  # a file table of 24,000+ entries
    slice_path = next(e.path for e in manifest.files if e.path.startswith("faiss/") and "slice" in e.path)
    files = [e.model_copy(update={"path": versioned(e.path, 3)}) if e.path == slice_path else e for e in manifest.files]
    write_manifest(tmp_path / "index", manifest.model_copy(update={"files": files}))
    index = CommittedIndexManifest(str(tmp_path / "index"), fileio.manifest_sha256(str(tmp_path / "index")), 0)
    assert index.summary().file_table is not None  # over 10,000 entries: in a file table

    no_faiss = KeptEntries(index, dropped_folders=("faiss",))
    kept = list(no_faiss.entries())
    assert [e.path for e in kept] == [e.path for e in files if not e.path.startswith("faiss/")]
    assert no_faiss.count() == len(kept) and all(isinstance(e, FileEntry) for e in kept)

    rewritten = KeptEntries(index, dropped_names=frozenset({slice_path}))
    assert [e.path for e in rewritten.entries()] == [e.path for e in files if e.path != versioned(slice_path, 3)]
