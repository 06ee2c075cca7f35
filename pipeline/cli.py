"""`ratrain-pipeline`: build-index, build-shards, run, validate, inspect, report (docs/design.md §3).

Anything after `--` goes to Beam as pipeline options, and so does an option the command does
not know before it (`ignore_unknown_options`); `_beam_args` then refuses any Beam would not
use. User errors end with one line on stderr and a non-zero exit; `--debug` shows the traceback.
"""

from __future__ import annotations

import json
import sys
import time

import click

from pipeline.console import error_line, report, setup_logging, summary

BEAM_ARGS = dict(context_settings={"ignore_unknown_options": True})
#: A reader's choice of an older commit of the directory it reads (docs/design.md §8).
COMMIT_OPTION = click.option(
    "--commit",
    type=click.IntRange(min=0),
    metavar="N",
    help="Read commit N of DIRECTORY (an index or shards directory), while it is kept (keep_commits); "
    "default: its newest.",
)


def _beam_args(beam_args, detach: bool = False) -> list[str]:
    """The command's Beam arguments, once Beam knows every option among them: an unknown one
    (a typo of the command's own option before `--`, or of a Beam option) fails naming it,
    and so does `--detach` where the job would end with the command, before anything is read,
    waited for or written. Run inside a command."""
    from pipeline.jobs.options import check_beam_args, check_detachable, pipeline_options

    ctx = click.get_current_context()
    ours = {}
    if ctx.parent is not None:
        ours.update(
            {
                opt: f"it is an option of ratrain-pipeline, put it before the command ({opt} {ctx.info_name} ...)"
                for param in ctx.parent.command.get_params(ctx.parent)
                if isinstance(param, click.Option)
                for opt in (*param.opts, *param.secondary_opts)
            }
        )
    ours.update(
        {
            opt: f"it is an option of `{ctx.info_name}`, put it before `--`"
            for param in ctx.command.get_params(ctx)
            if isinstance(param, click.Option)
            for opt in (*param.opts, *param.secondary_opts)
        }
    )
    checked = check_beam_args(beam_args, ours)
    if detach:
        check_detachable(pipeline_options(checked))
    return checked


def _config(path: str):
    """A local config file, or one on gs:// (a flex template's parameter)."""
    from schemas.config import ConfigError, config_from_yaml, load_config

    if "://" not in path:
        return load_config(path)
    from pipeline.common import fileio

    if not fileio.exists(path):
        raise ConfigError(f"config file not found: {path}")
    return config_from_yaml(fileio.read_bytes(path).decode("utf-8"), path)


@click.group()
@click.option("--debug", is_flag=True, help="Show tracebacks and Beam's own logs.")
@click.pass_context
def cli(ctx, debug):
    """Turn a text corpus into retrieval-augmented (RETRO-style) training shards."""
    ctx.obj = {"debug": debug}
    setup_logging(debug)


DRY_RUN = click.option(
    "--dry-run",
    is_flag=True,
    help="Build the pipeline graph and print the options and stages (JSON); "
    "read no input, write nothing, submit nothing.",
)


CORPUS_CHUNKS = click.option(
    "--corpus-chunks",
    type=float,
    default=None,
    help="With --dry-run: estimate memory per worker for a corpus of this "
    "many chunks (e.g. 1e8); default: from the input files' sizes.",
)
CORPUS_DOCUMENTS = click.option(
    "--corpus-documents", type=float, default=None, help="With --corpus-chunks: documents in it (default: chunks / 10)."
)


def _print_plan(plan: dict, cfg, chunks: float | None, documents: float | None) -> None:
    """The dry-run plan with the memory model's estimate per worker process."""
    from pipeline.jobs.memory_model import estimate

    plan = {**plan, "memory_estimate": estimate(cfg, chunks, documents)}
    click.echo(json.dumps(plan, indent=2, sort_keys=True, default=str))


DETACH = click.option(
    "--detach",
    is_flag=True,
    help="Submit the job and exit; it commits its own manifest when it finishes (for cluster runners).",
)


@cli.command("build-index", **BEAM_ARGS)
@click.option("--config", "config_path", required=True, help="Pipeline config (YAML).")
@click.argument("beam_args", nargs=-1, type=click.UNPROCESSED)
@click.option("--force", is_flag=True, help="Rebuild chunks and embeddings even when they match.")
@click.option(
    "--delete",
    "delete_path",
    default=None,
    help="A file of document ids (the corpus's id field; one a line) to delete from the committed index.",
)
@DRY_RUN
@CORPUS_CHUNKS
@CORPUS_DOCUMENTS
@DETACH
def build_index_cmd(config_path, beam_args, *, force, delete_path, dry_run, corpus_chunks, corpus_documents, detach):
    """Stages 1-3: chunk, embed and index the retrieval corpus -> <output>/index/. A committed
    index whose corpus gained files gets them appended; --delete removes documents from it."""
    from pipeline.build_index.job import build_index
    from pipeline.common import fileio

    beam_args = _beam_args(beam_args, detach=detach and not dry_run)
    cfg = _config(config_path)
    delete = ()
    if delete_path is not None:
        delete = tuple(line.strip() for line in fileio.read_bytes(delete_path).decode().splitlines() if line.strip())
    result = build_index(cfg, beam_args, force=force, dry_run=dry_run, detach=detach, delete=delete)
    if dry_run:
        _print_plan({"build-index": result}, cfg, corpus_chunks, corpus_documents)
    else:
        report(result, "build-index counters")


