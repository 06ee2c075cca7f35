"""Beam pipeline options: whatever follows `--` on the command line, over local defaults.

The local default is the in-process FnApiRunner: Beam's DirectRunner would first try to
download the Prism binary, which a machine without network cannot do.
"""
from __future__ import annotations

import os

from apache_beam.options.pipeline_options import DirectOptions, PipelineOptions

LOCAL_RUNNER = "FnApiRunner"


def with_defaults(beam_args: list[str]) -> list[str]:
    args = list(beam_args)
    if not any(a == "--runner" or a.startswith("--runner=") for a in args):
        args.insert(0, f"--runner={LOCAL_RUNNER}")
    return args


def share_cores(options: PipelineOptions) -> None:
    """Local multi-process runs: each worker process gets its share of the cores for the
    OpenMP pools of faiss and torch (every process using all cores made a 2-worker index
    build on 2 cores 10-100x slower). An OMP_NUM_THREADS set by the user wins; worker
    processes inherit the environment."""
    direct = options.view_as(DirectOptions)
    if direct.direct_running_mode != "multi_processing" or "OMP_NUM_THREADS" in os.environ:
        return
    cores = os.cpu_count() or 1
    workers = direct.direct_num_workers or cores  # 0 means one worker per core
    if workers > 1:
        os.environ["OMP_NUM_THREADS"] = str(max(1, cores // workers))


def pipeline_options(beam_args: list[str]) -> PipelineOptions:
    options = PipelineOptions(with_defaults(beam_args))
    share_cores(options)
    return options
