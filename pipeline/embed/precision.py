"""The check that a build in any setting other than torch float32 (bfloat16, another backend,
int8) finds the neighbours torch float32 finds: on a hash-chosen sample, top-2 agreement and the
Wilson upper bound the build is judged by.
"""

from __future__ import annotations

import math

import numpy as np

from pipeline.chunks.chunking import load_tokenizer
from pipeline.embed.encoder import chunk_texts, encode_texts, load_encoder, resolved_precision, torch_threads
from schemas.backends import REFERENCE_BACKEND, REFERENCE_PRECISION
from schemas.measures import TIE_TOLERANCE, setting_name
from schemas.stage_config import EmbeddingConfig


class PrecisionTooLow(RuntimeError):
    """Embeddings whose neighbours disagree with torch float32's."""


PRECISION_SALT = 4
# One-sided 99% normal quantile: the build fails only when the agreement is below
# min_agreement with 99% confidence, so a small sample is not failed by one near-tie.
AGREEMENT_CONFIDENCE_Z = 2.326


def top2_agreement(reference: np.ndarray, reduced: np.ndarray) -> tuple[int, int]:
    """(slots that agree, slots) over the sample's top-2 neighbours (within the sample, self
    excluded) found in reduced precision: a slot agrees when its neighbour is float32's, or as
    similar as float32's 2nd best within TIE_TOLERANCE (exact ties between duplicate chunks
    have no order)."""
    k = min(2, len(reference) - 1)
    if k < 1:
        return 0, 0
    exact, approximate = reference @ reference.T, reduced @ reduced.T
    np.fill_diagonal(exact, -np.inf)
    np.fill_diagonal(approximate, -np.inf)
    kth = -np.sort(-exact, axis=1)[:, k - 1]
    found = np.argsort(-approximate, axis=1, kind="stable")[:, :k]
    agree = np.take_along_axis(exact, found, axis=1) >= kth[:, None] - TIE_TOLERANCE
    return int(agree.sum()), int(agree.size)


def agreement_upper_bound(agreeing: int, slots: int, z: float = AGREEMENT_CONFIDENCE_Z) -> float:
    """The Wilson score upper bound on the true agreement given `agreeing` of `slots`: the
    largest agreement the sample does not rule out at the bound's confidence (1.0 for no
    slots). 29 of 30 slots -> 0.995; 497 of 512 -> 0.984; 490 of 512 -> 0.974."""
    if slots == 0:
        return 1.0
    p, z2 = agreeing / slots, z * z
    centre = p + z2 / (2 * slots)
    spread = z * math.sqrt(p * (1 - p) / slots + z2 / (4 * slots * slots))
    return min(1.0, (centre + spread) / (1 + z2 / slots))


def safer_setting(cfg: EmbeddingConfig, precision: str) -> str:
    """The change a failed check advises: drop int8 first, then reduced precision, then the backend."""
    if cfg.quantize != "none":
        return "set embedding.quantize: none"
    if precision != REFERENCE_PRECISION:
        return f"set embedding.precision: {REFERENCE_PRECISION}"
    return f"set embedding.backend: {REFERENCE_BACKEND}"


def check_precision(sample, stored, cfg: EmbeddingConfig, tokenizer_path: str, threads: int | None) -> dict:
    """The precision check: the sampled chunks embedded again by torch in float32, compared
    with what the stage stored (nothing to compare for torch float32 itself). Raises
    PrecisionTooLow when even the upper confidence bound of the agreement
    (`agreement_upper_bound`) is below cfg.min_agreement."""
    precision = resolved_precision(cfg)
    chunks = sorted((chunk for _, chunk in sample), key=lambda c: c.chunk_id)
    report = {
        "precision": precision,
        "backend": cfg.backend,
        "quantize": cfg.quantize,
        "sample_size": len(chunks),
        "top2_agreement": 1.0,
        "agreement_upper_bound": 1.0,
        "min_cosine": 1.0,
        "min_agreement": cfg.min_agreement,
    }
    if (cfg.backend, precision) == (REFERENCE_BACKEND, REFERENCE_PRECISION) or not chunks:
        return report
    stored = dict(stored)
    reduced = np.stack([stored[c.chunk_id] for c in chunks])
    with torch_threads(threads):
        reference = encode_texts(load_encoder(cfg), chunk_texts(load_tokenizer(tokenizer_path), chunks), cfg.batch_size)
    agreeing, slots = top2_agreement(reference, reduced)
    agreement = agreeing / slots if slots else 1.0
    upper = agreement_upper_bound(agreeing, slots)
    report.update(
        top2_agreement=agreement,
        agreement_upper_bound=upper,
        min_cosine=float(np.min(np.sum(reference * reduced, axis=1))),
    )
    if upper < cfg.min_agreement:
        raise PrecisionTooLow(
            f"embedding {setting_name(cfg.backend, precision, cfg.quantize)}: only {agreeing} of {slots} top-2 "
            f"neighbour slots of "
            f"{len(chunks)} sampled chunks agree with torch float32 ({agreement:.3f}; at 99% "
            f"confidence at most {upper:.3f}, below min_agreement "
            f"{cfg.min_agreement}); {safer_setting(cfg, precision)}"
        )
    return report
