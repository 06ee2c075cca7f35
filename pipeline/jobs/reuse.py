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
from dataclasses import dataclass
from typing import Literal, TypeVar

from pydantic import BaseModel

from pipeline.common import fileio
from pipeline.corpus.parse import match_corpus
from pipeline.index.files import INDEX_FILE, QUANTIZER_FILE
from pipeline.index.sources import SOURCES_DIR
from pipeline.jobs.job import index_dir
from schemas.config import PipelineConfig
from schemas.manifest import IndexManifest, InputFile, ShardsManifest, read_manifest, unversioned

log = logging.getLogger("ratrain")
Model = TypeVar("Model", bound=BaseModel)
IndexAction = Literal["reuse", "append", "rebuild_faiss", "build"]


def committed_index(directory: str) -> tuple[IndexManifest | None, str | None]:
    """`committed(directory, IndexManifest)` (its fields: a file table's entries are not read)
    and the sha256 of the commit manifest it was read from (one read): what a change of the
    index builds on, and checks at its commit."""
    found = fileio.current_manifest(directory)
    if found is None:
        return None, None
    path, data = found
    try:
        manifest = read_manifest(data, path, IndexManifest)
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
        changes = corpus_changes(previous, listed)
        if changes:
            return "append" if appendable(cfg, previous, changes) else "build"
    if previous.config_hash == cfg.index_hash():
        return "reuse"
    return "rebuild_faiss" if previous.embed_config_hash == cfg.embed_hash() else "build"


def listed_corpus_files(cfg: PipelineConfig) -> list[InputFile]:
    """The retrieval corpus's files as its globs match them now (one listing, in this process)."""
    return [InputFile.listed(f) for f in match_corpus(cfg.retrieval_corpus)]


@dataclass(frozen=True)
class CorpusChanges:
    """The corpus files now against those the index holds the documents of."""

    new: list[InputFile]  # no generation read them
    changed: list[InputFile]  # read, but of another size or time now: read again, their documents replaced
    gone: list[str]  # read, and matched no more: their documents deleted

    def __bool__(self) -> bool:
        return bool(self.new or self.changed or self.gone)

    @property
    def to_read(self) -> list[InputFile]:
        return sorted(self.new + self.changed, key=lambda f: f.path)


def indexed_files(previous: IndexManifest) -> dict[str, InputFile]:
    """{path: as read} of the corpus files whose documents the index holds: every generation's
    inputs (a later reading of a file replaces an earlier), less the files gone since."""
    files: dict[str, InputFile] = {}
    for generation in previous.generations:
        files.update({f.path: f for f in generation.inputs})
        for path in generation.removed_inputs:
            files.pop(path, None)
    return files


def corpus_changes(previous: IndexManifest, listed: list[InputFile]) -> CorpusChanges:
    indexed = indexed_files(previous)
    return CorpusChanges(
        [f for f in listed if f.path not in indexed],
        [f for f in listed if f.path in indexed and indexed[f.path].changed_in(f)],
        sorted(set(indexed) - {f.path for f in listed}),
    )


def appendable(cfg: PipelineConfig, previous: IndexManifest, changes: CorpusChanges) -> bool:
    """The changes can be applied to the index (else it is built from scratch): documents
    become chunks and embeddings as they did (`encoding_hash`), the index settings are the
    same, the index is one file or slices by lists, and for changed or gone files, it knows which documents came
    from them (its sources files)."""
    if previous.encoding_config_hash != cfg.encoding_hash():
        log.info("build-index: the corpus grew, but the settings changed since the index was built")
        return False
    if previous.config_hash != cfg.index_hash_over(previous.embed_config_hash):
        log.info("build-index: the corpus grew, but index.* changed since the index was built")
        return False
    directory = index_dir(cfg)
    faiss_paths = {unversioned(path) for path in fileio.listed_paths(previous, directory, "faiss")}
    if f"faiss/{INDEX_FILE}" not in faiss_paths and f"faiss/{QUANTIZER_FILE}" not in faiss_paths:
        log.warning("build-index: the corpus changed; an index in slices by chunk-id range is rebuilt")
        return False
    if (changes.changed or changes.gone) and next(fileio.listed_paths(previous, directory, SOURCES_DIR), None) is None:
        log.info("build-index: corpus files changed or went, and the index does not record its documents' files")
        return False
    return True


def shards_reusable(cfg: PipelineConfig, previous: ShardsManifest | None, index_sha: str) -> bool:
    return (
        previous is not None
        and previous.config_hash == cfg.shards_hash()
        and previous.index_manifest_sha256 == index_sha
    )
