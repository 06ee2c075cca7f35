"""Embed chunks with a frozen sentence-transformers encoder through Beam `RunInference`.

Chunks are grouped by chunk-id range (`chunk_id // (batch_size * BATCHES_PER_GROUP)`), not by
bundle, and a group is cut into batches of similar token counts (`encode_texts`): the encoder's
output depends on batch composition (at the 1e-7 level in float32), so this is what keeps the
embeddings byte-identical whatever the runner or the number of workers. On a CPU it also
depends on the number of intra-op threads (matrix kernels split their sums by thread
count, e.g. AMX kernels on small batches), so every encoder call runs with the job's fixed
thread count (`options.encoder_threads`), recorded in the manifest.
"""

from __future__ import annotations

from collections.abc import Iterable

import apache_beam as beam
import numpy as np
from apache_beam.metrics import Metrics
from apache_beam.ml.inference.base import KeyedModelHandler, ModelHandler, RunInference

from pipeline.chunks.chunking import load_tokenizer
from pipeline.corpus.records import METRICS_NAMESPACE
from pipeline.embed.backends import CALIBRATION_CHUNKS, CALIBRATION_SALT
from pipeline.embed.embedder import embed_texts, load_embedder, needs_calibration
from pipeline.embed.encoder import EmbeddedChunks, chunk_texts
from pipeline.embed.precision import PRECISION_SALT, check_precision
from schemas.stage_config import EmbeddingConfig

# Batches a group of chunks is cut into. Larger groups sort more texts by token count, so
# batches pad less (on the quickstart's chunks at batch 64, padded batches hold 7.7% more
# tokens than the texts with 1 batch a group, 2.9% with 16, 1.6% with 32, 0.7% with all 72 in
# one), but are fewer and larger units of work.
BATCHES_PER_GROUP = 32


class SentenceEncoderHandler(ModelHandler):
    """RunInference handler; one element = one group of chunks (chunk ids, texts), encoded in
    batches of `batch_size` by `embedding.backend`.

    The model is loaded once per worker process (`load_embedder`; the precision check shares
    the torch model); on GPU runners `model_copies=1` shares one copy between a machine's
    processes.
    """

    def __init__(self, cfg: EmbeddingConfig, threads: int | None, model_copies: int | None = None):
        # One element is already a group of batches, so RunInference must not batch again.
        super().__init__(min_batch_size=1, max_batch_size=1, model_copies=model_copies)
        self.cfg, self.threads = cfg, threads

    def load_model(self):
        return load_embedder(self.cfg, self.threads)

    def run_inference(self, batch, model, inference_args=None) -> Iterable[EmbeddedChunks]:
        for chunk_ids, texts in batch:
            Metrics.counter(METRICS_NAMESPACE, "chunks_embedded").inc(len(chunk_ids))
            yield EmbeddedChunks(chunk_ids, embed_texts(self.cfg, model, texts, self.threads))

    def get_num_bytes(self, batch) -> int:
        return sum(len(t) for _, texts in batch for t in texts)

    def get_metrics_namespace(self) -> str:
        return "EmbedChunks"


class _EncodeCalibrated(beam.DoFn):
    """The handler's encoding where the model needs calibration texts from the corpus (static
    int8): they arrive as a side input, which RunInference's model loading cannot take."""

    def __init__(self, handler: SentenceEncoderHandler, tokenizer_path: str, keyed: bool):
        self.handler, self.tokenizer_path, self.keyed = handler, tokenizer_path, keyed

    def setup(self):
        self.model = None

    def process(self, element, calibration):
        if self.model is None:  # the side input is the same for every group: load once
            chunks = sorted((chunk for _, chunk in calibration), key=lambda c: c.chunk_id)
            texts = chunk_texts(load_tokenizer(self.tokenizer_path), chunks)
            self.model = load_embedder(self.handler.cfg, self.handler.threads, texts)
        key, group = element if self.keyed else (None, element)
        for encoded in self.handler.run_inference([group], self.model):
            yield (key, encoded) if self.keyed else encoded


