"""build-shards tunes the depth it searches at on its own search: sampled training chunks with
their sequence's documents excluded, measured against exact search (`recall_below_target`:
deepen, warn or fail). On long documents (`benchmarks.synthetic.long_documents`: IVF64 over 32
documents of 100 chunks) the index's plain depth (nprobe 1) leaves recall@2 outside the own
document near 0.6; tests/index/test_search_depth.py has the index's side of it."""

import apache_beam as beam
import faiss
import numpy as np
import pytest
from apache_beam.testing.util import assert_that

from benchmarks.synthetic import long_documents
from pipeline.chunks.chunk_files import ChunkFileRanges, TrainingChunks, chunks_table
from pipeline.chunks.chunking import Chunk
from pipeline.common.sampling import TRAIN_SALT, in_sample
from pipeline.common.writers import parquet_bytes
from pipeline.index.factory import training_size
from pipeline.index.search import set_search_depth
from pipeline.index.train import train_index
from pipeline.retrieve.beam import DocumentSpans, PackSequences, RetrieveNeighbours
from pipeline.retrieve.depth import NeighbourRecallTooLow
from pipeline.retrieve.recall import MeasureNeighbourRecall
from pipeline.retrieve.search import QueryBlock, Retrieval
from pipeline.shards.rows import NeighbourIds
from schemas.manifest import FileEntry
from tests.helpers import local_pipeline, write_embedding_files, write_list_slices

DOCUMENTS, CHUNKS_PER_DOCUMENT, FACTORY = 32, 100, "IVF64,Flat"
L, M, K, PAD = 2, 4, 2, 0
TARGET = 0.95


@pytest.fixture(scope="module")
def corpus():
    vectors, spans = long_documents(DOCUMENTS, CHUNKS_PER_DOCUMENT)
    return vectors, spans, np.arange(len(vectors), dtype=np.int64)


def _chunks(spans):
    chunks = []
    for doc_id, (start, end) in enumerate(spans):
        for chunk_id in range(start, end):
            tokens = np.array([1 + chunk_id % 997, 2, 3, 4], np.int32)
            chunks.append(Chunk(chunk_id, doc_id, chunk_id - start, tokens, np.full(M, PAD, np.int32)))
    return chunks


def _index_files(directory, vectors, ids, slices: int):
    """The index at nprobe 1 (the depth a plain tuning picks here), in one file or in `slices`
    slices by lists: (the index file, or None; the slices' Routing, or None)."""
    index = train_index(FACTORY, vectors[in_sample(ids, training_size(len(ids), FACTORY), len(ids), TRAIN_SALT)])
    index.add_with_ids(vectors, ids)
    set_search_depth(index, 1)
    if slices > 1:
        return None, write_list_slices(directory, index, slices)
    faiss.write_index(index, str(directory / "index.faiss"))
    return str(directory / "index.faiss"), None


def _retrieve(tmp_path, corpus, policy: str, slices: int, check_depth, check_recall):
    vectors, spans, ids = corpus
    chunks = _chunks(spans)
    (tmp_path / "index" / "chunks").mkdir(parents=True, exist_ok=True)
    entries = []
    for number, begin in enumerate(range(0, len(chunks), 800)):
        path = f"chunks/chunks-{number:05d}.parquet"
        (tmp_path / "index" / path).write_bytes(parquet_bytes(chunks_table(chunks[begin : begin + 800], M)))
        entries.append(FileEntry(path=path, rows=len(chunks[begin : begin + 800]), bytes=0, sha256=""))
    chunk_files = ChunkFileRanges.from_entries(str(tmp_path / "index"), entries)
    write_embedding_files(tmp_path / "index" / "embeddings", ids, vectors, files=len(ids) // 800)
    index_path, routing = _index_files(tmp_path / "index", vectors, ids, slices)
    spec = Retrieval(
        index_path=index_path,
        depth=1,
        chunk_files=chunk_files,
        chunks_per_seq=L,
        chunk_tokens=M,
        neighbours=K,
        candidates=K,
        pad_id=PAD,
        probes=200,
        embeddings=str(tmp_path / "index" / "embeddings" / "*.parquet"),
        target_recall=TARGET,
        recall_below_target=policy,
        routing=routing,
    )
    with local_pipeline() as p:
        sequences = p | "Chunks" >> beam.Create([TrainingChunks.of_chunks(chunks)]) | PackSequences(L, PAD)
        queries = p | "Queries" >> beam.Create([QueryBlock(ids, vectors[ids])])
        spans_read = p | DocumentSpans(str(tmp_path / "index" / "chunks" / "*.parquet"))
        retrieved = (sequences, queries, spans_read) | RetrieveNeighbours(spec, shard_rows=16)
        ids = retrieved.rows | beam.Map(NeighbourIds.of)
        recall = (retrieved.probes, retrieved.truth, ids) | MeasureNeighbourRecall(K)
        assert_that(retrieved.search_depth, check_depth, label="CheckDepth")
        assert_that(recall, check_recall, label="CheckRecall")
        filled = retrieved.rows | beam.FlatMap(
            lambda batch: [bool((row.neighbour_ids >= 0).all()) for row in batch.rows]
        )
        assert_that(filled, _all_filled)


def _all_filled(filled: list[bool]) -> None:
    """Every slot of every row filled (neighbour_fill 1.0), one index or slices by lists."""
    assert filled and all(filled)


@pytest.mark.slow
@pytest.mark.parametrize("slices", [1, 4])
@pytest.mark.beam
def test_build_shards_deepens_until_its_neighbour_recall_meets_the_target(corpus, tmp_path, slices):
    def check_depth(results):
        (depth,) = results
        assert depth.index_depth == 1 and depth.depth > 1 and not depth.plateau
        assert depth.curve[0].depth == 1 and depth.curve[0].recall < TARGET
        assert depth.curve[-1].depth == depth.depth and depth.curve[-1].recall >= TARGET

    def check_recall(results):
        (recall,) = results
        assert recall["sample_size"] == 200 and recall["value"] >= TARGET

    _retrieve(tmp_path, corpus, "deepen", slices, check_depth, check_recall)


@pytest.mark.slow
@pytest.mark.beam
def test_recall_below_target_warn_keeps_the_index_depth_and_fail_names_the_depth_that_meets_it(corpus, tmp_path):
    def kept(results):
        (depth,) = results
        assert depth.depth == 1 and len(depth.curve) == 1 and depth.curve[0].recall < TARGET

    def below(results):
        (recall,) = results
        assert recall["value"] < 0.8  # what the shards held before the depth was tuned on them

    _retrieve(tmp_path / "warn", corpus, "warn", 1, kept, below)
    with pytest.raises(Exception, match=r"at the index's search depth 1 is below index.target_recall 0.95.*depth \d+"):
        _retrieve(tmp_path / "fail", corpus, "fail", 1, kept, below)
    assert issubclass(NeighbourRecallTooLow, RuntimeError)


@pytest.mark.unit
def test_a_probe_sample_without_embedding_files_is_refused():
    with pytest.raises(ValueError, match="probes needs Retrieval.embeddings"):
        spec = Retrieval(
            index_path="index.faiss",
            depth=1,
            chunk_files=None,
            chunks_per_seq=L,
            chunk_tokens=M,
            neighbours=K,
            candidates=K,
            pad_id=PAD,
            probes=10,
        )
        RetrieveNeighbours(spec, shard_rows=16)
