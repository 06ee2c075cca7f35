"""The memory model: what it marks as growing with the corpus is all that grows, and `--dry-run`
prints it for the corpus size given or read from the input's size."""

import json

import pytest

from pipeline.index.factory import choose_index_factory, estimated_bytes
from pipeline.index.slices import PIECE_BYTES
from pipeline.jobs.memory_model import Corpus, stage_memory
from pipeline.jobs.memory_training import two_level_steps
from schemas.backends import EXPORTED_ENCODER
from schemas.config import config_from_dict
from schemas.stage_config import parse_size
from tests.helpers import sample_documents, small_config, write_config, write_jsonl


def model_config(index_type="auto", index=None, **overrides):
    return config_from_dict(
        small_config(
            "/tmp/unused",
            "/tmp/unused/*.jsonl",
            index={"memory_budget": "2TB", "type": index_type, **(index or {})},
            **overrides,
        )
    )


@pytest.mark.parametrize("index_type", ["auto", "IVF65536_HNSW32,PQ32x8np"])
@pytest.mark.unit
def test_only_the_terms_marked_as_growing_change_with_the_corpus(index_type):
    cfg = model_config(index_type)
    small, large = (stage_memory(cfg, Corpus.of(c, c / 30)) for c in (1e8, 3e10))
    for a, b in zip(small, large):
        assert len(a["grows_with_corpus"]) == len(b["grows_with_corpus"])
        fixed, fixed_large = ({k: v for k, v in s["terms"].items() if k not in s["grows_with_corpus"]} for s in (a, b))
        assert fixed == fixed_large, a["stage"]
        assert (a["bytes"] == b["bytes"]) == (not a["grows_with_corpus"]), a["stage"]


@pytest.mark.unit
def test_the_index_terms_are_the_index_builders_own_estimate():
    stages = {s["stage"]: s for s in stage_memory(model_config(), Corpus.of(1e8))}
    factory = choose_index_factory(10**8, 384, parse_size("2TB"))
    assert f"index: assemble trained {factory}" in stages  # two-level clustering at 2^18 lists
    whole = estimated_bytes(factory, 10**8, 384)
    assert stages["index: merge"]["terms"] == {
        "the whole index (100,000,000 vectors)": whole,
        "its lists' spare room as they grow": whole,
    }


@pytest.mark.unit
def test_two_level_training_holds_no_step_with_the_whole_sample():
    corpus = Corpus.of(3e10)
    flat, two_level = (
        [
            s
            for s in stage_memory(model_config(index={"clustering": c}), corpus)
            if s["stage"].startswith("index: ") and not any(w in s["stage"] for w in ("fill", "merge", "change"))
        ]
        for c in ("flat", "auto")
    )
    (whole,) = flat
    assert [s["stage"] for s in two_level] == [
        "index: first-level and encoder subsets of one sample file",
        "index: write one subset file",
        "index: train first level",
        "index: assign one sample file to the first level",
        "index: train one first-level cluster",
        "index: write one block of centroids",
        "index: Lloyd step over one sample file",
        "index: Lloyd step: combine one block's sums",
        "index: Lloyd step: move one block",
        f"index: assemble trained {whole['stage'].split()[-1]}",
    ]
    assert max(s["bytes"] for s in two_level) < whole["bytes"] / 10


@pytest.mark.unit
def test_two_level_rows_scale_as_their_shapes():
    """4x the lists: the centroids 4x, the first level and a first-level cluster 2x (√lists
    clusters of 256; 64 x lists vectors over √lists clusters), a sample file's share 4x, a
    subset file and a block of lists's rows the same, the encoder's sample the same."""
    small, large = (
        [step.terms for step in two_level_steps(f"IVF{lists}_HNSW32,PQ32x8np", 10**9, 384, 65536)]
        for lists in (2**16, 2**18)
    )
    ratios = [[round(b / a, 1) for a, b in zip(s.values(), t.values())] for s, t in zip(small, large)]
    quantizer = estimated_bytes("IVF262144_HNSW32,PQ32x8np", 0, 384) / estimated_bytes(
        "IVF65536_HNSW32,PQ32x8np", 0, 384
    )
    assert ratios == [[4], [1], [2], [4], [2], [1], [4, 4, 4, 1], [1], [1], [4, round(quantizer, 1), 1]]


@pytest.mark.unit
def test_chunk_files_rows_bound_the_steps_that_hold_one_file():
    small, large = (stage_memory(model_config(chunk_file_rows=rows), Corpus.of(1e8)) for rows in (4096, 65536))
    grows = {a["stage"] for a, b in zip(small, large) if b["bytes"] > a["bytes"]}
    assert grows == {
        "write chunks",
        "embed",
        "index: first-level and encoder subsets of one sample file",  # a sample file: its share of one
        "index: assign one sample file to the first level",
        "index: Lloyd step over one sample file",
        "index: fill one embeddings file",
        "build-shards: search",  # over its own chunks: the embeddings file its queries come from
        "build-shards: join one chunk file",
        "build-shards: refresh one chunk file's shards",  # the chunk and embedding files of its shards
    }


