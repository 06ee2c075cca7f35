"""The inference-time retriever finds the neighbours build-shards wrote: the training sequences of
the built sample output, their own documents excluded, searched again from their token ids
(embedded afresh, so scores may differ in their last bits: ties within 1e-6 count equal); and it
refuses, in one line, an index whose encoder is gone. (tests/e2e/test_sliced_index_retrieval.py
has it over an index in slices.)"""

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline.retrieve.online import IndexNotUsable, Retriever
from pipeline.retrieve.sequences import document_spans
from tests.helpers import shard_rows

pytestmark = pytest.mark.e2e

TIE = 1e-6


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
    equal = slots = same_tokens = same_ids = 0
    for tokens, doc_ids, neighbours, ids, scores in shard_rows(out / "shards"):
        found = retriever.retrieve(tokens[:n], exclude_documents=doc_ids)
        assert found.tokens.shape == neighbours.shape and found.ids.shape == ids.shape
        equal += int(((found.ids == ids) | (np.abs(found.scores - scores) <= TIE)).sum())
        slots += ids.size
        same = found.ids == ids
        same_tokens += int((found.tokens[same] == neighbours[same]).all(axis=-1).sum())
        same_ids += int(same.sum())
        own = np.concatenate([np.arange(a, b) for a, b in retriever.document_ranges(doc_ids)])
        assert not np.isin(found.ids, own).any()  # never a chunk of the sequence's own documents
    assert slots == shards["num_sequences"] * (n // config["chunk_tokens"]) * config["neighbours"] > 0
    assert equal / slots >= 0.999
    assert same_tokens == same_ids  # the same chunk brings the same chunk + continuation tokens


def test_retriever_excludes_each_document_by_the_span_build_shards_excludes(built_output):
    _, config, _ = built_output
    index = Path(config["output"]) / "index"
    chunks = pq.read_table(sorted((index / "chunks").glob("*.parquet")), columns=["chunk_id", "doc_id"])
    spans = dict(document_spans(chunks["chunk_id"].to_numpy(), chunks["doc_id"].to_numpy()))
    retriever = Retriever.open(str(index))
    assert len(retriever.chunk_files.starts) > 2 and len(spans) > 10  # documents across several chunk files
    assert {doc_id: retriever.document_ranges([doc_id]) for doc_id in spans} == {d: [s] for d, s in spans.items()}
    assert retriever.document_ranges([min(spans) - 1, max(spans) + 1]) == []  # not in the database: nothing


def test_retriever_refuses_an_index_whose_encoder_directory_is_gone(built_output, tmp_path):
    _, config, _ = built_output
    index = tmp_path / "index"
    shutil.copytree(Path(config["output"]) / "index", index)
    manifest = json.loads((index / "manifest.json").read_text())
    missing = tmp_path / "models" / "encoder"
    manifest["embedding_model"]["name"] = str(missing)
    (index / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(IndexNotUsable, match=rf"^{index}: its encoder model directory {missing} is missing$"):
        Retriever.open(str(index))
