"""Contracts shared by the pipeline and the trainer: config, manifests, Arrow schemas.

Imports neither Beam nor faiss nor torch, so every component can depend on it. Its modules, one
line each: docs/design.md §2.
"""

from importlib.metadata import PackageNotFoundError, version

from schemas.arrow import SCHEMA_VERSION

try:  # the distribution's version: pipeline, schemas and trainer ship together
    __version__ = version("ratrain-pipeline")
except PackageNotFoundError:  # a source tree that is not installed
    __version__ = "0.0.0+src"

__all__ = ["SCHEMA_VERSION", "__version__"]
