"""The edits of `edits.plan_edits` carried out on the workflow's JSON, in the form ComfyUI's frontend itself saves:
a node's inputs are its link sockets (in definition order, optional ones with the hollow shape 7) then its linked
widget inputs, each link's target slot its index there; `widgets_values` in widget order; new node and link ids above
every id in use, and every id counter of the workflow moved up to them.

The panel does the same edits with the frontend's graph API (web/offload_convert.js); the browser test holds the two
to the same graph.
"""
from __future__ import annotations

import uuid
from typing import Any

from .pack_nodes import BUDGET_TYPE, PACK_NODES, PackNode, widget_values
from .ui_graph import SUBGRAPH_INPUT_ID, ConvertError, Graph, Workflow

OPTIONAL_SHAPE = 7  # LiteGraph's RenderShape.HollowCircle: how the frontend marks an optional input
DROPPED_PROPERTIES = ("cnr_id", "ver", "aux_id")  # which pack a node comes from: not ComfyUI's any more


def _socket(name: str, kind: str, optional: bool) -> dict[str, Any]:
    entry: dict[str, Any] = {"localized_name": name, "name": name, "type": kind, "link": None}
    if optional:
        entry["shape"] = OPTIONAL_SHAPE
    return entry


def _inputs_for(pack: PackNode, linked_widgets: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """A node's serialized inputs: every link socket, then the widget inputs that carry a link (kept as they were)."""
    out = [_socket(i.name, i.type, i.optional) for i in pack.sockets]
    out += [linked_widgets[w.name] for w in pack.widgets if w.name in linked_widgets]
    return out


def _properties(old: Any, type_name: str) -> dict[str, Any]:
    props = {k: v for k, v in (old or {}).items() if k not in DROPPED_PROPERTIES} if isinstance(old, dict) else {}
    props["Node name for S&R"] = type_name
    return props


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _point(pos: Any) -> list[float] | None:
    """[x, y] of a position the frontend saved as a list or as {"0": x, "1": y}; None when it is neither."""
    if isinstance(pos, dict):
        pos = [pos.get("0"), pos.get("1")]
    if isinstance(pos, list) and len(pos) == 2 and all(_number(v) for v in pos):
        return [float(pos[0]), float(pos[1])]
    return None


class _Applier:
    def __init__(self, wf: Workflow) -> None:
        self.wf = wf
        self.last_node, self.last_link = wf.max_ids()
        self.handles: dict[str, int] = {}

    def node_id(self, ref: Any) -> int:
        if isinstance(ref, str) and ref.startswith("new:"):
            return self.handles[ref]
        return int(ref)

    def new_link_id(self) -> int:
        self.last_link += 1
        return self.last_link

    def retarget(self, graph: Graph, node: dict[str, Any]) -> None:
        """Each link into `node` points at the index of the input that holds it."""
        for index, slot in enumerate(node.get("inputs") or []):
            link = graph.link(slot.get("link"))
            if link is not None:
                link["target_slot"] = index

    # ------------------------------------------------------------------------------------------------- the ops
    def replace(self, graph: Graph, edit: dict[str, Any]) -> None:
        node = graph.node(edit["node"])
        if node is None:
            raise ConvertError(f"{graph.name}: node {edit['node']} to replace is not there")
        pack = PACK_NODES[edit["type"]]
        widget_names = {w.name for w in pack.widgets}
        linked: dict[str, dict[str, Any]] = {}
        for slot in node.get("inputs") or []:
            if not isinstance(slot, dict) or slot.get("link") is None:
                continue
            if slot.get("name") not in widget_names:  # edits.replaceable() keeps such a loader
                raise ConvertError(f"{graph.name}: node {edit['node']}'s linked input {slot.get('name')!r} is not "
                                   f"an input of {pack.display_name}")
            linked[slot["name"]] = slot
        node["inputs"] = _inputs_for(pack, linked)
        self.retarget(graph, node)
        outputs = node.get("outputs") or []
        node["outputs"] = [dict(outputs[i] if i < len(outputs) and isinstance(outputs[i], dict) else {"links": []},
                                name=name, localized_name=name, type=kind) for i, (name, kind) in enumerate(pack.outputs)]
        node["type"] = pack.type
        node["widgets_values"] = widget_values(pack, edit["widgets"])
        node["properties"] = _properties(node.get("properties"), pack.type)
        node["size"] = list(edit["size"])
        if edit.get("title"):
            node["title"] = edit["title"]
        else:
            node.pop("title", None)

    def add(self, graph: Graph, edit: dict[str, Any]) -> None:
        pack = PACK_NODES[edit["type"]]
        self.last_node += 1
        self.handles[edit["handle"]] = self.last_node
        order = max((n.get("order", 0) for n in graph.nodes if isinstance(n.get("order"), int)), default=-1) + 1
        graph.add_node({"id": self.last_node, "type": pack.type, "pos": list(edit["pos"]), "size": list(edit["size"]),
                        "flags": {}, "order": order, "mode": 0, "inputs": _inputs_for(pack, {}),
                        "outputs": [{"localized_name": name, "name": name, "type": kind, "links": []}
                                    for name, kind in pack.outputs],
                        "properties": {"Node name for S&R": pack.type},
                        "widgets_values": widget_values(pack, edit["widgets"])})

    def insert(self, graph: Graph, edit: dict[str, Any]) -> None:
        new = graph.node(self.node_id(edit["node"]))
        source_id, slot = int(edit["source"][0]), int(edit["source"][1])
        source = graph.node(source_id)
        if new is None or source is None:
            raise ConvertError(f"{graph.name}: node {source_id} to insert after is not there")
        out = source["outputs"][slot]
        moved = [lid for lid in out.get("links") or [] if graph.link(lid) is not None]
        for lid in moved:
            link = graph.link(lid)
            link["origin_id"] = new["id"]
            link["origin_slot"] = 0
        new["outputs"][0]["links"] = moved
        lid = self.new_link_id()
        index = next(i for i, s in enumerate(new["inputs"]) if s["name"] == edit["input"])
        graph.add_link(lid, source_id, slot, new["id"], index, str(out.get("type")))
        out["links"] = [lid]
        new["inputs"][index]["link"] = lid

    def subgraph_input(self, graph: Graph, edit: dict[str, Any]) -> None:
        slots = graph.io_slots("inputs")
        last = _point(slots[-1].get("pos")) if slots else None
        box = (graph.data.get("inputNode") or {}).get("bounding")
        if last is not None:
            pos = [last[0], last[1] + 20]
        elif isinstance(box, list) and len(box) == 4 and all(_number(v) for v in box):
            pos = [box[0] + box[2] - 20, box[1] + 20]
        else:
            pos = [0, 0]
        slots.append({"id": str(uuid.uuid5(uuid.NAMESPACE_URL, f"layer-offload/{graph.gid}/{edit['name']}")),
                      "name": edit["name"], "type": edit["type"], "linkIds": [], "localized_name": edit["name"],
                      "pos": pos})
        names = [s.get("name") for s in slots]
        for parent in self.wf.graphs():
            for inst in parent.nodes:
                if inst["type"] == graph.gid:
                    self._align_instance(parent, inst, slots, names)

    def _align_instance(self, parent: Graph, inst: dict[str, Any], slots: list[dict[str, Any]],
                        names: list[Any]) -> None:
        """An instance's serialized inputs, one per subgraph input in the subgraph's order (how the frontend lays
        them out), the new one last; entries it had are kept."""
        have = [i for i in inst.get("inputs") or [] if isinstance(i, dict)]
        if [i.get("name") for i in have] == names[:-1]:
            rebuilt = have
        else:
            by_name: dict[Any, dict[str, Any]] = {}
            for entry in have:
                by_name.setdefault(entry.get("name"), entry)
            rebuilt = []
            for s in slots[:-1]:
                entry = by_name.pop(s.get("name"), None)
                rebuilt.append(entry if entry is not None else
                               {k: v for k, v in (("label", s.get("label")), ("localized_name", s.get("localized_name")),
                                                  ("name", s.get("name")), ("type", s.get("type")), ("link", None))
                                if v is not None or k == "link"})
            for entry in by_name.values():  # inputs the subgraph no longer has: unlinked, as the frontend drops them
                if entry.get("link") is not None:
                    self.unlink(parent, entry["link"])
        new = slots[-1]
        rebuilt.append({"localized_name": new["name"], "name": new["name"], "type": new["type"], "link": None})
        inst["inputs"] = rebuilt
        self.retarget(parent, inst)

    def link(self, graph: Graph, edit: dict[str, Any]) -> None:
        target = graph.node(self.node_id(edit["to"]["node"]))
        if target is None:
            raise ConvertError(f"{graph.name}: node {edit['to']['node']} to link is not there")
        name = edit["to"]["input"]
        inputs = target.setdefault("inputs", [])
        index = next((i for i, s in enumerate(inputs) if isinstance(s, dict) and s.get("name") == name), None)
        if index is None:
            inputs.append(_socket(name, BUDGET_TYPE, True))
            index = len(inputs) - 1
        lid = self.new_link_id()
        source = edit["from"]
        if "subgraph_input" in source:
            slots = graph.io_slots("inputs")
            origin_slot = next(i for i, s in enumerate(slots) if s.get("name") == source["subgraph_input"])
            slots[origin_slot].setdefault("linkIds", []).append(lid)
            graph.add_link(lid, SUBGRAPH_INPUT_ID, origin_slot, int(target["id"]), index, BUDGET_TYPE)
        else:
            origin = graph.node(self.node_id(source["node"]))
            slot = int(source.get("slot", 0))
            origin["outputs"][slot].setdefault("links", [])
            if origin["outputs"][slot]["links"] is None:
                origin["outputs"][slot]["links"] = []
            origin["outputs"][slot]["links"].append(lid)
            graph.add_link(lid, int(origin["id"]), slot, int(target["id"]), index, BUDGET_TYPE)
        inputs[index]["link"] = lid

    def unlink(self, graph: Graph, lid: Any) -> None:
        link = graph.link(lid)
        if link is None:
            return
        origin = graph.node(link["origin_id"])
        if origin is not None:
            for out in origin.get("outputs") or []:
                if isinstance(out, dict) and isinstance(out.get("links"), list) and link["id"] in out["links"]:
                    out["links"].remove(link["id"])
        elif link["origin_id"] == SUBGRAPH_INPUT_ID:
            for s in graph.io_slots("inputs"):
                if link["id"] in (s.get("linkIds") or []):
                    s["linkIds"].remove(link["id"])
        graph.data["links"] = [e for e in graph.data["links"] if e is not link.entry]
        del graph.links[int(link["id"])]


def apply_edits(wf: Workflow, edits: list[dict[str, Any]]) -> None:
    """Carry out `edits` on the workflow's JSON in place (node and link ids allocated here, counters updated)."""
    applier = _Applier(wf)
    for edit in edits:
        op = getattr(applier, edit["op"], None) if edit.get("op") in (
            "replace", "add", "insert", "subgraph_input", "link") else None
        if op is None:
            raise ConvertError(f"unknown edit {edit.get('op')!r}")
        op(wf.graph(edit["graph"]), edit)
    if edits:
        wf.set_counters(applier.last_node, applier.last_link)
