"""What "Offload this workflow" changes, decided once from the workflow as it is: a list of edits (JSON-ready) that
`apply.apply_edits` carries out on the JSON and web/offload_convert.js with the frontend's graph API, so the command
line and the panel make the same workflow.

Per graph (the root and every subgraph definition; a definition is edited once, whatever its instances):
- each active UNETLoader / CheckpointLoaderSimple is replaced by the pack's loader of the same file
  (`replace`: same node id, position, links and widget values, the plan's preset), unless a link goes into an input
  the pack's loader lacks (then it is treated as the other loaders are);
- every other loader (a node named ...Loader... without a MODEL / CLIP input: GGUF loaders, CLIP loaders, LTX-2's text
  encoder, image-only checkpoints ...) gets Offload Model / Offload CLIP after each MODEL / CLIP output that is used
  and not yet offloaded (`add` beside it, then `insert`: its consumers move to the new node's output);
- one VRAM Budget node (the root's own if it has one, else a new one) is linked to every offload node whose budget
  input is free; a subgraph gets an OFFLOAD_BUDGET input (`subgraph_input`) that carries it in, through every level.

Nothing else changes. A workflow converted once gives no edits (idempotent).

Edit records: {"op": "replace", "graph", "node", "type", "widgets", "title", "size"}; {"op": "add", "graph",
"handle", "type", "widgets", "pos", "size"}; {"op": "insert", "graph", "node", "source": [node, slot], "input"};
{"op": "subgraph_input", "graph", "name", "type"}; {"op": "link", "graph", "from": {"node", "slot"} |
{"subgraph_input"}, "to": {"node", "input"}}. "graph" is "root" or a subgraph's id; a "node" is an existing id or
the "new:<n>" handle of an `add`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from . import layout
from .pack_nodes import (BUDGET_TYPE, BUDGET_USERS, DEFAULT_TITLES, OFFLOAD_AFTER, PACK_NODES, PACK_TYPES, REPLACED,
                         REPLACED_WIDGETS, VRAM_BUDGET)
from .ui_graph import ROOT, Graph, Workflow, is_active, widget_dict

# (graph id, node id, role) -> preset; role: "diffusion" | "checkpoint" | "text_encoder" | "model"
PresetFor = Callable[[str, int, str], str]
# node types that pass a value along without loading anything (never a loader)
VIRTUAL = frozenset({"Reroute", "PrimitiveNode", "Note", "MarkdownNote", "GetNode", "SetNode"})


@dataclass
class Change:
    """One line of the summary: what was done to which node."""

    graph: str
    node: int
    type: str
    action: str
    preset: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"graph": self.graph, "node": self.node, "type": self.type, "action": self.action,
                "preset": self.preset}


@dataclass
class _Plan:
    edits: list[dict[str, Any]] = field(default_factory=list)
    changes: list[Change] = field(default_factory=list)
    taken: dict[str, list[layout.Rect]] = field(default_factory=dict)
    new_budget_users: dict[str, list[Any]] = field(default_factory=dict)  # graph -> ids / handles needing the link
    count: int = 0

    def handle(self) -> str:
        self.count += 1
        return f"new:{self.count}"


def _input(node: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((i for i in node.get("inputs") or [] if isinstance(i, dict) and i.get("name") == name), None)


def _linked(node: dict[str, Any], name: str) -> bool:
    slot = _input(node, name)
    return slot is not None and slot.get("link") is not None


def _slot_type(slot: Any) -> str:
    return str(slot.get("type", "")) if isinstance(slot, dict) else ""


def is_loader(node: dict[str, Any]) -> bool:
    """A node that makes a model from files: named ...Loader..., no MODEL / CLIP / any-type input, not the pack's."""
    kind = node["type"]
    if kind in PACK_TYPES or kind in VIRTUAL or "loader" not in kind.lower():
        return False
    return not any(_slot_type(i) in ("MODEL", "CLIP", "*") for i in node.get("inputs") or [])


def replaceable(node: dict[str, Any]) -> bool:
    """A UNETLoader / CheckpointLoaderSimple the pack's loader can stand in for: every linked input is one of its
    widgets (a link into anything else would be lost; such a loader gets an Offload node after it instead)."""
    if node["type"] not in REPLACED:
        return False
    widgets = set(REPLACED_WIDGETS[node["type"]])
    return all(i.get("link") is None or i.get("name") in widgets for i in node.get("inputs") or [])


