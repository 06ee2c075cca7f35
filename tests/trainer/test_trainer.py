"""Trainer: shard dataset (partition, shuffle, resume, refusals; local, and gs:// against the GCS
emulator), RETRO model causality, training runs through `ratrain-train`'s main (e2e)."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from torch.utils.data import DataLoader

from schemas.arrow import SCHEMA_VERSION, SchemaVersionError, read_shard_table, shard_ipc_bytes
from schemas.manifest import FILE_TABLE
from tests.helpers import REPO
from tests.trainer_fixtures import source_rows, write_shard_dir
from trainer import ShardDataset
from trainer.dataset import ShardDataError
from trainer.model import Retro, RetroConfig
from trainer.options import TrainConfig, parse_args
from trainer.train import accumulate_gradients, main, next_token_loss

SHARD_ROWS = [7, 5, 9, 6]  # uneven on purpose: 27 sequences, record batches of 3
SEQ_IDS = set(range(1000, 1000 + sum(SHARD_ROWS)))


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("shards")
    write_shard_dir(directory, shard_rows=SHARD_ROWS)
    return directory


def loader_ids(dataset: ShardDataset, *, batch_size: int, num_workers: int, batches: int | None = None):
    """seq_ids in the order a DataLoader hands them over (at most `batches` batches)."""
    ids = []
    for i, batch in enumerate(DataLoader(dataset, batch_size=batch_size, num_workers=num_workers)):
        if batches is not None and i == batches:
            break
        ids.extend(batch["seq_id"].tolist())
    return ids


# -- dataset --------------------------------------------------------------------------------


@pytest.mark.unit
def test_samples_match_the_shards(shard_dir):
    dataset = ShardDataset(shard_dir)
    assert (dataset.sequence_tokens, dataset.chunk_tokens, dataset.neighbours, dataset.pad_id) == (16, 4, 2, 0)
    reference = source_rows(shard_dir)
    samples = list(dataset)
    assert len(samples) == len(dataset) == 27
    for sample in samples:
        assert sample["seq_id"].dtype == torch.int64 and sample["seq_id"].dim() == 0
        assert sample["tokens"].dtype == torch.int64 and sample["tokens"].shape == (17,)
        assert sample["neighbours"].dtype == torch.int64 and sample["neighbours"].shape == (4, 2, 8)
        assert sample["neighbour_ids"].dtype == torch.int64 and sample["neighbour_ids"].shape == (4, 2)
        assert sample["neighbour_scores"].dtype == torch.float32 and sample["neighbour_scores"].shape == (4, 2)
        row = reference[int(sample["seq_id"])]
        assert np.array_equal(sample["tokens"].numpy(), row["tokens"])
        assert np.array_equal(sample["neighbours"].numpy(), row["neighbours"])
        assert np.array_equal(sample["neighbour_ids"].numpy(), row["neighbour_ids"])
        assert np.array_equal(sample["neighbour_scores"].numpy(), row["neighbour_scores"])


@pytest.mark.unit
def test_reads_schema_version_1_shards(tmp_path):
    """The old layout (IPC file, tensor extension columns) reads as the same samples."""
    old, new = tmp_path / "v1", tmp_path / "v2"
    write_shard_dir(old, shard_rows=[5, 4], schema_version=1)
    write_shard_dir(new, shard_rows=[5, 4])
    assert isinstance(
        read_shard_table(pa.memory_map(str(old / "shard-00000.arrow")))["neighbours"].type, pa.FixedShapeTensorType
    )
    samples = {version: list(ShardDataset(directory, seed=3)) for version, directory in (("1", old), ("2", new))}
    assert len(samples["1"]) == len(samples["2"]) == 9
    for a, b in zip(samples["1"], samples["2"]):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[name], b[name]) for name in a)
    reference = source_rows(old)
    for sample in samples["1"]:
        assert np.array_equal(sample["neighbours"].numpy(), reference[int(sample["seq_id"])]["neighbours"])


@pytest.mark.unit
def test_refuses_a_shard_whose_layout_differs_from_the_manifest(tmp_path):
    write_shard_dir(tmp_path, shard_rows=[3, 3])
    old = tmp_path / "old"
    write_shard_dir(old, shard_rows=[3, 3], schema_version=1)
    (tmp_path / "shard-00001.arrow").write_bytes((old / "shard-00001.arrow").read_bytes())
    size = (tmp_path / "shard-00001.arrow").stat().st_size
    rewrite_manifest(tmp_path, lambda m: m["shards"][1].update(bytes=size))
    with pytest.raises(
        ShardDataError, match=rf"shard-00001\.arrow: metadata schema_version='1', the manifest says {SCHEMA_VERSION}"
    ):
        list(ShardDataset(tmp_path, shuffle=False))


@pytest.mark.unit
def test_a_manifest_whose_entries_are_in_its_file_table_yields_the_same_samples(shard_dir, tmp_path):
    write_shard_dir(tmp_path, shard_rows=SHARD_ROWS, inline_entries=2)
    assert (tmp_path / FILE_TABLE).exists() and json.loads((tmp_path / "manifest.json").read_text())["shards"] == []
    for options in [{"shuffle": True, "seed": 3, "verify": True}, {"shuffle": False, "rank": 1, "world_size": 2}]:
        inline, table = ShardDataset(shard_dir, **options), ShardDataset(tmp_path, **options)
        assert [int(s["seq_id"]) for s in table] == [int(s["seq_id"]) for s in inline]
    (tmp_path / "shard-00002.arrow").write_bytes(b"")
    with pytest.raises(ShardDataError, match="shard-00002.arrow: 0 bytes on disk"):
        list(ShardDataset(tmp_path, shuffle=False))
    # verifying shards against the table's sha256 column first checks the table itself
    table = tmp_path / FILE_TABLE
    table.write_bytes(table.read_bytes()[:-1] + b"!")
    with pytest.raises(ShardDataError, match=f"{FILE_TABLE}: sha256 .* differs from the manifest's"):
        ShardDataset(tmp_path, verify=True)


@pytest.mark.unit
def test_samples_are_writable_and_warning_free(shard_dir, recwarn):
    sample = next(iter(ShardDataset(shard_dir)))
    sample["tokens"][0] = 1  # copies of the mapped rows, not read-only views
    assert not [w for w in recwarn if "writable" in str(w.message)]


def mapped_shards(monkeypatch) -> list[tuple[str, pa.MemoryMappedFile]]:
    """(path, file) of every file pyarrow memory-maps from here on: how a dataset reads local
    shards (the page cache reads ahead)."""
    mapped, memory_map = [], pa.memory_map

    def recorded(path, *args, **kwargs):
        mapped.append((str(path), memory_map(path, *args, **kwargs)))
        return mapped[-1][1]

    monkeypatch.setattr(pa, "memory_map", recorded)
    return mapped


def shard_paths(directory: Path) -> list[str]:
    return [str(directory / f"shard-{i:05d}.arrow") for i in range(len(SHARD_ROWS))]


@pytest.mark.unit
def test_one_shard_is_mapped_at_a_time(shard_dir, monkeypatch):
    dataset = ShardDataset(shard_dir, seed=4)
    mapped = mapped_shards(monkeypatch)
    most_open = max(sum(not f.closed for _, f in mapped) for _ in dataset)
    assert most_open == 1 and sorted(path for path, _ in mapped) == shard_paths(shard_dir)
    assert all(f.closed for _, f in mapped)


@pytest.mark.unit
def test_two_ranks_two_workers_cover_each_sequence_once_per_epoch(shard_dir):
    for epoch in (0, 1):
        seen = []
        for rank in (0, 1):
            dataset = ShardDataset(shard_dir, rank=rank, world_size=2, seed=3, batch_size=2)
            dataset.set_epoch(epoch)
            ids = loader_ids(dataset, batch_size=2, num_workers=2)
            assert len(ids) == len(dataset)
            seen.extend(ids)
        assert sorted(seen) == sorted(SEQ_IDS), f"epoch {epoch}"
    assert {len(ShardDataset(shard_dir, rank=r, world_size=2)) for r in (0, 1)} == {13, 14}


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
@pytest.mark.unit
def test_worker_count_does_not_change_the_order(shard_dir):
    dataset = ShardDataset(shard_dir, rank=1, world_size=2, seed=5, batch_size=3)
    in_process = [int(s["seq_id"]) for s in dataset]
    assert loader_ids(dataset, batch_size=3, num_workers=0) == in_process
    assert loader_ids(dataset, batch_size=3, num_workers=2) == in_process
    assert loader_ids(dataset, batch_size=3, num_workers=3) == in_process


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.unit
def test_batched_mode_yields_the_collated_batches(shard_dir, workers):
    """One batch per block, gathered at once: equal to collating the per-sample stream
    (batches cross shard boundaries: shards of 7, 5, 9, 6 rows, batches of 4)."""

    def loader(batched):
        dataset = ShardDataset(shard_dir, rank=1, world_size=2, seed=6, batch_size=4, batched=batched)
        return list(DataLoader(dataset, batch_size=None if batched else 4, num_workers=workers))

    batched, collated = loader(True), loader(False)
    assert len(batched) == len(collated) == 4  # 14 sequences: 4 + 4 + 4 + 2
    for a, b in zip(batched, collated):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)


@pytest.mark.unit
def test_shuffle_is_deterministic_per_epoch_and_differs_between_epochs(shard_dir):
    def order(epoch, seed=0, shuffle=True):
        dataset = ShardDataset(shard_dir, seed=seed, shuffle=shuffle)
        dataset.set_epoch(epoch)
        return [int(s["seq_id"]) for s in dataset]

    epoch0, epoch1 = order(0), order(1)
    assert sorted(epoch0) == sorted(epoch1) == sorted(SEQ_IDS)
    assert epoch0 != epoch1
    assert order(0) == epoch0
    assert order(0, seed=1) != epoch0
    assert epoch0 != sorted(epoch0)
    manifest_order = sorted(SEQ_IDS)  # the fixture numbers sequences in manifest order
    assert order(0, shuffle=False) == order(1, shuffle=False) == manifest_order


@pytest.mark.parametrize("workers_before, workers_after", [(2, 2), (2, 0), (0, 2)])
@pytest.mark.unit
def test_resume_mid_epoch_yields_exactly_the_rest(shard_dir, workers_before, workers_after):
    def dataset():
        d = ShardDataset(shard_dir, rank=0, world_size=2, seed=7, batch_size=2)
        d.set_epoch(1)
        return d

    uninterrupted = loader_ids(dataset(), batch_size=2, num_workers=workers_before)
    first = dataset()
    consumed = loader_ids(first, batch_size=2, num_workers=workers_before, batches=3)
    first.advance(len(consumed))
    state = json.loads(json.dumps(first.state_dict()))  # survives a checkpoint round trip

    resumed = ShardDataset(shard_dir, rank=0, world_size=2, seed=0, batch_size=2)  # seed comes from state
    resumed.load_state_dict(state)
    rest = loader_ids(resumed, batch_size=2, num_workers=workers_after)
    assert consumed == uninterrupted[:6]
    assert consumed + rest == uninterrupted


@pytest.mark.unit
def test_resume_at_a_position_inside_a_batch(shard_dir):
    full = [int(s["seq_id"]) for s in ShardDataset(shard_dir, seed=2)]
    resumed = ShardDataset(shard_dir, seed=2, batch_size=4)
    resumed.load_state_dict({**resumed.state_dict(), "position": 5})
    assert loader_ids(resumed, batch_size=4, num_workers=2) == full[5:]


@pytest.mark.unit
def test_resume_refuses_a_different_partition(shard_dir):
    state = ShardDataset(shard_dir, rank=0, world_size=2).state_dict()
    with pytest.raises(ValueError, match="world_size"):
        ShardDataset(shard_dir).load_state_dict(state)


def rewrite_manifest(directory: Path, change) -> None:
    path = directory / "manifest.json"
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


@pytest.mark.unit
def test_refuses_an_unknown_manifest_schema_version(tmp_path):
    write_shard_dir(tmp_path, shard_rows=[3])
    rewrite_manifest(tmp_path, lambda m: m.update(schema_version=99))
    with pytest.raises(SchemaVersionError, match="schema_version 99"):
        ShardDataset(tmp_path)


@pytest.mark.unit
def test_refuses_a_shard_with_an_unknown_schema_version(tmp_path):
    write_shard_dir(tmp_path, shard_rows=[3, 3])
    path = tmp_path / "shard-00001.arrow"
    table = read_shard_table(pa.memory_map(str(path)))
    table = table.replace_schema_metadata({**table.schema.metadata, b"schema_version": b"99"})
    path.write_bytes(shard_ipc_bytes(table))
    size = path.stat().st_size
    rewrite_manifest(tmp_path, lambda m: m["shards"][1].update(bytes=size))
    with pytest.raises(SchemaVersionError, match=r"shard-00001\.arrow.*schema_version '99'"):
        list(ShardDataset(tmp_path))


@pytest.mark.unit
def test_refuses_a_row_count_mismatch_naming_the_file(tmp_path):
    write_shard_dir(tmp_path, shard_rows=[4, 5])

    def claim_six_rows(m):
        m["shards"][1]["rows"] = 6
        m["num_sequences"] = 10

    rewrite_manifest(tmp_path, claim_six_rows)
    with pytest.raises(ShardDataError, match=r"shard-00001\.arrow: 5 rows in the file, the manifest says 6"):
        list(ShardDataset(tmp_path))


@pytest.mark.unit
def test_refuses_a_size_mismatch_naming_the_file(tmp_path):
    write_shard_dir(tmp_path, shard_rows=[4, 5])
    with open(tmp_path / "shard-00000.arrow", "ab") as f:
        f.write(b"\0")
    with pytest.raises(ShardDataError, match=r"shard-00000\.arrow: \d+ bytes on disk, the manifest says"):
        list(ShardDataset(tmp_path))


@pytest.mark.unit
def test_verify_refuses_a_shard_whose_bytes_changed_naming_it(tmp_path):
    write_shard_dir(tmp_path, shard_rows=[4, 4])
    path = tmp_path / "shard-00001.arrow"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, same structure, different bytes
    path.write_bytes(bytes(data))
    assert len(list(ShardDataset(tmp_path, shuffle=False))) == 8  # unverified: read as it is
    with pytest.raises(ShardDataError, match=r"shard-00001\.arrow: sha256 \w+ differs"):
        list(ShardDataset(tmp_path, shuffle=False, verify=True))


def truncated_middle_shard(directory: Path) -> list[int]:
    """Shards of 4, 5 and 6 rows, the middle one cut short; the seq_ids of that shard."""
    write_shard_dir(directory, shard_rows=[4, 5, 6])
    path = directory / "shard-00001.arrow"
    path.write_bytes(path.read_bytes()[:-100])
    return list(range(1004, 1009))


@pytest.mark.unit
def test_a_bad_shard_met_mid_epoch_raises_naming_it(tmp_path):
    truncated_middle_shard(tmp_path)
    dataset = ShardDataset(tmp_path, shuffle=False)  # the manifest is all that is read
    samples = iter(dataset)
    assert [int(next(samples)["seq_id"]) for _ in range(4)] == [1000, 1001, 1002, 1003]  # shard 0 reads
    with pytest.raises(ShardDataError, match=r"shard-00001\.arrow: \d+ bytes on disk, the manifest says"):
        next(samples)


@pytest.mark.unit
def test_skip_bad_shards_leaves_out_a_shard_met_mid_epoch_with_a_warning(tmp_path):
    write_shard_dir(tmp_path / "good", shard_rows=[4, 5, 6])
    bad = truncated_middle_shard(tmp_path / "bad")
    in_full = [int(s["seq_id"]) for s in ShardDataset(tmp_path / "good", seed=3)]
    dataset = ShardDataset(tmp_path / "bad", skip_bad_shards=True, seed=3)
    assert len(dataset) == 15 and dataset.skipped == []  # nothing opened yet
    with pytest.warns(UserWarning, match=r"skipping a bad shard: .*shard-00001\.arrow: \d+ bytes on disk"):
        ids = [int(s["seq_id"]) for s in dataset]
    assert ids == [i for i in in_full if i not in bad]  # every other row in its place
    assert len(dataset.skipped) == 1 and "shard-00001.arrow" in dataset.skipped[0]


@pytest.mark.filterwarnings("ignore:skipping a bad shard")
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.unit
def test_skip_bad_shards_in_batched_mode_keeps_the_good_rows_in_order(tmp_path, workers):
    """Blocks of 4 over shards of 4, 5 (bad), 6 rows in manifest order: block 1 is all in the
    bad shard and yields no batch, block 2 keeps its shard-2 rows only. With two workers,
    worker 1 (blocks 1, 3) hands over block 3 in block 1's turn."""
    truncated_middle_shard(tmp_path)
    dataset = ShardDataset(tmp_path, shuffle=False, batch_size=4, batched=True, skip_bad_shards=True)
    batches = [b["seq_id"].tolist() for b in DataLoader(dataset, batch_size=None, num_workers=workers)]
    blocks = [[1000, 1001, 1002, 1003], [1009, 1010, 1011], [1012, 1013, 1014]]
    assert batches == (blocks if workers == 0 else [blocks[0], blocks[2], blocks[1]])


