"""Imported at the start of every Python process whose PYTHONPATH holds this directory. While
BUNDLE_PEAKS_DIR is set (`benchmarks/decontamination.py --bundles` sets it for a job, and
Beam's worker processes inherit it), every bundle a process runs is recorded in
BUNDLE_PEAKS_DIR/<pid>.jsonl: its transforms' names and how far it raised the process's
resident memory (VmHWM, reset through /proc/self/clear_refs as the bundle starts, less VmRSS
then). A process runs one bundle at a time while recording, so the resets do not overlap."""

import json
import os
import threading
from pathlib import Path


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _record_bundles(directory: Path) -> None:
    from apache_beam.runners.worker import bundle_processor

    original = bundle_processor.BundleProcessor.process_bundle
    one_at_a_time = threading.Lock()
    log = directory / f"{os.getpid()}.jsonl"

    def process_bundle(self, *args, **kwargs):
        with one_at_a_time:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
            start = _status_kb("VmRSS")
            try:
                return original(self, *args, **kwargs)
            finally:
                names = sorted(t.unique_name for t in self.process_bundle_descriptor.transforms.values())
                rise = _status_kb("VmHWM") - start
                with log.open("a") as f:
                    f.write(json.dumps({"rss_kb": start, "rise_kb": rise, "transforms": names}) + "\n")

    bundle_processor.BundleProcessor.process_bundle = process_bundle


if os.environ.get("BUNDLE_PEAKS_DIR"):
    _record_bundles(Path(os.environ["BUNDLE_PEAKS_DIR"]))