def _offloaded(graph: Graph, node: dict[str, Any], slot: int, kind: str) -> bool:
    """Whether an output already feeds an Offload node of its kind (or Offload Any): then it is left as it is."""
    wanted = {OFFLOAD_AFTER[kind].type, "OffloadAny"}
    for link in graph.consumers(node, slot):
        target = graph.node(link["target_id"])
        if target is not None and target["type"] in wanted:
            return True
    return False


def _title(node: dict[str, Any]) -> str | None:
    title = node.get("title")
    if not isinstance(title, str) or not title or title in DEFAULT_TITLES.get(node["type"], ()):
        return None
    return title


def _size(node: dict[str, Any], want: tuple[int, int]) -> list[float]:
    x, y, w, h = layout.node_rect(node)
    return [max(w, want[0]), max(h - layout.TITLE, want[1])]


def _graph_rects(graph: Graph) -> list[layout.Rect]:
    rects = [layout.node_rect(n) for n in graph.nodes]
    for key in ("inputNode", "outputNode"):  # a subgraph's input and output nodes: [x, y, w, h]
        box = graph.data.get(key, {}).get("bounding") if isinstance(graph.data.get(key), dict) else None
        if isinstance(box, list) and len(box) == 4 and all(isinstance(v, (int, float)) for v in box):
            rects.append((float(box[0]), float(box[1]), float(box[2]), float(box[3])))
    return rects


def _replace(plan: _Plan, graph: Graph, node: dict[str, Any], preset_for: PresetFor) -> None:
    pack, names = REPLACED[node["type"]]
    role = "diffusion" if pack.type == "OffloadDiffusionModelLoader" else "checkpoint"
    preset = preset_for(graph.gid, int(node["id"]), role)
    old = widget_dict(node, REPLACED_WIDGETS[node["type"]])
    widgets = {ours: old[theirs] for ours, theirs in names.items() if theirs in old}
    widgets["preset"] = preset
    size = _size(node, pack.size)
    plan.edits.append({"op": "replace", "graph": graph.gid, "node": int(node["id"]), "type": pack.type,
                       "widgets": widgets, "title": _title(node), "size": size})
    plan.changes.append(Change(graph.name, int(node["id"]), node["type"], f"replaced by {pack.display_name}", preset))
    x, y = layout.node_rect(node)[:2]
    plan.taken[graph.gid].append(layout.rect_at([x, y + layout.TITLE], size))
    plan.new_budget_users[graph.gid].append(int(node["id"]))


def _insert_after(plan: _Plan, graph: Graph, node: dict[str, Any], slot: int, kind: str,
                  preset_for: PresetFor) -> None:
    pack = OFFLOAD_AFTER[kind]
    preset = preset_for(graph.gid, int(node["id"]), "text_encoder" if kind == "CLIP" else "model")
    handle = plan.handle()
    pos = layout.free_spot(layout.node_rect(node), pack.size, plan.taken[graph.gid])
    plan.edits.append({"op": "add", "graph": graph.gid, "handle": handle, "type": pack.type,
                       "widgets": {"preset": preset}, "pos": pos, "size": list(pack.size)})
    plan.edits.append({"op": "insert", "graph": graph.gid, "node": handle, "source": [int(node["id"]), slot],
                       "input": pack.inputs[0].name})
    plan.changes.append(Change(graph.name, int(node["id"]), node["type"],
                               f"{pack.display_name} added after its {kind} output", preset))
    plan.taken[graph.gid].append(layout.rect_at(pos, pack.size))
    plan.new_budget_users[graph.gid].append(handle)


def _budget_input(graph: Graph) -> str | None:
    """The name of a subgraph's OFFLOAD_BUDGET input, when it has one."""
    return next((s.get("name") for s in graph.io_slots("inputs") if _slot_type(s) == BUDGET_TYPE), None)


def _unique_name(graph: Graph, base: str) -> str:
    names = {s.get("name") for s in graph.io_slots("inputs")}
    name, n = base, 1
    while name in names:
        name, n = f"{base}_{n}", n + 1
    return name


def _budget_node(graph: Graph) -> dict[str, Any] | None:
    return next((n for n in graph.nodes if n["type"] == VRAM_BUDGET.type and is_active(n)), None)


