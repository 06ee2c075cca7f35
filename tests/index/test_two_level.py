"""Two-level k-means's steps over files: the centroids cut into blocks of lists, the Lloyd
sums combined and the centroids moved per block, as the one-element path would."""

import numpy as np
import pytest

from pipeline.index.factory import IndexBuildError
from pipeline.index.kmeans import list_assigner, list_sums, moved_centroids
from pipeline.index.two_level import (
    LIST_BLOCK,
    CentroidBlocks,
    add_block_sums,
    cut_into_blocks,
    file_block_sums,
    move_block,
    read_block_sums,
    write_block,
    write_block_sums,
)


def unit(rng, n, d=8):
    x = rng.normal(size=(n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def written(tmp_path, centroids, step=0) -> CentroidBlocks:
    blocks = CentroidBlocks.of_step(str(tmp_path), step, len(centroids))
    pieces: dict[int, list] = {}
    for block, piece in cut_into_blocks(0, centroids):
        pieces.setdefault(block, []).append(piece)
    for block, these in pieces.items():
        write_block(blocks, block, these)
    return blocks


@pytest.mark.unit
def test_clusters_pieces_make_every_block_once(tmp_path):
    rng = np.random.default_rng(0)
    lists = [3000, 2000, 0, 5000]  # clusters' shares: the second straddles a block boundary
    centroids = unit(rng, sum(lists))
    blocks = CentroidBlocks.of_step(str(tmp_path), 0, len(centroids))
    pieces: dict[int, list] = {}
    for start, count in zip(np.cumsum([0, *lists[:-1]]), lists):
        for block, piece in cut_into_blocks(int(start), centroids[start : start + count]):
            pieces.setdefault(block, []).append(piece)
    assert sorted(pieces) == [0, 1, 2] and blocks.block_count == 3
    for block in (2, 0, 1):
        write_block(blocks, block, reversed(pieces[block]))
    assert np.array_equal(blocks.read_all(), centroids)
    with pytest.raises(IndexBuildError, match="centroid block 1"):
        write_block(blocks, 1, pieces[1][1:])  # a cluster's piece missing


@pytest.mark.unit
def test_sums_combined_and_centroids_moved_per_block_are_bit_equal_to_the_one_element_path(tmp_path):
    rng = np.random.default_rng(1)
    first, centroids = unit(rng, 64), unit(rng, 2 * LIST_BLOCK + 1000)  # three blocks, the last short
    vectors = unit(rng, 30_000)
    assigner = list_assigner(first, centroids)
    touched, sums, _ = list_sums(assigner, vectors)
    expected = moved_centroids(centroids, touched, sums)

    by_block: dict[int, list] = {}
    for file in np.array_split(vectors, 7):  # seven sample files
        for block, part in file_block_sums(assigner, file):
            by_block.setdefault(block, []).append(part)
    current, target = written(tmp_path, centroids, 0), CentroidBlocks.of_step(str(tmp_path), 1, len(centroids))
    for block, parts in by_block.items():
        halves = [add_block_sums(parts[::-2]), None, add_block_sums(parts[-2::-2])]  # any grouping, any order
        move_block(current, target, block, add_block_sums(halves))
    assert sorted(by_block) == [0, 1, 2]
    assert np.array_equal(target.read_all(), expected)


@pytest.mark.unit
def test_sums_of_two_blocks_are_never_folded_together():
    rng = np.random.default_rng(2)
    assigner = list_assigner(unit(rng, 8), unit(rng, 2 * LIST_BLOCK))
    (_, first), (_, second) = file_block_sums(assigner, unit(rng, 20_000))
    with pytest.raises(IndexBuildError, match="block 1"):
        add_block_sums([first, second])


@pytest.mark.unit
def test_block_sums_written_one_after_another_are_read_back_each_by_its_range(tmp_path):
    rng = np.random.default_rng(3)
    assigner = list_assigner(unit(rng, 8), unit(rng, 2 * LIST_BLOCK + 100))
    parts = file_block_sums(assigner, unit(rng, 20_000))
    refs = write_block_sums(parts, str(tmp_path / "sums.bin"))
    assert [block for block, _ in refs] == [block for block, _ in parts] == [0, 1, 2]
    for (_, ref), (_, part) in zip(reversed(refs), reversed(parts)):  # any order
        back = read_block_sums(ref)
        assert all(np.array_equal(getattr(back, f), getattr(part, f)) for f in ("lists", "sums", "counts"))
    (tmp_path / "sums.bin").write_bytes((tmp_path / "sums.bin").read_bytes()[:-8])
    with pytest.raises(IndexBuildError, match="expected"):
        read_block_sums(refs[-1][1])