@pytest.mark.unit
def test_refuses_a_missing_shard(tmp_path):
    write_shard_dir(tmp_path, shard_rows=[4, 5])
    (tmp_path / "shard-00001.arrow").unlink()
    with pytest.raises(ShardDataError, match=r"shard-00001\.arrow: shard listed in the manifest is missing"):
        list(ShardDataset(tmp_path))


@pytest.mark.unit
def test_construction_reads_the_manifest_and_no_shard(shard_dir, monkeypatch):
    mapped = mapped_shards(monkeypatch)
    dataset = ShardDataset(shard_dir, verify=True, skip_bad_shards=True)
    assert mapped == []  # (and it builds with no shard file there at all: the next test)
    assert len(list(dataset)) == len(SEQ_IDS)
    assert sorted(path for path, _ in mapped) == shard_paths(shard_dir)  # each once, as reached


@pytest.mark.unit
def test_a_manifest_without_its_shards_builds_and_fails_on_the_first_one_read(shard_dir, tmp_path):
    (tmp_path / "manifest.json").write_bytes((shard_dir / "manifest.json").read_bytes())  # no shard files
    dataset = ShardDataset(tmp_path, seed=4)
    assert len(dataset) == len(SEQ_IDS)
    first_id = int(next(iter(ShardDataset(shard_dir, seed=4)))["seq_id"])  # the same order, shards there
    first = next(
        path.name
        for path in sorted(shard_dir.glob("shard-*.arrow"))
        if first_id in read_shard_table(pa.memory_map(str(path)))["seq_id"].to_pylist()
    )
    with pytest.raises(ShardDataError, match=rf"{re.escape(first)}: shard listed in the manifest is missing"):
        next(iter(dataset))


