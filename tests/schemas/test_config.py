import pytest

from pipeline.cli import main
from schemas.config import ConfigError, config_from_dict, load_config
from schemas.stage_config import parse_size
from tests.helpers import small_config, write_config

pytestmark = pytest.mark.unit


def test_defaults_and_sizes(tmp_path):
    cfg = config_from_dict(small_config(tmp_path / "out", "x/*.jsonl"))
    assert cfg.chunks_per_sequence == 4
    assert cfg.training() is cfg.retrieval_corpus
    assert cfg.embedding.model == "all-MiniLM-L6-v2"
    assert parse_size("64MB") == 64_000_000 and parse_size("2GiB") == 2 * 2**30


def test_unknown_key_names_the_field(tmp_path):
    data = small_config(tmp_path, "x")
    data["embedding"] = {"batch_szie": 3}
    with pytest.raises(ConfigError, match=r"embedding\.batch_szie: unknown key"):
        config_from_dict(data)


def test_wrong_type_names_the_field(tmp_path):
    data = small_config(tmp_path, "x", chunk_tokens="many")
    with pytest.raises(ConfigError, match=r"chunk_tokens: .*integer"):
        config_from_dict(data)


def test_sequence_must_be_whole_chunks(tmp_path):
    with pytest.raises(ConfigError, match="multiple of chunk_tokens"):
        config_from_dict(small_config(tmp_path, "x", sequence_tokens=100))


def test_bad_format_and_size(tmp_path):
    data = small_config(tmp_path, "x")
    data["retrieval_corpus"]["format"] = "csv"
    data["index"] = {"memory_budget": "lots"}
    with pytest.raises(ConfigError) as err:
        config_from_dict(data)
    assert "retrieval_corpus.format" in str(err.value) and "index.memory_budget" in str(err.value)


def test_output_does_not_change_config_hashes(tmp_path):
    a = config_from_dict(small_config(tmp_path / "a", "x"))
    b = config_from_dict(small_config(tmp_path / "b", "x"))
    c = config_from_dict(small_config(tmp_path / "a", "x", neighbours=3))
    assert a.index_hash() == b.index_hash() and a.shards_hash() == b.shards_hash()
    assert a.index_hash() == c.index_hash() and a.shards_hash() != c.shards_hash()


def test_shard_bytes_decides_rows_per_shard(tmp_path):
    rows_only = config_from_dict(small_config(tmp_path, "x", shard_rows=16))
    assert rows_only.rows_per_shard() == 16
    # n=128, m=32, k=2: 8 + 4·129 + 8 slots · (4·64 + 12) + 32 = 2,700 bytes a row
    by_size = config_from_dict(small_config(tmp_path, "x", shard_bytes="1MB"))
    assert by_size.rows_per_shard() == 1_000_000 // 2_700
    assert config_from_dict(small_config(tmp_path, "x", shard_bytes=10)).rows_per_shard() == 1
    assert by_size.shards_hash() != rows_only.shards_hash()
    with pytest.raises(ConfigError, match="shard_bytes"):
        config_from_dict(small_config(tmp_path, "x", shard_bytes="-3"))


