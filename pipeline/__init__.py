"""ratrain-pipeline: Beam jobs that turn a corpus into RETRO-style training shards.

A package per stage, in the order data flows: `corpus`, `chunks`, `embed`, `index`, `retrieve`,
`shards`; `jobs` holds what every Beam job shares, `build_index` and `build_shards` are the
jobs (`run` both), `check` looks at their outputs, `common` serves them all, and `cli` is the
command line. Its packages and modules, one line each, and the layers they keep:
docs/design.md §2.
"""

from schemas import __version__

__all__ = ["__version__"]
