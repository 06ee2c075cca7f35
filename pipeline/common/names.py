"""File numbers: every numbered file is `<prefix>-NNNNN.<ext>` (`file_name`), and files are put
in order by that number (`file_number`), never by name: past 99,999 the number takes a sixth
digit, and `-100000` sorts before `-99999` as text. Imports no Beam."""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-(\d+)(?:\.[\w.]+)?$")


def file_name(prefix: str, number: int, extension: str) -> str:
    return f"{prefix}-{number:05d}.{extension}"


def file_number(path: str) -> int:
    """The NNNNN of `.../<prefix>-NNNNN.<ext>` (or of a prefix without an extension); -1 for a
    name without one."""
    found = _NUMBER.search(path)
    return int(found.group(1)) if found else -1
