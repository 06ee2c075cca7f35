"""Arguments that cannot be swapped silently: no function of pipeline/, schemas/ or trainer/ takes
more than five positional parameters, and no dataclass of more than five fields is built
positionally (`kw_only=True`). Five adjacent ints (L, m, k, candidates, pad) passed in order
were how a swap would go unseen."""

import ast

import pytest

from tests.house.imports import modules

pytestmark = pytest.mark.unit

MAX_POSITIONAL = 5


def _is_dataclass_decorator(node: ast.expr) -> bool:
    target = node.func if isinstance(node, ast.Call) else node
    return (isinstance(target, ast.Name) and target.id == "dataclass") or (
        isinstance(target, ast.Attribute) and target.attr == "dataclass"
    )


def _kw_only(node: ast.expr) -> bool:
    return isinstance(node, ast.Call) and any(
        k.arg == "kw_only" and isinstance(k.value, ast.Constant) and k.value.value is True for k in node.keywords
    )


def positional_overflows(source: str, where: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names = [a.arg for a in node.args.posonlyargs + node.args.args if a.arg not in ("self", "cls")]
            if len(names) > MAX_POSITIONAL:
                found.append(f"{where}:{node.lineno} {node.name}({', '.join(names)})")
        elif isinstance(node, ast.ClassDef):
            decorators = [d for d in node.decorator_list if _is_dataclass_decorator(d)]
            fields = [s for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
            if decorators and len(fields) > MAX_POSITIONAL and not any(_kw_only(d) for d in decorators):
                found.append(f"{where}:{node.lineno} dataclass {node.name} ({len(fields)} fields)")
    return found


def test_no_function_or_dataclass_takes_more_than_five_arguments_in_order():
    found = [f for name, path in modules().items() for f in positional_overflows(path.read_text(), name)]
    assert found == []


def test_the_check_finds_a_long_positional_list():
    source = """
from dataclasses import dataclass

def search(index, queries, L, m, k, candidates, pad): ...
def fine(index, queries, *, L, m, k, candidates, pad): ...

@dataclass(frozen=True)
class Retrieval:
    a: int
    b: int
    c: int
    d: int
    e: int
    f: int

@dataclass(frozen=True, kw_only=True)
class Named:
    a: int
    b: int
    c: int
    d: int
    e: int
    f: int
"""
    assert positional_overflows(source, "m") == [
        "m:4 search(index, queries, L, m, k, candidates, pad)",
        "m:8 dataclass Retrieval (6 fields)",
    ]
