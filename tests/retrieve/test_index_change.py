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
        generation=generations[-1].number if generations else None,
        generations=tuple(generations),
    )


GENERATIONS = [
    GenerationSpan(0, 0, 1_000, 0),
    GenerationSpan(1, 1_000, 200, 3),  # an append that replaced 3 documents
    GenerationSpan(2, 1_200, 0, 5),  # a delete
    GenerationSpan(3, 1_200, 50, 0),
]
DELETED = ["deleted/deleted-00001.parquet", "deleted/deleted-00002.parquet.c4"]  # .c4: renumbered by commit 4


def test_the_change_since_a_generation_holds_only_the_later_ones():
    index = index_of(GENERATIONS, DELETED)
    change = index.change_since(1)
    assert change is not None
    assert (change.since, change.newest) == (1, 3)
    assert change.new_chunks == ((1_200, 1_250),)
    assert change.deleted_paths == ("deleted/deleted-00002.parquet.c4",)
    assert change.deleted_documents == 5
    assert str(change) == "generations 2-3: 50 chunks added, 5 documents deleted"

    since_build = index.change_since(0)
    assert since_build is not None and since_build.new_chunks == ((1_000, 1_200), (1_200, 1_250))
    assert since_build.deleted_paths == tuple(DELETED) and since_build.deleted_documents == 8
    assert str(index.change_since(2)) == "generation 3: 50 chunks added, 0 documents deleted"


def test_no_change_where_the_history_does_not_reach_or_nothing_came_after():
    index = index_of(GENERATIONS, DELETED)
    assert index.change_since(3) is None  # the newest: nothing after it
    assert index.change_since(7) is None  # not a generation of this index
    assert index.change_since(None) is None  # shards that name no generation
    assert index_of([]).change_since(0) is None  # a manifest from before generations