@pytest.mark.e2e  # a dry run: the whole job's graph built through the CLI
def test_dry_run_prints_the_estimate_for_a_given_size_and_for_the_input_files(tmp_path, capsys):
    from pipeline.cli import main

    write_jsonl(tmp_path / "corpus" / "a.jsonl", sample_documents(20))
    settings = small_config(tmp_path / "out", str(tmp_path / "corpus" / "*.jsonl"), index={"memory_budget": "8GiB"})
    path = write_config(tmp_path / "c.yaml", settings)
    main(["run", "--config", str(path), "--dry-run", "--corpus-chunks", "1e8"])
    given = json.loads(capsys.readouterr().out)["memory_estimate"]
    assert given["corpus"] == {"chunks": 10**8, "documents": 10**7, "source": "given"}
    assert given["largest"] in {s["stage"] for s in given["per_worker_process"]}
    main(["build-index", "--config", str(path), "--dry-run"])
    listed = json.loads(capsys.readouterr().out)["memory_estimate"]["corpus"]
    text_bytes = (tmp_path / "corpus" / "a.jsonl").stat().st_size
    assert listed["chunks"] == pytest.approx(text_bytes / 4 / config_from_dict(settings).chunk_tokens, rel=0.01)
    assert not (tmp_path / "out").exists()


@pytest.mark.unit
def test_with_index_slices_a_worker_holds_one_slice_whatever_the_corpus():
    small, large = (stage_memory(model_config(index={"slice_bytes": "4GiB"}), Corpus.of(c)) for c in (1e8, 3e10))
    for a, b in zip(small, large):
        if a["stage"] == "index: merge":
            assert not b["grows_with_corpus"] and a["bytes"] == b["bytes"] < 5 * 2**30, a["stage"]
        if a["stage"] == "build-shards: search":  # one slice, and the quantizer of the lists `auto` picks
            slice_term = "one index slice"
            assert [t for t in a["terms"] if t.startswith(slice_term)] and all(
                a["terms"][t] == 4 * 2**30 for t in a["terms"] if t.startswith(slice_term)
            )
            assert b["grows_with_corpus"] == ["the quantizer and list owners, one copy per process"]
        if a["stage"] == "index: change one slice (append, delete)":  # a worker per slice: nothing grows
            # but the piece of new codes it reads, up to PIECE_BYTES where there are the files
            assert not b["grows_with_corpus"], a["stage"]
            assert all(row["terms"]["one piece of its new codes read"] <= PIECE_BYTES for row in (a, b))


@pytest.mark.unit
def test_the_merge_is_given_a_path_per_part_and_only_for_one_index_file():
    def gather(cfg, chunks):
        rows = {s["stage"]: s for s in stage_memory(cfg, Corpus.of(chunks))}
        return rows.get("index: gather the filled parts (one index file)")

    small, large = gather(model_config(), 1e8), gather(model_config(), 4e8)
    # 4x the chunk files, 4x the paths (never their codes or list sizes)
    assert large["bytes"] - small["bytes"] == pytest.approx(3 * (small["bytes"] - 400 * 2**20), rel=0.01)
    assert small["grows_with_corpus"] == [next(iter(small["terms"]))]
    assert gather(model_config(index={"slice_bytes": "4GiB"}), 1e8) is None  # slices are assembled from their lists


@pytest.mark.unit
def test_with_dedupe_the_candidate_step_holds_one_file_and_one_search_batch_whatever_the_corpus():
    """The candidates of one chunk file arrive a search batch at a time: a fixed bound, set by
    chunk_file_rows and neighbour_candidates, not by the corpus or how often a chunk is hit."""
    step = "build-shards: candidate tokens of one chunk file"

    def held(chunks, **overrides):
        stages = stage_memory(model_config(dedupe_neighbours=True, **overrides), Corpus.of(chunks))
        return {s["stage"]: s for s in stages}[step]

    assert step not in {s["stage"] for s in stage_memory(model_config(), Corpus.of(1e8))}
    assert held(1e8) == held(3e10) and not held(3e10)["grows_with_corpus"]
    assert (
        held(1e8)["bytes"]
        < held(1e8, chunk_file_rows=4096)["bytes"]
        < held(1e8, chunk_file_rows=4096, neighbour_candidates=40)["bytes"]
    )


@pytest.mark.unit
def test_an_exported_backend_adds_its_runtime_to_the_embed_step():
    def embed(**embedding):
        config = model_config(embedding={"batch_size": 32, "cpu_threads": 1, **embedding})
        return next(s for s in stage_memory(config, Corpus.of(1e8)) if s["stage"] == "embed")

    torch, openvino = embed(), embed(backend="openvino")
    assert openvino["terms"] == {**torch["terms"], "openvino runtime": EXPORTED_ENCODER}
    assert openvino["bytes"] == torch["bytes"] + EXPORTED_ENCODER


@pytest.mark.unit
def test_a_refresh_holds_new_vectors_up_to_a_slice_where_the_index_is_in_slices():
    """A 10% append at 3·10^10 chunks is refreshed only if its new vectors fit in a search
    worker (its min_ram, else a slice); else the shards are built whole. The whole index's budget
    (2 TB here) is a process's only for an index in one file."""
    refresh = "build-shards: refresh one chunk file's shards"
    for index, cap in (
        ({"slice_bytes": "16GiB"}, parse_size("16GiB")),
        ({"slice_bytes": "16GiB", "min_ram": "64GB"}, parse_size("64GB")),  # the workers' memory, said
        ({}, parse_size("2TB")),
    ):
        cfg = model_config("IVF1048576_HNSW32,PQ32x8np", index)
        (step,) = [s for s in stage_memory(cfg, Corpus.of(3e10)) if s["stage"] == refresh]
        new_vectors = next(v for k, v in step["terms"].items() if k.startswith("the new vectors"))
        assert new_vectors == cap, index
