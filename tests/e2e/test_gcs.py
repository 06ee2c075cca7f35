"""gs:// end to end against the local GCS emulator: the pipeline reads its corpus from and
commits its outputs to a bucket through Beam's FileSystems, `validate` checks them there, and the
trainer streams the shards from there."""

import io
import json

import pyarrow.parquet as pq
import pytest
from apache_beam.io.filesystems import FileSystems

from pipeline.check.facts import ListedSizes
from pipeline.check.plan import plan_validation
from pipeline.check.problems import ValidationFailed
from pipeline.check.units import units
from pipeline.check.validate import validate_path
from pipeline.common import fileio
from pipeline.jobs.commit import commit_directory
from pipeline.run import run_all
from schemas.config import config_from_dict
from schemas.manifest import FileEntry, VectorIndexManifest
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


def test_a_commit_on_gcs_that_died_moving_its_files_is_finished_by_a_retry(gcs):
    """Beam's GCS rename fails for a file an earlier try moved: the retry finds it in place (one
    listing by name prefix) and commits; a file neither staged nor in place fails the commit
    before its manifest is put."""
    url = gcs.bucket("commit-retry")
    staging, final = f"{url}/out/.staging/index-0123456789ab", f"{url}/out/index"
    paths = [f"chunks/chunks-{i:05d}.parquet" for i in range(5)]
    for path in paths:
        fileio.write_bytes(fileio.join(staging, path), f"new {path}".encode())
    entries = [FileEntry(path=p, rows=1, bytes=1, sha256=fileio.sha256_bytes(f"new {p}".encode())) for p in paths]

    def commit(staged: list[str]) -> None:
        manifest = VectorIndexManifest.model_construct(files=entries, counters={})
        commit_directory(staging, final, manifest, staged, timings=lambda counters: {"job": "index-0123456789ab"})

    FileSystems.rename([fileio.join(staging, p) for p in paths[:2]], [fileio.join(final, p) for p in paths[:2]])
    gone = fileio.join(staging, paths[4])
    kept = fileio.read_bytes(gone)
    FileSystems.delete([gone])  # neither staged nor in place
    with pytest.raises(FileNotFoundError, match=r"1 file\(s\) neither staged nor in place: \['chunks/chunks-00004"):
        commit(paths)
    assert fileio.current_manifest(final) is None
    fileio.write_bytes(gone, kept)  # staged again: the retry commits
    commit(paths)
    assert json.loads(fileio.current_manifest(final)[1])["commit"] == 1
    assert {p: fileio.read_bytes(fileio.join(final, p)).decode() for p in paths} == {p: f"new {p}" for p in paths}