@cli.command("index", **BEAM_ARGS)
@click.option(
    "--embeddings",
    "embeddings",
    required=True,
    multiple=True,
    help="Glob of Parquet files with chunk_id: int64 and embedding: fixed_size_list<float32|float16>[d] (repeatable).",
)
@click.option("--output", required=True, help="Directory for faiss/index.faiss (or its shards) and manifest.json.")
@click.option("--type", "index_type", default="auto", show_default=True, help="'auto' or a faiss index_factory string.")
@click.option("--memory-budget", default="4GiB", show_default=True, help="e.g. 64MB, 2GiB.")
@click.option(
    "--target-recall", default=0.95, show_default=True, type=float, help="1-recall@10 the tuned nprobe must reach."
)
@click.option("--nprobe", default=None, type=int, help="Fixed search depth instead of tuning.")
@click.option(
    "--slice-bytes",
    default=None,
    help="Split an IVF index into slices of at most this size (e.g. 12MB), each owning a group of nearby "
    "inverted lists (faiss/slice-NNNNN.faiss, plus quantizer.faiss and list_owners.npy).",
)
@click.argument("beam_args", nargs=-1, type=click.UNPROCESSED)
def index_cmd(embeddings, output, *, index_type, memory_budget, target_recall, nprobe, slice_bytes, beam_args):
    """Build a faiss index over embeddings you already have (the index stage alone)."""
    from pydantic import ValidationError

    from pipeline.build_index.faiss_only import build_vector_index
    from schemas.config import ConfigError, format_validation_error
    from schemas.stage_config import IndexConfig

    beam_args = _beam_args(beam_args)
    try:
        cfg = IndexConfig(
            type=index_type,
            memory_budget=memory_budget,
            target_recall=target_recall,
            nprobe=nprobe,
            slice_bytes=slice_bytes,
        )
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, "index options")) from None
    manifest = build_vector_index(list(embeddings), output, cfg, beam_args)
    summary(manifest.counters, "index counters")


@cli.command("build-shards", **BEAM_ARGS)
@click.option("--config", "config_path", required=True, help="Pipeline config (YAML).")
@click.argument("beam_args", nargs=-1, type=click.UNPROCESSED)
@DRY_RUN
@CORPUS_CHUNKS
@CORPUS_DOCUMENTS
@DETACH
@click.option(
    "--wait-for-index",
    is_flag=True,
    help="First wait until the index this config describes is committed (e.g. by a "
    "detached build-index), polling its manifest.",
)
@click.option(
    "--wait-timeout",
    default=7 * 24 * 3600.0,
    show_default=True,
    type=float,
    help="Seconds --wait-for-index waits before giving up.",
)
@click.option(
    "--poll-every",
    default=30.0,
    show_default=True,
    type=float,
    help="Seconds between looks at the index manifest while waiting.",
)
@click.option("--full", is_flag=True, help="Build every shard again, not refresh them from what the index changed.")
def build_shards_cmd(
    config_path,
    beam_args,
    *,
    dry_run,
    corpus_chunks,
    corpus_documents,
    detach,
    wait_for_index,
    wait_timeout,
    poll_every,
    full,
):
    """Stages 4-5: retrieve neighbours for the training corpus -> <output>/shards/."""
    from pipeline.build_index.files import wait_for_index as wait
    from pipeline.build_shards.job import build_shards

    beam_args = _beam_args(beam_args, detach=detach and not dry_run)
    cfg = _config(config_path)
    if wait_for_index and not dry_run:
        wait(cfg, wait_timeout, poll_every)
    result = build_shards(cfg, beam_args, dry_run=dry_run, detach=detach, full=full)
    if dry_run:
        _print_plan({"build-shards": result}, cfg, corpus_chunks, corpus_documents)
    else:
        report(result, "build-shards counters")


@cli.command("run", **BEAM_ARGS)
@click.option("--config", "config_path", required=True, help="Pipeline config (YAML).")
@click.option("--force", is_flag=True, help="Rebuild stages even when their manifest matches.")
@click.argument("beam_args", nargs=-1, type=click.UNPROCESSED)
@DRY_RUN
@CORPUS_CHUNKS
@CORPUS_DOCUMENTS
@DETACH
def run_cmd(config_path, *, force, beam_args, dry_run, corpus_chunks, corpus_documents, detach):
    """Both stages; a stage whose committed manifest matches the config is skipped. With
    --detach, the first stage to build is submitted and the command exits (follow a detached
    build-index with `build-shards --wait-for-index`)."""
    from pipeline.build_index.job import build_index
    from pipeline.build_shards.job import build_shards
    from pipeline.run import run_all

    beam_args = _beam_args(beam_args, detach=detach and not dry_run)
    if dry_run:
        cfg, args = _config(config_path), beam_args
        _print_plan(
            {
                "build-index": build_index(cfg, args, dry_run=True),
                "build-shards": build_shards(cfg, args, dry_run=True),
            },
            cfg,
            corpus_chunks,
            corpus_documents,
        )
        return
    start = time.monotonic()
    stages = run_all(_config(config_path), beam_args, force=force, detach=detach)
    for stage, (status, result) in stages.items():
        if status == "submitted":
            report(result, stage)
        else:
            summary(result, f"{stage} ({status})")
    click.echo(f"run {'submitted' if detach else 'finished'} in {time.monotonic() - start:.1f} s", err=True)


