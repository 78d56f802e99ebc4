"""Every relative link of the README and the guides (docs/*.md) resolves: the file exists, and a #anchor names a
heading of that file as GitHub makes anchors of headings (so moving a section to another guide breaks no link)."""
from __future__ import annotations

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_FENCE = re.compile(r"^ *```.*?^ *```", re.S | re.M)
_CODE_SPAN = re.compile(r"`[^`\n]*`")


def documents() -> list[str]:
    docs = os.path.join(ROOT, "docs")
    return ["README.md", *sorted(f"docs/{n}" for n in os.listdir(docs) if n.endswith(".md"))]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation other than - and _ removed, spaces to
    hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = re.sub(r"[*`]", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: str) -> set[str]:
    """The anchors of one markdown file: its headings (a repeated one gets -1, -2, ...) and explicit id/name tags."""
    with open(path, encoding="utf-8") as f:
        text = _FENCE.sub("", f.read())
    seen: dict[str, int] = {}
    out: set[str] = set()
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.M):
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    out.update(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", text))
    return out


def links(doc: str) -> list[str]:
    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
        text = _CODE_SPAN.sub("", _FENCE.sub("", f.read()))
    return _LINK.findall(text)


def test_the_slugs_are_githubs():
    assert slug("Will it fit? (`python -m offload plan`)") == "will-it-fit-python--m-offload-plan"
    assert slug("Predictions against published measurements (`benchmarks/published_table.py`)") == \
        "predictions-against-published-measurements-benchmarkspublished_tablepy"
    assert slug("torch.compile") == "torchcompile"
    assert slug("How it fits into ComfyUI's memory manager") == "how-it-fits-into-comfyuis-memory-manager"


def test_the_documents_link_to_each_other():
    assert len(documents()) >= 8
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    guides = [d for d in documents() if d != "README.md"]
    unlinked = [g for g in guides if f"({g})" not in readme and f"({g}#" not in readme]
    assert not unlinked, f"guides the README does not link: {unlinked}"


@pytest.mark.parametrize("doc", documents())
def test_relative_links_and_anchors_resolve(doc):
    broken = []
    for target in links(doc):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto: ... not checked here
            continue
        path, _, anchor = target.partition("#")
        base = os.path.dirname(os.path.join(ROOT, doc))
        full = os.path.normpath(os.path.join(base, path)) if path else os.path.join(ROOT, doc)
        if not os.path.exists(full):
            broken.append(f"{target}: no such file")
        elif anchor and full.endswith(".md") and anchor not in anchors(full):
            broken.append(f"{target}: no heading makes #{anchor}")
    assert not broken, f"{doc}: " + "; ".join(broken)
