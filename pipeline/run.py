"""`run`: build-index then build-shards, skipping a stage whose committed manifest matches."""
from __future__ import annotations

import logging

from pipeline import fileio
from pipeline.stages import build_index, build_shards, index_dir, load_index_manifest, shards_dir
from schemas.config import PipelineConfig

log = logging.getLogger("ratrain")


def _committed(directory: str) -> dict | None:
    path = fileio.join(directory, fileio.MANIFEST)
    return fileio.read_json(path) if fileio.exists(path) else None


def run_all(cfg: PipelineConfig, beam_args: list[str], force: bool = False) -> dict:
    """{stage: (built|skipped, counters)}."""
    report = {}
    index = _committed(index_dir(cfg))
    if not force and index and index.get("config_hash") == cfg.index_hash():
        log.info("build-index: skipped, %s matches the config", index_dir(cfg))
        report["build-index"] = ("skipped", index["counters"])
    else:
        report["build-index"] = ("built", build_index(cfg, beam_args, force=force).counters)
    _, index_sha = load_index_manifest(cfg)
    shards = _committed(shards_dir(cfg))
    if (not force and shards and shards.get("config_hash") == cfg.shards_hash()
            and shards.get("index_manifest_sha256") == index_sha):
        log.info("build-shards: skipped, %s matches the config and index", shards_dir(cfg))
        report["build-shards"] = ("skipped", shards["counters"])
    else:
        report["build-shards"] = ("built", build_shards(cfg, beam_args).counters)
    return report
