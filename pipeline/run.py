"""`run`: build-index then build-shards, skipping a stage whose committed manifest matches."""

from __future__ import annotations

import logging

from pipeline.build_index.files import load_committed_index
from pipeline.build_index.job import build_index
from pipeline.build_shards.job import build_shards
from pipeline.common.errors import StageError
from pipeline.common.fileio import committed
from pipeline.jobs.commits import finish_output
from pipeline.jobs.job import Submitted, index_dir, shards_dir
from pipeline.jobs.lease import ATTACHED_SECONDS, Lease
from pipeline.jobs.reuse import index_action, listed_corpus_files, shards_reusable
from schemas.config import PipelineConfig
from schemas.manifest import IndexManifest, ShardsManifest

log = logging.getLogger("ratrain")


def run_all(cfg: PipelineConfig, beam_args: list[str], force: bool = False, detach: bool = False) -> dict:
    """{stage: (built|skipped, counters) or (submitted, Submitted)}. Detached, the first stage
    that needs building is submitted and nothing after it (build-shards needs the index).
    Attached, the output's lease is held across both stages: no other run slips in between."""
    with Lease.take(cfg.output, "run", seconds=ATTACHED_SECONDS) as lease:
        finish_output(cfg.output, cfg.keep_commits)  # a commit that died after its put, in a stage run may skip
        if detach:  # the submitted job takes the lease and holds it until it commits
            lease.release()
            return _run_stages(cfg, beam_args, force=force, detach=True)
        return _run_stages(cfg, beam_args, force=force, detach=False)


def _run_stages(cfg: PipelineConfig, beam_args: list[str], *, force: bool, detach: bool) -> dict:
    report: dict[str, tuple[str, dict[str, int] | Submitted]] = {}
    index = None if force else committed(index_dir(cfg), IndexManifest)
    if index is not None and index_action(cfg, index, listed_corpus_files(cfg)) == "reuse":
        log.info("build-index: skipped, %s matches the config", index_dir(cfg))
        report["build-index"] = ("skipped", index.counters)
    else:
        built_index = build_index(cfg, beam_args, force=force, detach=detach)
        if isinstance(built_index, Submitted):
            report["build-index"] = ("submitted", built_index)
            return report
        if not isinstance(built_index, IndexManifest):  # a dict only from a dry run, which run never asks for
            raise StageError(f"build-index returned no committed manifest: {type(built_index).__name__}")
        report["build-index"] = ("built", built_index.counters)
    index_sha = load_committed_index(cfg).manifest_sha256
    shards = None if force else committed(shards_dir(cfg), ShardsManifest)
    if shards is not None and shards_reusable(cfg, shards, index_sha):
        log.info("build-shards: skipped, %s matches the config and index", shards_dir(cfg))
        report["build-shards"] = ("skipped", shards.counters)
    else:
        built_shards = build_shards(cfg, beam_args, detach=detach)
        if isinstance(built_shards, Submitted):
            report["build-shards"] = ("submitted", built_shards)
        elif isinstance(built_shards, ShardsManifest):
            report["build-shards"] = ("built", built_shards.counters)
        else:  # a dict only from a dry run, which run never asks for
            raise StageError(f"build-shards returned no committed manifest: {type(built_shards).__name__}")
    return report
