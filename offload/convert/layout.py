"""Where a new node goes on the canvas: next to the node it follows, on the first spot no other node covers.

A node's `pos` is the top-left corner of its body; its title bar (30 px in LiteGraph) sits above it, so a node covers
[x, y - 30, w, h + 30]. Candidates go right of the node first (the reading direction of a graph), then below, above
and left, stepping outwards; the first free one wins, else the first candidate (an overlap, never a lost node).
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence

TITLE = 30.0
GAP = 40.0
Rect = tuple[float, float, float, float]


def _num(value: Any, default: float) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def node_rect(node: dict[str, Any]) -> Rect:
    """The canvas area a node covers, its title bar included (a missing or bad pos/size reads as a small box)."""
    pos = node.get("pos")
    size = node.get("size")
    if isinstance(pos, dict):  # some writers store {"0": x, "1": y}
        pos = [pos.get("0"), pos.get("1")]
    if isinstance(size, dict):
        size = [size.get("0"), size.get("1")]
    x = _num(pos[0], 0.0) if isinstance(pos, list) and len(pos) >= 2 else 0.0
    y = _num(pos[1], 0.0) if isinstance(pos, list) and len(pos) >= 2 else 0.0
    w = _num(size[0], 200.0) if isinstance(size, list) and len(size) >= 2 else 200.0
    h = _num(size[1], 80.0) if isinstance(size, list) and len(size) >= 2 else 80.0
    return (x, y - TITLE, max(w, 1.0), max(h, 1.0) + TITLE)


def _overlaps(a: Rect, b: Rect, margin: float = 10.0) -> bool:
    return (a[0] < b[0] + b[2] + margin and b[0] < a[0] + a[2] + margin and
            a[1] < b[1] + b[3] + margin and b[1] < a[1] + a[3] + margin)


def free_spot(anchor: Rect, size: Sequence[float], taken: Iterable[Rect], rings: int = 12) -> list[float]:
    """The `pos` of a node of `size` next to the `anchor` rectangle where it covers none of `taken`."""
    w, h = float(size[0]), float(size[1]) + TITLE
    ax, ay, aw, ah = anchor
    taken = list(taken)
    candidates: list[tuple[float, float]] = []
    step_y, step_x = h + GAP / 2, w + GAP / 2
    for ring in range(rings):
        candidates.append((ax + aw + GAP + ring * step_x, ay))  # right, then further right
        candidates.append((ax, ay + ah + GAP + ring * step_y))  # below, further down
        candidates.append((ax + aw + GAP, ay + ring * step_y))  # right column, going down
        candidates.append((ax, ay - h - GAP - ring * step_y))  # above
        candidates.append((ax - w - GAP - ring * step_x, ay))  # left
    for x, y in candidates:
        if not any(_overlaps((x, y, w, h), r) for r in taken):
            return [round(x, 1), round(y + TITLE, 1)]
    x, y = candidates[0]
    return [round(x, 1), round(y + TITLE, 1)]


def rect_at(pos: Sequence[float], size: Sequence[float]) -> Rect:
    """The area a node placed at `pos` with `size` covers."""
    return (float(pos[0]), float(pos[1]) - TITLE, float(size[0]), float(size[1]) + TITLE)
