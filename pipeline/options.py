"""Beam pipeline options: whatever follows `--` on the command line, over local defaults.

The local default is the in-process FnApiRunner: Beam's DirectRunner would first try to
download the Prism binary, which a machine without network cannot do.
"""
from __future__ import annotations

import os

from apache_beam.options.pipeline_options import DirectOptions, PipelineOptions, PortableOptions, StandardOptions

LOCAL_RUNNER = "FnApiRunner"
# Runners whose SDK workers run on the machine that launches the job.
IN_PROCESS_RUNNERS = {None, LOCAL_RUNNER, "DirectRunner", "BundleBasedDirectRunner", "SwitchingDirectRunner"}


def with_defaults(beam_args: list[str]) -> list[str]:
    args = list(beam_args)
    if not any(a == "--runner" or a.startswith("--runner=") for a in args):
        args.insert(0, f"--runner={LOCAL_RUNNER}")
    return args


def local_worker_processes(options: PipelineOptions) -> int | None:
    """How many SDK worker processes share this machine's cores, or None when the workers run
    elsewhere (a cluster runner, or a portable job service with its own worker environment)."""
    runner = options.view_as(StandardOptions).runner
    if runner in IN_PROCESS_RUNNERS:
        direct = options.view_as(DirectOptions)
        if direct.direct_running_mode != "multi_processing":
            return 1
        return direct.direct_num_workers or os.cpu_count() or 1  # 0 means one worker per core
    if runner == "PortableRunner" and options.view_as(PortableOptions).environment_type == "LOOPBACK":
        return 1  # the job service calls back into this process
    return None


def encoder_threads(configured: int | None, device: str, options: PipelineOptions) -> int | None:
    """Intra-op threads of each CPU encoder process. Part of what decides the embeddings' last
    bits (CPU matrix kernels split their sums by thread count), so it is fixed once per job
    and recorded in the manifest. Configured: as given. Otherwise this machine's share of
    the cores where the workers run here, and 1 on cluster runners (one SDK process per
    core). None on a GPU, where threads do not touch the arithmetic."""
    if not device.startswith("cpu"):
        return None
    if configured is not None:
        return configured
    workers = local_worker_processes(options)
    return 1 if workers is None else max(1, (os.cpu_count() or 1) // workers)


def share_cores(options: PipelineOptions) -> None:
    """Local multi-process runs: each worker process gets its share of the cores for the
    OpenMP pools of faiss and torch (every process using all cores made a 2-worker index
    build on 2 cores 10-100x slower). An OMP_NUM_THREADS set by the user wins; worker
    processes inherit the environment."""
    workers = local_worker_processes(options)
    if workers is None or workers == 1 or "OMP_NUM_THREADS" in os.environ:
        return
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // workers))


def pipeline_options(beam_args: list[str]) -> PipelineOptions:
    options = PipelineOptions(with_defaults(beam_args))
    share_cores(options)
    return options
