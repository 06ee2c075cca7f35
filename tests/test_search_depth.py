"""The search depth tuned on the search that is made: own documents excluded. On long documents a
chunk's nearest IVF lists are its own document's, so the depth that finds its nearest other
vector (what the index's plain recall measures) misses its nearest chunks of other documents
(what build-shards keeps). `benchmarks.synthetic.long_documents` has that shape: IVF64 over 32
documents of 100 chunks reaches 1-recall@10 0.99 at nprobe 1, where recall@2 outside the own
document is 0.62 and needs nprobe 16."""

import apache_beam as beam
import faiss
import numpy as np
import pytest
from apache_beam.testing.util import assert_that

from benchmarks.synthetic import long_documents
from pipeline.chunks.chunk_files import ChunkFileRanges
from pipeline.chunks.chunking import Chunk
from pipeline.common.writers import chunks_table, embeddings_table, parquet_bytes
from pipeline.index.build import BuildIndex
from pipeline.index.exact import exact_nearest_other, exact_nearest_outside
from pipeline.index.factory import training_size
from pipeline.index.recall import one_recall_at_k, recall_of
from pipeline.index.sampling import QUERY_SALT, TRAIN_SALT, in_sample
from pipeline.index.search import search_depth_range, search_each_excluding, set_search_depth
from pipeline.index.train import build_index, train_index
from pipeline.index.tuning import tune_index_depth
from pipeline.retrieve.beam import DocumentSpans, PackSequences, RetrieveNeighbours
from pipeline.retrieve.recall import MeasureNeighbourRecall
from pipeline.retrieve.search import NeighbourRecallTooLow, Retrieval
from schemas.config import IndexConfig
from schemas.manifest import FileEntry
from tests.helpers import local_pipeline

DOCUMENTS, CHUNKS_PER_DOCUMENT, FACTORY = 32, 100, "IVF64,Flat"
L, M, K, PAD = 2, 4, 2, 0
TARGET = 0.95


@pytest.fixture(scope="module")
def corpus():
    vectors, spans = long_documents(DOCUMENTS, CHUNKS_PER_DOCUMENT)
    return vectors, spans, np.arange(len(vectors), dtype=np.int64)


def _document_of(spans, chunk_ids):
    return np.searchsorted([end for _, end in spans], chunk_ids, side="right")


def test_tuning_without_own_documents_excluded_picks_a_depth_below_target(corpus):
    vectors, spans, ids = corpus
    index = build_index(ids, vectors, FACTORY)
    queries = ids[in_sample(ids, 300, len(ids), QUERY_SALT)]
    documents = [(spans[d],) for d in _document_of(spans, queries)]
    nearest_other = exact_nearest_other(queries, vectors[queries], ids, vectors)
    outside = exact_nearest_outside(vectors[queries], documents, ids, vectors, 100)

    def plain_at(depth):
        set_search_depth(index, depth)
        return one_recall_at_k(index, queries, vectors[queries], nearest_other)

    def own_at(depth):
        set_search_depth(index, depth)
        return recall_of(outside, search_each_excluding(index, vectors[queries], K, documents)[1])

    cfg = IndexConfig(target_recall=TARGET)
    depths = search_depth_range(index)
    (plain_depth, plain_recall, _), _, none = tune_index_depth(depths, plain_at, None, cfg, K)
    assert none is None and plain_recall >= TARGET
    assert own_at(plain_depth) < 0.8  # the depth tuned the old way: neighbours well below target

    (depth, recall, plateau), curve, own = tune_index_depth(depths, plain_at, own_at, cfg, K)
    assert depth > plain_depth and own["depth"] == depth and own["value"] >= TARGET and not plateau
    assert own["curve"][0]["recall"] < TARGET and [p["depth"] for p in own["curve"]] == depths[: len(own["curve"])]
    assert recall >= TARGET and curve[-1] == {"depth": depth, "recall": recall}  # plain, at the depth kept


def _embedding_files(directory, vectors, rows_per_file=800):
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for number, start in enumerate(range(0, len(vectors), rows_per_file)):
        rows = [(i, vectors[i]) for i in range(start, min(start + rows_per_file, len(vectors)))]
        path = directory / f"embeddings-{number:05d}.parquet"
        path.write_bytes(parquet_bytes(embeddings_table(rows)))
        paths.append(str(path))
    return paths


@pytest.mark.parametrize("shard_bytes", [None, 130_000], ids=["one file", "4 shards"])
def test_build_index_tunes_its_depth_with_each_query_document_excluded(corpus, tmp_path, shard_bytes):
    vectors, spans, ids = corpus
    paths = _embedding_files(tmp_path / "embeddings", vectors)
    documents = [(int(i), int(d)) for i, d in zip(ids, _document_of(spans, ids))]
    cfg = IndexConfig(type=FACTORY, target_recall=TARGET, shard_bytes=shard_bytes)

    def check(infos):
        (info,) = infos
        recall = info["recall_at_k"]
        own = recall["own_document_excluded"]
        assert len(info["files"]) == (1 if shard_bytes is None else 4)
        assert own["k"] == K and own["value"] >= TARGET and info["nprobe"] == own["depth"] >= 16
        assert recall["curve"][0]["depth"] == 1 and recall["curve"][0]["recall"] >= TARGET  # plain: nprobe 1 would do
        assert own["curve"][0]["recall"] < TARGET

    with local_pipeline() as p:
        chunk_docs = p | "Documents" >> beam.Create(documents)
        info = p | beam.Create(paths) | BuildIndex(cfg, str(tmp_path / "faiss"), chunk_docs, K)
        assert_that(info, check)


