"""Every relative link and #anchor in README.md and docs/*.md resolves, and the README stays a
front door: at most 200 lines, linking every page of docs/.

A link resolves when the file or folder it names exists inside the repository; an anchor when it
is the slug of a heading of the Markdown file it points into, by GitHub's rules: the heading's
text (a link's text, not its address) lowercased, every character but letters, digits, spaces,
'-' and '_' removed, each space made a '-', and a repeated slug numbered '-1', '-2', ... Links in
code (fenced blocks, `spans`) are not links. Web addresses are not followed.

docs/flags.md is checked against its generator by tests/unit/test_flags_doc.py."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, List, Set, Tuple

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
PAGES = [README] + sorted((REPO / "docs").glob("*.md"))
README_MAX_LINES = 200

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def prose(text: str) -> str:
    """The text with fenced code blocks and inline code spans blanked (line breaks kept)."""
    out, fence = [], None
    for line in text.splitlines():
        stripped = line.lstrip()
        if fence is None and stripped.startswith(("```", "~~~")):
            fence = stripped[:3]
            line = ""
        elif fence is not None:
            if stripped.startswith(fence):
                fence = None
            line = ""
        out.append(line)
    return re.sub(r"`[^`]+`", lambda m: re.sub(r"[^\n]", " ", m.group(0)), "\n".join(out))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return "".join(c for c in text if c.isalnum() or c in " -_").replace(" ", "-")


def anchors(path: Path) -> Set[str]:
    """The anchors of a Markdown file's headings (ATX headings outside code)."""
    seen: Dict[str, int] = {}
    out = set()
    text = path.read_text(encoding="utf-8")
    fence = None
    for line in text.splitlines():  # headings keep their `code`: the raw lines, fences skipped
        stripped = line.lstrip()
        if stripped.startswith(("```", "~~~")):
            fence = None if fence else stripped[:3]
            continue
        match = None if fence else re.match(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            out.add(base if count == 0 else f"{base}-{count}")
    return out


def links(path: Path) -> List[Tuple[int, str]]:
    """(line, target) of the Markdown links of a file, outside code (a link's text may span
    lines)."""
    text = prose(path.read_text(encoding="utf-8"))
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in LINK.finditer(text)]


def problems_of(path: Path, root: Path = REPO) -> List[str]:
    """What does not resolve among `path`'s links (empty: all do)."""
    where = path.relative_to(root)
    out = []
    for number, target in links(path):
        if not target or SCHEME.match(target) or target.startswith("//"):
            continue
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if root.resolve() not in linked.parents and linked != root.resolve():
            out.append(f"{where}:{number}: {target} leaves the repository")
            continue
        if not linked.exists():
            out.append(f"{where}:{number}: {target}: no such file or folder")
            continue
        if not anchor:
            continue
        if linked.suffix != ".md":
            if not re.fullmatch(r"L\d+(-L\d+)?", anchor):
                out.append(f"{where}:{number}: {target}: #{anchor} in a file that is not Markdown")
        elif anchor not in anchors(linked):
            out.append(f"{where}:{number}: {target}: no heading of "
                       f"{linked.relative_to(root.resolve())} has the anchor #{anchor}")
    return out


def test_every_relative_link_and_anchor_resolves():
    assert len(PAGES) >= 12, PAGES
    problems = [p for page in PAGES for p in problems_of(page)]
    checked = sum(len(links(page)) for page in PAGES)
    assert checked > 50, checked
    assert not problems, "\n".join(problems)


def test_the_readme_is_short_and_links_every_page():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"
    linked = {(README.parent / target.partition("#")[0]).resolve()
              for _, target in links(README) if not SCHEME.match(target)}
    missing = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert not missing, f"README.md does not link docs/{', docs/'.join(missing)}"


def test_slugs_follow_githubs_rules():
    assert slug("Resuming: `--load`") == "resuming---load"
    assert slug("Mixture-of-Experts (Switch, ST-MoE, CPM-2-MoE's BASE layers)") == \
        "mixture-of-experts-switch-st-moe-cpm-2-moes-base-layers"
    assert slug("Preprocessing: `data_tools/preprocess_data.py`") == \
        "preprocessing-data_toolspreprocess_datapy"
    assert slug("A [linked](x.md) heading") == "a-linked-heading"
    assert slug("TP × PP") == "tp--pp"


def test_the_check_catches_a_broken_link_and_anchor(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## Same\n\n## Same\n", encoding="utf-8")
    page = tmp_path / "docs" / "b.md"
    page.write_text(
        "# B\n\n"
        "[fine](a.md#a-page) [fine too](a.md#same-1) [self](#b) [web](https://x.org/#nope)\n"
        "[gone](missing.md) [bad anchor](a.md#nope) [no third](a.md#same-2)\n"
        "`[in code](missing-too.md)`\n\n"
        "```\n[in a block](missing-three.md)\n```\n"
        "[out](../../outside.md) [two\nlines](a.md#also-nope)\n", encoding="utf-8")
    said = "\n".join(problems_of(page, root=tmp_path))
    assert "missing.md: no such file" in said
    assert "a.md#nope: no heading of docs/a.md has the anchor #nope" in said
    assert "a.md#same-2" in said
    assert "leaves the repository" in said
    assert "a.md#also-nope" in said
    for fine in ("a.md#a-page", "#same-1", "#b", "x.org", "missing-too", "missing-three"):
        assert fine not in said, said
    assert len(said.splitlines()) == 5, said
