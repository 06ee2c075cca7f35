"""Which corpus files an index's next generation reads: those the listing shows new, or other
than the generation that read them (size, or modification time), and those gone."""

import os

import pytest

from pipeline.jobs.reuse import corpus_changes, listed_corpus_files
from schemas.config import config_from_dict
from schemas.manifest import Generation, IndexManifest, InputFile
from tests.helpers import sample_documents, small_config, write_jsonl

pytestmark = pytest.mark.unit


def _indexed(inputs: list[InputFile]) -> IndexManifest:
    """An index whose one generation read `inputs` (only what corpus_changes looks at)."""
    return IndexManifest.model_construct(generations=[Generation.model_construct(inputs=inputs, removed_inputs=[])])


def test_a_file_rewritten_to_the_same_size_is_read_again(tmp_path):
    for name, start in (("a", 0), ("b", 4), ("c", 8)):
        write_jsonl(tmp_path / "corpus" / f"{name}.jsonl", sample_documents(4, start=start))
    cfg = config_from_dict(small_config(tmp_path / "out", str(tmp_path / "corpus" / "*.jsonl")))
    read = listed_corpus_files(cfg)
    assert [f.modified for f in read] == [os.stat(f.path).st_mtime for f in read]
    index = _indexed(read)
    assert not corpus_changes(index, listed_corpus_files(cfg))

    a, b, c = (tmp_path / "corpus" / f"{name}.jsonl" for name in "abc")
    text = a.read_text()
    a.write_text(text.replace("a", "b", 1) if "a" in text else text[::-1])  # same size, other bytes
    os.utime(a, (a.stat().st_atime, read[0].modified + 1))  # a clock that moved on
    c.unlink()
    (tmp_path / "corpus" / "d.jsonl").write_text(b.read_text())
    changes = corpus_changes(index, listed_corpus_files(cfg))
    assert a.stat().st_size == read[0].bytes
    assert [f.path for f in changes.changed] == [str(a)]
    assert [f.path for f in changes.new] == [str(tmp_path / "corpus" / "d.jsonl")]
    assert changes.gone == [str(c)]

    # a manifest written before times were recorded compares sizes alone
    sizes_only = _indexed([f.model_copy(update={"modified": None}) for f in read[:2]])
    assert not corpus_changes(sizes_only, listed_corpus_files(cfg)).changed