def _chunks(spans):
    chunks = []
    for doc_id, (start, end) in enumerate(spans):
        for chunk_id in range(start, end):
            tokens = np.array([1 + chunk_id % 997, 2, 3, 4], np.int32)
            chunks.append(Chunk(chunk_id, doc_id, chunk_id - start, tokens, np.full(M, PAD, np.int32)))
    return chunks


def _index_files(directory, vectors, ids, shards: int) -> list[str]:
    """The index at nprobe 1 (the depth a plain tuning picks here), in `shards` files by
    chunk-id range, each from the same trained index."""
    trained = train_index(FACTORY, vectors[in_sample(ids, training_size(len(ids), FACTORY), len(ids), TRAIN_SALT)])
    paths = []
    for number, part in enumerate(np.array_split(ids, shards)):
        shard = faiss.clone_index(trained)
        shard.add_with_ids(vectors[part], part)
        set_search_depth(shard, 1)
        paths.append(str(directory / f"shard-{number:05d}.faiss"))
        faiss.write_index(shard, paths[-1])
    return paths


def _retrieve(tmp_path, corpus, policy: str, shards: int, check_depth, check_recall):
    vectors, spans, ids = corpus
    chunks = _chunks(spans)
    (tmp_path / "index" / "chunks").mkdir(parents=True, exist_ok=True)
    entries = []
    for number, begin in enumerate(range(0, len(chunks), 800)):
        path = f"chunks/chunks-{number:05d}.parquet"
        (tmp_path / "index" / path).write_bytes(parquet_bytes(chunks_table(chunks[begin : begin + 800], M)))
        entries.append(FileEntry(path=path, rows=len(chunks[begin : begin + 800]), bytes=0, sha256=""))
    chunk_files = ChunkFileRanges.from_entries(str(tmp_path / "index"), entries)
    _embedding_files(tmp_path / "index" / "embeddings", vectors)
    index_paths = _index_files(tmp_path / "index", vectors, ids, shards)
    spec = Retrieval(
        tuple(index_paths),
        1,
        chunk_files,
        L,
        M,
        K,
        K,
        PAD,
        probes=200,
        embeddings=str(tmp_path / "index" / "embeddings" / "*.parquet"),
        target_recall=TARGET,
        recall_below_target=policy,
    )
    with local_pipeline() as p:
        sequences = p | "Chunks" >> beam.Create(chunks) | PackSequences(L, PAD)
        queries = p | "Queries" >> beam.Create([(int(i), vectors[i]) for i in ids])
        spans_read = p | DocumentSpans(str(tmp_path / "index" / "chunks" / "*.parquet"))
        retrieved = (sequences, queries, spans_read) | RetrieveNeighbours(spec)
        recall = (retrieved.probes, retrieved.truth, retrieved.rows) | MeasureNeighbourRecall(K)
        assert_that(retrieved.search_depth, check_depth, label="CheckDepth")
        assert_that(recall, check_recall, label="CheckRecall")


@pytest.mark.slow
@pytest.mark.parametrize("shards", [1, 4])
def test_build_shards_deepens_until_its_neighbour_recall_meets_the_target(corpus, tmp_path, shards):
    def check_depth(results):
        (depth,) = results
        assert depth["index_depth"] == 1 and depth["depth"] > 1 and not depth["plateau"]
        assert depth["curve"][0]["depth"] == 1 and depth["curve"][0]["recall"] < TARGET
        assert depth["curve"][-1] == {"depth": depth["depth"], "recall": depth["curve"][-1]["recall"]}
        assert depth["curve"][-1]["recall"] >= TARGET

    def check_recall(results):
        (recall,) = results
        assert recall["sample_size"] == 200 and recall["value"] >= TARGET

    _retrieve(tmp_path, corpus, "deepen", shards, check_depth, check_recall)


@pytest.mark.slow
def test_recall_below_target_warn_keeps_the_index_depth_and_fail_names_the_depth_that_meets_it(corpus, tmp_path):
    def kept(results):
        (depth,) = results
        assert depth["depth"] == 1 and len(depth["curve"]) == 1 and depth["curve"][0]["recall"] < TARGET

    def below(results):
        (recall,) = results
        assert recall["value"] < 0.8  # what the shards held before the depth was tuned on them

    _retrieve(tmp_path / "warn", corpus, "warn", 1, kept, below)
    with pytest.raises(Exception, match=r"at the index's search depth 1 is below index.target_recall 0.95.*depth \d+"):
        _retrieve(tmp_path / "fail", corpus, "fail", 1, kept, below)
    assert issubclass(NeighbourRecallTooLow, RuntimeError)


def test_a_probe_sample_without_embedding_files_is_refused():
    with pytest.raises(ValueError, match="probes needs Retrieval.embeddings"):
        RetrieveNeighbours(Retrieval(("index.faiss",), 1, None, L, M, K, K, PAD, probes=10))
