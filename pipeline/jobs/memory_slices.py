"""The memory model's rows for an index built in slices (`pipeline/jobs/memory_model.py`):
sharing the lists out, each piece of a slice, each slice merged from its pieces, and the
slices' search results merged to tune the depth (`pipeline.index.build_slices`).
"""

from __future__ import annotations

import math

from pipeline.index.factory import estimated_bytes, ivf_lists
from pipeline.index.recall import RECALL_K
from pipeline.index.slices import files_per_piece

# A group after a GroupByKey is one element, received and decoded whole (two groups' worth);
# while a step works on one, Beam's data plane holds the next and gRPC has received more. A bundle
# of 2-8 groups of 16 MB rose 8.5-11.6 groups' worth (2 Intel Xeon cores, Python objects 4-5 of
# them; benchmarks/group_read_ahead.py): this many beyond the two
READ_AHEAD_GROUPS = 9


def piece_bytes(vectors: int, *, files: int, slices: int, per_vector: int) -> float:
    """A piece's codes and ids: `files_per_piece` files' blocks of one slice, a file holding
    about as many vectors of a slice as each other."""
    block = vectors / max(files, 1) / slices * per_vector  # a file's codes of one slice
    return files_per_piece(vectors, files, slices, per_vector) * block


def piece_step(step: str, *, trained: float, piece: float, auto_grows: list[int]) -> tuple:
    """Assembling a piece (`AssemblePiece`: the build's, and an append's of its new vectors)."""
    return (
        step,
        {
            "trained index": trained,
            "the piece's blocks as received and decoded (one group), and its lists": 3 * piece,
            f"the next pieces' groups, read ahead by Beam ({READ_AHEAD_GROUPS} groups' worth)": READ_AHEAD_GROUPS
            * piece,
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
    piece = piece_bytes(chunks, files=math.ceil(chunks / file_rows), slices=slices, per_vector=per_vector)
    nlist = ivf_lists(factory) or 0
    queries, depths = min(recall_sample, chunks), int(math.log2(nlist or 1)) + 2
    return [
        piece_step("index: assemble one piece of a slice", trained=trained, piece=piece, auto_grows=auto_grows),
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
