"""ratrain-pipeline: Beam stages that turn a corpus into RETRO-style training shards."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("ratrain-pipeline")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+src"
