"""Contracts shared by the pipeline and the trainer: config, manifests, Arrow schemas.

Imports neither Beam nor faiss nor torch, so every component can depend on it.
"""

from schemas.arrow import SCHEMA_VERSION

__all__ = ["SCHEMA_VERSION"]