def _wire_budget(plan: _Plan, wf: Workflow) -> None:
    """Link every offload node whose budget input is free to the one VRAM Budget node, through subgraph inputs."""
    wants: dict[str, bool] = {}
    input_names: dict[str, str] = {}

    def consumers(graph: Graph) -> list[tuple[str, str]]:
        """(node id or handle, input name) in `graph` waiting for the budget."""
        out: list[tuple[Any, str]] = [(ref, "budget") for ref in plan.new_budget_users[graph.gid]]
        replaced = set(plan.new_budget_users[graph.gid])
        for node in graph.nodes:
            if int(node["id"]) in replaced:
                continue
            if node["type"] in BUDGET_USERS and not _linked(node, "budget"):
                out.append((int(node["id"]), "budget"))
            elif node["type"] in wf.subgraphs and want(wf.subgraphs[node["type"]]):
                name = input_names[node["type"]]
                if not _linked(node, name):
                    out.append((int(node["id"]), name))
        return out

    def want(sub: Graph) -> bool:
        if sub.gid not in wants:
            wants[sub.gid] = False  # nesting was checked acyclic; this only guards the recursion
            input_names[sub.gid] = _budget_input(sub) or _unique_name(sub, "budget")
            wants[sub.gid] = bool(consumers(sub)) and _budget_node(sub) is None
        return wants[sub.gid]

    for graph in wf.graphs():
        if graph.is_subgraph:
            want(graph)
    links: list[dict[str, Any]] = []  # after every subgraph input exists (an instance's inputs follow its subgraph's)
    for graph in wf.graphs():
        waiting = consumers(graph)
        if not waiting:
            continue
        source: dict[str, Any]
        budget = _budget_node(graph)
        if budget is not None:
            source = {"node": int(budget["id"]), "slot": 0}
        elif graph.is_subgraph:
            name = input_names[graph.gid]
            if _budget_input(graph) is None:
                plan.edits.append({"op": "subgraph_input", "graph": graph.gid, "name": name, "type": BUDGET_TYPE})
            source = {"subgraph_input": name}
        else:
            handle = plan.handle()
            rects = _graph_rects(graph)
            left = min((r[0] for r in rects), default=0.0)
            first = next((graph.node(ref) for ref, _ in waiting if graph.node(ref) is not None), None)
            top = layout.node_rect(first)[1] + layout.TITLE if first is not None else 0.0
            pos = [round(left - VRAM_BUDGET.size[0] - 2 * layout.GAP, 1), round(top, 1)]
            plan.edits.append({"op": "add", "graph": graph.gid, "handle": handle, "type": VRAM_BUDGET.type,
                               "widgets": {}, "pos": pos, "size": list(VRAM_BUDGET.size)})
            plan.changes.append(Change(graph.name, 0, VRAM_BUDGET.type, "VRAM Budget node added"))
            source = {"node": handle, "slot": 0}
        links += [{"op": "link", "graph": graph.gid, "from": source, "to": {"node": ref, "input": name}}
                  for ref, name in waiting]
    plan.edits += links


def plan_edits(wf: Workflow, preset_for: PresetFor) -> tuple[list[dict[str, Any]], list[Change]]:
    """The edits that put the pack's nodes into `wf` (see the module doc), and what they do, line by line."""
    plan = _Plan()
    for graph in wf.graphs():
        plan.taken[graph.gid] = _graph_rects(graph)
        plan.new_budget_users[graph.gid] = []
    for graph in wf.graphs():
        for node in list(graph.nodes):
            if is_active(node) and replaceable(node):
                _replace(plan, graph, node, preset_for)
    for graph in wf.graphs():
        for node in list(graph.nodes):
            if not is_active(node) or replaceable(node) or not is_loader(node):
                continue
            for slot, out in enumerate(node.get("outputs") or []):
                kind = _slot_type(out)
                if kind in OFFLOAD_AFTER and graph.consumers(node, slot) and not _offloaded(graph, node, slot, kind):
                    _insert_after(plan, graph, node, slot, kind, preset_for)
    _wire_budget(plan, wf)
    return plan.edits, plan.changes


def pack_node(type_name: str) -> Any:
    """The pack's node description an edit names."""
    return PACK_NODES[type_name]