def _group_sample(keyed, salt: int, size: int) -> list:
    """A group's `size` chunks with the smallest hashes of their ids under `salt`, as
    (hash, chunk id, chunk): the sample's candidates from this group, keyed in one numpy call."""
    from pipeline.common.sampling import sample_keys

    chunks = list(keyed[1])
    ids = np.array([c.chunk_id for c in chunks], dtype=np.int64)
    keys = sample_keys(ids, salt)
    return [(int(keys[i]), int(ids[i]), chunks[i]) for i in np.lexsort((ids, keys))[:size]]


def _hash_sample(groups, salt: int, size: int, label: str):
    """The `size` chunks with the smallest hashes of their ids under `salt` (the same whatever
    the grouping or bundling), as one list of (hash, chunk) sorted by hash: each group's
    smallest, then the smallest of those."""
    return (
        groups
        | f"{label}Candidates" >> beam.FlatMap(_group_sample, salt, size)
        | f"{label}Sample" >> beam.combiners.Top.Smallest(size, key=lambda s: s[:2])
        | f"{label}Chunks" >> beam.Map(lambda picked: [(key, chunk) for key, _, chunk in picked])
    )


def _stored_in_sample(group: EmbeddedChunks, sampled: set) -> list:
    """The (chunk id, embedding) pairs of an encoded group whose chunks the check sampled."""
    return [(i, group.vectors[n]) for n, i in enumerate(group.chunk_ids.tolist()) if i in sampled]


class _PrepareGroup(beam.DoFn):
    """(key, a group's chunks) -> (chunk ids, texts) in chunk-id order; `keyed`: as (key, that)."""

    def __init__(self, tokenizer_path: str, keyed: bool = False):
        self.tokenizer_path, self.keyed = tokenizer_path, keyed

    def setup(self):
        self.tokenizer = load_tokenizer(self.tokenizer_path)

    def process(self, element):
        key, chunks = element
        chunks = sorted(chunks, key=lambda c: c.chunk_id)
        prepared = (np.array([c.chunk_id for c in chunks], dtype=np.int64), chunk_texts(self.tokenizer, chunks))
        yield (key, prepared) if self.keyed else prepared


