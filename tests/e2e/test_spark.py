"""The pipeline on Spark: Beam's Spark job server (from deploy/local/runners.py's pinned jars)
running Spark inside itself on two cores (`local[2]`), Spark's own shuffle and scheduling; what
it writes is compared byte for byte with the local runner's output of the same config."""

import pytest

from pipeline.run import run_all
from schemas.config import config_from_dict
from tests.helpers import assert_matches_the_local_run

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_long_documents_on_spark_write_the_local_runners_bytes(spark_options, long_documents_built_locally, tmp_path):
    """Both stages with LOOPBACK workers: every chunk, embedding, index slice and shard file
    equal to the local runner's, every neighbour slot filled, the same recall, validate passing."""
    config, local = long_documents_built_locally
    report = run_all(config_from_dict(config(tmp_path / "out")), [*spark_options, "--environment_type=LOOPBACK"])
    assert [status for status, _ in report.values()] == ["built", "built"]
    assert_matches_the_local_run(tmp_path / "out", local)
