"""Beam pipeline options: whatever follows `--` on the command line, over local defaults.

The local default is the in-process FnApiRunner: Beam's DirectRunner would first try to
download the Prism binary, which a machine without network cannot do.
"""
from __future__ import annotations

from apache_beam.options.pipeline_options import PipelineOptions

LOCAL_RUNNER = "FnApiRunner"


def with_defaults(beam_args: list[str]) -> list[str]:
    args = list(beam_args)
    if not any(a == "--runner" or a.startswith("--runner=") for a in args):
        args.insert(0, f"--runner={LOCAL_RUNNER}")
    return args


def pipeline_options(beam_args: list[str]) -> PipelineOptions:
    return PipelineOptions(with_defaults(beam_args))
