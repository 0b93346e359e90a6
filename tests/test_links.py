"""Every relative link in the repository's Markdown files resolves: the file
exists, and a `#anchor` names a heading of the file it points to (GitHub's
and MkDocs' rule for heading anchors). `mkdocs build --strict` checks only
the pages under docs/ and not links that leave it."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
SKIPPED = {".git", "site", "node_modules", ".venv", "outputs"}


def _markdown_files():
    return sorted(
        path
        for path in ROOT.rglob("*.md")
        if not SKIPPED.intersection(path.relative_to(ROOT).parts)
    )


def _anchor(heading):
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"`|\*", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path):
    anchors, in_code = set(), False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            anchor = _anchor(line.lstrip("#"))
            base, n = anchor, 1
            while anchor in anchors:
                anchor, n = f"{base}-{n}", n + 1
            anchors.add(anchor)
    return anchors


def _links(path):
    in_code = False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_code = not in_code
            continue
        if in_code:
            continue
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target):  # not http:, mailto:
                yield number, target


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for path in _markdown_files():
        for number, target in _links(path):
            file_part, _, anchor = target.partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(ROOT)}:{number}: {target}"
            if not linked.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
                broken.append(f"{where} (no heading with anchor #{anchor})")
    assert not broken, "Broken links:\n" + "\n".join(broken)


@pytest.mark.parametrize(
    "heading, anchor",
    [
        ("Install and run", "install-and-run"),
        ("`DUQOutput`: the head", "duqoutput-the-head"),
        ("Which score, for which question?", "which-score-for-which-question"),
    ],
)
def test_anchors_follow_github(heading, anchor):
    assert _anchor(heading) == anchor
