"""The ComfyUI face imports one way: no module of nodes/ imports (at top level or inside a function) a module that
imports it back, directly or through others. Read from the source (no ComfyUI needed)."""
from __future__ import annotations

import ast
from pathlib import Path

NODES = Path(__file__).resolve().parents[1] / "nodes"


def _imports(path: Path) -> set[str]:
    """Sibling modules of nodes/ that `path` imports anywhere in its body (relative imports of level 1)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                out.add(node.module.split(".")[0])
            else:
                out.update(a.name for a in node.names)
    return {m for m in out if (NODES / f"{m}.py").exists()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_nodes_modules_import_without_a_circle() -> None:
    graph = {p.stem: _imports(p) - {p.stem} for p in NODES.glob("*.py") if p.stem != "__init__"}
    assert "comfy_patcher" in graph and "apply" in graph
    assert _cycle(graph) is None, f"import circle in nodes/: {' -> '.join(_cycle(graph) or [])}"


def test_the_cycle_finder_finds_one() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
