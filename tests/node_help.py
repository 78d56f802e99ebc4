"""Reading the node help pages (web/docs/<node id>.md, served at /extensions/<pack>/docs/<node id>.md, where ComfyUI's
frontend asks for a node's help after /docs/<node id>/<locale>.md): their title, the inputs they describe, their
sections. Shared by tests/test_node_help.py (the recorded node definitions) and tests/comfyui/test_node_help_live.py (the
nodes' own schemas)."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, List

DOCS = Path(__file__).resolve().parents[1] / "web" / "docs"
SECTIONS = ("Inputs", "Outputs", "Example")
_INPUT = re.compile(r"^- `([A-Za-z0-9_]+)` \(")


def page(node_id: str) -> str:
    return (DOCS / f"{node_id}.md").read_text(encoding="utf-8")


def sections(text: str) -> Dict[str, str]:
    """'## Name' sections of a page, by name ('' for what comes before the first)."""
    out: Dict[str, List[str]] = {"": []}
    current = ""
    for line in text.splitlines():
        if line.startswith("## "):
            current = line[3:].strip()
            out[current] = []
        else:
            out[current].append(line)
    return {k: "\n".join(v).strip() for k, v in out.items()}


def described_inputs(text: str) -> List[str]:
    """The inputs a page's Inputs section describes ("- `name` (...): what it is"), in order."""
    return [m.group(1) for line in sections(text).get("Inputs", "").splitlines() if (m := _INPUT.match(line))]


def problems(node_id: str, display_name: str, inputs: List[str]) -> List[str]:
    """What is wrong with a node's help page: missing, its title, a section, an input not or wrongly described."""
    path = DOCS / f"{node_id}.md"
    if not path.is_file():
        return [f"{node_id}: no help page {path}"]
    text = page(node_id)
    found = []
    if not text.startswith(f"# {display_name}\n"):
        found.append(f"{node_id}: the page's title is not '# {display_name}'")
    parts = sections(text)
    if len(parts[""].splitlines()) < 2 or "#" not in parts[""]:
        found.append(f"{node_id}: no description under the title")
    for name in SECTIONS:
        if not parts.get(name):
            found.append(f"{node_id}: no '## {name}' section")
    described = described_inputs(text)
    for name in inputs:
        if name not in described:
            found.append(f"{node_id}: input {name!r} is not described")
    for name in described:
        if name not in inputs:
            found.append(f"{node_id}: the page describes {name!r}, which the node does not have")
    if "```" not in parts.get("Example", ""):
        found.append(f"{node_id}: the example has no wiring block")
    return found
