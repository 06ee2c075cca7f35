"""Beam's look for a DoFn's state and timer specs, answered once per DoFn class.

Beam 2.77 asks `userstate.get_dofn_specs` whether a DoFn keeps state about eight times per
ParDo while a pipeline is built, sent and run (the ParDo's checks, its runner API form, each
bundle's operations), and each time it walks `dir(dofn)` and reads the signature of every
method (~1.2 ms a DoFn here). A build-index and build-shards of six documents asked 2,624
times: ~3 s of their ~14 s on the local runner, a cost no corpus size amortises in small runs.
The answer depends only on the methods' default arguments (a StateParam or TimerParam), which
belong to the class, plus any bound method an instance holds itself (`beam.FlatMap(bound_method)`
keeps it as `process`): those are the cache key, so every DoFn gets the answer Beam's walk gives
(`tests/jobs/test_dofn_specs.py` compares the two over every step of the project's jobs).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import apache_beam as beam
from apache_beam.transforms import userstate

CHECKED_BEAM_VERSION = "2.77.0"  # the release whose get_dofn_specs this cache was checked against

Specs = tuple[set, set]
beams_dofn_specs: Callable[[Any], Specs] = userstate.get_dofn_specs  # Beam's own walk
_found: dict[tuple, tuple[frozenset, frozenset]] = {}


def specs_key(dofn: Any) -> tuple | None:
    """What Beam's walk over `dofn` depends on, or None where that cannot be told from outside
    (no instance dictionary)."""
    try:
        own = vars(dofn)
    except TypeError:
        return None
    methods = sorted((name, value.__func__) for name, value in own.items() if isinstance(value, types.MethodType))
    return type(dofn), tuple(methods)


def cached_dofn_specs(dofn: Any) -> Specs:
    """`userstate.get_dofn_specs(dofn)`, computed once per key (fresh sets: callers may change them)."""
    key = specs_key(dofn)
    if key is None:
        return beams_dofn_specs(dofn)
    if key not in _found:
        found_states, found_timers = beams_dofn_specs(dofn)
        _found[key] = frozenset(found_states), frozenset(found_timers)
    states, timers = _found[key]
    return set(states), set(timers)


def cache_dofn_specs() -> bool:
    """Answer Beam's spec look from the cache in this process, on the Beam release it was checked
    against (another keeps Beam's own walk). Whether the cache is in place."""
    if beam.__version__ != CHECKED_BEAM_VERSION:
        return False
    userstate.get_dofn_specs = cached_dofn_specs
    return True
