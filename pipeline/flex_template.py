"""What the Dataflow flex-template entry script (`deploy/dataflow/main.py`) runs: the template's
parameters and the pipeline options arrive as flags (`--config=gs://... --command=run
--runner=...`). The project's own flags are taken out; everything else goes to Beam.

The launcher must exit once the job is submitted, so the command always runs detached: the job
commits its own output. `run` submits the first stage that needs building; launch it again
once that stage has committed (or launch `build-shards`, which then finds the index).
"""

from __future__ import annotations

import argparse
import sys

COMMANDS = ("run", "build-index", "build-shards")


def split_args(argv: list[str]) -> tuple[str, str, list[str]]:
    """(config path, command, Beam options)."""
    parser = argparse.ArgumentParser(prog="ratrain flex template", add_help=False)
    parser.add_argument("--config", required=True)
    parser.add_argument("--command", default="run", choices=COMMANDS)
    known, beam_args = parser.parse_known_args(argv)
    return known.config, known.command, beam_args


def main(argv: list[str] | None = None) -> None:
    from pipeline import cli

    config, command, beam_args = split_args(sys.argv[1:] if argv is None else argv)
    cli.main([command, "--config", config, "--detach", "--", *beam_args])
