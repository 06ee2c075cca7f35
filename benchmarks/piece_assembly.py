"""A slice's pieces assembled outside Beam, at the scale rehearsal's index shapes: what the step
itself holds (`AssemblePiece`: the trained index emptied, a piece's blocks added, written as a
part), apart from what a runner holds to hand it its groups.

    .venv/bin/python benchmarks/piece_assembly.py [--vectors 250000] [--files 251] [--json FILE]

At N and 4N vectors (and files), 384-d, `IVF4096,PQ32x8np` (inner product, as the index stage
builds it) and 16 MB slices as `benchmarks/scale_rehearsal.py --parts index` builds them: each
file's vectors encoded once and cut into blocks by slice; then, in a fresh process per size,
one worker's share of the pieces (every other one) assembled in turn, as one bundle would. Per
piece: the rise of the process's peak resident memory over the assembly alone (VmHWM reset
first, free heap trimmed) and of its Python objects (tracemalloc); and the resident memory
above where the share began, after each piece, which would grow if a piece left something.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import subprocess
import sys
import tempfile
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.synthetic import LowRankClusters  # noqa: E402
from pipeline.embed.encoder import cpu_summary  # noqa: E402
from pipeline.index.factory import estimated_bytes  # noqa: E402
from pipeline.index.routing import slice_count  # noqa: E402
from pipeline.index.slices import files_per_piece, vectors_per_slice  # noqa: E402

FACTORY, DIM, SLICE_BYTES, NLIST = "IVF4096,PQ32x8np", 384, 16 << 20, 4096
MB = 2**20


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def _trim() -> None:
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def _trained(path: Path) -> None:
    import faiss

    from pipeline.index.files import write_index

    index = faiss.index_factory(DIM, FACTORY, faiss.METRIC_INNER_PRODUCT)
    index.train(LowRankClusters(DIM).sample(NLIST * 40, np.random.default_rng(0)))
    write_index(index, str(path))


def assemble(trained: str, vectors: int, files: int) -> dict:
    """One worker's share of the pieces at this size, in this process."""
    import faiss

    from pipeline.index.files import EmptiedTrained
    from pipeline.index.routing import list_blocks
    from pipeline.index.train import write_piece

    slices = slice_count(np.full(NLIST, math.ceil(vectors / NLIST)), vectors_per_slice(FACTORY, DIM, SLICE_BYTES))
    per_vector = estimated_bytes(FACTORY, 1, DIM) - estimated_bytes(FACTORY, 0, DIM)
    per_piece = files_per_piece(vectors, files, slices, per_vector)
    owner = np.arange(NLIST) * slices // NLIST  # lists of about equal size each way
    encoder = faiss.read_index(trained)
    blocks: dict[tuple[int, int], list] = {}
    rng, per_file = np.random.default_rng(1), vectors // files
    for number in range(files):  # each file encoded once, as the fill does, and cut by slice
        encoder.reset()
        first = number * per_file
        encoder.add_with_ids(LowRankClusters(DIM).sample(per_file, rng), np.arange(first, first + per_file))
        for block in list_blocks(encoder, owner):
            blocks.setdefault((block.index_slice, number // per_piece), []).append(block)
    del encoder
    share = sorted(blocks)[::2]  # one of two workers' pieces
    emptied = EmptiedTrained()
    tracemalloc.start()
    _trim()
    began = _status_mb("VmRSS")
    pieces = []
    with tempfile.TemporaryDirectory() as out:
        for key in share:
            _trim()
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
            before, traced = _status_mb("VmRSS"), tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            write_piece(emptied(trained), blocks[key], f"{out}/piece.faiss")
            pieces.append(
                {
                    "blocks": len(blocks[key]),
                    "codes_mb": sum(b.codes.nbytes + b.ids.nbytes for b in blocks[key]) / MB,
                    "rise_mb": _status_mb("VmHWM") - before,
                    "traced_rise_mb": (tracemalloc.get_traced_memory()[1] - traced) / MB,
                    "above_start_mb": _status_mb("VmRSS") - began,
                }
            )
    return {"vectors": vectors, "files": files, "slices": slices, "files_per_piece": per_piece, "pieces": pieces}


def _summary(result: dict) -> str:
    pieces = result["pieces"]
    first, later = pieces[0], pieces[1:] or pieces
    codes, blocks = np.mean([p["codes_mb"] for p in pieces]), np.mean([p["blocks"] for p in pieces])
    return (
        f"{result['vectors']:,} vectors, {result['files']:,} files, {result['slices']} slices, {len(pieces)} pieces "
        f"of {result['files_per_piece']} files ({codes:.2f} MB of codes, {blocks:.0f} blocks each): first piece "
        f"+{first['rise_mb']:.1f} MB (Python {first['traced_rise_mb']:.1f}), later pieces at most "
        f"+{max(p['rise_mb'] for p in later):.1f} MB, resident memory above the start after the last "
        f"{pieces[-1]['above_start_mb']:.1f} MB"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vectors", type=int, default=250_000)
    parser.add_argument("--files", type=int, default=251)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--one", nargs=3, metavar=("TRAINED", "VECTORS", "FILES"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:  # a size in its own process
        print(json.dumps(assemble(args.one[0], int(args.one[1]), int(args.one[2]))))
        return
    with tempfile.TemporaryDirectory() as root:
        trained = Path(root, "trained.faiss")
        _trained(trained)
        results = []
        for scale in (1, 4):
            size = [str(scale * args.vectors), str(scale * args.files)]
            command = [sys.executable, __file__, "--one", str(trained), *size]
            results.append(json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout))
    print(f"AssemblePiece outside Beam, {FACTORY}, {cpu_summary()}:")
    for result in results:
        print("  " + _summary(result))
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu_summary(), "results": results}, indent=2))


if __name__ == "__main__":
    main()
