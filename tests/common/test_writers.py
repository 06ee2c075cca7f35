"""`pipeline.common.writers`: deterministic file writers."""

import apache_beam as beam
import pytest
from apache_beam.testing.util import assert_that, equal_to

from pipeline.common.writers import WriteRejected, rejected_file_of
from pipeline.corpus.records import Rejected
from tests.helpers import local_pipeline, read_rejected

pytestmark = pytest.mark.beam


def test_rejected_records_are_spread_over_stably_named_files(tmp_path):
    """Each bad record's file is chosen by its source, so no worker gathers them all; the same
    input gives the same files."""
    records = [Rejected(f"gs://b/corpus/part-{i % 7}.jsonl", i, "malformed_json", "x") for i in range(40)]
    with local_pipeline() as p:
        entries = p | beam.Create(records) | WriteRejected(str(tmp_path / "rejected"), "build-index")
        assert_that(entries | beam.Map(lambda e: e.rows) | beam.combiners.ToList() | beam.Map(sum), equal_to([40]))
    files = {p.name for p in (tmp_path / "rejected").iterdir()}
    assert files == {f"build-index-{rejected_file_of(r):05d}.jsonl" for r in records} and len(files) > 1
    written = read_rejected(tmp_path, "build-index")
    assert sorted((r["source"], r["position"]) for r in written) == sorted((r.source, r.position) for r in records)
