"""The project's import graph, read from the source with `ast` (nothing is imported): every
`import` and `from ... import` of a project module, at module level or inside a function."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from tests.helpers import REPO

PACKAGES = ("pipeline", "schemas", "trainer")  # what the layers order
SOURCES = (*PACKAGES, "tests", "benchmarks", "examples", "deploy")  # where no underscore name is imported


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(roots=PACKAGES) -> dict[str, Path]:
    return {module_name(path): path for root in roots for path in sorted((REPO / root).rglob("*.py"))}


@dataclass(frozen=True)
class Import:
    importer: str
    line: int
    module: str  # the project module imported (a package's __init__ included)
    name: str | None  # the name taken from it (`from module import name`), None for `import module`


def imports_of(name: str, path: Path, known: set[str]) -> list[Import]:
    """The project imports of one source file. `from package import module` counts as an import of
    the module; `from module import name` as one of the module, with `name`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [Import(name, node.lineno, a.name, None) for a in node.names if a.name.split(".")[0] in PACKAGES]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] not in PACKAGES:
                continue
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                if submodule in known:
                    found.append(Import(name, node.lineno, submodule, None))
                else:
                    found.append(Import(name, node.lineno, node.module, alias.name))
        elif isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{path}:{node.lineno}: a relative import; the project imports by full name")
    return found


def graph(roots=PACKAGES) -> dict[str, list[Import]]:
    """Each module of `roots` -> its imports of project modules."""
    known = set(modules(SOURCES))
    return {name: imports_of(name, path, known) for name, path in modules(roots).items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(edges.get(successor, ())))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found
