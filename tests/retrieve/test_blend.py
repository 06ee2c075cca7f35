"""A blend's plan, draws and placement (`pipeline.retrieve.blend`), and the seeded permutation
they rest on: exact counts, every position taken once, the same answer however the sequences
are split among workers."""

import numpy as np
import pytest

from pipeline.common.sampling import Permutation
from pipeline.retrieve.blend import BlendPlan, SourceSize
from pipeline.retrieve.search import QueryBlock
from pipeline.shards.rows import Sequence
from schemas.stage_config import TrainingSource

pytestmark = pytest.mark.unit

L = 4


def _source(name: str, weight: float, **more) -> TrainingSource:
    return TrainingSource(paths=[f"{name}/*.jsonl"], name=name, weight=weight, **more)


SOURCES = [_source("web", 0.6), _source("code", 0.3), _source("kernel", 0.1, repeat=3)]
# the kernel source is small: its repeat of 3 sizes the blend (450,000 tokens), of which web and
# code are subsampled
SIZES = [SourceSize(sequences=9_000, tokens=900_000), SourceSize(sequences=4_000, tokens=300_000)]
SIZES.append(SourceSize(sequences=200, tokens=15_000))


def _plan(sources=SOURCES, sizes=SIZES, seed=5) -> BlendPlan:
    return BlendPlan.of(sources, sizes, seed=seed, chunks_per_seq=L)


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64, 1000, 4097])
def test_a_permutation_takes_every_position_once_and_depends_on_its_seed(size):
    ids = np.arange(size)
    first = Permutation(size, seed=1)(ids)
    assert sorted(first.tolist()) == ids.tolist()
    assert np.array_equal(first, Permutation(size, seed=1)(ids[::-1])[::-1])  # per id, whatever else is asked
    if size > 3:
        assert not np.array_equal(first, Permutation(size, seed=2)(ids))
    with pytest.raises(ValueError, match="outside"):
        Permutation(size, seed=1)(np.array([size]))


def test_the_plan_gives_each_source_its_share_of_tokens_within_its_repeat():
    plan = _plan()
    web, code, kernel = plan.sources
    # kernel binds: 3 passes of 15,000 tokens are its 0.1 of a 450,000-token blend
    assert kernel.draws == 600 and kernel.repeats == 400 and kernel.distinct == 200
    assert web.draws == round(0.6 * 450_000 / 100) and web.repeats == 0  # 100 tokens a sequence
    assert code.draws == round(0.3 * 450_000 / 75) and code.repeats == 0
    tokens = [s.draws * s.tokens / s.sequences for s in plan.sources]
    shares = np.array(tokens) / sum(tokens)
    assert np.allclose(shares, [0.6, 0.3, 0.1], atol=1e-3)
    assert [s.first_draw for s in plan.sources] == [0, web.draws, web.draws + code.draws]
    assert [s.first_chunk for s in plan.sources] == [0, 9_000 * L, 13_000 * L]
    # weights need not sum to 1; max_tokens caps a source and through it the blend
    doubled = _plan([_source(s.name, 2 * s.weight, repeat=s.repeat) for s in SOURCES])
    assert [s.draws for s in doubled.sources] == [s.draws for s in plan.sources]
    capped = _plan([SOURCES[0], SOURCES[1], _source("kernel", 0.1, repeat=3, max_tokens=7_500)])
    assert capped.sources[2].draws == 100 and capped.sources[0].draws == web.draws // 6


def test_a_source_with_no_sequence_or_no_draw_is_an_error_naming_it():
    with pytest.raises(ValueError, match="'code' holds no full sequence of 4 chunks"):
        _plan(sizes=[SIZES[0], SourceSize(sequences=0, tokens=0), SIZES[2]])
    tiny = [_source("web", 1.0), _source("code", 1e-9)]
    with pytest.raises(ValueError, match="'code': its share .* is under half a sequence"):
        _plan(tiny, SIZES[:2])


def test_draws_fill_every_position_once_the_same_however_the_sequences_are_split():
    plan = _plan()
    positions, per_source = [], []
    for number, source in enumerate(plan.sources):
        which, where = plan.copies(number, np.arange(source.sequences))
        counts = np.bincount(which, minlength=source.sequences)
        # each sequence drawn floor or ceil of draws / sequences times
        assert counts.sum() == source.draws and counts.max() - counts.min() <= 1
        assert (counts > 0).sum() == source.distinct
        assert np.array_equal(counts > 0, plan.drawn(number, np.arange(source.sequences)))
        # split into batches of 64 (as packed) or 7: the same draws, the same positions
        for step in (64, 7):
            parts = [
                plan.copies(number, np.arange(a, min(a + step, source.sequences)))
                for a in range(0, source.sequences, step)
            ]
            split = np.concatenate([where for _, where in parts])
            assert np.array_equal(np.sort(split), np.sort(where))
        positions.append(where)
        per_source.append(where)
    everything = np.concatenate(positions)
    assert np.array_equal(np.sort(everything), np.arange(plan.draws))
    # interleaved: each tenth of the blend holds each source near its share of draws
    tenths = [np.bincount(where * 10 // plan.draws, minlength=10) for where in per_source]
    for source, counts in zip(plan.sources, tenths):
        assert np.all(np.abs(counts - source.draws / 10) < 4 * np.sqrt(source.draws / 10) + 2)
    other = _plan(seed=6)
    assert not np.array_equal(other.copies(0, np.arange(64))[1], plan.copies(0, np.arange(64))[1])


def test_sequences_and_their_queries_land_under_the_same_blended_ids():
    plan = _plan()
    kernel = 2
    packed = [Sequence(j, np.full(L * 8 + 1, j, np.int32), (1000 + j,)) for j in range(64)]
    blended = plan.blended(kernel, packed)
    assert all(s.source == kernel and s.doc_ids == (1000 + s.tokens[0],) for s in blended)
    # the chunks of those sequences, embedded under the kernel source's ids; one chunk past them
    chunk_ids = np.arange(64 * L)
    embedded = plan.embedded_ids(kernel, chunk_ids)
    drawn = plan.drawn(kernel, chunk_ids // L)
    assert np.array_equal(embedded >= 0, drawn) and np.array_equal(
        embedded[drawn], plan.sources[kernel].first_chunk + chunk_ids[drawn]
    )
    assert plan.embedded_ids(kernel, np.array([200 * L]))[0] == -1  # the source's tail: in no sequence
    kept = embedded >= 0
    vectors = np.repeat(chunk_ids[kept, None].astype(np.float32), 3, axis=1)  # a vector saying its chunk
    queries = plan.queries(QueryBlock(embedded[kept], vectors))
    expected = {s.seq_id * L + c: s.tokens[0] * L + c for s in blended for c in range(L)}
    assert sorted(queries.chunk_ids.tolist()) == sorted(expected)
    assert all(expected[i] == v for i, v in zip(queries.chunk_ids.tolist(), queries.vectors[:, 0].astype(int).tolist()))
