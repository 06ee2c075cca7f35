"""A job graph holds no file list: its serialised size (what a runner is sent, and Dataflow
refuses over 20 MB) stays the same however many files the inputs and the index hold."""

import pytest

from benchmarks.scale_sim import CHUNK_FILE_ROWS, append_graph_bytes, config, index_manifest, write_manifest
from pipeline.build_index.faiss_only import rebuild_faiss
from pipeline.build_shards.job import build_shards
from pipeline.common import fileio
from pipeline.corpus.read import ReadCorpus
from pipeline.jobs.job import graph_bytes
from schemas.manifest import IndexManifest
from schemas.stage_config import CorpusConfig
from tests.helpers import local_pipeline

pytestmark = pytest.mark.unit


def _build_shards_graph(tmp_path, chunk_files: int) -> int:
    """build-shards' graph (as `--dry-run` builds it) against a committed index of this many
    chunk files (and as many embedding files: twice as many manifest entries)."""
    cfg = config(tmp_path / f"{chunk_files:06d}")  # paths of one length: graphs differ only by the index
    write_manifest(tmp_path / f"{chunk_files:06d}" / "index", index_manifest(chunk_files * CHUNK_FILE_ROWS, cfg))
    return build_shards(cfg, [], dry_run=True)["graph_bytes"]


def test_build_shards_graph_does_not_grow_with_chunk_files(tmp_path):
    # one index file at 500 chunk files; 2 and 4 slices by lists (the 16 GiB slices of
    # benchmarks/scale_sim.py) at 10,000 and 20,000: the routed search's rounds are as many as
    # doubling takes from one list to all 262,144, whatever the files and slices
    one_file, small, large = (_build_shards_graph(tmp_path, files) for files in (500, 10_000, 20_000))
    assert abs(large - small) <= 0.1 * small, (small, large)
    assert large < 2 * 2**20  # the bound benchmarks/scale_sim.py reports at 3e10 chunks
    # the dry run built the graph a run would, against the committed index: its slices add the
    # routed search's steps
    assert small > one_file + 2_000


def _append_graph(tmp_path, chunk_files: int) -> int:
    root = tmp_path / f"append-{chunk_files:06d}"
    cfg = config(root)
    write_manifest(root / "index", index_manifest(chunk_files * CHUNK_FILE_ROWS, cfg))
    return append_graph_bytes(cfg)


def test_an_append_graph_does_not_grow_with_the_index(tmp_path):
    """Before, an append's graph held the committed manifest twice and every chunk file's range
    (~2 x 138 MB at 3e10 chunks); it holds the index's directory and manifest sha256 now. One
    index file at 500 and 1,000 chunk files; 2 and 4 slices (changed a slice per worker: more
    steps) at 10,000 and 20,000."""
    for fewer, more in ((500, 1_000), (10_000, 20_000)):
        small, large = _append_graph(tmp_path, fewer), _append_graph(tmp_path, more)
        assert abs(large - small) <= 0.02 * small, (fewer, small, large)


def _faiss_rebuild_graph(tmp_path, chunk_files: int) -> int:
    root = tmp_path / f"faiss-{chunk_files:06d}"
    cfg = config(root)
    write_manifest(root / "index", index_manifest(chunk_files * CHUNK_FILE_ROWS, cfg))
    directory = fileio.join(cfg.output, "index")
    previous = fileio.committed(directory, IndexManifest)
    sha256 = fileio.manifest_sha256(directory) or ""
    return rebuild_faiss(cfg, previous, [], previous_sha256=sha256, dry_run=True)["graph_bytes"]


def test_a_faiss_only_rebuild_graph_does_not_grow_with_the_index(tmp_path):
    """Before, the graph of a rebuild of the faiss index alone (only `index.*` changed) held
    every embedding file's path and the committed manifest; it names the manifest by its
    sha256 now, and a worker lists the files. (The synthetic entries compress well in a graph:
    it grew 3.4% from 1,000 to 4,000 chunk files before, by ~6 B a file.)"""
    small, large = (_faiss_rebuild_graph(tmp_path, files) for files in (1_000, 8_000))
    assert abs(large - small) <= 0.005 * small, (small, large)


def test_an_append_and_a_delete_graph_stay_small_at_a_hundred_thousand_entries_and_deletes(tmp_path):
    """10^5 manifest entries (50,000 chunk and as many embedding files) and 10^5 documents to
    delete: the ids to delete go to a file in the job's staging, named in the graph by its path
    and sha256 (in the graph, 10^5 of them took 2.3 MB)."""
    root = tmp_path / "large"
    cfg = config(root)
    write_manifest(root / "index", index_manifest(50_000 * CHUNK_FILE_ROWS, cfg))
    few = append_graph_bytes(cfg)
    for append in (True, False):
        many = append_graph_bytes(cfg, deletes=100_000, append=append)
        assert many <= 2 * 10**6 and abs(many - few) <= 0.02 * few, (append, few, many)


def test_reading_a_corpus_lists_its_files_inside_the_job(tmp_path):
    def graph(files: int) -> int:
        directory = tmp_path / str(files)
        directory.mkdir()
        for number in range(files):
            (directory / f"part-{number:05d}.jsonl").write_text('{"id": "a", "text": "b"}\n')
        pipeline = local_pipeline()
        _ = pipeline | ReadCorpus(CorpusConfig(paths=[str(directory / "*.jsonl")], format="jsonl"))
        return graph_bytes(pipeline)

    small, large = graph(2), graph(4_000)
    assert abs(large - small) <= 0.1 * small, (small, large)
