"""The one reuse policy: what a committed directory lets a job skip (docs/design.md §8).

An index directory whose manifest matches the config's index hash, over the very files it
read, is reused whole; one whose files are all still there, unchanged, beside new ones, with
the same settings, gets the new files appended; one whose chunks and embeddings match (the
embed hash) keeps them and gets a new faiss index; anything else, or no readable manifest, is
built from scratch. Shards are reused when their config hash and the sha256 of the index
manifest they were built from both match.
"""

from __future__ import annotations

import logging
from typing import Literal, TypeVar

from pydantic import BaseModel

from pipeline.common import fileio
from pipeline.corpus.parse import match_corpus
from pipeline.index.build import INDEX_FILE
from schemas.config import PipelineConfig
from schemas.manifest import MANIFEST_FILE, IndexManifest, InputFile, ShardsManifest, read_manifest

log = logging.getLogger("ratrain")
Model = TypeVar("Model", bound=BaseModel)
IndexAction = Literal["reuse", "append", "rebuild_faiss", "build"]


def committed(directory: str, model: type[Model]) -> Model | None:
    """The committed manifest of `directory`, or None: none there, or an older or foreign one
    (which nothing can be reused from)."""
    try:
        return fileio.committed_manifest(directory, model)
    except ValueError:
        return None


def committed_index(directory: str) -> tuple[IndexManifest | None, str | None]:
    """`committed(directory, IndexManifest)` and the sha256 of the manifest.json it was read
    from (one read): what a change of the index builds on, and checks at its commit."""
    path = fileio.join(directory, MANIFEST_FILE)
    if not fileio.exists(path):
        return None, None
    data = fileio.read_bytes(path)
    try:
        manifest = fileio.whole(read_manifest(data, path, IndexManifest), directory)
    except ValueError:
        return None, None
    return manifest, fileio.sha256_bytes(data)


def index_action(
    cfg: PipelineConfig, previous: IndexManifest | None, listed: list[InputFile] | None = None
) -> IndexAction:
    """What to do with the committed index `previous`, given the corpus files the config's
    globs match now (`listed`; None: not listed, the files are taken as read)."""
    if previous is None:
        return "build"
    if listed is not None and previous.generations:
        new, changed = corpus_changes(previous, listed)
        if changed:
            log.info(
                "build-index: %d corpus file(s) changed or went since the index read them, e.g. %s",
                len(changed),
                changed[0],
            )
            return "build"
        if new:
            return "append" if appendable(cfg, previous) else "build"
    if previous.config_hash == cfg.index_hash():
        return "reuse"
    return "rebuild_faiss" if previous.embed_config_hash == cfg.embed_hash() else "build"


def listed_corpus_files(cfg: PipelineConfig) -> list[InputFile]:
    """The retrieval corpus's files as its globs match them now (one listing, in this process)."""
    return [InputFile(path=path, bytes=size) for path, _, size in match_corpus(cfg.retrieval_corpus)]


def corpus_changes(previous: IndexManifest, listed: list[InputFile]) -> tuple[list[InputFile], list[str]]:
    """(files listed now that no generation read, paths read then that are gone or of another size now)."""
    read = {f.path: f.bytes for generation in previous.generations for f in generation.inputs}
    now = {f.path: f.bytes for f in listed}
    changed = sorted(path for path, size in read.items() if now.get(path) != size)
    return [f for f in listed if f.path not in read], changed


def appendable(cfg: PipelineConfig, previous: IndexManifest) -> bool:
    """New files can be appended: documents become chunks and embeddings as they did
    (`encoding_hash`), the index settings are the same, and the index is one file."""
    if previous.encoding_config_hash != cfg.encoding_hash():
        log.info("build-index: the corpus grew, but the settings changed since the index was built")
        return False
    if previous.config_hash != cfg.index_hash_over(previous.embed_config_hash):
        log.info("build-index: the corpus grew, but index.* changed since the index was built")
        return False
    if [f.path for f in previous.files if f.path.startswith("faiss/")] != [f"faiss/{INDEX_FILE}"]:
        log.warning("build-index: the corpus grew; appending to an index in slices is not built yet, so it is rebuilt")
        return False
    return True


def shards_reusable(cfg: PipelineConfig, previous: ShardsManifest | None, index_sha: str) -> bool:
    return (
        previous is not None
        and previous.config_hash == cfg.shards_hash()
        and previous.index_manifest_sha256 == index_sha
    )
