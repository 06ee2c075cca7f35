"""Tokenise documents and cut them into chunks of m tokens with dense, stable chunk ids.

Chunk ids are dense (0 … N-1) and stable: documents are ordered by doc id and each takes the
next `ceil(tokens / m)` ids. They are assigned without any table of all documents: doc ids
are uniform 63-bit hashes, so their top bits split them into 2^16 buckets that are contiguous,
ordered doc-id ranges; a prefix sum over the buckets' chunk counts (a side input of at most
2^16 entries) gives each bucket its first id, and each bucket, grouped on one worker, numbers
its own documents in doc-id order. A chunk row carries its continuation — the next chunk of the
same document, or pad where the document ends — so a neighbour never runs into another
document (docs/design.md §5). (Training sequences are packed in `pipeline.retrieve.sequences`.)
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
from tokenizers import Tokenizer

TOKENIZE_BATCH_CHARS = 1 << 20  # text tokenized in one batched call, at most (one longer document alone)
TOKENIZE_PIECE_CHARS = 1 << 16  # a longer text is tokenized a piece at a time: the tokenizer holds
# ~128 bytes per byte of text it is given (2 GB for a 16 MiB text, measured with the bundled tokenizer)
_WORD_END = re.compile(r"(?<=\S)\s")  # where whitespace begins after a word: a cut that changes no token
BUCKET_BITS = 16  # doc-id buckets of the chunk-id prefix sum: 65,536 offsets at most


@dataclass(frozen=True)
class Chunk:
    chunk_id: int
    doc_id: int
    position: int  # index of the chunk within its document
    tokens: np.ndarray  # int32 [m]
    continuation: np.ndarray  # int32 [m]: next chunk of the same document, or pad


@functools.lru_cache(maxsize=4)
def load_tokenizer(path: str) -> Tokenizer:
    """A whole-document tokenizer: truncation and padding off (the bundled file truncates at 128)."""
    tokenizer = Tokenizer.from_file(path)
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def pad_id_of(tokenizer: Tokenizer) -> int:
    for token in ("[PAD]", "<pad>", "<|pad|>", "<|endoftext|>"):
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return token_id
    return 0


def text_pieces(text: str, piece_chars: int = TOKENIZE_PIECE_CHARS) -> list[str]:
    """`text` cut into pieces of at most `piece_chars` characters, each cut where whitespace
    begins after a word, so that tokenizers that split at whitespace give the same tokens
    piece by piece. A stretch of `piece_chars` with no such place is cut where it ends."""
    pieces, start = [], 0
    while len(text) - start > piece_chars:
        end = start + piece_chars
        cuts = [m.start() for m in _WORD_END.finditer(text, start + 1, end + 1)]
        cut = cuts[-1] if cuts else end
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


def tokenize_batch(tokenizer: Tokenizer, texts: list[str]) -> list[np.ndarray]:
    """Token ids of each text, without special tokens. The texts' pieces (`text_pieces`) go to
    the tokenizer in batched calls of at most `TOKENIZE_BATCH_CHARS`, so its memory is bounded
    by that, not by the longest text."""
    pieces = [text_pieces(text) for text in texts]
    flat = [piece for text in pieces for piece in text]
    ids: list[np.ndarray] = []
    call: list[str] = []
    chars = 0  # in `call`
    for i, piece in enumerate(flat):
        call.append(piece)
        chars += len(piece)
        if i + 1 == len(flat) or chars + len(flat[i + 1]) > TOKENIZE_BATCH_CHARS:
            ids += [np.asarray(e.ids, dtype=np.int32) for e in tokenizer.encode_batch(call, add_special_tokens=False)]
            call, chars = [], 0
    numbered = iter(ids)
    return [np.concatenate([next(numbered) for _ in text]) for text in pieces]  # every text has a piece


def num_chunks(num_tokens: int, m: int) -> int:
    return -(-num_tokens // m)


def chunk_tokens(tokens: np.ndarray, m: int, pad_id: int) -> np.ndarray:
    """[ceil(len/m), m] chunks, the last one padded."""
    rows = num_chunks(len(tokens), m)
    chunks = np.full((rows, m), pad_id, dtype=np.int32)
    chunks.reshape(-1)[: len(tokens)] = tokens
    return chunks


def chunk_document(doc_id: int, tokens: np.ndarray, first_chunk_id: int, m: int, pad_id: int) -> Iterator[Chunk]:
    """The chunks of one document, ids from `first_chunk_id`, each with its continuation."""
    chunks = chunk_tokens(tokens, m, pad_id)
    padding = np.full(m, pad_id, dtype=np.int32)
    for i, row in enumerate(chunks):
        continuation = chunks[i + 1] if i + 1 < len(chunks) else padding
        yield Chunk(first_chunk_id + i, doc_id, i, row, continuation)


def chunk_offsets(chunk_counts: Iterable[tuple[int, int]], first_chunk_id: int = 0) -> dict[int, int]:
    """{key: first chunk id}: keys (doc ids, or buckets of them) in order, ids dense from
    `first_chunk_id`."""
    offsets, next_id = {}, first_chunk_id
    for doc_id, count in sorted(chunk_counts):
        offsets[doc_id] = next_id
        next_id += count
    return offsets


def bucket_of(doc_id: int, bits: int = BUCKET_BITS) -> int:
    """The doc-id bucket: the top `bits` of the 63-bit doc id, so buckets are contiguous doc-id
    ranges in doc-id order."""
    return doc_id >> (63 - bits)