# -- gs:// (against the local GCS emulator) -----------------------------------------------


@pytest.fixture(scope="module")
def gcs_shards(gcs, shard_dir) -> str:
    url = gcs.bucket("trainer-shards") + "/run/shards"
    return gcs.upload(shard_dir, url)


def _samples_by_id(dataset) -> dict[int, dict]:
    return {int(s["seq_id"]): {k: v.numpy() for k, v in s.items()} for s in dataset}


@pytest.mark.e2e
def test_gcs_stream_equals_the_local_one(gcs_shards, shard_dir):
    remote, local = ShardDataset(gcs_shards, seed=2), ShardDataset(shard_dir, seed=2)
    assert [int(s["seq_id"]) for s in remote] == [int(s["seq_id"]) for s in local]
    a, b = _samples_by_id(remote), _samples_by_id(local)
    assert a.keys() == SEQ_IDS and all(np.array_equal(a[i][k], b[i][k]) for i in a for k in a[i])


@pytest.mark.e2e
def test_gcs_manifest_with_a_file_table_streams_as_the_local_one(gcs, shard_dir, tmp_path):
    write_shard_dir(tmp_path, shard_rows=SHARD_ROWS, inline_entries=2)
    remote = ShardDataset(gcs.upload(tmp_path, gcs.bucket("trainer-table") + "/shards"), seed=2, verify=True)
    assert [int(s["seq_id"]) for s in remote] == [int(s["seq_id"]) for s in ShardDataset(shard_dir, seed=2)]


