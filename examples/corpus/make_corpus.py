#!/usr/bin/env python3
"""Build the ratrain-pipeline sample corpus from Debian's ``python3.11-doc``.

Usage::

    apt-get download python3.11-doc
    dpkg-deb -x python3.11-doc_*.deb pkg
    python3 make_corpus.py pkg [--out DIR]

``pkg`` may be the extracted package root (the folder holding ``usr/``), or any
folder below it that contains the Sphinx ``_sources`` tree (``*.rst.txt``).

The script reads the reStructuredText sources of the Python documentation,
converts a fixed selection of them to plain text (reST markup stripped, code
examples dropped), splits every page into section-sized documents and writes
them as JSON Lines files ``python311-docs-partN.jsonl`` (fields ``id``,
``title``, ``text``).  It uses the Python 3.11 standard library only and its
output is deterministic.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

# --------------------------------------------------------------------------
# What goes into the corpus
# --------------------------------------------------------------------------

# Whole folders of the documentation (relative to _sources/).
INCLUDE_DIRS = ["tutorial", "howto", "faq"]

# Pages inside INCLUDE_DIRS that are left out: index pages, and HOWTOs about
# CPython's C internals or porting tools, which are mostly code.
EXCLUDE_PAGES = {
    "tutorial/index",
    "tutorial/appendix",
    "howto/index",
    "howto/clinic",
    "howto/cporting",
    "howto/instrumentation",
    "howto/isolating-extensions",
    "howto/pyporting",
    "faq/index",
}

# Single pages (relative to _sources/, without the ".rst.txt" suffix).
# Library and language-reference pages were chosen because a HOWTO, FAQ or
# tutorial page covers the same ground, so related passages exist across
# different documents (e.g. howto/regex and library/re).
INCLUDE_PAGES = [
    "glossary",
    "reference/executionmodel",  # tutorial/classes (scopes and namespaces)
    "reference/compound_stmts",  # tutorial/controlflow, tutorial/errors
    "reference/import",  # tutorial/modules
    "library/re",  # howto/regex
    "library/logging",  # howto/logging, howto/logging-cookbook
    "library/argparse",  # howto/argparse
    "library/functools",  # howto/functional
    "library/itertools",  # howto/functional
    "library/enum",  # howto/enum
    "library/ipaddress",  # howto/ipaddress
    "library/urllib.request",  # howto/urllib2
    "library/socket",  # howto/sockets
    "library/curses",  # howto/curses
    "library/unicodedata",  # howto/unicode
    "library/codecs",  # howto/unicode
    "library/exceptions",  # tutorial/errors
    "library/collections",  # tutorial/datastructures
    "library/venv",  # tutorial/venv
]

OUT_PREFIX = "python311-docs-part"
N_PARTS = 3

MIN_WORDS = 150  # sections shorter than this are merged with a neighbour
MAX_WORDS = 1500  # sections longer than this are split further
DROP_BELOW_WORDS = 80  # whole pages shorter than this are skipped

SUBSTITUTIONS = {"version": "3.11", "release": "3.11.2", "today": ""}

# --------------------------------------------------------------------------
# Block-level reST handling
# --------------------------------------------------------------------------

ADORN_CHARS = set("=-~^*#\"'`+:._")

# Directives dropped together with their content.
DROP_DIRECTIVES = {
    "index",
    "toctree",
    "code-block",
    "code",
    "sourcecode",
    "doctest",
    "testcode",
    "testsetup",
    "testoutput",
    "testcleanup",
    "productionlist",
    "literalinclude",
    "highlight",
    "highlightlang",
    "tabularcolumns",
    "sectionauthor",
    "moduleauthor",
    "codeauthor",
    "contents",
    "image",
    "figure",
    "only",
    "include",
    "raw",
    "audit-event",
    "currentmodule",
    "module",
    "program",
    "list-table",
    "csv-table",
    "table",
    "raw-html",
    "ifconfig",
    "literal",
    "parsed-literal",
    "math",
    "graphviz",
    "autoclass",
    "autofunction",
    "automodule",
    "c:namespace",
    "default-role",
    "role",
    "container",
    "pdbcommand-group",
    "blockdiag",
    "centered",
    "hlist",
    "versionchanged-list",
    "miscnews",
    "limited-api-list",
    "refcounting",
    "stable-api-list",
}

# Object-description directives: the signature is kept as a line of text.
DESC_DIRECTIVES = {
    "function",
    "method",
    "classmethod",
    "staticmethod",
    "attribute",
    "data",
    "class",
    "exception",
    "decorator",
    "decoratormethod",
    "coroutinemethod",
    "coroutinefunction",
    "abstractmethod",
    "awaitablemethod",
    "awaitablefunction",
    "opcode",
    "cmdoption",
    "option",
    "describe",
    "object",
    "pdbcommand",
    "envvar",
    "property",
    "py:function",
    "py:method",
    "py:class",
    "py:attribute",
    "py:data",
    "c:function",
    "c:macro",
    "c:type",
    "c:member",
    "c:var",
    "c:struct",
    "c:enum",
    "c:enumerator",
    "c:union",
    "fixer",
    "2to3fixer",
    "monitoring-event",
    "setting",
}
DESC_PREFIX = {
    "class": "class ",
    "exception": "exception ",
    "decorator": "@",
    "decoratormethod": "@",
    "py:class": "class ",
}

ADMONITIONS = {
    "note": "Note",
    "warning": "Warning",
    "important": "Important",
    "caution": "Caution",
    "attention": "Attention",
    "danger": "Danger",
    "error": "Error",
    "hint": "Hint",
    "tip": "Tip",
    "seealso": "See also",
    "impl-detail": "CPython implementation detail",
    "admonition": None,
}

RE_DIRECTIVE = re.compile(r"^\.\.\s+([\w:-]+)::(?:\s+(.*))?$")
RE_LABEL = re.compile(r"^\.\.\s+_([^:]+|`[^`]+`):\s*(\S.*)?$")
RE_FOOTNOTE = re.compile(r"^\.\.\s+\[([#*\w-]+)\]\s*(.*)$")
RE_OPTION = re.compile(r"^:[\w-]+:(\s|$)")
RE_FIELD = re.compile(r"^:([A-Za-z][\w .-]*):(\s+.*)?$")
RE_BULLET = re.compile(r"^([*+\-\u2022])(\s+)(.*)$")
RE_ENUM = re.compile(r"^(\(?(?:\d+|#|[a-zA-Z])[.)])(\s+)(.*)$")


def indent_of(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def dedent(lines: list[str]) -> list[str]:
    widths = [indent_of(line) for line in lines if line.strip()]
    if not widths:
        return []
    n = min(widths)
    return [line[n:] if line.strip() else "" for line in lines]


def is_adornment(line: str) -> bool:
    s = line.rstrip()
    return len(s) >= 3 and s[0] in ADORN_CHARS and s == s[0] * len(s)


def is_simple_table_border(line: str) -> bool:
    s = line.rstrip()
    return bool(s) and bool(re.fullmatch(r"=+( +=+)+", s))


def take_indented(lines: list[str], i: int, min_indent: int = 1) -> int:
    """Return the index after the block of blank-or-indented lines at i."""
    n = len(lines)
    while i < n and (not lines[i].strip() or indent_of(lines[i]) >= min_indent):
        i += 1
    return i


class Converter:
    """Converts one reST page into a list of blocks.

    A block is ("h", level, text) for a section title or ("p", text) for a
    paragraph of plain text.
    """

    def __init__(self, inline: Inline):
        self.inline = inline
        self.styles: list[tuple[str, bool]] = []

    # -- helpers ----------------------------------------------------------
    def heading_level(self, char: str, overline: bool) -> int:
        key = (char, overline)
        if key not in self.styles:
            self.styles.append(key)
        return self.styles.index(key)

    def para(self, text_lines: list[str]) -> tuple[str, bool]:
        """Inline-convert a paragraph; report whether it opens a literal."""
        raw = " ".join(line.strip() for line in text_lines)
        literal_next = False
        if raw.endswith("::"):
            literal_next = True
            if raw == "::":
                raw = ""
            elif raw.endswith(" ::"):
                raw = raw[:-3]
            else:
                raw = raw[:-1]
        return self.inline.convert(raw), literal_next

    # -- main loop --------------------------------------------------------
    def convert(self, lines: list[str]) -> list[tuple]:
        out: list[tuple] = []
        i, n = 0, len(lines)
        literal_next = False
        while i < n:
            line = lines[i]
            if not line.strip():
                i += 1
                continue
            ind = indent_of(line)
            if ind > 0:
                # Indented block: literal block after "::", else block quote.
                j = take_indented(lines, i, 1)
                if not literal_next:
                    out.extend(self.convert(dedent(lines[i:j])))
                literal_next = False
                i = j
                continue
            literal_next = False
            s = line.rstrip()
            nxt = lines[i + 1].rstrip() if i + 1 < n else ""

            # Section title with overline.
            if (
                is_adornment(s)
                and i + 2 < n
                and lines[i + 1].strip()
                and is_adornment(lines[i + 2])
                and lines[i + 2].rstrip()[0] == s[0]
            ):
                level = self.heading_level(s[0], True)
                out.append(("h", level, self.inline.convert(lines[i + 1].strip())))
                i += 3
                continue
            # Section title with underline only.
            if (
                nxt
                and is_adornment(nxt)
                and not is_adornment(s)
                and not is_simple_table_border(nxt)
                and len(nxt) >= max(3, len(s.strip()) - 2)
            ):
                level = self.heading_level(nxt[0], False)
                out.append(("h", level, self.inline.convert(s.strip())))
                i += 2
                continue
            # Transition.
            if is_adornment(s) and not nxt.strip():
                i += 1
                continue
            # Tables: dropped.
            if s.startswith("+-") or s.startswith("+="):
                while i < n and lines[i].strip():
                    i += 1
                continue
            if is_simple_table_border(s):
                borders = 0
                while i < n:
                    if is_simple_table_border(lines[i]):
                        borders += 1
                        if borders >= 2 and (i + 1 >= n or not lines[i + 1].strip()):
                            i += 1
                            break
                    i += 1
                continue
            # Explicit markup.
            if s.startswith(".."):
                i = self.explicit(lines, i, out)
                continue
            # Doctest block.
            if s.startswith(">>>"):
                while i < n and lines[i].strip():
                    i += 1
                continue
            # Field list (page metadata such as :Author:) - dropped.
            if RE_FIELD.match(s) and not s.startswith(":ref:") and "`" not in s.split(":", 2)[1]:
                i = take_indented(lines, i + 1, 1)
                continue
            # Bullet / enumerated list item.
            m = RE_BULLET.match(s) or RE_ENUM.match(s)
            if m and (m.group(1) in "*+-\u2022" or self._looks_enumerated(lines, i, m)):
                width = len(m.group(1)) + len(m.group(2))
                j = i + 1
                while j < n and (not lines[j].strip() or indent_of(lines[j]) >= width):
                    j += 1
                # Trailing blank lines belong to nobody.
                body = [m.group(3)] + [line[width:] if line.strip() else "" for line in lines[i + 1 : j]]
                blocks = self.convert(body)
                marker = "-" if m.group(1) in "*+-\u2022" else m.group(1).replace("#", "")
                if blocks and blocks[0][0] == "p":
                    prefix = marker + " " if marker else ""
                    blocks[0] = ("p", prefix + blocks[0][1])
                out.extend(blocks)
                i = j
                continue
            # Definition list item: one line, then an indented definition.
            if nxt.strip() and indent_of(nxt) > 0:
                term, _ = self.para([s])
                j = take_indented(lines, i + 1, 1)
                if term:
                    out.append(("p", term))
                out.extend(self.convert(dedent(lines[i + 1 : j])))
                i = j
                continue
            # Plain paragraph.
            j = i
            while j < n and lines[j].strip() and indent_of(lines[j]) == 0:
                if j > i and lines[j].startswith(".. "):
                    break
                j += 1
            text, literal_next = self.para(lines[i:j])
            if text:
                out.append(("p", text))
            i = j
        return out

    @staticmethod
    def _looks_enumerated(lines, i, m) -> bool:
        # Avoid treating sentences like "A. Smith wrote..." as list items:
        # require a digit/# marker, or a neighbouring item of the same kind.
        tok = m.group(1)
        if re.match(r"^\(?(\d+|#)[.)]$", tok):
            return True
        return False

    def explicit(self, lines: list[str], i: int, out: list[tuple]) -> int:
        s = lines[i].rstrip()
        end = take_indented(lines, i + 1, 1)
        m = RE_FOOTNOTE.match(s)
        if m:
            body = [m.group(2)] + dedent(lines[i + 1 : end])
            out.extend(self.convert(body))
            return end
        if RE_LABEL.match(s):
            return end
        m = RE_DIRECTIVE.match(s)
        if not m:
            return end  # comment or substitution definition
        name, arg = m.group(1), (m.group(2) or "").strip()
        block = lines[i + 1 : end]
        if name in DROP_DIRECTIVES:
            return end
        # Header continuation lines (until the first blank line) and options.
        head = []
        k = 0
        while k < len(block) and block[k].strip() and not RE_OPTION.match(block[k].strip()):
            head.append(block[k].strip())
            k += 1
        while k < len(block) and block[k].strip() and RE_OPTION.match(block[k].strip()):
            k += 1
            while (
                k < len(block)
                and block[k].strip()
                and not RE_OPTION.match(block[k].strip())
                and indent_of(block[k]) > indent_of(block[k - 1])
            ):
                k += 1
        content = dedent(block[k:])

        if name in DESC_DIRECTIVES:
            sigs = [arg] + head if arg else head
            prefix = DESC_PREFIX.get(name, "")
            for sig in sigs:
                sig = sig.rstrip("\\").strip()
                if sig:
                    out.append(("p", prefix + self.inline.plain_signature(sig)))
            out.extend(self.convert(content))
            return end

        if name in ("versionadded", "versionchanged", "deprecated", "deprecated-removed"):
            parts = arg.split(None, 2 if name == "deprecated-removed" else 1)
            if name == "deprecated-removed":
                ver = ", will be removed in version ".join(parts[:2])
                rest = parts[2] if len(parts) > 2 else ""
            else:
                ver = parts[0] if parts else ""
                rest = parts[1] if len(parts) > 1 else ""
            label = {
                "versionadded": "New in version ",
                "versionchanged": "Changed in version ",
                "deprecated": "Deprecated since version ",
                "deprecated-removed": "Deprecated since version ",
            }[name] + ver
            body_lines = ([rest] if rest else []) + head + ([""] if head or rest else []) + content
            blocks = self.convert(body_lines)
            if blocks and blocks[0][0] == "p":
                blocks[0] = ("p", f"{label}: {blocks[0][1]}")
            else:
                blocks.insert(0, ("p", label + "."))
            out.extend(blocks)
            return end

        if name in ADMONITIONS or name in (
            "topic",
            "sidebar",
            "rubric",
            "availability",
            "glossary",
            "epigraph",
            "highlights",
            "compound",
            "class-directive",
        ):
            label = ADMONITIONS.get(name)
            if name == "availability":
                out.append(("p", "Availability: " + self.inline.convert(" ".join([arg] + head)) + "."))
                return end
            if name in ("topic", "sidebar", "rubric", "admonition"):
                title = self.inline.convert(" ".join([arg] + head).strip())
                if title:
                    out.append(("p", title))
                out.extend(self.convert(content))
                return end
            body_lines = ([arg] if arg else []) + head + [""] + content
            blocks = self.convert(body_lines)
            if label and blocks and blocks[0][0] == "p":
                blocks[0] = ("p", f"{label}: {blocks[0][1]}")
            out.extend(blocks)
            return end

        # Unknown directive: keep its content, drop its arguments.
        out.extend(self.convert(content))
        return end


# --------------------------------------------------------------------------
# Inline markup
# --------------------------------------------------------------------------

RE_LITERAL = re.compile(r"``(.+?)``")
RE_ROLE = re.compile(r":((?:[a-z]+:)?[a-z][\w-]*):`((?:[^`\\]|\\.)+)`")
RE_LINK = re.compile(r"`([^`<]*?)\s*<([^`>]*)>`__?")
RE_REFNAME = re.compile(r"`([^`]+)`__?")
RE_INTERP = re.compile(r"`([^`]+)`")
RE_STRONG = re.compile(r"\*\*(?=\S)(.+?)(?<=\S)\*\*")
RE_EMPH = re.compile(r"(?<![\w*\\])\*(?=[^\s*])(.+?)(?<=[^\s*\\])\*(?![\w*])")
RE_FOOTREF = re.compile(r"\s?\[(?:#[\w-]*|\d+|\*|[A-Za-z][\w-]*\d+)\]_")
RE_SUBST = re.compile(r"\|([\w-]+)\|_?")
RE_WORDREF = re.compile(r"(?<=[A-Za-z0-9])_(?=[\s.,;:)!?'\"]|$)")
RE_EXPLICIT = re.compile(r"^(.*?)\s*<([^<>]+)>$", re.S)

PAREN_ROLES = {"func", "meth", "c:func", "py:func", "py:meth"}


class Inline:
    def __init__(self, labels: dict[str, str], doc_titles: dict[str, str]):
        self.labels = labels
        self.doc_titles = doc_titles

    def role(self, name: str, body: str) -> str:
        body = re.sub(r"\\([^{}])", r"\1", body)
        m = RE_EXPLICIT.match(body)
        explicit = m.group(1).strip() if m and m.group(1).strip() else None
        target = (m.group(2) if m else body).strip()
        short = name.split(":")[-1]
        if short == "pep":
            return explicit or "PEP " + target.split("#")[0]
        if short == "rfc":
            return explicit or "RFC " + target.split("#")[0]
        if short == "issue":
            return explicit or "bpo-" + target
        if short == "gh":
            return explicit or "gh-" + target
        if short == "abbr":
            return re.sub(r"\s*\(.*\)$", "", body).strip()
        if short in ("samp", "file", "menuselection", "guilabel"):
            body = re.sub(r"(?<!\\)[{}]", "", body).replace("\\{", "{").replace("\\}", "}")
            return body.replace("-->", "\u2192")
        if explicit:
            return explicit
        if short in ("ref", "numref"):
            return self.labels.get(target.lower(), target.replace("-", " "))
        if short == "doc":
            return self.doc_titles.get(target.lstrip("/"), target.rsplit("/", 1)[-1])
        if short in (
            "keyword",
            "term",
            "kbd",
            "dfn",
            "math",
            "sup",
            "sub",
            "manpage",
            "mailheader",
            "mimetype",
            "program",
            "command",
            "envvar",
            "option",
            "token",
            "source",
            "pdbcmd",
            "opcode",
            "2to3fixer",
            "newsfragment",
        ):
            return target.lstrip("!~")
        # Cross-reference roles (class, func, meth, mod, exc, attr, data, ...).
        text = target
        if text.startswith("!"):
            text = text[1:]
        if text.startswith("~"):
            text = text[1:].rsplit(".", 1)[-1]
        text = text.lstrip(".")
        if short in PAREN_ROLES and name.split(":")[0] in ("func", "meth", "c", "py") and not text.endswith(")"):
            text += "()"
        return text

    def convert(self, text: str) -> str:
        saved: list[str] = []

        def keep(s: str) -> str:
            saved.append(s)
            return f"\x00{len(saved) - 1}\x00"

        text = RE_LITERAL.sub(lambda m: keep(m.group(1)), text)
        text = RE_ROLE.sub(lambda m: keep(self.role(m.group(1), m.group(2))), text)
        text = RE_LINK.sub(lambda m: keep(m.group(1) or m.group(2)), text)
        text = RE_REFNAME.sub(lambda m: keep(m.group(1)), text)
        text = RE_INTERP.sub(lambda m: keep(m.group(1)), text)
        text = RE_FOOTREF.sub("", text)
        text = RE_STRONG.sub(r"\1", text)
        text = RE_EMPH.sub(r"\1", text)
        text = RE_SUBST.sub(lambda m: SUBSTITUTIONS.get(m.group(1), m.group(1)), text)
        text = RE_WORDREF.sub("", text)
        text = re.sub(r"\\ ", "", text)
        text = re.sub(r"\\(.)", r"\1", text)
        text = text.replace(" --- ", " \u2014 ").replace("---", "\u2014")
        for _ in range(3):  # placeholders may nest (a role inside a link)
            text = re.sub(r"\x00(\d+)\x00", lambda m: saved[int(m.group(1))], text)
        return re.sub(r"\s+", " ", text).strip()

    def plain_signature(self, sig: str) -> str:
        return re.sub(r"\s+", " ", sig.replace("\\", "")).strip()


# --------------------------------------------------------------------------
# Pages, labels and splitting
# --------------------------------------------------------------------------


def find_sources(root: Path) -> Path:
    if root.name == "_sources" and root.is_dir():
        return root
    for cand in sorted(root.rglob("_sources")):
        if (cand / "tutorial").is_dir() and (cand / "library").is_dir():
            return cand
    sys.exit(f"no Sphinx _sources tree with tutorial/ and library/ under {root}")


def read_page(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8").replace("\t", "        ")
    return text.splitlines()


def scan_labels(src: Path) -> tuple[dict[str, str], dict[str, str]]:
    """Map reST labels and page paths to the title they point at."""
    plain = Inline({}, {})
    labels: dict[str, str] = {}
    doc_titles: dict[str, str] = {}
    for path in sorted(src.rglob("*.rst.txt")):
        rel = path.relative_to(src).as_posix()[: -len(".rst.txt")]
        lines = read_page(path)
        pending: list[str] = []
        for i, line in enumerate(lines):
            s = line.rstrip()
            m = RE_LABEL.match(s)
            if m and not m.group(2):
                pending.append(m.group(1).strip("`").lower())
                continue
            if not s.strip():
                continue
            title = None
            if i + 1 < len(lines) and is_adornment(lines[i + 1]) and not is_adornment(s) and not s.startswith(" "):
                title = s.strip()
            elif is_adornment(s) and i + 2 < len(lines) and is_adornment(lines[i + 2]):
                title = lines[i + 1].strip()
            elif is_adornment(s) and i > 0 and lines[i - 1].strip():
                continue  # underline of a title handled on the previous line
            if title is not None:
                title = plain.convert(title)
                if rel not in doc_titles:
                    doc_titles[rel] = title
                for lab in pending:
                    labels.setdefault(lab, title)
            pending = []
    return labels, doc_titles


def words(blocks) -> int:
    return sum(len(b[-1].split()) for b in blocks)


def slugify(text: str) -> str:
    s = re.sub(r"[^\w]+", "-", text.lower()).strip("-")
    return s[:60].strip("-") or "section"


def split_sections(blocks: list[tuple], level: int) -> list[list[tuple]]:
    """Split at headings of the given level (first group is the preamble)."""
    groups: list[list[tuple]] = [[]]
    for b in blocks:
        if b[0] == "h" and b[1] == level:
            groups.append([])
        groups[-1].append(b)
    return [g for g in groups if g]


def merge_small(groups: list[list[tuple]]) -> list[list[tuple]]:
    merged: list[list[tuple]] = []
    for g in groups:
        if (
            merged
            and (words(merged[-1]) < MIN_WORDS or words(g) < MIN_WORDS)
            and words(merged[-1]) + words(g) <= MAX_WORDS
        ):
            merged[-1] = merged[-1] + g
        else:
            merged.append(list(g))
    return merged


def split_by_paragraphs(group: list[tuple]) -> list[list[tuple]]:
    target = MAX_WORDS * 2 // 3
    parts: list[list[tuple]] = [[]]
    for b in group:
        if words(parts[-1]) >= target and b[0] == "p":
            parts.append([])
        parts[-1].append(b)
    if len(parts) > 1 and words(parts[-1]) < MIN_WORDS:
        last = parts.pop()
        parts[-1].extend(last)
    return parts


def chunk(blocks: list[tuple], level: int = 1) -> list[list[tuple]]:
    if words(blocks) <= MAX_WORDS:
        return [blocks]
    max_level = max((b[1] for b in blocks if b[0] == "h"), default=-1)
    if level > max_level:
        return split_by_paragraphs(blocks)
    groups = split_sections(blocks, level)
    if len(groups) == 1:
        return chunk(blocks, level + 1)
    result: list[list[tuple]] = []
    for g in merge_small(groups):
        result.extend(chunk(g, level + 1))
    return merge_small(result)


def page_documents(rel: str, blocks: list[tuple]) -> list[dict]:
    if words(blocks) < DROP_BELOW_WORDS:
        return []
    page_title = next((b[2] for b in blocks if b[0] == "h"), rel)
    # Always split at the first section level, then enforce the size limits.
    groups = merge_small(split_sections(blocks, 1))
    pieces: list[list[tuple]] = []
    for g in groups:
        pieces.extend(chunk(g, 2))
    pieces = merge_small(pieces)
    docs = []
    seen: set[str] = set()
    for idx, piece in enumerate(pieces):
        heads = [b for b in piece if b[0] == "h"]
        first = piece[0]
        if idx == 0 or not heads:
            section = None if idx == 0 else f"part {idx + 1}"
        else:
            section = first[2] if first[0] == "h" else heads[0][2]
        title = page_title if section is None or section == page_title else f"{page_title}: {section}"
        ident = rel if idx == 0 else f"{rel}#{slugify(section or str(idx))}"
        base, k = ident, 2
        while ident in seen:
            ident = f"{base}-{k}"
            k += 1
        seen.add(ident)
        text = "\n\n".join(b[-1] for b in piece).strip()
        docs.append({"id": ident, "title": title, "text": text})
    return docs


def selected_pages(src: Path) -> list[str]:
    pages = []
    for d in INCLUDE_DIRS:
        for p in sorted((src / d).rglob("*.rst.txt")):
            rel = p.relative_to(src).as_posix()[: -len(".rst.txt")]
            if rel not in EXCLUDE_PAGES:
                pages.append(rel)
    for rel in INCLUDE_PAGES:
        if not (src / f"{rel}.rst.txt").is_file():
            sys.exit(f"missing page: {rel}")
        pages.append(rel)
    return pages


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("package_dir", type=Path, help="extracted python3.11-doc package (dpkg-deb -x output)")
    ap.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).resolve().parent,
        help="output folder (default: the folder of this script)",
    )
    args = ap.parse_args(argv)

    src = find_sources(args.package_dir)
    labels, doc_titles = scan_labels(src)
    inline = Inline(labels, doc_titles)

    # Documents grouped per page, so that a page never straddles two files.
    per_page: list[list[dict]] = []
    for rel in selected_pages(src):
        blocks = Converter(inline).convert(read_page(src / f"{rel}.rst.txt"))
        docs = page_documents(rel, blocks)
        if docs:
            per_page.append(docs)

    def size(docs):
        return sum(len(json.dumps(d, ensure_ascii=False).encode()) + 1 for d in docs)

    total = sum(size(d) for d in per_page)
    parts: list[list[dict]] = [[] for _ in range(N_PARTS)]
    acc = 0
    for docs in per_page:
        idx = min(N_PARTS - 1, int(acc * N_PARTS / total))
        parts[idx].extend(docs)
        acc += size(docs)

    args.out.mkdir(parents=True, exist_ok=True)
    n_docs = 0
    for k, docs in enumerate(parts, 1):
        path = args.out / f"{OUT_PREFIX}{k}.jsonl"
        with path.open("w", encoding="utf-8", newline="\n") as f:
            for d in docs:
                f.write(json.dumps(d, ensure_ascii=False) + "\n")
        n_docs += len(docs)
        print(f"{path}: {len(docs)} documents, {path.stat().st_size} bytes")
    print(f"total: {n_docs} documents from {len(per_page)} pages, {total} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