def _groups_of_file(keyed, size: int):
    """(file number, its chunks) -> ((file number, groups in it), group's chunks) for each group of
    the file's chunks by chunk-id range (`chunk_id // size`, as EmbedChunks groups them; a range a
    file boundary cuts is two groups): the file's groups travel fused with it, never shuffled."""
    number, chunks = keyed
    groups: dict[int, list] = {}
    for chunk in chunks:
        groups.setdefault(chunk.chunk_id // size, []).append(chunk)
    for group in sorted(groups):
        yield (number, len(groups)), groups[group]


class _WholeFiles(beam.DoFn):
    """((file number, groups in it), EmbeddedChunks of one group) -> one EmbeddedChunks per file,
    once all its groups are encoded. A file's groups come from one input element of the fused
    step before (`_groups_of_file`) and RunInference batches one group at a time, so they all
    arrive in its bundle; a bundle that ends short of a file fails rather than write it short."""

    def start_bundle(self):
        self.pending: dict[int, list[EmbeddedChunks]] = {}

    def process(self, keyed):
        (number, groups), encoded = keyed
        parts = self.pending.setdefault(number, [])
        parts.append(encoded)
        if len(parts) == groups:
            del self.pending[number]
            parts.sort(key=lambda part: int(part.chunk_ids[0]))
            yield EmbeddedChunks(
                np.concatenate([part.chunk_ids for part in parts]), np.concatenate([part.vectors for part in parts])
            )

    def finish_bundle(self):
        if self.pending:
            raise RuntimeError(
                f"embedding files {sorted(self.pending)} ended a bundle short of their groups: the runner "
                "split the encoding of a file across bundles"
            )


class EmbedChunks(beam.PTransform):
    """Chunk rows -> (EmbeddedChunks, one per group; precision check report), grouped by
    chunk-id range, batched by token count within a group, encoded by `embedding.backend` in
    `embedding.precision` (and quantize) with `threads` intra-op threads on a CPU.
    With `embedding.accelerator` set, the stage carries that Beam resource hint (GPU workers).

    The check: `precision_sample` chunks (the smallest hashes of their ids, so the same ones
    whatever the bundling) are embedded again by torch in float32 and compared with what was
    stored. Static int8 (openvino) is calibrated on another such sample of CALIBRATION_CHUNKS."""

    def __init__(self, cfg: EmbeddingConfig, tokenizer_path: str, threads: int | None):
        super().__init__()
        self.cfg, self.tokenizer_path, self.threads = cfg, tokenizer_path, threads
        if cfg.accelerator:
            self.with_resource_hints(accelerator=cfg.accelerator)

    def expand(self, chunks):
        size = self.cfg.batch_size * BATCHES_PER_GROUP
        grouped = (
            chunks | "KeyByGroup" >> beam.Map(lambda c: (c.chunk_id // size, c)) | "GroupChunks" >> beam.GroupByKey()
        )
        return encoded_and_checked(grouped, self.cfg, self.tokenizer_path, self.threads)


class EmbedChunkFiles(EmbedChunks):
    """(file number, the file's chunks) as the chunk files are written -> (EmbeddedChunks, one per
    file; precision check report): what EmbedChunks does, where each chunk file is written, so
    neither the chunks nor their embeddings are shuffled again. Within a file the chunks are
    encoded in the same chunk-id groups, and the file's embeddings are whole in one element,
    ready to be written where they are."""

    def expand(self, files):
        return encoded_and_checked(files, self.cfg, self.tokenizer_path, self.threads, whole_files=True)


def encoded_and_checked(grouped, cfg: EmbeddingConfig, tokenizer_path: str, threads, *, whole_files: bool = False):
    """(key, chunks) groups -> (EmbeddedChunks, precision check report): a group each, or with
    `whole_files` (the groups are chunk files) a file each, encoded by chunk-id group within it."""
    size = cfg.batch_size * BATCHES_PER_GROUP
    handler = SentenceEncoderHandler(cfg, threads, cfg.model_copies)
    if whole_files:  # each group keyed by its file, so the file's groups are joined after encoding
        grouped_chunks = grouped | "GroupsOfFile" >> beam.FlatMap(_groups_of_file, size)
    else:
        grouped_chunks = grouped
    groups = grouped_chunks | "DecodeTexts" >> beam.ParDo(_PrepareGroup(tokenizer_path, keyed=whole_files))
    if needs_calibration(cfg):
        calibration = _hash_sample(grouped, CALIBRATION_SALT, CALIBRATION_CHUNKS, "Calibration")
        encoded = groups | "Encode" >> beam.ParDo(
            _EncodeCalibrated(handler, tokenizer_path, whole_files), beam.pvalue.AsSingleton(calibration)
        )
    else:
        encoded = groups | "Encode" >> RunInference(KeyedModelHandler(handler) if whole_files else handler)
    if whole_files:
        encoded = encoded | "WholeFiles" >> beam.ParDo(_WholeFiles())
    sample = _hash_sample(grouped, PRECISION_SALT, cfg.precision_sample, "PrecisionCheck")
    sampled = sample | "SampledIds" >> beam.Map(lambda picked: {c.chunk_id for _, c in picked})
    stored = (
        encoded
        | "StoredForCheck" >> beam.FlatMap(_stored_in_sample, beam.pvalue.AsSingleton(sampled))
        | "GatherStored" >> beam.combiners.ToList()
    )
    report = sample | "CheckPrecision" >> beam.Map(
        check_precision, beam.pvalue.AsSingleton(stored), cfg, tokenizer_path, threads
    )
    return encoded, report
