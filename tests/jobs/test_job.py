"""What every job shares (`pipeline.jobs.job`): the stage timings its manifest records, its entries."""

import pytest

from pipeline.jobs.entry_pieces import sorted_entries
from pipeline.jobs.job import stage_timings

pytestmark = pytest.mark.unit


def test_stage_timings_are_the_wall_time_between_the_two_clocks():
    timings = stage_timings("build-shards", 1_000.0, 1_012.5, {"sequences": 50}, "sequences")
    assert timings == {
        "stage": "build-shards",
        "started": "1970-01-01T00:16:40+00:00",
        "committed": "1970-01-01T00:16:52+00:00",
        "wall_seconds": 12.5,
        "records": "sequences",
        "records_per_second": 4.0,
        "job": None,  # the commit names its job
    }
    assert stage_timings("build-shards", 1_000.0, 999.0, {"sequences": 50}, "sequences")["records_per_second"] is None


def test_manifest_entries_come_sorted_by_path_and_a_path_written_twice_fails():
    from schemas.manifest import FileEntry

    def entry(path, rows):
        return FileEntry(path=path, rows=rows, bytes=0, sha256="")

    assert [e.path for e in sorted_entries([entry("b", 1), entry("a", 2)])] == ["a", "b"]
    with pytest.raises(RuntimeError, match="a was written twice"):
        sorted_entries([entry("a", 1), entry("b", 1), entry("a", 2)])