def _cli_error(args, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


def test_cli_missing_config_is_one_line(tmp_path, capsys):
    line = _cli_error(["build-index", "--config", str(tmp_path / "nope.yaml")], capsys)
    assert "config file not found" in line


def test_cli_invalid_config_is_one_line(tmp_path, capsys):
    path = write_config(tmp_path / "c.yaml", small_config(tmp_path, "x", neighbours=0))
    line = _cli_error(["run", "--config", str(path)], capsys)
    assert "neighbours" in line


def test_cli_glob_matching_nothing_is_one_line(tmp_path, capsys):
    path = write_config(tmp_path / "c.yaml", small_config(tmp_path / "out", str(tmp_path / "none*.jsonl")))
    line = _cli_error(["build-index", "--config", str(path)], capsys)
    assert "matches no file" in line and "none*.jsonl" in line


def test_cli_build_shards_without_index(tmp_path, capsys):
    (tmp_path / "c.jsonl").write_text('{"id": 1, "text": "x"}\n')
    path = write_config(tmp_path / "c.yaml", small_config(tmp_path / "out", str(tmp_path / "*.jsonl")))
    line = _cli_error(["build-shards", "--config", str(path)], capsys)
    assert "run build-index first" in line


def test_load_config_reads_yaml(tmp_path):
    path = write_config(tmp_path / "c.yaml", small_config(tmp_path / "out", "x/*.jsonl"))
    assert load_config(path).neighbours == 2


def test_the_default_encoder_width_is_read_without_loading_it():
    from pipeline.common.models import embedding_dim

    assert embedding_dim("all-MiniLM-L6-v2") == 384
    assert embedding_dim("some-org/a-hub-model") is None  # not local: checked when it is built


def test_an_unbuildable_index_type_fails_before_reading_anything(tmp_path):
    from pipeline.build_index.job import build_index
    from pipeline.index.factory import IndexBuildError

    cfg = config_from_dict(
        small_config(tmp_path / "out", str(tmp_path / "no-such-corpus-*.jsonl"), index={"type": "IVF64,PQ7"})
    )
    with pytest.raises(IndexBuildError, match=r"'IVF64,PQ7' is not a valid faiss factory string for dim 384"):
        build_index(cfg, [])  # the corpus glob matches nothing: the index type was checked first
    assert not (tmp_path / "out").exists()


def test_one_encoder_per_gpu_by_default(tmp_path):
    gpu = config_from_dict(
        small_config(tmp_path, "x", embedding={"device": "cuda", "accelerator": "type:nvidia-l4;count:1"})
    )
    assert gpu.embedding.model_copies == 1  # every SDK process of a GPU worker sees the GPU
    two = config_from_dict(
        small_config(tmp_path, "x", embedding={"accelerator": "type:nvidia-l4;count:2", "model_copies": 2})
    )
    assert two.embedding.model_copies == 2
    assert config_from_dict(small_config(tmp_path, "x")).embedding.model_copies is None


def test_placement_hints_do_not_change_what_is_built(tmp_path):
    plain = config_from_dict(small_config(tmp_path, "x"))
    placed = config_from_dict(
        small_config(
            tmp_path,
            "x",
            embedding={**plain.embedding.model_dump(), "accelerator": "type:nvidia-l4;count:1", "model_copies": 1},
            index={"min_ram": "64GB"},
        )
    )
    assert (plain.embed_hash(), plain.index_hash(), plain.shards_hash()) == (
        placed.embed_hash(),
        placed.index_hash(),
        placed.shards_hash(),
    )


def _hashes(config: dict) -> tuple[str, str, str]:
    cfg = config_from_dict(config)
    return cfg.embed_hash(), cfg.index_hash(), cfg.shards_hash()


def test_an_evaluation_corpus_changes_the_hashes_of_the_stages_it_decontaminates_and_only_those(tmp_path):
    plain = small_config(tmp_path / "out", "corpus/*.jsonl")
    evaluation = {"paths": ["eval/*.jsonl"], "id_field": "id"}
    training = {"paths": ["train/*.jsonl"], "id_field": "id"}
    embed, index, shards = _hashes(plain)
    with_eval = _hashes({**plain, "evaluation_corpus": evaluation})
    assert with_eval[0] != embed and with_eval[1] != index and with_eval[2] == shards  # training: same
    other_eval = _hashes({**plain, "evaluation_corpus": [evaluation, {"paths": ["more/*.jsonl"]}]})
    assert other_eval[0] != with_eval[0]
    stricter = _hashes({**plain, "evaluation_corpus": evaluation, "decontamination": {"threshold": 0.7}})
    assert stricter[0] != with_eval[0]

    separate = {**plain, "training_corpus": training}
    base = _hashes(separate)
    only_training = _hashes(
        {**separate, "evaluation_corpus": evaluation, "decontamination": {"apply_to": ["training"]}}
    )
    assert only_training[:2] == base[:2] and only_training[2] != base[2]
    only_retrieval = _hashes(
        {**separate, "evaluation_corpus": evaluation, "decontamination": {"apply_to": ["retrieval"]}}
    )
    assert only_retrieval[0] != base[0] and only_retrieval[2] == base[2]
    assert _hashes({**plain, "decontamination": {"threshold": 0.7}}) == (embed, index, shards)  # no evaluation: off


def test_decontaminating_only_training_with_the_same_corpus_is_a_config_error(tmp_path):
    config = small_config(tmp_path / "out", "corpus/*.jsonl")
    config.update(evaluation_corpus={"paths": ["eval/*.jsonl"]}, decontamination={"apply_to": ["training"]})
    with pytest.raises(ConfigError, match=r"apply_to \[training\] with training_corpus: same"):
        config_from_dict(config)


def _blend(*sources, **more):
    return config_from_dict(
        {**small_config("/tmp/o", "c/*.jsonl"), "training_corpus": [dict(source) for source in sources], **more}
    )


def test_a_blend_names_its_sources_and_its_errors_name_the_source(tmp_path):
    web = {"name": "web", "paths": ["web/*.jsonl"], "weight": 0.6}
    code = {"name": "code", "paths": "code/*.parquet", "format": "parquet", "weight": 0.4, "repeat": 3}
    cfg = _blend(web, code)
    assert cfg.blended and cfg.source_names() == ("web", "code") and cfg.training_sources()[1].repeat == 3
    assert config_from_dict(small_config("/tmp/o", "c/*.jsonl")).source_names() == ("retrieval",)
    # a seed at its default leaves the hash of shards built before blends alone; another changes it
    assert (
        _blend(web, code, blend_seed=0).shards_hash()
        == cfg.shards_hash()
        != _blend(web, code, blend_seed=1).shards_hash()
    )
    assert _blend(web, {**code, "weight": 0.5}).shards_hash() != cfg.shards_hash()
    for sources, message in (
        ((web, {**code, "name": "web"}), r"each source needs a name of its own \(web twice\)"),
        ((), "a blend needs at least one source"),
        (({**web, "name": "a b"},), r"training_corpus.blend.0.name: String should match pattern"),
        (({**web, "weight": 0},), r"training_corpus.blend.0.weight: Input should be greater than 0"),
        (({**web, "repeat": 0.5},), r"training_corpus.blend.0.repeat: Input should be greater than or equal to 1"),
    ):
        with pytest.raises(ConfigError, match=message):
            _blend(*sources)
    with pytest.raises(TypeError, match="training_sources"):
        cfg.training()
