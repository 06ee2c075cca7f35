"""What the `ratrain-pipeline` commands show on the terminal: the project's progress lines with
Beam's and Hugging Face's chatter turned down, a stage's counters, and any failure as one line
(`--debug` shows tracebacks and Beam's own logs)."""

from __future__ import annotations

import logging
import sys

import click


def _no_worker_tracebacks(record: logging.LogRecord) -> bool:
    """Beam logs a failing step's traceback before re-raising it; the command prints one line."""
    return not (
        record.name.startswith("apache_beam")
        and (record.exc_info or "Traceback (most recent call last)" in record.getMessage())
    )


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if not verbose:  # Beam and HF are chatty at INFO; keep the project's own progress lines
        for name in ("apache_beam", "sentence_transformers", "transformers", "faiss", "httpx", "huggingface_hub"):
            logging.getLogger(name).setLevel(logging.WARNING)
        for handler in logging.getLogger().handlers:
            handler.addFilter(_no_worker_tracebacks)


def summary(counters: dict[str, int], title: str) -> None:
    width = max((len(k) for k in counters), default=0)
    click.echo(f"{title}:", err=True)
    for name, value in counters.items():
        click.echo(f"  {name:<{width}}  {value:,}", err=True)


def report(result, title: str) -> None:
    """A committed stage's counters, or where a detached one will commit."""
    from pipeline.jobs.job import Submitted

    if isinstance(result, Submitted):
        job = f" as job {result.job}" if result.job else ""
        click.echo(f"{result.stage} submitted{job}; it commits {result.manifest} when it finishes", err=True)
    else:
        summary(result.counters, title)


def error_line(err: BaseException) -> str:
    """One line naming the problem. Errors raised inside Beam workers arrive re-raised with the
    failing step appended to their message; the first line is the original one."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    first = lines[0] if lines else type(err).__name__
    if isinstance(err, (ValueError, FileNotFoundError, RuntimeError)):
        return first
    return f"{type(err).__name__}: {first} (run with --debug for the traceback)"
