"""`pipeline.common.writers`: deterministic file writers."""

import apache_beam as beam
import pytest
from apache_beam.testing.util import assert_that, equal_to

from pipeline.common.rejected import REJECTED_BLOCK, REJECTED_FILES, Rejected, WriteRejected, rejected_file_of
from tests.helpers import local_pipeline, read_rejected


@pytest.mark.beam
def test_rejected_records_are_spread_over_stably_named_files(tmp_path):
    """Each bad record's file is chosen by its source and position block, so no worker gathers
    them all, not even those of one bad file; the same input gives the same files."""
    records = [Rejected(f"gs://b/corpus/part-{i % 7}.jsonl", i, "malformed_json", "x") for i in range(40)]
    bad_file = [Rejected("gs://b/corpus/bad.jsonl", b * REJECTED_BLOCK + 1, "malformed_json", "x") for b in range(5)]
    records += bad_file
    with local_pipeline() as p:
        entries = p | beam.Create(records) | WriteRejected(str(tmp_path / "rejected"), "build-index")
        assert_that(entries | beam.Map(lambda e: e.rows) | beam.combiners.ToList() | beam.Map(sum), equal_to([45]))
    files = {p.name for p in (tmp_path / "rejected").iterdir()}
    assert files == {f"build-index-{rejected_file_of(r):05d}.jsonl" for r in records} and len(files) > 1
    assert len({rejected_file_of(r) for r in bad_file}) == 5
    written = read_rejected(tmp_path, "build-index")
    assert sorted((r["source"], r["position"]) for r in written) == sorted((r.source, r.position) for r in records)


@pytest.mark.unit
def test_one_sources_rejects_take_consecutive_files_by_position_block():
    """Block 0 (whole-file rejects at -1 included) keeps the file a hash of the source gives;
    each further block of positions takes the next file, wrapping at REJECTED_FILES."""
    at = [Rejected("corpus/bad.jsonl", p, "malformed_json", "x") for p in (-1, 0, REJECTED_BLOCK - 1, REJECTED_BLOCK)]
    first = rejected_file_of(at[0])
    assert [rejected_file_of(r) for r in at] == [first, first, first, (first + 1) % REJECTED_FILES]
    wrapped = Rejected("corpus/bad.jsonl", REJECTED_FILES * REJECTED_BLOCK, "malformed_json", "x")
    assert rejected_file_of(wrapped) == first
