"""`validate` as outputs grow: the job's graph does not grow with the files, a sample reads only
the chunk rows it checks, the in-process check holds nothing per document."""

import json

import numpy as np
import pytest

from benchmarks.validate_sample import L, Layout, write_index, write_shards
from pipeline.check.plan import plan_validation
from pipeline.check.problems import ValidationFailed
from pipeline.check.validate import run_in_process, validate_path
from pipeline.check.validate_beam import validate_job_graph_bytes
from pipeline.common.fileio import sha256_bytes
from tests.helpers import rewrite_shard


def _output_listing(root, files: int):
    """An output whose manifests list `files` chunk files and `files` shards (a tiny output's
    manifests, their entries multiplied: no data files behind them)."""
    rng = np.random.default_rng(0)
    write_shards(root / "shards", root / "index", write_index(root / "index", 4, rng), 2, rng)
    index = json.loads((root / "index" / "manifest.json").read_text())
    faiss = [e for e in index["files"] if e["path"].startswith("faiss/")]
    chunk = {"rows": 1, "bytes": 1000}  # and a sha256 of its own (a repeated string pickles once)
    index["files"] = [{"path": f"chunks/chunks-{i:06d}.parquet", **chunk, "sha256": f"{i:064x}"} for i in range(files)]
    index["files"] += [{"path": "embeddings/embeddings-000000.parquet", "rows": files, "bytes": 1, "sha256": "e" * 64}]
    index["files"] += faiss
    index.update(num_chunks=files, num_documents=files // L)
    data = json.dumps(index).encode()
    (root / "index" / "manifest.json").write_bytes(data)
    shards = json.loads((root / "shards" / "manifest.json").read_text())
    entry = {**shards["shards"][0], "rows": 1}
    shards["shards"] = [{**entry, "path": f"shard-{i:06d}.arrow", "sha256": f"{i:064x}"} for i in range(files)]
    shards.update(num_sequences=files, index_manifest_sha256=sha256_bytes(data))
    (root / "shards" / "manifest.json").write_text(json.dumps(shards))
    return root


@pytest.mark.unit
def test_the_jobs_graph_does_not_grow_with_the_files(tmp_path):
    """Before, every chunk file's entry was an argument of several steps (2.8 MB of graph at
    5,000 chunk files); Dataflow refuses a job over 20 MB. 10^4 files here (10^5 take ~4 s,
    most of it parsing the manifests: docs/scale.md has that size)."""
    small = validate_job_graph_bytes(str(_output_listing(tmp_path / "small", 1_000)))
    large = validate_job_graph_bytes(str(_output_listing(tmp_path / "large", 10_000)))
    assert abs(large - small) <= 0.1 * small, (small, large)


def _output(root):
    """100 shards of 2 sequences into 8,192 chunks (m = 64) in 128 files of 64 rows, in row
    groups of 16."""
    rng = np.random.default_rng(1)
    db = write_index(root / "index", 4096, rng, Layout(m=64, chunk_file_rows=64, row_group_rows=16))
    write_shards(root / "shards", root / "index", db, 100, rng, rows=2)
    return root


@pytest.mark.unit
def test_a_sample_reads_only_the_chunk_rows_it_checks_and_finds_a_wrong_neighbour(tmp_path):
    output = _output(tmp_path)
    plan = plan_validation(str(output), 0.01)
    assert len(plan.shard_entries) == 1
    read = run_in_process(plan).chunk_bytes_read
    assert 0 < read <= 0.05 * sum(unit.entry.bytes for unit in plan.chunk_files)

    def wrong_token(columns):
        columns["neighbours"][1, 1, 1, 3] += 1  # a neighbour of the second sequence

    rewrite_shard(output / "shards", wrong_token, plan.shard_entries[0].path)
    with pytest.raises(ValidationFailed, match="neighbour tokens differ from the chunk database"):
        validate_path(str(output), 0.01)
