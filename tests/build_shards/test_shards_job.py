"""build-shards' warnings: shards that are worse than their row count suggests (empty neighbour
slots, repeated tokens dropped, neighbour recall below target) say so, with the cause."""

import pytest

from pipeline.build_shards.manifest import neighbour_warnings
from schemas.config import config_from_dict
from schemas.measures import NeighbourRecall
from tests.helpers import shards_manifest, small_config

pytestmark = pytest.mark.unit


def manifest(filled, recall, counters=None):
    return shards_manifest(
        filled,
        neighbour_fill=filled / 80,
        counters=counters or {},
        neighbour_recall=NeighbourRecall(measure="", value=recall, sample_size=40, slots=80, tolerance=1e-3),
    )


def test_shards_worse_than_they_look_get_a_warning_with_the_cause(tmp_path):
    cfg = config_from_dict(small_config(tmp_path, "x"))
    assert neighbour_warnings(manifest(80, 1.0), cfg) == []
    (few,) = neighbour_warnings(manifest(60, 1.0), cfg)
    assert "75.0% of neighbour slots are filled (20 empty)" in few and "fewer than k chunks outside" in few
    deduped = config_from_dict(small_config(tmp_path, "x", dedupe_neighbours=True))
    (repeats,) = neighbour_warnings(manifest(60, 1.0, {"candidates_dropped_duplicate_tokens": 30}), deduped)
    assert "raise neighbour_candidates" in repeats
    (missed,) = neighbour_warnings(manifest(80, 0.9), cfg)
    assert "neighbour recall 0.900" in missed


def test_an_index_in_slices_by_chunk_id_range_is_refused_with_what_to_do(tmp_path):
    """Slices without the quantizer and list owners (an index built before slices owned lists)
    cannot be routed to: build-shards says to rebuild it rather than search a missing file."""
    from benchmarks.scale_sim import CHUNK_FILE_ROWS, config, index_manifest, write_manifest
    from pipeline.build_index.files import load_committed_index
    from pipeline.common.errors import StageError

    cfg = config(tmp_path)
    manifest = index_manifest(10_000 * CHUNK_FILE_ROWS, cfg)
    old = manifest.model_copy(
        update={"files": [f for f in manifest.files if not f.path.endswith((".npy", "quantizer.faiss"))]}
    )
    write_manifest(tmp_path / "index", old)
    with pytest.raises(StageError, match="slices by chunk-id range.*rebuild it"):
        load_committed_index(cfg)
    write_manifest(tmp_path / "index", manifest)
    assert load_committed_index(cfg).routing_paths is not None


def test_a_refresh_records_the_shards_it_wrote_as_runs_of_numbers():
    from pipeline.build_shards.refresh import RewrittenRuns
    from schemas.manifest import ShardEntry

    def shard(number: int, commit: int | None = None) -> ShardEntry:
        name = f"shard-{number:05d}.arrow" if commit is None else f"shard-{number:05d}.c{commit:06d}.arrow"
        return ShardEntry(path=name, rows=1, bytes=1, sha256="x")

    runs = RewrittenRuns()
    left = runs.create_accumulator()
    for number in (7, 3, 4):
        left = runs.add_input(left, shard(number))
    right = runs.add_input(runs.add_input(runs.create_accumulator(), shard(5, commit=2)), shard(9))
    assert runs.extract_output(runs.merge_accumulators([left, right])) == [(3, 5), (7, 7), (9, 9)]
