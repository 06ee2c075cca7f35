"""What an index gained and lost since a generation (`CommittedIndex.change_since`): the
chunk ids of the generations after it and the deleted-document files they wrote."""

import pytest

from pipeline.retrieve.committed import CommittedIndex, GenerationSpan

pytestmark = pytest.mark.unit


def index_of(generations, deleted_paths=()):
    return CommittedIndex(
        directory="out/index",
        manifest_sha256="0" * 64,
        num_chunks=sum(g.num_chunks for g in generations),
        nprobe=None,
        faiss_paths=["faiss/index.faiss"],
        routing_paths=None,
        nlist=None,
        deleted_paths=tuple(deleted_paths),
        generations=tuple(generations),
    )


# each change records the sha256 of the manifest it changed: A (the build), then B, then C
A, B, C = "a" * 64, "b" * 64, "c" * 64
GENERATIONS = [
    GenerationSpan(0, 0, 1_000, 0, None),
    GenerationSpan(1, 1_000, 200, 3, A),  # an append that replaced 3 documents
    GenerationSpan(2, 1_200, 0, 5, B),  # a delete
    GenerationSpan(3, 1_200, 50, 0, C),
]
DELETED = ["deleted/deleted-00001.parquet", "deleted/deleted-00002.parquet.c4"]  # .c4: renumbered by commit 4


def test_the_change_since_a_generation_holds_only_the_later_ones():
    index = index_of(GENERATIONS, DELETED)
    change = index.change_since(1, B)
    assert change is not None
    assert (change.since, change.newest, index.generation) == (1, 3, 3)
    assert change.new_chunks == ((1_200, 1_250),)
    assert change.deleted_paths == ("deleted/deleted-00002.parquet.c4",)
    assert change.deleted_documents == 5
    assert str(change) == "generations 2-3: 50 chunks added, 5 documents deleted"

    since_build = index.change_since(0, A)
    assert since_build is not None and since_build.new_chunks == ((1_000, 1_200), (1_200, 1_250))
    assert since_build.deleted_paths == tuple(DELETED) and since_build.deleted_documents == 8
    assert str(index.change_since(2, C)) == "generation 3: 50 chunks added, 0 documents deleted"


def test_no_change_where_the_history_does_not_go_through_the_shards_manifest_or_nothing_came_after():
    index = index_of(GENERATIONS, DELETED)
    assert index.change_since(3, "d" * 64) is None  # the newest: nothing after it
    assert index.change_since(1, A) is None  # generation 2 changed another manifest: a rebuild between
    assert index.change_since(7, A) is None  # not a generation of this index
    assert index.change_since(None, A) is None  # shards that name no generation
    assert index_of([]).change_since(0, A) is None  # a manifest from before generations
    unchained = [g if g.number != 1 else GenerationSpan(1, 1_000, 200, 3, None) for g in GENERATIONS]
    assert index_of(unchained, DELETED).change_since(0, A) is None  # a manifest from before the chain
