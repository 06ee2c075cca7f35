"""A corpus of long documents made from the sample corpus: each page of the Python docs as one
document (its sections joined in order), optionally with near-duplicate passages planted
within and across documents. Books, papers, code files and long web pages look like this: the
nearest chunks of a chunk are mostly from its own document.

    python examples/long_documents.py OUT.jsonl [--pages P ...] [--near-duplicates]
        [--pages-per-document N]

With no --pages every one of the 56 pages is used (~22 KB each on average).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

CORPUS = Path(__file__).resolve().parent / "corpus"


def pages() -> dict[str, list[str]]:
    """{page id: its sections' texts, in order} from the sample corpus."""
    result: dict[str, list[str]] = {}
    for path in sorted(CORPUS.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            doc = json.loads(line)
            result.setdefault(doc["id"].split("#")[0], []).append(doc["text"])
    return result


def _paragraphs(text: str) -> list[str]:
    return [p for p in text.split("\n\n") if len(p) > 200]


def long_documents(
    names: list[str] | None = None, near_duplicates: bool = False, pages_per_document: int = 1
) -> list[dict]:
    """One document per page (`id` = the page id), or per run of `pages_per_document`
    consecutive pages (`id` = their ids joined by '+': book-length documents). With
    `near_duplicates`, each document gets
    (a) a long paragraph of its own repeated near its end with one word changed, and (b) a long
    paragraph of the next document copied into its middle with one word changed, so that
    near-identical chunks exist inside one document and across two."""
    sections = pages()
    names = list(sections) if names is None else names
    groups = [names[i : i + pages_per_document] for i in range(0, len(names), pages_per_document)]
    texts = {"+".join(group): "\n\n".join(t for name in group for t in sections[name]) for group in groups}
    names = list(texts)
    if near_duplicates:
        planted = {}
        for i, name in enumerate(names):
            own = _paragraphs(texts[name])
            other = _paragraphs(texts[names[(i + 1) % len(names)]])
            within = own[len(own) // 3].replace(" the ", " this ", 1)
            across = other[len(other) // 2].replace(" a ", " one ", 1)
            parts = texts[name].split("\n\n")
            middle = len(parts) // 2
            planted[name] = "\n\n".join(parts[:middle] + [across] + parts[middle:] + [within])
        texts = planted
    return [{"id": name, "text": texts[name]} for name in names]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--pages", nargs="*", help="page ids, e.g. howto/regex library/re")
    parser.add_argument("--near-duplicates", action="store_true")
    parser.add_argument("--pages-per-document", type=int, default=1)
    args = parser.parse_args()
    docs = long_documents(args.pages, args.near_duplicates, args.pages_per_document)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("".join(json.dumps(d) + "\n" for d in docs))
    print(f"{args.out}: {len(docs)} documents, {sum(len(d['text']) for d in docs):,} characters")


if __name__ == "__main__":
    main()
