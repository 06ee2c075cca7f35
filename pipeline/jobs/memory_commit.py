"""The memory model's rows (§6) for the steps that hand a stage's file entries to its commit and
commit them."""

from __future__ import annotations

import math

from pipeline.jobs.entry_pieces import PIECE_NUMBERS, PIECE_READ
from schemas.config import PipelineConfig
from schemas.file_table import TABLE_ROW_GROUP

FILE_ENTRY = 1_100  # a manifest file entry parsed (1,088 B measured, docs/scale.md)
#: A name and sha256 an earlier commit lists, looked up by a commit (Python str and dict slot):
#: 14.2 MB for 65,536 of them, measured (tests/jobs/test_commit.py's row-group test).
LISTED_NAME = 217
ARROW_ENTRY = 130  # a file table row read as Arrow: its path, sha256 and counts (an estimate)


def commit_steps(cfg: PipelineConfig, chunks: float, append_share: float) -> list[tuple]:
    """The steps that hand a stage's file entries to its commit and commit them
    (`jobs/entry_pieces.py`, `jobs/commit.py`): workers write the entries as pieces of at most
    PIECE_NUMBERS files, the worker writing one holding its group; the commit (one worker) reads
    every piece at once, PIECE_READ entries of each at a time, merged in path order, and looks
    what earlier commits list up a row group at a time (`commits.ListedFiles`). An append's
    commit also reads the entries it keeps of the previous commit, a row group of its file
    table at a time (`KeptEntries`). Chunk and embedding files (the sources and faiss files are
    fewer) and shards, `training_corpus: same`."""
    files = 2 * math.ceil(chunks / cfg.chunk_file_rows)
    shards = math.ceil(chunks / cfg.chunks_per_sequence / cfg.rows_per_shard())
    appended = math.ceil(append_share * files)
    listed = {f"a row group ({TABLE_ROW_GROUP:,}) of the names earlier commits list": TABLE_ROW_GROUP * LISTED_NAME}

    def merged(entries: int, what: str) -> dict[str, float]:
        pieces = 2 * math.ceil(entries / 2 / PIECE_NUMBERS)  # two folders
        held = pieces * PIECE_READ * FILE_ENTRY
        return {f"{pieces:,} pieces of {what}, {PIECE_READ:,} entries of each at a time": held}

    kept = {
        f"a row group ({TABLE_ROW_GROUP:,}) of the entries kept, as Arrow, {PIECE_READ:,} as objects": (
            TABLE_ROW_GROUP * ARROW_ENTRY + PIECE_READ * FILE_ENTRY
        )
    }
    return [
        (
            "a stage's file entries: write one piece",
            {f"one piece's {PIECE_NUMBERS:,} file entries as objects": PIECE_NUMBERS * FILE_ENTRY},
            [],
        ),
        ("build-index: commit", {**merged(files, "chunk and embedding files"), **listed}, [0]),
        (
            f"index: change: commit (an append of {append_share:.0%})",
            {**merged(appended, "new files"), **kept, **listed},
            [0],
        ),
        ("build-shards: commit", {**merged(shards, "shards"), **listed}, [0]),
    ]
