"""The search depth tuned on the search that is made: own documents excluded. On long documents a
chunk's nearest IVF lists are its own document's, so the depth that finds its nearest other
vector (what the index's plain recall measures) misses its nearest chunks of other documents
(what build-shards keeps). `benchmarks.synthetic.long_documents` has that shape: IVF64 over 32
documents of 100 chunks reaches 1-recall@10 0.99 at nprobe 1, where recall@2 outside the own
document is 0.62 and needs nprobe 16. Here the index's side (the depth `build-index` tunes);
build-shards' own tuning is in tests/retrieve/test_retrieval_depth.py."""

import apache_beam as beam
import numpy as np
import pytest
from apache_beam.testing.util import assert_that

from benchmarks.synthetic import long_documents
from pipeline.common.sampling import QUERY_SALT, in_sample
from pipeline.index.build import BuildIndex
from pipeline.index.exact import exact_nearest_other, exact_nearest_outside
from pipeline.index.files import searched_files
from pipeline.index.recall import one_recall_at_k, recall_of
from pipeline.index.search import search_depth_range, search_each_excluding, set_search_depth
from pipeline.index.train import build_index
from pipeline.index.tuning import tune_index_depth
from schemas.measures import DepthRecall
from schemas.stage_config import IndexConfig
from tests.helpers import local_pipeline, write_embedding_files

DOCUMENTS, CHUNKS_PER_DOCUMENT, FACTORY = 32, 100, "IVF64,Flat"
K = 2  # the neighbours build-shards keeps
TARGET = 0.95


@pytest.fixture(scope="module")
def corpus():
    vectors, spans = long_documents(DOCUMENTS, CHUNKS_PER_DOCUMENT)
    return vectors, spans, np.arange(len(vectors), dtype=np.int64)


def _document_of(spans, chunk_ids):
    return np.searchsorted([end for _, end in spans], chunk_ids, side="right")


@pytest.mark.unit
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
        return recall_of(outside, search_each_excluding(index, vectors[queries], K, documents).ids)

    cfg = IndexConfig(target_recall=TARGET)
    depths = search_depth_range(index)
    (plain_depth, plain_recall, _), _, none = tune_index_depth(depths, plain_at, None, cfg, K)
    assert none is None and plain_recall >= TARGET
    assert own_at(plain_depth) < 0.8  # the depth tuned the old way: neighbours well below target

    (depth, recall, plateau), curve, own = tune_index_depth(depths, plain_at, own_at, cfg, K)
    assert depth > plain_depth and own.depth == depth and own.value >= TARGET and not plateau
    assert own.curve[0].recall < TARGET and [p.depth for p in own.curve] == depths[: len(own.curve)]
    assert recall >= TARGET and curve[-1] == DepthRecall(depth=depth, recall=recall)  # plain, at the depth kept


@pytest.mark.parametrize("slice_bytes", [None, 130_000], ids=["one file", "slices"])
@pytest.mark.beam
def test_build_index_tunes_its_depth_with_each_query_document_excluded(corpus, tmp_path, slice_bytes):
    vectors, spans, ids = corpus
    paths = write_embedding_files(tmp_path / "embeddings", ids, vectors, files=len(ids) // 800)
    documents = [(int(i), int(d)) for i, d in zip(ids, _document_of(spans, ids))]
    cfg = IndexConfig(type=FACTORY, target_recall=TARGET, slice_bytes=slice_bytes)

    def check(infos):
        (info,) = infos
        recall = info.recall_at_k
        own = recall.own_document_excluded
        searched = searched_files([f.path for f in info.files])
        assert len(searched) == 1 if slice_bytes is None else len(searched) >= 4
        assert own.k == K and own.value >= TARGET and info.nprobe == own.depth >= 16
        assert recall.curve[0].depth == 1 and recall.curve[0].recall >= TARGET  # plain: nprobe 1 would do
        assert own.curve[0].recall < TARGET

    with local_pipeline() as p:
        chunk_docs = p | "Documents" >> beam.Create(documents)
        info = p | beam.Create(paths) | BuildIndex(cfg, str(tmp_path / "faiss"), chunk_docs, K)
        assert_that(info, check)
    assert list((tmp_path / "faiss" / "parts").glob("*")), (
        "the filled parts stay for a retry (the commit discards them)"
    )
