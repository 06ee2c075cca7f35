"""The cache of Beam's stateful-DoFn look answers as Beam's own walk does: for every DoFn the
project's jobs build, and for the DoFns whose answer differs (state on the class, state on a
method an instance holds)."""

import apache_beam as beam
import pytest
from apache_beam.transforms import userstate
from apache_beam.transforms.userstate import BagStateSpec

from benchmarks.scale_sim import CHUNK_FILE_ROWS, config, index_manifest, write_manifest
from pipeline.build_index.job import build_index
from pipeline.build_shards.job import build_shards
from pipeline.jobs import dofn_specs
from schemas.config import config_from_dict
from tests.helpers import sample_documents, small_config, write_jsonl

BAG = BagStateSpec("seen", beam.coders.VarIntCoder())
SEEN = beam.DoFn.StateParam(BAG)  # a DoFn keeps state where a method defaults to one


class Counting(beam.DoFn):
    def process(self, element, seen=SEEN):
        seen.add(1)
        yield element


class Holder:
    def keyed(self, element, seen=SEEN):
        return element

    def plain(self, element):
        return element


@pytest.mark.unit
def test_a_dofn_with_state_on_its_class_or_on_a_method_it_holds_is_told_apart():
    holder = Holder()
    dofns = [Counting(), beam.FlatMap(holder.keyed).dofn, beam.FlatMap(holder.plain).dofn, beam.Map(len).dofn]
    for dofn in dofns:
        assert dofn_specs.cached_dofn_specs(dofn) == dofn_specs.beams_dofn_specs(dofn), dofn
    stateful = [bool(dofn_specs.cached_dofn_specs(dofn)[0]) for dofn in dofns]
    assert stateful == [True, True, False, False]  # one wrapper class: told apart by the method it holds
    again = dofn_specs.cached_dofn_specs(dofns[0])
    again[0].clear()  # a caller's change does not reach the cache
    assert dofn_specs.cached_dofn_specs(dofns[0])[0] == {BAG}


@pytest.mark.e2e  # dry runs of whole jobs
def test_every_dofn_of_build_index_and_build_shards_gets_beams_own_answer(tmp_path, monkeypatch):
    cached = dofn_specs.cached_dofn_specs
    asked: list[str] = []

    def compared(dofn):
        ours = cached(dofn)
        assert ours == dofn_specs.beams_dofn_specs(dofn), dofn
        asked.append(type(dofn).__name__)
        return ours

    monkeypatch.setattr(dofn_specs, "cached_dofn_specs", compared)  # what new_pipeline puts in place
    monkeypatch.setattr(userstate, "get_dofn_specs", userstate.get_dofn_specs)  # put back afterwards
    write_jsonl(tmp_path / "corpus" / "a.jsonl", sample_documents(2))
    small = config_from_dict(small_config(tmp_path / "small", str(tmp_path / "corpus" / "*.jsonl")))
    build_index(small, [], dry_run=True)
    sliced = config(tmp_path / "sliced")  # an index in slices: the routed search's steps
    write_manifest(tmp_path / "sliced" / "index", index_manifest(4 * CHUNK_FILE_ROWS, sliced))
    build_shards(sliced, [], dry_run=True)
    assert userstate.get_dofn_specs is compared
    assert len(set(asked)) >= 15 and len(asked) > 1_000  # 18 classes, 2,016 looks
