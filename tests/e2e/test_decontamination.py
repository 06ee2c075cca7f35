"""Decontamination end to end: evaluation documents planted in the retrieval and the training
corpora (copies, 1%-changed copies) are removed from both, recorded in `rejected/` with their
Jaccard, counted in the manifests, found in no chunk file and no training sequence, and
`validate` fails when a removed document's chunks are there after all."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from benchmarks.synthetic import words_replaced
from pipeline.check.problems import ValidationFailed
from pipeline.check.validate import validate_path
from pipeline.common.rejected import NEAR_DUPLICATE
from pipeline.corpus.records import doc_id_for
from pipeline.decontaminate.minhash import jaccard, shingles
from pipeline.run import run_all
from schemas.config import config_from_dict
from tests.helpers import sample_documents, small_config, write_jsonl

pytestmark = pytest.mark.e2e


def test_near_duplicates_of_evaluation_documents_are_in_no_chunk_file_and_no_sequence(tmp_path):
    retrieval = sample_documents(16)
    training = sample_documents(10, start=20)
    evaluation = [
        {"id": "eval-copy", "text": retrieval[2]["text"]},
        {"id": "eval-changed", "text": words_replaced(retrieval[5]["text"], 0.01, 5)},
        {"id": "eval-half", "text": " ".join(retrieval[7]["text"].split()[: len(retrieval[7]["text"].split()) // 2])},
        {"id": "eval-training", "text": training[3]["text"]},
        {"id": "eval-unrelated", "text": sample_documents(1, start=60)[0]["text"]},
    ]
    write_jsonl(tmp_path / "retrieval" / "r.jsonl", retrieval)
    write_jsonl(tmp_path / "training" / "t.jsonl", training)
    write_jsonl(tmp_path / "eval" / "e.jsonl", evaluation)
    config = small_config(
        tmp_path / "out",
        str(tmp_path / "retrieval" / "*.jsonl"),
        training_corpus={"paths": [str(tmp_path / "training" / "*.jsonl")], "id_field": "id"},
        evaluation_corpus={"paths": [str(tmp_path / "eval" / "*.jsonl")], "id_field": "id"},
    )
    cfg = config_from_dict(config)
    sets = [shingles(e["text"], 13) for e in evaluation]

    def near(docs):
        return {doc_id_for(d["id"]) for d in docs if max(jaccard(shingles(d["text"], 13), s) for s in sets) >= 0.8}

    removed_retrieval, removed_training = near(retrieval), near(training)
    assert {doc_id_for(retrieval[i]["id"]) for i in (2, 5)} == removed_retrieval  # not the half
    assert removed_training == {doc_id_for(training[3]["id"])}

    report = run_all(cfg, [])
    (built, index), (_, shards) = report["build-index"], report["build-shards"]
    counter = f"rejected_{NEAR_DUPLICATE}"
    assert built == "built" and index[counter] == 2 and shards[counter] == 1
    assert index["evaluation_documents"] == shards["evaluation_documents"] == len(evaluation)
    records = [json.loads(line) for p in sorted((tmp_path / "out" / "rejected").glob("*.jsonl")) for line in p.open()]
    near_records = [r for r in records if r["reason"] == NEAR_DUPLICATE]
    assert {r["doc_id"] for r in near_records} == removed_retrieval | removed_training
    assert all(r["jaccard"] >= 0.8 and r["evaluation_id"].startswith("eval-") for r in near_records)

    chunk_docs = np.concatenate(
        [
            pq.read_table(p, columns=["doc_id"])["doc_id"].to_numpy()
            for p in (tmp_path / "out" / "index" / "chunks").glob("*.parquet")
        ]
    )
    assert not set(chunk_docs.tolist()) & removed_retrieval  # so never a neighbour either
    assert doc_id_for(retrieval[7]["id"]) in set(chunk_docs.tolist())  # the half-copied one stays
    sequence_docs = {
        d
        for p in (tmp_path / "out" / "shards").glob("*.arrow")
        for docs in pa.ipc.open_file(p).read_all()["doc_ids"].to_pylist()
        for d in docs
    }
    assert sequence_docs and not sequence_docs & removed_training
    assert all(line.startswith("OK") for line in validate_path(str(tmp_path / "out")))

    # a rejected record naming a document that is in the chunk files: validate must say so
    path = next(
        p
        for p in sorted((tmp_path / "out" / "rejected").glob("build-index-*.jsonl"))
        if NEAR_DUPLICATE in p.read_text()
    )
    lines = path.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if NEAR_DUPLICATE in line)
    record = json.loads(lines[at])
    record["doc_id"] = int(chunk_docs[0])
    lines[at] = json.dumps(record)
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValidationFailed, match="removed as a near-duplicate of an evaluation document"):
        validate_path(str(tmp_path / "out"))
