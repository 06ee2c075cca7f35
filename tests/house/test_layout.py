"""The layout is written once, in docs/design.md §2: every module of pipeline/, schemas/ and
trainer/ has its line there, and each package's docstring points to it instead of listing its
modules again (lists kept in two places drift)."""

import re

import pytest

from tests.helpers import REPO
from tests.house.imports import modules

pytestmark = pytest.mark.unit


def layout_section() -> str:
    text = (REPO / "docs" / "design.md").read_text()
    return text[text.index("\n## 2. Layout") : text.index("\n## 3.")]


def where_listed(section: str, module: str) -> str:
    """The part of §2 that must name `module`: its stage package's row of the table, the
    schemas/ or trainer/ entry of the tree, or (pipeline's own modules) the whole section."""
    parts = module.split(".")
    if parts[0] == "pipeline" and len(parts) == 3:
        row = re.search(rf"^\| `{parts[1]}/`.*$", section, re.M)
        return row.group(0) if row else ""
    if parts[0] in ("schemas", "trainer"):
        entry = re.search(rf"^{parts[0]}/ .*?(?=^\S)", section, re.M | re.S)
        return entry.group(0) if entry else ""
    return section


def unlisted(section: str) -> list[str]:
    missing = []
    for module, path in modules().items():
        if path.name == "__init__.py":
            continue
        name = module.split(".")[-1]
        listed = where_listed(section, module)
        if f"`{name}`" not in listed and f"{name}.py" not in listed:
            missing.append(module)
    return missing


def test_every_module_has_its_line_in_the_layout():
    assert unlisted(layout_section()) == []


def test_a_module_missing_from_the_layout_is_found():
    section = layout_section().replace("`build_slices`", "`slices of the build`")
    assert unlisted(section) == ["pipeline.index.build_slices"]


def test_package_docstrings_point_to_the_layout_instead_of_listing_modules():
    packages = [path for root in ("pipeline", "schemas", "trainer") for path in (REPO / root).rglob("__init__.py")]
    assert len(packages) > 10
    assert [str(p.relative_to(REPO)) for p in packages if "docs/design.md §2" not in p.read_text()] == []
