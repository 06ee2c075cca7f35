"""gs:// end to end against the local GCS emulator: the pipeline reads its corpus from and
commits its outputs to a bucket through Beam's FileSystems, `validate` checks them there, and the
trainer streams the shards from there."""

import io
import json

import pyarrow.parquet as pq
import pytest

from pipeline.check.facts import ListedSizes
from pipeline.check.plan import plan_validation
from pipeline.check.problems import ValidationFailed
from pipeline.check.units import units
from pipeline.check.validate import validate_path
from pipeline.run import run_all
from schemas.config import config_from_dict
from tests.helpers import BAD_RECORDS, is_manifest, read_rejected, sample_documents, small_config, write_jsonl
from trainer import ShardDataset

pytestmark = pytest.mark.e2e


def _blobs(gcs, bucket: str, prefix: str) -> dict[str, bytes]:
    return {
        b.name[len(prefix) + 1 :]: b.download_as_bytes() for b in gcs.client().list_blobs(bucket, prefix=prefix + "/")
    }


def test_run_on_gcs_gives_the_local_bytes_and_streams_to_the_trainer(gcs, built_output, tmp_path):
    root, local_config, _ = built_output
    docs = sample_documents(16)  # the corpus of `built_output`, uploaded
    write_jsonl(tmp_path / "corpus" / "a.jsonl", docs[:8])
    write_jsonl(tmp_path / "corpus" / "b.jsonl", docs[8:] + BAD_RECORDS)
    bucket = gcs.bucket("ratrain-e2e")
    gcs.upload(tmp_path / "corpus", f"{bucket}/corpus")
    config = small_config(f"{bucket}/out", f"{bucket}/corpus/*.jsonl")
    report = run_all(config_from_dict(config), [])
    assert [status for status, _ in report.values()] == ["built", "built"]

    remote = _blobs(gcs, "ratrain-e2e", "out")
    local = {p.relative_to(root / "out").as_posix(): p.read_bytes() for p in (root / "out").rglob("*") if p.is_file()}

    def same(key):  # query speed is measured per run; rejected records and sources files name their source
        return not (is_manifest(key.rsplit("/", 1)[-1]) or key.startswith(("rejected/", "index/sources/")))

    assert not any(k.startswith(".staging/") for k in remote)
    assert {k: v for k, v in remote.items() if same(k)} == {k: v for k, v in local.items() if same(k)}
    rejected = [
        json.loads(line)
        for key, data in sorted(remote.items())
        if key.startswith("rejected/build-index-")
        for line in data.decode().splitlines()
    ]
    assert len(rejected) == len(read_rejected(root / "out", "build-index"))
    assert all(r["source"].startswith("gs://ratrain-e2e/corpus/") for r in rejected)
    sources = [pq.read_table(io.BytesIO(data)) for key, data in remote.items() if key.startswith("index/sources/")]
    assert sources and all(s.startswith("gs://ratrain-e2e/corpus/") for t in sources for s in t["source"].to_pylist())

    lines = validate_path(f"{bucket}/out")
    assert len(lines) == 2 and all(line.startswith("OK") for line in lines)
    dataset = ShardDataset(f"{bucket}/out/shards", seed=1)
    manifest = json.loads(remote["shards/manifest.json"])
    assert sorted(int(s["seq_id"]) for s in dataset) == list(range(manifest["num_sequences"]))
    assert [status for status, _ in run_all(config_from_dict(config), []).values()] == ["skipped", "skipped"]
    assert _blobs(gcs, "ratrain-e2e", "out") == remote  # the re-run changed nothing

    # a sample lists the files it does not read by name prefix, and finds one cut short
    assert all(line.startswith("OK") for line in validate_path(f"{bucket}/out", 0.2))
    plan = plan_validation(f"{bucket}/out", 0.2)
    listed = (entry.path for sizes in units(plan, ListedSizes) for entry in sizes.entries)
    unsampled = next(path for path in listed if path.startswith("shard-"))
    gcs.client().bucket("ratrain-e2e").blob(f"out/shards/{unsampled}").upload_from_string(b"short")
    with pytest.raises(ValidationFailed, match=f"{unsampled}: 5 bytes, manifest says"):
        validate_path(f"{bucket}/out", 0.2)


def test_a_config_on_gcs_is_read_from_there(gcs, tmp_path, capsys):
    from pipeline.cli import main
    from tests.helpers import write_config

    bucket = gcs.bucket("ratrain-config")
    (tmp_path / "conf").mkdir()
    write_config(tmp_path / "conf" / "c.yaml", small_config(f"{bucket}/out", f"{bucket}/corpus/*.jsonl", neighbours=3))
    gcs.upload(tmp_path / "conf", f"{bucket}/conf")
    main(["build-shards", "--config", f"{bucket}/conf/c.yaml", "--dry-run"])
    assert json.loads(capsys.readouterr().out)["build-shards"]["stages"]
    with pytest.raises(SystemExit):
        main(["build-shards", "--config", f"{bucket}/conf/missing.yaml", "--dry-run"])
    assert "config file not found: gs://ratrain-config/conf/missing.yaml" in capsys.readouterr().err
