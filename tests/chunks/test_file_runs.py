"""`FileRuns`: a manifest's numbered files as runs, looked up as the explicit list of every
file's path and first row would be, whatever order and batches the entries come in."""

import numpy as np
import pytest

from pipeline.chunks.file_runs import FileRuns, FileRunsBuilder
from pipeline.common.names import file_name, file_number

pytestmark = pytest.mark.unit


def _layout(rng):
    """(paths, rows) of files as generations write them (full files, a shorter last), with
    versioned names, gaps in the numbers, a sixth digit and names outside the pattern."""
    paths, rows, number = [], [], 0
    for _ in range(rng.integers(1, 5)):
        full, files = int(rng.integers(1, 9)), int(rng.integers(1, 40))
        number += int(rng.integers(0, 3))  # a gap
        version = rng.choice(["", ".c000003", ".c000012"])
        for i in range(files):
            paths.append(f"chunks/{file_name('chunks', number, 'parquet')}".replace(".parquet", f"{version}.parquet"))
            rows.append(full if i < files - 1 else int(rng.integers(0, full + 1)))
            number += 1
    if rng.random() < 0.3:
        number += 99_990
        paths.append(f"chunks/{file_name('chunks', number, 'parquet')}")  # past 99,999
        rows.append(3)
    if rng.random() < 0.3:
        paths += ["chunks/hand-given.parquet", f"chunks/chunks-{number + 1}.parquet"]  # unnumbered; unpadded
        rows += [2, 5]
    return paths, rows


@pytest.mark.parametrize("seed", range(40))
def test_runs_look_files_up_as_the_explicit_list_would(seed):
    rng = np.random.default_rng(seed)
    paths, rows = _layout(rng)
    order = sorted(range(len(paths)), key=lambda i: file_number(paths[i]))  # stable: as readers order them
    want_paths = [paths[i] for i in order]
    want_starts = np.cumsum([0] + [rows[i] for i in order])

    shuffled = rng.permutation(len(paths))
    builder = FileRunsBuilder()
    for batch in np.array_split(shuffled, int(rng.integers(1, 5))):  # a file table's row groups
        builder.add([paths[i] for i in batch], [rows[i] for i in batch])
    runs = builder.build()

    if not any("hand-given" in p for p in paths):  # unnumbered files keep the order they came in
        assert list(runs.paths()) == want_paths
    assert runs.num_files == len(paths) and runs.num_rows == want_starts[-1]
    assert [runs.start(f) for f in range(len(paths) + 1)] == want_starts.tolist()
    numbered = [f for f in range(len(paths)) if file_number(want_paths[f]) >= 0]
    assert [runs.number(f) for f in numbered] == [file_number(want_paths[f]) for f in numbered]
    ids = np.arange(want_starts[-1])
    assert runs.positions_of(ids).tolist() == (np.searchsorted(want_starts, ids, side="right") - 1).tolist()
    assert len(runs) <= 2 * 4 + 3  # two a generation, plus the odd names
    assert [runs.position_of(runs.path(f)) for f in range(len(paths))] == list(range(len(paths)))
    for absent in ("chunks/other.parquet", paths[0].replace("chunks-", "embeddings-"), "chunks/chunks-99999.x"):
        with pytest.raises(ValueError, match="not one of these files"):
            runs.position_of(absent)


def test_a_generation_of_100000_files_is_two_runs():
    paths = [f"embeddings/{file_name('embeddings', n, 'parquet')}" for n in range(100_010)]
    runs = FileRuns.of(paths[::-1], [17] + [65_536] * 100_009)  # in any order
    assert len(runs) == 2 and runs.path(100_000) == "embeddings/embeddings-100000.parquet"
    assert runs.start(100_009) == 100_009 * 65_536 and runs.num_rows == 100_009 * 65_536 + 17


def test_a_number_past_an_int64_is_a_name_of_its_own():
    runs = FileRuns.of(["chunks/chunks-00000.parquet", f"chunks/chunks-{'9' * 25}.parquet"], [2, 3])
    assert runs.num_rows == 5 and sorted(runs.paths()) == [
        "chunks/chunks-00000.parquet",
        f"chunks/chunks-{'9' * 25}.parquet",
    ]


def test_a_number_listed_twice_is_an_error():
    with pytest.raises(ValueError, match="file number 1 is listed twice"):
        names = ["chunks-00001.parquet", "chunks-00000.parquet", "chunks-00001.c000002.parquet"]
        FileRuns.of([f"chunks/{name}" for name in names], [1, 1, 1])
    with pytest.raises(IndexError):
        FileRuns.of(["chunks/chunks-00000.parquet"], [4]).path(1)


def test_a_file_without_a_path_or_rows_is_an_error():
    for paths, rows in ((["chunks/chunks-00000.parquet", None], [1, 2]), (["chunks/chunks-00000.parquet"], [None])):
        with pytest.raises(ValueError, match="a file without a path or a row count"):
            FileRunsBuilder().add(paths, rows)
