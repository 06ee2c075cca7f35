"""`inspect`: print training sequences with their decoded neighbours and scores."""

from __future__ import annotations

import posixpath
import textwrap

import pyarrow as pa

from pipeline.build_shards.manifest import neighbour_summary
from pipeline.chunks.chunking import load_tokenizer
from pipeline.common import fileio
from pipeline.common.models import resolve_tokenizer
from pipeline.shards.rows import chunk_overlap
from schemas.arrow import read_shard_table, shard_column, shard_sources
from schemas.manifest import IndexManifest, ShardsManifest

TEXT_CHARS = 240


def _text(tokenizer, ids) -> str:
    text = tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)
    return textwrap.shorten(" ".join(text.split()), TEXT_CHARS, placeholder=" …")


def inspect_shards(directory: str, count: int, max_chunks: int = 4, commit: int | None = None) -> list[str]:
    """The first `count` sequences of the shards (their current commit, or `commit`) with their
    neighbours decoded."""
    # summaries only: the shards' paths come from one column (10^6 entries at 3e10 chunks)
    manifest = fileio.committed_summary(directory, ShardsManifest, number=commit)
    index = fileio.committed_summary(posixpath.join(posixpath.dirname(directory.rstrip("/")), "index"), IndexManifest)
    tokenizer = load_tokenizer(resolve_tokenizer(index.tokenizer.name))
    m = manifest.chunk_tokens
    lines: list[str] = [f"{directory}: {manifest.num_sequences} sequences, {neighbour_summary(manifest)}"]
    check = index.embedding_precision
    if check is not None:
        lines.append(f"embeddings in {check.summary()}")
    lines += [f"source {source.summary()}" for source in manifest.sources]
    for path in fileio.entry_paths_and_rows(manifest, directory)[0]:
        table = read_shard_table(pa.BufferReader(fileio.read_bytes(fileio.join(directory, path))))
        tokens = shard_column(table, "tokens")
        neighbours = shard_column(table, "neighbours")
        ids = shard_column(table, "neighbour_ids")
        scores = shard_column(table, "neighbour_scores")
        names, sources = shard_sources(table)
        for row in range(table.num_rows):
            if count <= 0:
                return lines
            count -= 1
            chunks = neighbours.shape[1] if max_chunks <= 0 else min(max_chunks, neighbours.shape[1])
            overlap = chunk_overlap(
                tokens[row, : neighbours.shape[1] * m].reshape(-1, m), neighbours[row], manifest.pad_id
            )
            source = f"source {names[sources[row]]}, " if manifest.sources else ""
            lines.append(
                f"== sequence {table['seq_id'][row].as_py()} ({source}documents "
                f"{table['doc_ids'][row].as_py()}), first {chunks} of {neighbours.shape[1]} chunks"
            )
            for j in range(chunks):
                lines.append(
                    f"-- chunk {j} (overlap r(C) = {overlap[j]:.3f}): "
                    f"{_text(tokenizer, tokens[row, j * m : (j + 1) * m])}"
                )
                for q in range(neighbours.shape[2]):
                    if ids[row, j, q] < 0:
                        lines.append(f"   neighbour {q}: (none)")
                        continue
                    lines.append(
                        f"   neighbour {q} [chunk {ids[row, j, q]}, score "
                        f"{scores[row, j, q]:.3f}]: {_text(tokenizer, neighbours[row, j, q, :m])}"
                    )
    return lines