@pytest.mark.e2e
def test_gcs_two_ranks_two_workers_cover_each_sequence_once(gcs_shards):
    seen = []
    for rank in (0, 1):
        dataset = ShardDataset(gcs_shards, rank=rank, world_size=2, seed=1, batch_size=2)
        seen.extend(loader_ids(dataset, batch_size=2, num_workers=2))
    assert sorted(seen) == sorted(SEQ_IDS)


@pytest.mark.e2e
def test_gcs_reads_ahead_one_shard(gcs_shards, monkeypatch):
    """Each remote object is fetched once: the manifest when the dataset is built, each shard
    while the one before it is read (at most one ahead), never one the epoch does not reach."""
    from trainer import shard_files

    fetched = []  # object keys, in the order requested, from any thread

    class RecordingGcs:  # the dataset's GCS client, recording what it is asked for
        def __init__(self, client):
            self.client = client

        def open_input_stream(self, key, *args, **kwargs):
            fetched.append(key.rsplit("/", 1)[1])
            return self.client.open_input_stream(key, *args, **kwargs)

    gcs_filesystem = shard_files.gcs_filesystem
    monkeypatch.setattr(shard_files, "gcs_filesystem", lambda: RecordingGcs(gcs_filesystem()))
    dataset = ShardDataset(gcs_shards, seed=4)
    assert fetched == ["manifest.json", "manifest-000001.json"]  # the manifest, and a look for a newer commit
    fetched.clear()
    order = []  # the shards in the order the epoch reads them
    for sample in dataset:
        shard = next(i for i, end in enumerate(np.cumsum(SHARD_ROWS)) if int(sample["seq_id"]) < 1000 + end)
        if not order or order[-1] != shard:
            order.append(shard)
            assert len(fetched) <= len(order) + 1  # the shard being read and at most the next one
            if len(order) == 1:  # the next shard is on its way while the first one is read
                deadline = time.monotonic() + 30
                while len(fetched) < 2:  # a readiness poll
                    assert time.monotonic() < deadline, "the next shard was never fetched ahead"
                    time.sleep(0.01)
    assert sorted(fetched) == [f"shard-{i:05d}.arrow" for i in range(len(SHARD_ROWS))]  # each fetched once
    assert fetched == [f"shard-{i:05d}.arrow" for i in order]


