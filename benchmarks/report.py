"""What the benchmark scripts share: peak memory of a process and writing their results."""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path


def peak_rss_kb(pid="self") -> int:
    """VmHWM: the peak resident set of one process since it exec'd (ru_maxrss would carry the
    parent's peak over a fork + exec); 0 once the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return 0


def read_into_page_cache(directory: str | Path) -> int:
    """Read every file under `directory` once, so that the builder timed next finds its input
    in the page cache as the one before it did: whichever ran first would otherwise pay the
    disk reads for all (this machine's kernel reclaims pages left cold). -> bytes read."""
    total = 0
    for path in sorted(Path(directory).rglob("*")):
        if path.is_file():
            with open(path, "rb") as f:
                while block := f.read(1 << 24):
                    total += len(block)
    return total


def timed(fn):
    """(fn(), seconds it took)."""
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def timed_in_process(fn):
    """(fn(), {seconds, sys_seconds, minor_faults}): wall time and what this process's threads
    spent in the kernel and faulting pages in, where fresh memory is touched (on a VM that hands
    freed memory back to its host, that costs up to ~10 s per GB: the part of a first run that a
    second one in the same process does not pay)."""
    before = resource.getrusage(resource.RUSAGE_SELF)
    value, seconds = timed(fn)
    after = resource.getrusage(resource.RUSAGE_SELF)
    return value, {
        "seconds": round(seconds, 2),
        "sys_seconds": round(after.ru_stime - before.ru_stime, 2),
        "minor_faults": after.ru_minflt - before.ru_minflt,
    }


def write_results(results: dict, path: str | Path) -> None:
    """The run's numbers as JSON (benchmarks/results/ is not committed)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, default=float))
    print(f"wrote {out}")
