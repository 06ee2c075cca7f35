"""The memory model's rows for an index built in slices (`pipeline/jobs/memory_model.py`):
sharing the lists out, each piece of a slice, each slice merged from its pieces, and the
slices' search results merged to tune the depth (`pipeline.index.build_slices`).
"""

from __future__ import annotations

import math

from pipeline.index.factory import estimated_bytes, ivf_lists
from pipeline.index.recall import RECALL_K
from pipeline.index.slices import files_per_piece


def piece_bytes(vectors: int, *, files: int, slices: int, per_vector: int) -> float:
    """A piece's codes and ids: `files_per_piece` files' blocks of one slice, a file holding
    about as many vectors of a slice as each other."""
    return files_per_piece(vectors, files, slices, per_vector) * block_bytes(
        vectors, files=files, slices=slices, per_vector=per_vector
    )


def block_bytes(vectors: int, *, files: int, slices: int, per_vector: int) -> float:
    """One file's codes and ids of one slice (a `ListBlock`)."""
    return vectors / max(files, 1) / slices * per_vector


def piece_step(step: str, *, trained: float, piece: float, block: float, auto_grows: list[int]) -> tuple:
    """Assembling a piece (`AssemblePiece`: the build's, and an append's of its new vectors). Its
    group is the blocks' places (`BlockRef`), a few bytes a file; the blocks are read one at a
    time. (Before, the group was the blocks' codes: the local runner delivers a worker's whole
    share of a stage at once, and the step held up to 57 MB against this row's 24 at 10^6
    vectors, docs/scale.md.)"""
    return (
        step,
        {
            "trained index": trained,
            "the piece's lists as they grow (codes, ids and spare room)": 2 * piece,
            "one block read and decoded": 2 * block,
        },
        auto_grows,
    )


def slice_steps(
    factory: str,
    *,
    chunks: int,
    dim: int,
    slices: int,
    file_rows: int,
    neighbours: int,
    recall_sample: int,
    auto_grows: list[int],
) -> list[tuple]:
    """(step, terms, growing) for the steps of an index in `slices` slices of equal vectors."""
    per_vector = estimated_bytes(factory, 1, dim) - estimated_bytes(factory, 0, dim)
    trained = estimated_bytes(factory, 0, dim)
    slice_codes = math.ceil(chunks / slices) * per_vector  # a slice's codes and ids
    files = math.ceil(chunks / file_rows)
    piece = piece_bytes(chunks, files=files, slices=slices, per_vector=per_vector)
    block = block_bytes(chunks, files=files, slices=slices, per_vector=per_vector)
    nlist = ivf_lists(factory) or 0
    queries, depths = min(recall_sample, chunks), int(math.log2(nlist or 1)) + 2
    return [
        piece_step(
            "index: assemble one piece of a slice", trained=trained, piece=piece, block=block, auto_grows=auto_grows
        ),
        (
            # merged from its pieces one at a time (measured: benchmarks/scale_rehearsal.py)
            "index: assemble one slice from its pieces",
            {
                f"one index slice (of {slices:,}): the trained index and its codes": trained + slice_codes,
                "its lists' spare room as they grow": slice_codes,
                "one piece read": piece,
            },
            [],
        ),
        (
            # merged pair by pair as they come (`AssembledSlices.merged`): two and the merge
            "index: merge the slices' search results",
            {
                f"{depths} depths' hits of {queries:,} queries, three copies": 3
                * depths
                * queries
                * (RECALL_K + 1 + neighbours)
                * 12
            },
            [],
        ),
        # sharing the lists out among slices: one process holds every centroid and list size
        ("index: plan slices", {f"{nlist:,} centroids, list sizes and owners": nlist * (dim * 4 + 20)}, auto_grows[:1]),
    ]
