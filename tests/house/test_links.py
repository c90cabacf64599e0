"""Every relative link and image in README.md and docs/ resolves: the file or folder exists inside
the repository, and a ``#fragment`` into a markdown file names one of its headings (GitHub's
slug). External http(s) links are not checked; links inside code are not links."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[2]

FENCE = re.compile(r"^ {0,3}(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target "title") and ![alt](target); the text may hold one level of brackets.
INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)")
HTML = re.compile(r"<(?:a|img)\b[^>]*?\b(?:href|src)=\"([^\"]+)\"", re.I)
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$")
HTML_ANCHOR = re.compile(r"<a\b[^>]*?\b(?:name|id)=\"([^\"]+)\"", re.I)
EXTERNAL = re.compile(r"^(?:[a-z][a-z0-9+.-]*:|//)", re.I)


def prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, with inline code spans blanked."""
    fence = None
    for no, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if m:
            if fence is None:
                fence = m.group(1)
            elif m.group(1) == fence:
                fence = None
            continue
        if fence is None:
            yield no, CODE_SPAN.sub(lambda c: " " * len(c.group(0)), line)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text (links as their text, no code marks or
    emphasis), lower-cased, everything but word characters, hyphens and spaces dropped, spaces
    as hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every fragment a link into the markdown file ``path`` may name."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    fence = None
    for line in path.read_text().splitlines():
        m = FENCE.match(line)
        if m:
            fence = m.group(1) if fence is None else (None if m.group(1) == fence else fence)
            continue
        if fence is not None:
            continue
        found.update(HTML_ANCHOR.findall(line))
        h = HEADING.match(line)
        if h:
            base = slug(h.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def targets(text: str) -> Iterator[tuple[int, str]]:
    for no, line in prose_lines(text):
        for pattern in (INLINE, REFERENCE, HTML):
            for target in pattern.findall(line):
                yield no, target


def broken_links(doc: Path, root: Path = ROOT) -> list[str]:
    """'file:line: target (why)' for each link of ``doc`` that does not resolve."""
    out = []
    for no, target in targets(doc.read_text()):
        if not target or EXTERNAL.match(target):
            continue
        where, _, fragment = target.partition("#")
        where = unquote(where)
        if not where:
            dest = doc
        elif where.startswith("/"):
            dest = (root / where.lstrip("/")).resolve()
        else:
            dest = (doc.parent / where).resolve()
        why = None
        if not dest.is_relative_to(root.resolve()):
            why = "leaves the repository"
        elif not dest.exists():
            why = "no such file"
        elif fragment and dest.suffix == ".md" and unquote(fragment) not in anchors(dest):
            why = f"no heading #{fragment} in {dest.relative_to(root.resolve())}"
        if why:
            out.append(f"{doc.relative_to(root)}:{no}: {target} ({why})")
    return out


def documents(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def test_slugs_follow_github() -> None:
    assert slug("The paper's concepts in the code") == "the-papers-concepts-in-the-code"
    assert slug("`dhisparse plan`, by example") == "dhisparse-plan-by-example"
    assert slug("Resolver (issue 4, re-measured for issue 27)") == (
        "resolver-issue-4-re-measured-for-issue-27"
    )
    assert slug("FP8 KV cache: the row and key formats") == "fp8-kv-cache-the-row-and-key-formats"
    assert slug("[A link](x.md) and **bold**") == "a-link-and-bold"


def test_the_check_finds_what_does_not_resolve(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A\n\n## Two words\n\n## Two words\n")
    (tmp_path / "README.md").write_text(
        "[ok](docs/a.md#two-words) [ok](docs/a.md#two-words-1) [ok](docs/) [ok](#b)\n"
        "## B\n"
        "[gone](docs/b.md) ![plot](docs/p.png) [bad](docs/a.md#three) [up](../x.md)\n"
        "[web](https://example.com/none) `[code](no.md)`\n"
        "```\n[fenced](no.md)\n```\n"
        "[ref]: docs/missing.md\n"
    )
    found = broken_links(tmp_path / "README.md", tmp_path)
    assert [f.split(": ", 1)[1] for f in found] == [
        "docs/b.md (no such file)",
        "docs/p.png (no such file)",
        "docs/a.md#three (no heading #three in docs/a.md)",
        "../x.md (leaves the repository)",
        "docs/missing.md (no such file)",
    ], found


def test_every_link_in_readme_and_docs_resolves() -> None:
    found = [b for doc in documents() for b in broken_links(doc)]
    assert not found, "links that do not resolve:\n" + "\n".join(found)