@pytest.mark.e2e
def test_gcs_missing_manifest_and_shard_name_the_url(gcs, shard_dir, tmp_path):
    url = gcs.bucket("trainer-broken") + "/shards"
    with pytest.raises(ShardDataError, match="trainer-broken/shards/manifest.json: no manifest"):
        ShardDataset(url)
    gcs.upload(shard_dir, url)
    gcs.client().bucket("trainer-broken").blob("shards/shard-00002.arrow").delete()
    dataset = ShardDataset(url, shuffle=False)
    with pytest.raises(ShardDataError, match="shard-00002.arrow: shard listed in the manifest is missing"):
        list(dataset)
    with pytest.warns(UserWarning, match="skipping a bad shard: .*shard-00002.arrow"):
        ids = [int(s["seq_id"]) for s in ShardDataset(url, shuffle=False, skip_bad_shards=True)]
    assert ids == sorted(SEQ_IDS - set(range(1012, 1021)))  # shard 2's rows (7 + 5 = 12 before it) left out


# -- model ----------------------------------------------------------------------------------

M = 4  # chunk tokens in the model tests


@pytest.fixture(scope="module")
def model() -> Retro:
    torch.manual_seed(0)
    config = RetroConfig(
        vocab_size=50, sequence_tokens=16, chunk_tokens=M, dim=32, depth=3, heads=4, cca_layers=(0, 2), encoder_depth=1
    )
    return Retro(config).eval()


