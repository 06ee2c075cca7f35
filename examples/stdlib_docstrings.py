"""A corpus of real English text larger than the sample corpus: the docstrings of Python
modules, one document per module (its docstring, then its classes' and functions' in source
order), from the standard library of the interpreter that runs this and, with
--site-packages, from the packages installed beside it.

    python examples/stdlib_docstrings.py OUT.jsonl [--site-packages] [--min-words 50]

Modules whose docstrings hold fewer than --min-words words, and test modules, are left out.
Deterministic for a given Python and set of installed packages (CPython 3.11's standard
library: 420 documents, 270k words).
"""

from __future__ import annotations

import argparse
import ast
import json
import sysconfig
from pathlib import Path


def module_text(path: Path) -> str:
    """The module's docstrings, in source order, one paragraph each."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    except (SyntaxError, ValueError):
        return ""
    nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)))]
    nodes.sort(key=lambda n: getattr(n, "lineno", 0))
    return "\n\n".join(doc for n in nodes if (doc := ast.get_docstring(n)))


def documents(site_packages: bool, min_words: int) -> list[dict]:
    roots = [("stdlib", Path(sysconfig.get_paths()["stdlib"]))]
    if site_packages:
        roots.append(("site-packages", Path(sysconfig.get_paths()["purelib"])))
    found = []
    for name, root in roots:
        for path in sorted(root.rglob("*.py")):
            relative = path.relative_to(root).as_posix()
            parts = set(relative.split("/"))
            if relative.startswith("site-packages/") or parts & {"test", "tests", "testing", "idle_test"}:
                continue
            text = module_text(path)
            if len(text.split()) >= min_words:
                found.append({"id": f"{name}/{relative}", "text": text})
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("out")
    parser.add_argument("--site-packages", action="store_true")
    parser.add_argument("--min-words", type=int, default=50)
    args = parser.parse_args()
    docs = documents(args.site_packages, args.min_words)
    Path(args.out).write_text("".join(json.dumps(d) + "\n" for d in docs))
    print(f"{len(docs)} documents, {sum(len(d['text'].split()) for d in docs):,} words -> {args.out}")


if __name__ == "__main__":
    main()
