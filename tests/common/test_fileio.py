"""`pipeline.common.fileio`: files through Beam's FileSystems (local and gs://). Reading a
committed directory's manifest is tested with the manifest reader (tests/schemas/)."""

import hashlib

import pytest

from pipeline.common import fileio

pytestmark = pytest.mark.unit


def test_sha256_file_streams_a_file_and_can_feed_one_hash_over_several(tmp_path):
    data = bytes(range(256)) * 40_000  # ~10 MB: several blocks
    (tmp_path / "a").write_bytes(data)
    assert fileio.sha256_file(str(tmp_path / "a")) == (hashlib.sha256(data).hexdigest(), len(data))
    running = hashlib.sha256(b"name")
    assert fileio.sha256_file(str(tmp_path / "a"), running)[0] == hashlib.sha256(b"name" + data).hexdigest()
