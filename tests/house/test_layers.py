"""The layers, as a contract (docs/design.md §2): each package imports only from its own layer and
the layers below it, the trainer takes from the pipeline only the Beam-free search and shard
rows, the import graph has no cycle, and no module imports another's underscore names. `make lint`
runs these."""

import ast

import pytest

from tests.house.imports import PACKAGES, SOURCES, Import, cycles, graph, modules

pytestmark = pytest.mark.unit

# Lowest first: schemas, what every stage shares, the stages in the order data flows (shards
# before retrieve: the retrieve stage makes shard rows), what every job shares, the jobs that
# wire the stages (build-shards reads the index build-index commits; run does both), the checks
# over a committed output, and the commands.
LAYERS = (
    ("schemas",),
    ("pipeline", "pipeline.common"),
    ("pipeline.corpus",),
    ("pipeline.decontaminate",),
    ("pipeline.chunks",),
    ("pipeline.embed",),
    ("pipeline.index",),
    ("pipeline.shards",),
    ("pipeline.retrieve",),
    ("pipeline.jobs",),
    ("pipeline.build_index",),
    ("pipeline.build_shards",),
    ("pipeline.run",),
    ("pipeline.check",),
    ("pipeline.console",),
    ("pipeline.cli",),
    ("pipeline.flex_template",),
)
# The trainer stays a reader of shards: from the pipeline, the r(C) audit's rows and, for
# ratrain-generate, the online Retriever and the error it raises.
TRAINER_MAY_IMPORT = ("pipeline.shards.rows", "pipeline.retrieve.online", "pipeline.common.errors")
# Libraries a layer must not load: schemas is read by the trainer and by Beam-free tools.
FORBIDDEN_LIBRARIES = {"schemas": ("apache_beam", "faiss", "torch"), "pipeline": ("torch",)}
TORCH_IN_PIPELINE = ("pipeline.embed.encoder",)  # the only module of pipeline/ that imports torch


def layer_of(module: str) -> int | None:
    """The index in LAYERS of the longest prefix naming `module`'s unit (None: the trainer)."""
    for length in range(module.count(".") + 1, 0, -1):
        prefix = ".".join(module.split(".")[:length])
        for number, units in enumerate(LAYERS):
            if prefix in units:
                return number
    return None


def layer_violations(edges: dict[str, list[Import]]) -> list[str]:
    found = []
    for importer, imports in edges.items():
        if importer.split(".")[0] == "trainer":
            found += [
                f"{importer}:{i.line} imports {i.module}"
                for i in imports
                if i.module.split(".")[0] == "pipeline" and i.module not in TRAINER_MAY_IMPORT
            ]
            continue
        own = layer_of(importer)
        for i in imports:
            target = layer_of(i.module)
            if target is None or own is None or target > own:
                found.append(f"{importer}:{i.line} imports {i.module} (a higher layer)")
    return found


def test_every_module_belongs_to_a_layer():
    unplaced = [name for name in modules() if name.split(".")[0] != "trainer" and layer_of(name) is None]
    assert unplaced == []


def test_each_layer_imports_only_from_itself_and_below():
    assert layer_violations(graph()) == []


def test_the_contract_catches_an_upward_import():
    """The check itself can fail: an index module importing the retrieve stage, as
    `index/build.py` did before `widest_span` moved to common."""
    edges = {"pipeline.index.build": [Import("pipeline.index.build", 49, "pipeline.retrieve.sequences", "x")]}
    assert layer_violations(edges) == ["pipeline.index.build:49 imports pipeline.retrieve.sequences (a higher layer)"]
    trainer = {"trainer.generate": [Import("trainer.generate", 1, "pipeline.jobs.commit", "StageError")]}
    assert layer_violations(trainer) == ["trainer.generate:1 imports pipeline.jobs.commit"]


def test_the_import_graph_has_no_cycle():
    edges = {name: {i.module for i in imports} for name, imports in graph().items()}
    assert cycles(edges) == []
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # the check can fail


def test_no_module_imports_another_modules_underscore_names():
    found = []
    sources = modules(SOURCES)
    for importer, imports in graph(SOURCES).items():
        found += [
            f"{importer}:{i.line} imports {i.module}.{i.name}"
            for i in imports
            if i.name and i.name.startswith("_") and not i.name.startswith("__") and i.module != importer
        ]
        tree = ast.parse(sources[importer].read_text())
        aliases = {i.module.split(".")[-1]: i.module for i in imports if i.name is None}
        found += [
            f"{importer}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ]
    assert found == []


def test_heavy_libraries_stay_where_they_belong():
    found = []
    for name, path in modules(PACKAGES).items():
        forbidden = FORBIDDEN_LIBRARIES.get(name.split(".")[0], ())
        if name in TORCH_IN_PIPELINE:
            forbidden = tuple(library for library in forbidden if library != "torch")
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            found += [f"{name}:{node.lineno} imports {n}" for n in names if n.split(".")[0] in forbidden]
    assert found == []
    assert set(PACKAGES) == {"pipeline", "schemas", "trainer"}
