"""Retrieval at inference time, without Beam: text or token ids in, neighbours out in the
layout of a training shard, found as build-shards finds them.

`Retriever.open(index_dir)` takes a committed index directory (`<output>/index`) and reads
everything from its manifest: the tokenizer, the encoder and the precision and threads it
embedded in, chunk_tokens, pad_id, the faiss file or its slices by lists. The number of
neighbours k and the search depth are those of the shards built from this index
(`<output>/shards/manifest.json`, when its index_manifest_sha256 is this index's): k, and the
depth build-shards tuned; without such shards, PipelineConfig's default k and the depth the
index stage tuned (nprobe). `neighbours`, `depth`, `dedupe` and `candidates` override them
(no manifest records dedupe_neighbours or neighbour_candidates).

Every rule is build-shards' own: chunks cut by `chunk_tokens`, their texts by `chunk_texts`,
embedded by `encode_texts`; one index searched by `search_each_excluding`, slices by
`search_slices` (one slice held at a time); hits made `candidate_rows`, deduplicated by
`select_distinct`, and turned into [L, k, 2m] by `FileTokens` and `neighbour_arrays`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from pipeline.chunks.chunking import chunk_document, load_tokenizer, tokenize_batch
from pipeline.chunks.committed import CommittedChunkFiles
from pipeline.common import fileio
from pipeline.common.arrays import groups, merge_ranges, widest_span
from pipeline.common.fileio import committed
from pipeline.common.models import fingerprint_path, resolve_model, resolve_tokenizer
from pipeline.index.search import search_each_excluding
from pipeline.retrieve.committed import read_committed_index
from pipeline.retrieve.depth import load_searched, search_slices
from pipeline.retrieve.file_tokens import FileTokens
from pipeline.retrieve.search import (
    candidate_rows,
    check_in_database,
    picks_of,
    select_distinct,
)
from pipeline.shards.rows import neighbour_arrays
from schemas.backends import backend_names
from schemas.config import PipelineConfig
from schemas.manifest import IndexManifest, ShardsManifest
from schemas.stage_config import EmbeddingConfig


class IndexNotUsable(RuntimeError):
    """An index directory the retriever cannot serve from: its encoder or tokenizer is missing or
    not the one it was built with. The message names the path and what is missing."""


@dataclass(frozen=True)
class Neighbours:
    """The neighbours of L chunks, as a shard row holds them."""

    tokens: np.ndarray  # int32 [L, k, 2m]: retrieved chunk + its continuation; pad_id where absent
    ids: np.ndarray  # int64 [L, k]: chunk ids, -1 = absent
    scores: np.ndarray  # float32 [L, k]: inner products (cosine), 0 where absent


class Retriever:
    """Neighbours of token chunks from a committed index, one query sequence at a time."""

    def __init__(
        self,
        manifest: IndexManifest,
        chunk_files: CommittedChunkFiles,
        tokenizer,
        encoder,
        *,
        embedding: EmbeddingConfig,
        neighbours: int,
        depth: int | None,
        dedupe: bool,
        candidates: int,
        index=None,
        routing=None,
    ):
        if (index is None) == (routing is None):
            raise ValueError("a Retriever searches one index or slices by lists (routing), one of them")
        self.manifest, self.chunk_files = manifest, chunk_files
        self.tokenizer, self.encoder = tokenizer, encoder
        self.neighbours, self.depth, self.dedupe, self.candidates = neighbours, depth, dedupe, candidates
        self.index, self.routing = index, routing
        self.embedding = embedding  # the setting the index was embedded with (`embedding_of`)
        self._bounds: dict[int, tuple[int, int]] = {}  # chunk file -> its first and last doc id

    @classmethod
    def open(
        cls,
        index_dir: str,
        *,
        neighbours: int | None = None,
        depth: int | None = None,
        dedupe: bool = False,
        candidates: int | None = None,
        device: str = "cpu",
        commit: int | None = None,
    ) -> Retriever:
        """The retriever of the committed index in `index_dir`, its current commit or `commit`
        (module docstring: where each setting comes from). It reads that commit while it is
        kept, whatever is committed after it. IndexNotUsable when its tokenizer or encoder
        cannot be loaded."""
        index, manifest = read_committed_index(index_dir, commit)
        tokenizer = _tokenizer_of(index_dir, manifest)
        check = manifest.embedding_precision
        if check is not None and check.backend not in backend_names():
            raise IndexNotUsable(f"{index_dir}: embedded by backend {check.backend}, not registered in this process")
        embedding = embedding_of(manifest, device)
        encoder = _encoder_of(index_dir, manifest, embedding)
        shards = committed(fileio.join(os.path.dirname(index_dir.rstrip("/")), "shards"), ShardsManifest)
        built = shards if shards is not None and shards.index_manifest_sha256 == index.manifest_sha256 else None
        if neighbours is None:
            neighbours = built.neighbours if built is not None else PipelineConfig.model_fields["neighbours"].default
        if depth is None:
            tuned = built.search_depth if built is not None else None
            depth = tuned.depth if tuned is not None else index.nprobe
        if candidates is None:
            candidates = max(neighbours, PipelineConfig.model_fields["neighbour_candidates"].default)
        index_path, routing = index.searched()
        chunk_files = CommittedChunkFiles(index_dir, index.num_chunks, index.manifest_sha256)
        return cls(
            manifest,
            chunk_files,
            tokenizer,
            encoder,
            embedding=embedding,
            neighbours=neighbours,
            depth=depth,
            dedupe=dedupe,
            candidates=candidates,
            index=None if index_path is None else load_searched(chunk_files, index_path, depth),
            routing=routing,
        )

    @property
    def chunk_tokens(self) -> int:
        return self.manifest.chunk_tokens

    @property
    def pad_id(self) -> int:
        return self.manifest.pad_id

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def tokenize(self, text: str) -> np.ndarray:
        """The token ids of `text` as the index's documents were tokenized."""
        return tokenize_batch(self.tokenizer, [text])[0]

    def decode(self, tokens) -> str:
        """Text of token ids, padding and special tokens dropped."""
        return self.tokenizer.decode([int(t) for t in tokens], skip_special_tokens=True)

    def chunks(self, tokens: np.ndarray):
        """Token ids cut into the index's chunks of m (the last padded), as documents are cut."""
        return list(chunk_document(-1, np.asarray(tokens, np.int32), 0, self.chunk_tokens, self.pad_id))

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        """The query embeddings [L, d] of the chunks of `tokens`, from their texts, by the
        backend, in the precision and with the encoder threads the index was embedded with."""
        from pipeline.embed.embedder import embed_texts
        from pipeline.embed.encoder import chunk_texts

        texts = chunk_texts(self.tokenizer, self.chunks(tokens))
        return embed_texts(self.embedding, self.encoder, texts, self.manifest.encoder_threads)

    def document_ranges(self, doc_ids: Iterable[int]) -> list[tuple[int, int]]:
        """The chunk-id ranges of these documents, merged (a document not in the database
        excludes nothing), as build-shards excludes a sequence's own documents."""
        spans = [self._document_span(int(doc_id)) for doc_id in doc_ids]
        return merge_ranges([span for span in spans if span is not None])

    def _document_span(self, doc_id: int) -> tuple[int, int] | None:
        """A document's chunk ids [first, last + 1), or None. Chunk ids follow doc-id order
        (docs/design.md §9), so a binary search over the chunk files finds the first file whose
        last doc id is not below it, each step reading one file's doc_id column; each file's
        first and last doc id is kept once read (a pair per file), never the chunks nor an
        entry per document."""
        files = self.chunk_files.num_files
        low, high = 0, files
        while low < high:
            middle = (low + high) // 2
            if self._doc_bounds(middle)[1] < doc_id:
                low = middle + 1
            else:
                high = middle
        spans = []
        for number in range(low, files):  # a document may run on into the next file
            docs = self._doc_ids(number)
            rows = np.flatnonzero(docs == doc_id)
            if not len(rows):
                break
            start = self.chunk_files.start(number)
            spans.append((start + int(rows[0]), start + int(rows[-1]) + 1))
            if rows[-1] != len(docs) - 1:
                break
        return widest_span(spans) if spans else None

    def _doc_ids(self, number: int) -> np.ndarray:
        return self.chunk_files.read(number, ["doc_id"])["doc_id"]

    def _doc_bounds(self, number: int) -> tuple[int, int]:
        if number not in self._bounds:
            docs = self._doc_ids(number)
            self._bounds[number] = (int(docs[0]), int(docs[-1]))
        return self._bounds[number]

    def retrieve(
        self,
        tokens: np.ndarray | str,
        exclude_documents: Sequence[int] = (),
        exclude_ranges: Sequence[tuple[int, int]] = (),
    ) -> Neighbours:
        """The neighbours of each chunk of `tokens` (token ids, or text to tokenize), with the
        chunks of `exclude_documents` (doc ids) and the chunk-id `exclude_ranges` skipped inside
        the search."""
        if isinstance(tokens, str):
            tokens = self.tokenize(tokens)
        return self.retrieve_embedded(
            self.embed(tokens), merge_ranges([*self.document_ranges(exclude_documents), *exclude_ranges])
        )

    def retrieve_embedded(self, queries: np.ndarray, excluded: list[tuple[int, int]]) -> Neighbours:
        """The neighbours of query embeddings [L, d], the chunk-id ranges `excluded` (merged) skipped."""
        L, k = len(queries), self.neighbours
        width = self.candidates if self.dedupe else k
        if self.routing is not None:
            scores, ids = search_slices(
                self.routing,
                queries,
                k=width,
                excluded_each=[excluded] * L,
                depth=self.depth,
                chunk_files=self.chunk_files,
            )
        else:
            found = search_each_excluding(self.index, queries, width, [excluded] * L)
            scores, ids = found.scores, found.ids
        hits = candidate_rows(np.zeros(L, np.int64), scores, ids, L)
        check_in_database(hits, self.chunk_files.num_chunks)
        picks = select_distinct(self._with_token_keys(hits), k)[0] if self.dedupe else picks_of(hits)
        values = self._values(picks["chunk_id"])
        return Neighbours(
            *neighbour_arrays(picks, values, chunks_per_seq=L, k=k, m=self.chunk_tokens, pad_id=self.pad_id)
        )

    def _each_file(self, chunk_ids: np.ndarray):
        """(where in `chunk_ids`, the chunk file holding them) for each file holding some,
        read in turn: what is held at once is one chunk file's tokens and the answers."""
        for number, at in groups(self.chunk_files.files_of(chunk_ids)):
            yield at, number

    def _values(self, chunk_ids: np.ndarray) -> np.ndarray:
        """Each chunk's tokens + continuation, int32 [len(chunk_ids), 2m]."""
        values = np.zeros((len(chunk_ids), 2 * self.chunk_tokens), np.int32)
        for at, number in self._each_file(chunk_ids):
            values[at] = FileTokens(self.chunk_files, number, continuation=True).values(chunk_ids[at])
        return values

    def _with_token_keys(self, hits: np.ndarray) -> np.ndarray:
        """A copy of CANDIDATE hits with each chunk's token_key."""
        hits = hits.copy()
        for at, number in self._each_file(hits["chunk_id"]):
            hits[at] = FileTokens(self.chunk_files, number, continuation=False).with_token_keys(hits[at])
        return hits


