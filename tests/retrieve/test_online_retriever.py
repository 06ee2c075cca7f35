"""The inference-time retriever finds the neighbours build-shards wrote: the training sequences of
the built sample output, their own documents excluded, searched again from their token ids
(embedded afresh, so scores may differ: ties within `tie_tolerance` count equal); and it
refuses, in one line, an index whose encoder is gone. (tests/e2e/test_sliced_index_retrieval.py
has it over an index in slices.)"""

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline.build_shards.job import build_shards
from pipeline.chunks.chunk_files import ChunkRows, chunks_table
from pipeline.chunks.chunking import Chunk
from pipeline.common.writers import parquet_bytes
from pipeline.retrieve.online import IndexNotUsable, Retriever
from pipeline.retrieve.sequences import document_spans
from schemas.config import config_from_dict
from tests.helpers import rewrite_manifest, shard_rows, tie_tolerance

pytestmark = pytest.mark.e2e


def test_retriever_finds_the_neighbours_build_shards_wrote(built_output):
    _, config, _ = built_output
    out = Path(config["output"])
    shards = json.loads((out / "shards" / "manifest.json").read_text())
    index = json.loads((out / "index" / "manifest.json").read_text())
    retriever = Retriever.open(str(out / "index"))
    assert retriever.neighbours == shards["neighbours"] == config["neighbours"]
    tuned = shards["search_depth"]["depth"] if shards["search_depth"] else None
    assert retriever.depth == (tuned if tuned is not None else index["nprobe"])
    n = shards["sequence_tokens"]
    tie = tie_tolerance(index["embedding_precision"]["precision"])
    equal = slots = same_tokens = same_ids = 0
    for tokens, doc_ids, neighbours, ids, scores in shard_rows(out / "shards"):
        found = retriever.retrieve(tokens[:n], exclude_documents=doc_ids)
        assert found.tokens.shape == neighbours.shape and found.ids.shape == ids.shape
        equal += int(((found.ids == ids) | (np.abs(found.scores - scores) <= tie)).sum())
        slots += ids.size
        same = found.ids == ids
        same_tokens += int((found.tokens[same] == neighbours[same]).all(axis=-1).sum())
        same_ids += int(same.sum())
        own = np.concatenate([np.arange(a, b) for a, b in retriever.document_ranges(doc_ids)])
        assert not np.isin(found.ids, own).any()  # never a chunk of the sequence's own documents
    assert slots == shards["num_sequences"] * (n // config["chunk_tokens"]) * config["neighbours"] > 0
    assert equal / slots >= 0.999
    assert same_tokens == same_ids  # the same chunk brings the same chunk + continuation tokens


def repeat_tokens(index: Path, m: int) -> None:
    """Give every run of 4 consecutive chunks the tokens of its first, in the chunk files alone
    (the embeddings and the faiss index stay, and build-shards' queries with them): many
    candidates then repeat a kept one's tokens."""
    for path in sorted((index / "chunks").glob("*.parquet")):
        rows = ChunkRows.of(pq.read_table(path))
        first = np.arange(len(rows.tokens)) // 4 * 4
        chunks = [
            Chunk(int(i), int(d), int(p), rows.tokens[f], c)
            for i, d, p, f, c in zip(rows.chunk_id, rows.doc_id, rows.position, first, rows.continuation)
        ]
        path.write_bytes(parquet_bytes(chunks_table(chunks, m)))


def test_retriever_drops_repeated_tokens_as_build_shards_does(built_output, tmp_path):
    _, config, _ = built_output
    out = tmp_path / "out"
    shutil.copytree(Path(config["output"]) / "index", out / "index")
    repeat_tokens(out / "index", config["chunk_tokens"])
    dedupe = {**config, "output": str(out), "dedupe_neighbours": True, "neighbour_candidates": 8}
    manifest = build_shards(config_from_dict(dedupe), [])
    retriever = Retriever.open(str(out / "index"), dedupe=True, candidates=8)
    n, m = config["sequence_tokens"], config["chunk_tokens"]
    index = json.loads((out / "index" / "manifest.json").read_text())
    tie = tie_tolerance(index["embedding_precision"]["precision"])
    equal = slots = 0
    # the queries are the sequences' chunks as embedded: the tokens before they were repeated
    built = shard_rows(Path(config["output"]) / "shards")
    for (tokens, doc_ids, *_), (_, same_doc_ids, _, ids, scores) in zip(built, shard_rows(out / "shards")):
        assert doc_ids == same_doc_ids
        found = retriever.retrieve(tokens[:n], exclude_documents=doc_ids)
        equal += int(((found.ids == ids) | (np.abs(found.scores - scores) <= tie)).sum())
        slots += ids.size
        for chunk in range(len(found.ids)):  # the chunks a chunk is given differ in their tokens
            filled = found.tokens[chunk, found.ids[chunk] >= 0, :m]
            assert len({row.tobytes() for row in filled}) == len(filled)
    assert slots == manifest.num_sequences * (n // m) * config["neighbours"] > 0
    assert manifest.counters["candidates_dropped_duplicate_tokens"] > 0
    assert equal / slots >= 0.999


def test_retriever_excludes_each_document_by_the_span_build_shards_excludes(built_output):
    _, config, _ = built_output
    index = Path(config["output"]) / "index"
    chunks = pq.read_table(sorted((index / "chunks").glob("*.parquet")), columns=["chunk_id", "doc_id"])
    spans = dict(document_spans(chunks["chunk_id"].to_numpy(), chunks["doc_id"].to_numpy()))
    retriever = Retriever.open(str(index))
    assert retriever.chunk_files.num_files > 1 and len(spans) > 10  # documents across several chunk files
    assert {doc_id: retriever.document_ranges([doc_id]) for doc_id in spans} == {d: [s] for d, s in spans.items()}
    assert retriever.document_ranges([min(spans) - 1, max(spans) + 1]) == []  # not in the database: nothing


def test_retriever_refuses_an_index_whose_encoder_directory_is_gone(built_output, tmp_path):
    _, config, _ = built_output
    index = tmp_path / "index"
    shutil.copytree(Path(config["output"]) / "index", index)
    manifest = json.loads((index / "manifest.json").read_text())
    missing = tmp_path / "models" / "encoder"
    manifest["embedding_model"]["name"] = str(missing)
    rewrite_manifest(index, json.dumps(manifest))
    with pytest.raises(IndexNotUsable, match=rf"^{index}: its encoder model directory {missing} is missing$"):
        Retriever.open(str(index))


def damage_faiss_file(index: Path) -> Path:
    """Overwrite index.faiss with bytes faiss cannot parse, of the same size."""
    path = index / "faiss" / "index.faiss"
    path.write_bytes(b"\x00garbage" * (path.stat().st_size // 8) + b"\x00" * (path.stat().st_size % 8))
    return path


REFUSED_UNREAD = r"the file changed since \(a run committed over it: run again\) or is damaged; faiss did not read it"


def test_a_faiss_file_whose_sha256_differs_is_refused_before_faiss_reads_it(built_output, tmp_path):
    from pipeline.common.errors import ChecksumMismatch

    _, config, _ = built_output
    out = tmp_path / "out"
    shutil.copytree(Path(config["output"]), out)
    path = damage_faiss_file(out / "index")
    with pytest.raises(ChecksumMismatch, match=f"^{path}: sha256 .* {REFUSED_UNREAD}$"):
        Retriever.open(str(out / "index"))
    shutil.rmtree(out / "shards")  # else the committed shards are reused and nothing is searched
    with pytest.raises(RuntimeError, match=REFUSED_UNREAD):  # the job's error, as the runner reraises it
        build_shards(config_from_dict({**config, "output": str(out)}), [])
