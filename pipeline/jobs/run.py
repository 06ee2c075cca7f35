"""`run`: build-index then build-shards, skipping a stage whose committed manifest matches."""

from __future__ import annotations

import logging

from pipeline.common import fileio
from pipeline.jobs.index_files import load_index_manifest
from pipeline.jobs.index_job import build_index
from pipeline.jobs.job import Submitted, index_dir, shards_dir
from pipeline.jobs.shards_job import build_shards
from schemas.config import PipelineConfig
from schemas.manifest import MANIFEST_FILE, read_manifest

log = logging.getLogger("ratrain")


def _committed(directory: str) -> dict | None:
    """The committed manifest as parsed JSON (schema_version checked), or None when there is none."""
    path = fileio.join(directory, MANIFEST_FILE)
    return read_manifest(fileio.read_bytes(path), path) if fileio.exists(path) else None


def run_all(cfg: PipelineConfig, beam_args: list[str], force: bool = False, detach: bool = False) -> dict:
    """{stage: (built|skipped, counters) or (submitted, Submitted)}. Detached, the first stage
    that needs building is submitted and nothing after it (build-shards needs the index)."""
    report = {}
    index = _committed(index_dir(cfg))
    if not force and index and index.get("config_hash") == cfg.index_hash():
        log.info("build-index: skipped, %s matches the config", index_dir(cfg))
        report["build-index"] = ("skipped", index["counters"])
    else:
        built = build_index(cfg, beam_args, force=force, detach=detach)
        if isinstance(built, Submitted):
            report["build-index"] = ("submitted", built)
            return report
        report["build-index"] = ("built", built.counters)
    _, index_sha = load_index_manifest(cfg)
    shards = _committed(shards_dir(cfg))
    if (
        not force
        and shards
        and shards.get("config_hash") == cfg.shards_hash()
        and shards.get("index_manifest_sha256") == index_sha
    ):
        log.info("build-shards: skipped, %s matches the config and index", shards_dir(cfg))
        report["build-shards"] = ("skipped", shards["counters"])
    else:
        built = build_shards(cfg, beam_args, detach=detach)
        report["build-shards"] = ("submitted", built) if isinstance(built, Submitted) else ("built", built.counters)
    return report
