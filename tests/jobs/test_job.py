"""What every job shares (`pipeline.jobs.job`): the stage timings its manifest records."""

import pytest

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
    }
    assert stage_timings("build-shards", 1_000.0, 999.0, {"sequences": 50}, "sequences")["records_per_second"] is None