def _tokenizer_of(index_dir: str, manifest: IndexManifest):
    """The tokenizer the index was built with, or IndexNotUsable."""
    path = resolve_tokenizer(manifest.tokenizer.name)
    if not os.path.isfile(path):
        raise IndexNotUsable(f"{index_dir}: its tokenizer file {path} is missing")
    if fingerprint_path(path) != manifest.tokenizer.fingerprint:
        raise IndexNotUsable(f"{index_dir}: the tokenizer file {path} is not the one the index was built with")
    try:
        return load_tokenizer(path)
    except Exception as err:  # the tokenizers library raises its own exception types
        raise IndexNotUsable(f"{index_dir}: its tokenizer file {path} cannot be loaded: {err}") from err


def embedding_of(manifest: IndexManifest, device: str) -> EmbeddingConfig:
    """The embedding setting (model, backend, precision, quantisation) the index was built
    with, as its manifest's check records it (an older manifest: torch; none: float32)."""
    check = manifest.embedding_precision
    setting = {"backend": check.backend, "precision": check.precision, "quantize": check.quantize} if check else {}
    return EmbeddingConfig(model=manifest.embedding_model.name, device=device, **setting)


def _encoder_of(index_dir: str, manifest: IndexManifest, embedding: EmbeddingConfig):
    """The encoder the index was embedded with (its directory, or a hub name loaded offline),
    in its backend, or IndexNotUsable."""
    from pipeline.embed.embedder import load_embedder, needs_calibration

    if needs_calibration(embedding):
        raise IndexNotUsable(
            f"{index_dir}: built with embedding.backend {embedding.backend} and quantize {embedding.quantize}, "
            "calibrated on its corpus; the retriever does not recalibrate it: rebuild with quantize: none to "
            "retrieve from it"
        )
    name = manifest.embedding_model.name
    path = resolve_model(name)
    if os.path.isabs(path) and not os.path.isdir(path):
        raise IndexNotUsable(f"{index_dir}: its encoder model directory {path} is missing")
    if os.path.isdir(path) and fingerprint_path(path) != manifest.embedding_model.fingerprint:
        raise IndexNotUsable(f"{index_dir}: the encoder model directory {path} is not the one the index was built with")
    try:
        return load_embedder(embedding, manifest.encoder_threads)
    except Exception as err:  # sentence-transformers raises OSError, ValueError, or the hub's own errors
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise IndexNotUsable(f"{index_dir}: its encoder model {path} cannot be loaded: {first}") from err