@pytest.fixture(scope="module")
def inputs():
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(1, 50, (2, 16), generator=generator)
    neighbours = torch.randint(1, 50, (2, 16 // M, 2, 2 * M), generator=generator)
    return tokens, neighbours


def changed_positions(before: torch.Tensor, after: torch.Tensor) -> list[int]:
    return (before - after).abs().amax(dim=(0, 2)).nonzero().flatten().tolist()


@torch.no_grad()
@pytest.mark.unit
def test_output_shapes(model, inputs):
    tokens, neighbours = inputs
    assert model(tokens, neighbours).shape == (2, 16, 50)
    assert model(tokens, None).shape == (2, 16, 50)
    assert model(tokens[:, :8], neighbours[:, :2]).shape == (2, 8, 50)


@torch.no_grad()
@pytest.mark.parametrize("t", [0, 5, 11, 15])
@pytest.mark.unit
def test_a_token_changes_no_logit_before_it(model, inputs, t):
    tokens, neighbours = inputs
    edited = tokens.clone()
    edited[:, t] = edited[:, t] % 49 + 1
    changed = changed_positions(model(tokens, neighbours), model(edited, neighbours))
    assert changed and min(changed) == t


@torch.no_grad()
@pytest.mark.parametrize("u", [0, 1, 2, 3])
@pytest.mark.unit
def test_neighbours_of_chunk_u_reach_positions_from_u_plus_one_times_m_minus_one(model, inputs, u):
    tokens, neighbours = inputs
    edited = neighbours.clone()
    edited[:, u] = edited[:, u] % 49 + 1
    changed = changed_positions(model(tokens, neighbours), model(tokens, edited))
    assert changed and min(changed) == (u + 1) * M - 1


@torch.no_grad()
@pytest.mark.unit
def test_pad_neighbours_are_masked_out(model, inputs):
    tokens, neighbours = inputs
    second_absent = neighbours.clone()
    second_absent[:, :, 1] = model.config.pad_id
    only_first = neighbours[:, :, :1]
    assert torch.allclose(model(tokens, second_absent), model(tokens, only_first), atol=1e-5)

    all_absent = torch.full_like(neighbours, model.config.pad_id)
    logits = model(tokens, all_absent)
    assert torch.isfinite(logits).all()
    # With nothing retrieved, CCA adds nothing: the same as skipping retrieval.
    assert torch.allclose(logits, model(tokens, None), atol=1e-5)


@pytest.mark.unit
def test_no_retrieval_model_has_no_encoder_or_cca():
    config = RetroConfig(vocab_size=50, sequence_tokens=16, chunk_tokens=M, dim=32, depth=3, heads=4, retrieval=False)
    model = Retro(config)
    assert model.encoder is None and all(block.cca is None for block in model.blocks)
    assert model(torch.ones(1, 16, dtype=torch.long), None).shape == (1, 16, 50)


@pytest.mark.unit
def test_config_rejects_cca_layers_outside_depth():
    with pytest.raises(ValueError, match="cca_layers"):
        RetroConfig(depth=2, cca_layers=(2,))


# -- training -------------------------------------------------------------------------------

TINY_MODEL = ["--vocab-size", "64", "--dim", "32", "--depth", "2", "--heads", "2", "--encoder-depth", "1"]


@pytest.fixture(scope="module")
def train_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("train")
    write_shard_dir(directory, shard_rows=[40, 40, 40], vocab_size=64)
    return directory


def losses(output: str) -> dict[int, float]:
    return {int(step): float(loss) for step, loss in re.findall(r"step=(\d+) loss=(\S+) tok/s=\S+", output)}


@pytest.mark.unit
def test_loss_leaves_pad_targets_out():
    logits = torch.randn(1, 3, 5)
    targets = torch.tensor([[2, 0, 0]])  # pad_id 0 after the first token
    expected = torch.nn.functional.cross_entropy(logits[0, :1], targets[0, :1])
    assert torch.allclose(next_token_loss(logits, targets, pad_id=0), expected)


@pytest.mark.e2e
def test_training_loss_decreases(train_dir, capsys):
    main(
        [
            "--shards",
            str(train_dir),
            "--steps",
            "30",
            "--batch-size",
            "8",
            "--lr",
            "1e-2",
            "--log-every",
            "1",
            "--seed",
            "1",
            *TINY_MODEL,
        ]
    )
    by_step = losses(capsys.readouterr().out)
    assert sorted(by_step) == list(range(1, 31))
    assert all(math.isfinite(v) for v in by_step.values())
    first, last = np.mean([by_step[s] for s in (1, 2, 3)]), np.mean([by_step[s] for s in (28, 29, 30)])
    assert first > math.log(64) - 0.5  # starts near chance
    assert last < first - 1.5, by_step


@pytest.mark.e2e
def test_validation_on_held_out_shards_is_scored_and_falls(train_dir, tmp_path, capsys):
    held_out = tmp_path / "val"
    write_shard_dir(held_out, shard_rows=[16], vocab_size=64, seed=9, first_seq_id=5000)
    main(
        [
            "--shards",
            str(train_dir),
            "--steps",
            "30",
            "--batch-size",
            "8",
            "--lr",
            "1e-2",
            "--log-every",
            "10",
            "--seed",
            "1",
            "--val-shards",
            str(held_out),
            "--val-every",
            "10",
            *TINY_MODEL,
        ]
    )
    val = {int(s): float(v) for s, v in re.findall(r"step=(\d+) val_loss=(\S+)", capsys.readouterr().out)}
    assert sorted(val) == [10, 20, 30] and val[30] < val[10] - 0.5, val


@pytest.mark.e2e
def test_resumed_training_continues_the_uninterrupted_run(train_dir, tmp_path, capsys):
    # 120 sequences / batch 8: epoch 0 ends at step 15, so resuming at 10 crosses an epoch.
    common = [
        "--shards",
        str(train_dir),
        "--steps",
        "20",
        "--batch-size",
        "8",
        "--lr",
        "1e-2",
        "--log-every",
        "1",
        "--num-workers",
        "2",
        *TINY_MODEL,
    ]
    main(common)
    uninterrupted = losses(capsys.readouterr().out)

    checkpoint = tmp_path / "ckpt.pt"
    main([*common[:3], "10", *common[4:], "--decay-steps", "20", "--checkpoint", str(checkpoint)])
    first_half = losses(capsys.readouterr().out)
    state = torch.load(checkpoint)
    assert state["step"] == 10 and state["ranks"][0]["dataset"]["position"] == 80
    main([*common, "--resume", str(checkpoint)])
    second_half = losses(capsys.readouterr().out)

    assert sorted(second_half) == list(range(11, 21))
    for step, loss in {**first_half, **second_half}.items():
        assert loss == pytest.approx(uninterrupted[step], abs=1e-4), step


@pytest.mark.e2e
def test_no_retrieval_ablation_trains(train_dir, capsys):
    main(["--shards", str(train_dir), "--steps", "3", "--batch-size", "4", "--no-retrieval", *TINY_MODEL])
    output = capsys.readouterr().out
    assert "retrieval=False" in output and len(losses(output)) == 1


@pytest.mark.e2e
def test_tokens_outside_the_vocabulary_stop_the_run_with_one_line(train_dir, capsys):
    with pytest.raises(SystemExit, match="outside the vocabulary .0, 30.: pass --vocab-size"):
        main(["--shards", str(train_dir), "--steps", "2", "--batch-size", "4", *TINY_MODEL[2:], "--vocab-size", "30"])


@pytest.mark.unit
def test_trainer_imports_neither_beam_nor_faiss_nor_sentence_transformers():
    code = (
        "import sys, trainer.train, trainer.evaluate; "
        "print([m for m in ('apache_beam', 'faiss', 'sentence_transformers') if m in sys.modules])"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    )
    assert result.stdout.strip() == "[]"


@pytest.mark.filterwarnings("ignore:skipping a bad shard")
@pytest.mark.unit
def test_an_epoch_with_every_shard_skipped_stops_training_instead_of_looping(tmp_path):
    from trainer.options import TrainError
    from trainer.train import epochs

    write_shard_dir(tmp_path, shard_rows=[4])
    (tmp_path / "shard-00000.arrow").write_bytes(b"not arrow")
    dataset = ShardDataset(tmp_path, batch_size=2, batched=True, skip_bad_shards=True)
    with pytest.raises(TrainError, match="yielded no batch: every shard was skipped"):
        next(epochs(DataLoader(dataset, batch_size=None), dataset))


@pytest.mark.e2e
def test_resume_from_a_checkpoint_at_the_end_of_an_epoch(train_dir, tmp_path, capsys):
    # 120 sequences / batch 8: the checkpoint at step 15 holds position 120 of epoch 0.
    common = [
        "--shards",
        str(train_dir),
        "--steps",
        "17",
        "--batch-size",
        "8",
        "--lr",
        "1e-2",
        "--log-every",
        "1",
        *TINY_MODEL,
    ]
    main(common)
    uninterrupted = losses(capsys.readouterr().out)
    checkpoint = tmp_path / "ckpt.pt"
    main([*common[:3], "15", *common[4:], "--decay-steps", "17", "--checkpoint", str(checkpoint)])
    assert torch.load(checkpoint)["ranks"][0]["dataset"]["position"] == 120
    capsys.readouterr()
    main([*common, "--resume", str(checkpoint)])
    resumed = losses(capsys.readouterr().out)
    assert sorted(resumed) == [16, 17]
    assert all(resumed[s] == pytest.approx(uninterrupted[s], abs=1e-4) for s in resumed), (resumed, uninterrupted)


# -- options, accumulation, precision, metrics ----------------------------------------------


@pytest.mark.unit
def test_every_option_is_a_flag_named_after_its_field():
    config = parse_args(
        [
            "--shards",
            "s",
            "--steps",
            "5",
            "--weight-decay",
            "0.02",
            "--grad-clip",
            "0.5",
            "--min-lr-ratio",
            "0",
            "--grad-accum",
            "3",
            "--precision",
            "bf16",
            "--compile",
            "--no-retrieval",
            "--cca-layers",
            "0,2",
            "--metrics",
            "m.jsonl",
        ]
    )
    assert (config.weight_decay, config.grad_clip, config.min_lr_ratio, config.grad_accum) == (0.02, 0.5, 0.0, 3)
    assert (config.precision, config.compile, config.retrieval, config.cca_layers) == ("bf16", True, False, (0, 2))
    assert config.metrics == "m.jsonl" and config.batch_size == TrainConfig.__dataclass_fields__["batch_size"].default
    assert parse_args(["--shards", "s", "--steps", "5"]).retrieval is True


@pytest.mark.parametrize(
    "flag, value", [("--grad-accum", "0"), ("--batch-size", "0"), ("--steps", "0"), ("--precision", "fp8")]
)
@pytest.mark.unit
def test_out_of_range_options_are_refused(flag, value, capsys):
    argv = ["--shards", "s", "--steps", "5", flag, value]
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert flag in capsys.readouterr().err


@pytest.fixture(scope="module")
def padded_dir(tmp_path_factory) -> Path:
    """Sequences ending in 0 to 8 pad tokens: batches differ in their count of targets."""
    directory = tmp_path_factory.mktemp("padded")
    write_shard_dir(directory, shard_rows=[48], vocab_size=64, pad_tails=True, seed=3)
    return directory


@pytest.mark.unit
def test_grad_accum_gives_the_gradient_of_the_whole_batch(padded_dir):
    batch = next(iter(ShardDataset(padded_dir, batch_size=8, batched=True)))
    halves = [
        {name: tensor[:3] for name, tensor in batch.items()},
        {name: tensor[3:] for name, tensor in batch.items()},
    ]
    config = RetroConfig(vocab_size=64, sequence_tokens=16, chunk_tokens=4, dim=32, depth=2, heads=2, encoder_depth=1)

    def gradients(micro_batches):
        torch.manual_seed(0)
        model = Retro(config)
        loss_sum, targets = accumulate_gradients(
            model,
            micro_batches,
            pad_id=0,
            retrieval=True,
            device=torch.device("cpu"),
            precision="fp32",
            scaler=torch.amp.GradScaler("cpu", enabled=False),
        )
        return float(loss_sum / targets), {name: p.grad for name, p in model.named_parameters()}

    whole_loss, whole = gradients([batch])
    split_loss, split = gradients(halves)
    assert split_loss == pytest.approx(whole_loss, rel=1e-6)
    assert whole.keys() == split.keys()
    for name in whole:
        assert torch.allclose(split[name], whole[name], rtol=1e-4, atol=1e-7), name
    # The test can tell: these halves hold different target counts, so a mean of their
    # per-batch means is not the whole batch's token mean.
    counts = [int((half["tokens"][:, 1:] != 0).sum()) for half in halves]
    assert counts[0] / 3 != counts[1] / 5


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.e2e
def test_grad_accum_2_trains_as_a_batch_twice_as_large(padded_dir, tmp_path, capsys):
    common = ["--shards", str(padded_dir), "--steps", "5", "--lr", "1e-2", "--log-every", "1", *TINY_MODEL]
    runs = {}
    for name, batching in {
        "accumulated": ["--batch-size", "4", "--grad-accum", "2"],
        "whole": ["--batch-size", "8"],
    }.items():
        main(
            [
                *common,
                *batching,
                "--metrics",
                str(tmp_path / f"{name}.jsonl"),
                "--checkpoint",
                str(tmp_path / f"{name}.pt"),
            ]
        )
        runs[name] = (read_metrics(tmp_path / f"{name}.jsonl"), torch.load(tmp_path / f"{name}.pt")["model"])
    (accumulated, accumulated_model), (whole, whole_model) = runs["accumulated"], runs["whole"]
    assert [r["step"] for r in accumulated] == [r["step"] for r in whole] == [1, 2, 3, 4, 5]
    for a, b in zip(accumulated, whole):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["grad_norm"] == pytest.approx(
            b["grad_norm"], rel=1e-4
        )
    # Adam turns rounding noise in gradients that are zero in exact arithmetic (key biases) into
    # updates of ~1e-5; a different gradient would move weights by ~lr = 1e-2.
    assert all(torch.allclose(accumulated_model[k], whole_model[k], atol=1e-4) for k in whole_model)


QUICKSTART_MODEL = ["--vocab-size", "64", "--dim", "128", "--depth", "4", "--heads", "4"]  # the Makefile's


@pytest.mark.e2e
def test_bf16_on_cpu_trains_the_quickstart_model(train_dir, capsys):
    main(
        [
            "--shards",
            str(train_dir),
            "--steps",
            "40",
            "--batch-size",
            "8",
            "--lr",
            "3e-3",
            "--log-every",
            "1",
            "--precision",
            "bf16",
            *QUICKSTART_MODEL,
        ]
    )
    output = capsys.readouterr().out
    by_step = losses(output)
    assert "bf16" in output and sorted(by_step) == list(range(1, 41))
    first, last = np.mean([by_step[s] for s in (1, 2, 3)]), np.mean([by_step[s] for s in (38, 39, 40)])
    assert last < first - 1.5, by_step


@pytest.mark.e2e
def test_fp16_scales_the_loss_and_keeps_the_scale_in_the_checkpoint(train_dir, tmp_path, capsys):
    checkpoint = tmp_path / "ckpt.pt"
    main(
        [
            "--shards",
            str(train_dir),
            "--steps",
            "4",
            "--batch-size",
            "4",
            "--log-every",
            "1",
            "--precision",
            "fp16",
            "--checkpoint",
            str(checkpoint),
            *TINY_MODEL,
        ]
    )
    assert all(math.isfinite(v) for v in losses(capsys.readouterr().out).values())
    assert torch.load(checkpoint)["scaler"]["scale"] > 1  # bf16 and fp32 keep no scaler state
    main(
        [
            "--shards",
            str(train_dir),
            "--steps",
            "5",
            "--batch-size",
            "4",
            "--precision",
            "fp16",
            "--resume",
            str(checkpoint),
            *TINY_MODEL,
        ]
    )
    assert sorted(losses(capsys.readouterr().out)) == [5]


@pytest.mark.e2e
def test_metrics_append_one_json_line_per_log_step_with_validation_loss(train_dir, tmp_path, capsys):
    held_out = tmp_path / "val"
    write_shard_dir(held_out, shard_rows=[8], vocab_size=64, seed=9, first_seq_id=5000)
    metrics = tmp_path / "metrics.jsonl"
    argv = [
        "--shards",
        str(train_dir),
        "--steps",
        "6",
        "--batch-size",
        "4",
        "--log-every",
        "2",
        "--val-shards",
        str(held_out),
        "--val-every",
        "3",
        "--metrics",
        str(metrics),
        *TINY_MODEL,
    ]
    main(argv)
    printed = capsys.readouterr().out
    records = read_metrics(metrics)
    assert [(r["step"], sorted(r)) for r in records] == [
        (2, ["grad_norm", "loss", "lr", "step", "tokens_per_s"]),
        (3, ["step", "val_loss"]),  # scored between log steps
        (4, ["grad_norm", "loss", "lr", "step", "tokens_per_s"]),
        (6, ["grad_norm", "loss", "lr", "step", "tokens_per_s", "val_loss"]),
    ]
    for record in records:
        if "loss" in record:
            assert f"step={record['step']} loss={record['loss']:.4f} tok/s={record['tokens_per_s']:.0f}" in printed
            assert record["grad_norm"] > 0 and record["lr"] > 0
        if "val_loss" in record:
            assert f"step={record['step']} val_loss={record['val_loss']:.4f}" in printed
    main(argv)
    assert len(read_metrics(metrics)) == 2 * len(records)  # appended, not overwritten


@pytest.mark.e2e
def test_tensorboard_writes_scalars_or_says_what_is_missing(train_dir, tmp_path):
    argv = [
        "--shards",
        str(train_dir),
        "--steps",
        "2",
        "--batch-size",
        "4",
        "--log-every",
        "1",
        "--tensorboard",
        str(tmp_path / "tb"),
        *TINY_MODEL,
    ]
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        with pytest.raises(SystemExit, match="--tensorboard needs the tensorboard package"):
            main(argv)
    else:
        main(argv)
        assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


@pytest.mark.e2e
def test_compiled_model_trains_as_the_eager_one(train_dir, capsys):
    argv = ["--shards", str(train_dir), "--steps", "2", "--batch-size", "4", "--log-every", "1", *TINY_MODEL]
    main(argv)
    eager = losses(capsys.readouterr().out)
    main([*argv, "--compile"])  # compiling: ~40 s on 2 cores the first time, ~8 s from inductor's cache
    compiled = losses(capsys.readouterr().out)
    assert sorted(compiled) == [1, 2]
    assert all(compiled[s] == pytest.approx(eager[s], abs=1e-4) for s in eager), (compiled, eager)


@pytest.mark.e2e
def test_a_resumed_run_reads_the_shards_commit_its_checkpoint_counts_in(tmp_path, capsys):
    """Commit 2 of the shards lands between a checkpoint and its resume: the resumed run reads
    commit 1 (its data position counts there) unless told another, which it refuses."""
    shards = tmp_path / "shards"
    write_shard_dir(shards, shard_rows=[16, 16], vocab_size=64)
    manifest = json.loads((shards / "manifest.json").read_text())
    for number in (1, 2):
        (shards / f"manifest-{number:06d}.json").write_text(json.dumps({**manifest, "commit": number}))
    (shards / "manifest-000002.json").rename(shards / "later.json")  # made after the checkpoint
    (shards / "manifest.json").write_text(json.dumps({**manifest, "commit": 1}))  # its copy
    checkpoint = tmp_path / "ckpt.pt"
    common = ["--shards", str(shards), "--batch-size", "4", "--log-every", "1", *TINY_MODEL]
    main([*common, "--steps", "2", "--checkpoint", str(checkpoint)])
    assert torch.load(checkpoint)["ranks"][0]["dataset"]["commit"] == 1
    (shards / "later.json").rename(shards / "manifest-000002.json")
    assert ShardDataset(shards).commit == 2  # the newest, found past the copy
    capsys.readouterr()
    main([*common, "--steps", "3", "--resume", str(checkpoint)])
    assert sorted(losses(capsys.readouterr().out)) == [3]
    with pytest.raises(SystemExit, match="cannot resume: state has commit=1, this dataset 2"):
        main([*common, "--steps", "3", "--resume", str(checkpoint), "--shards-commit", "2"])
    copied = tmp_path / "copied"  # copied as manifest.json and the shards: its copy names commit 1
    copied.mkdir()
    for path in [shards / "manifest.json", *shards.glob("*.arrow")]:
        (copied / path.name).write_bytes(path.read_bytes())
    assert ShardDataset(copied, commit=1).commit == 1 and ShardDataset(copied).commit == 1
    with pytest.raises(ShardDataError, match="no commit 2"):
        ShardDataset(copied, commit=2)