@cli.command("validate", **BEAM_ARGS)
@click.argument("directory")
@click.option(
    "--sample",
    default=1.0,
    show_default=True,
    type=click.FloatRange(0, 1, min_open=True),
    help="Check this share of the shards (the same ones every run, chosen by file name) against "
    "the chunk rows they reference, and the same share of chunk and embedding files, reading "
    "only those and the chunk row groups they reference; every other listed file by its size.",
)
@click.option(
    "--hash-all", is_flag=True, help="With --sample: also check every other listed file's sha256 (reads them all)."
)
@COMMIT_OPTION
@click.argument("beam_args", nargs=-1, type=click.UNPROCESSED)
def validate_cmd(directory, sample, hash_all, commit, beam_args):
    """Check an index, shards or output directory end to end; exit 0 only if sound. In this
    process, or as a Beam job when pipeline options follow `--`."""
    from pipeline.check.problems import ValidationFailed
    from pipeline.check.validate import validate_path

    beam_args = _beam_args(beam_args)
    commits = None if commit is None else {directory: commit}
    try:
        if beam_args:
            from pipeline.check.validate_beam import validate_with_beam

            lines = validate_with_beam(directory, beam_args, sample, commits, hash_all=hash_all)
        else:
            lines = validate_path(directory, sample, commits, hash_all=hash_all)
    except ValidationFailed as failed:  # a Beam job's report holds a line per problem
        click.echo(f"error: {failed}", err=True)
        sys.exit(1)
    for line in lines:
        click.echo(line)


@cli.command("inspect")
@click.argument("directory")
@click.option("--n", "count", default=1, show_default=True, help="Sequences to print.")
@click.option("--chunks", "max_chunks", default=4, show_default=True, help="Chunks per sequence to print (0: all).")
@COMMIT_OPTION
def inspect_cmd(directory, count, max_chunks, commit):
    """Print sequences with their decoded neighbours and scores."""
    from pipeline.check.inspect import inspect_shards

    for line in inspect_shards(directory, count, max_chunks, commit):
        click.echo(line)


@cli.command("report")
@click.argument("directory")
@click.option(
    "--eval",
    "evaluations",
    multiple=True,
    metavar="FILE",
    help="Also show the scores `ratrain-eval --json FILE` wrote for a checkpoint (repeat for several); "
    "report a model by its loss on low-overlap chunks.",
)
def report_cmd(directory, evaluations):
    """Write DIRECTORY/report.html: one self-contained page on an output, index or shards
    directory (manifests, neighbour scores and fill, overlap, recall against search depth,
    stage timings, rejected records, sample sequences, checkpoint scores given with --eval);
    prints its path."""
    from pipeline.check.html import write_report

    click.echo(write_report(directory, evaluations))


@cli.command("gc")
@click.argument("directory")
@click.option("--keep", default=1, show_default=True, type=click.IntRange(min=1), help="Newest commits kept.")
@click.option("--orphans", is_flag=True, help="Also delete the files no kept commit lists (else they are counted).")
def gc_cmd(directory, keep, orphans):
    """Delete the commits of an output's index/ and shards/ (or of one committed directory) but
    the newest KEEP, with every file only they list (under the output's lease)."""
    from pipeline.jobs.commits import collect

    for done in collect(directory, keep, orphans=orphans):
        line = f"{done.directory}: {done.commits} commit{'s' if done.commits != 1 else ''} kept"
        if done.orphans:
            count = f"{len(done.orphans)} file{'s' if len(done.orphans) != 1 else ''} listed by no commit"
            line += (
                f"; {count} deleted"
                if orphans
                else f"; {count} (a commit that died before its put): --orphans deletes them"
            )
        click.echo(line)


def main(argv=None) -> None:
    args = argv if argv is not None else sys.argv[1:]
    debug = "--debug" in args[: next((i for i, a in enumerate(args) if not a.startswith("-")), len(args))]
    try:
        cli.main(args=argv, prog_name="ratrain-pipeline", standalone_mode=False)
    except click.exceptions.Abort:
        sys.exit(130)
    except click.ClickException as err:
        err.show()
        sys.exit(err.exit_code)
    except Exception as err:  # every failure ends in one line unless --debug
        if debug:
            raise
        click.echo(f"error: {error_line(err)}", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
