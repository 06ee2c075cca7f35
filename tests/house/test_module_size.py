"""The house rule that keeps modules readable: no module of pipeline/, schemas/ or trainer/ over
400 lines (a module that grows past it has become two concerns; split it where the data or the
layer changes)."""

import pytest

from tests.helpers import REPO
from tests.house.imports import modules

pytestmark = pytest.mark.unit

MAX_LINES = 400


def test_no_module_is_over_400_lines():
    sizes = {str(path.relative_to(REPO)): len(path.read_text().splitlines()) for path in modules().values()}
    assert len(sizes) > 50  # the packages were found
    assert {path: lines for path, lines in sizes.items() if lines > MAX_LINES} == {}
