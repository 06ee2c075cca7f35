"""MinHash signatures: datasketch's `MinHash.update_batch` (what `Signer` uses) against the same
permutations applied in plain numpy, and the cost of shingling, on the sample corpus.

    .venv/bin/python benchmarks/minhash_hashing.py [--num-perm 128] [--ngram 13] [--repeat 3]

The numpy floor computes exactly datasketch's "affine64" values (MurmurHash3 finalizer, then
a·h + b modulo 2^64, minimum per permutation) from a uint64 array, without datasketch's
per-shingle Python list; the script checks that both give the same signatures before timing.
Prints words/s for shingling and for each signer (best of --repeat), and writes JSON to
benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
from benchmarks.report import timed, write_results  # noqa: E402
from pipeline.decontaminate.minhash import SHINGLE_BLOCK, Signer, shingles, words  # noqa: E402
from pipeline.embed.encoder import cpu_summary  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
FMIX = (np.uint64(33), np.uint64(0xFF51AFD7ED558CCD), np.uint64(33), np.uint64(0xC4CEB9FE1A85EC53), np.uint64(33))


def numpy_signature(hashes: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """datasketch's affine64 MinHash of `hashes`, in numpy."""
    s1, m1, s2, m2, s3 = FMIX
    signature = np.full(len(a), np.iinfo(np.uint64).max, np.uint64)
    with np.errstate(over="ignore"):
        for start in range(0, len(hashes), SHINGLE_BLOCK):
            h = hashes[start : start + SHINGLE_BLOCK]
            h = h ^ (h >> s1)
            h = h * m1
            h = h ^ (h >> s2)
            h = h * m2
            h = (h ^ (h >> s3))[:, None]
            signature = np.minimum(signature, (h * a + b).min(axis=0))
    return signature


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--num-perm", type=int, default=128)
    parser.add_argument("--ngram", type=int, default=13)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--output", default=str(REPO / "benchmarks" / "results" / "minhash_hashing.json"))
    args = parser.parse_args()
    texts = [
        json.loads(line)["text"]
        for path in sorted((REPO / "examples" / "corpus").glob("*.jsonl"))
        for line in path.read_text().splitlines()
        if line.strip()
    ]
    total_words = sum(len(words(t)) for t in texts)
    signer = Signer(args.num_perm, 1)
    a, b = signer.permutations
    sets = [shingles(t, args.ngram) for t in texts]
    if any(not np.array_equal(signer.signature(s), numpy_signature(s, a, b)) for s in sets):
        raise SystemExit("numpy and datasketch signatures differ")
    best = {}
    for _ in range(args.repeat):
        for name, work in (
            ("shingles", lambda: [shingles(t, args.ngram) for t in texts]),
            ("datasketch signatures", lambda: [signer.signature(s) for s in sets]),
            ("numpy signatures", lambda: [numpy_signature(s, a, b) for s in sets]),
        ):
            best[name] = min(best.get(name, float("inf")), timed(work)[1])
    print(f"{len(texts)} documents, {total_words:,} words, {args.ngram}-grams, {args.num_perm} permutations")
    print(f"CPU: {cpu_summary()}")
    for name, seconds in best.items():
        print(f"{name:<22} {seconds:7.3f} s  {total_words / seconds:12,.0f} words/s")
    ratio = best["datasketch signatures"] / best["numpy signatures"]
    print(f"datasketch / numpy: {ratio:.2f}x the time")
    write_results(
        {"cpu": cpu_summary(), "documents": len(texts), "words": total_words, "seconds": best, "ratio": ratio},
        args.output,
    )


if __name__ == "__main__":
    main()
