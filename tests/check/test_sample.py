"""The sample `validate` reads: the same files as sorting every name by its hash, found without
holding a hash per file."""

import numpy as np
import pytest

from pipeline.check.sample import PREFIXES, Sample, name_hash, sample_count


def _lowest(names: list[str], count: int) -> set[str]:
    return set(sorted(names, key=name_hash)[:count])


@pytest.mark.unit
def test_a_threshold_chooses_the_names_that_hash_lowest_in_any_batching():
    rng = np.random.default_rng(0)
    for total in (1, 2, 7, 1000, 3 * PREFIXES // 2):  # past the prefixes: several names share one
        names = [f"chunks/chunks-{n:05d}.parquet" for n in rng.permutation(total * 3)[:total]]
        batches = [names[i : i + 97] for i in range(0, total, 97)]
        for fraction in (0.0001, 0.01, 0.3, 0.999, 1.0):
            sample = Sample.of(fraction, total, lambda batches=batches: iter(batches))
            chosen = {name for name in names if sample.chooses(name)}
            assert len(chosen) == sample.count == sample_count(fraction, total) >= 1
            assert chosen == _lowest(names, sample.count), (total, fraction)


@pytest.mark.unit
def test_a_complete_sample_reads_no_names_and_a_wrong_total_is_refused():
    def never():
        raise AssertionError("names read for a sample of all")

    assert Sample.of(1.0, 5, never).complete
    assert Sample.of(0.5, 1, never).complete  # one file: the one at least
    with pytest.raises(ValueError, match="3 names given for a sample of 4"):
        Sample.of(0.5, 4, lambda: [["a", "b", "c"]])
