"""A ComfyUI UI workflow (what the frontend saves) as graphs to read and edit in place: the root graph and each
subgraph definition, their nodes, their links in either form the frontend writes (root `links` as
`[id, origin, origin_slot, target, target_slot, type]` lists, subgraph links and schema-1 workflows as objects), the
subgraph's input and output slots (link origins -10 / targets -20), and the id counters the whole workflow shares
(node and link ids are unique across the root and every subgraph: the frontend keeps one `state` for all of them).

Plain JSON manipulation: no ComfyUI import. Bad structure is a `ConvertError` naming what is wrong.
"""
from __future__ import annotations

from typing import Any, Iterator

SUBGRAPH_INPUT_ID = -10  # the frontend's ids of a subgraph's input and output nodes
SUBGRAPH_OUTPUT_ID = -20
ROOT = "root"
MAX_NODES = 20_000  # nodes in all graphs together: more is not a workflow a person made
MAX_SUBGRAPHS = 1_000  # the frontend's own limit of nested subgraphs (Subgraph.MAX_NESTED_SUBGRAPHS)
MUTED_MODES = (2, 4)  # never, bypass


class ConvertError(ValueError):
    """A workflow the converter cannot edit: says what is wrong with it."""


def _int_id(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConvertError(f"{what} is not a number: {value!r:.60}")
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ConvertError(f"{what} is not a number: {value!r:.60}") from None
    if isinstance(value, float) and value != number:
        raise ConvertError(f"{what} is not a whole number: {value!r}")
    return number


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_slots(slots: Any, what: str, links_key: str) -> None:
    """A node's inputs / outputs (or a subgraph's): a list of objects with a name, a type, and link ids."""
    if slots is None:
        return
    if not isinstance(slots, list):
        raise ConvertError(f"{what} is not a list")
    for index, slot in enumerate(slots):
        if not isinstance(slot, dict):
            raise ConvertError(f"{what}: entry {index} is not an object")
        label = f"{what}: {slot.get('name')!r:.40}" if isinstance(slot.get("name"), str) else f"{what}: entry {index}"
        if not isinstance(slot.get("name"), str):
            raise ConvertError(f"{label} has no name")
        if not isinstance(slot.get("type", ""), (str, int)) or isinstance(slot.get("type"), bool):
            raise ConvertError(f"{label} has a type that is not a name: {slot.get('type')!r:.60}")
        held = slot.get(links_key)
        if links_key == "link":
            if held is not None and not _is_int(held):
                raise ConvertError(f"{label} holds a link that is not an id: {held!r:.60}")
        elif held is not None and not (isinstance(held, list) and all(_is_int(v) for v in held)):
            raise ConvertError(f"{label}: {links_key} is not a list of link ids")


def _check_node(node: dict[str, Any], what: str) -> None:
    """The parts of a node the converter reads or edits have the frontend's shapes (else a ConvertError naming them;
    the layout fields are read leniently in layout.node_rect)."""
    inputs, outputs = node.get("inputs"), node.get("outputs")
    _check_slots(inputs, f"{what}: inputs", "link")
    _check_slots(outputs, f"{what}: outputs", "links")
    values = node.get("widgets_values")
    if values is not None and not isinstance(values, (list, dict)):
        raise ConvertError(f"{what}: widgets_values is neither a list nor an object")
    if node.get("properties") is not None and not isinstance(node.get("properties"), dict):
        raise ConvertError(f"{what}: properties is not an object")
    mode = node.get("mode", 0)
    if not _is_int(mode):
        raise ConvertError(f"{what}: mode is not a number: {mode!r:.40}")


class Link:
    """One link of a graph, over its JSON entry (a list or an object): reads and writes go to the entry."""

    __slots__ = ("entry",)
    _FIELDS = {"id": 0, "origin_id": 1, "origin_slot": 2, "target_id": 3, "target_slot": 4, "type": 5}

    def __init__(self, entry: Any) -> None:
        self.entry = entry

    def __getitem__(self, key: str) -> Any:
        if isinstance(self.entry, list):
            return self.entry[self._FIELDS[key]]
        return self.entry.get(key)

    def __setitem__(self, key: str, value: Any) -> None:
        if isinstance(self.entry, list):
            self.entry[self._FIELDS[key]] = value
        else:
            self.entry[key] = value


class Graph:
    """The root graph or one subgraph definition."""

    def __init__(self, data: dict[str, Any], gid: str, name: str) -> None:
        self.data = data
        self.gid = gid
        self.name = name
        nodes = data.get("nodes")
        if not isinstance(nodes, list) or not all(isinstance(n, dict) for n in nodes):
            raise ConvertError(f"{name}: 'nodes' is not a list of objects")
        self.nodes: list[dict[str, Any]] = nodes
        self.by_id: dict[int, dict[str, Any]] = {}
        for node in nodes:
            nid = _int_id(node.get("id"), f"{name}: a node's id")
            if nid in self.by_id:
                raise ConvertError(f"{name}: node id {nid} is used twice")
            if not isinstance(node.get("type"), str):
                raise ConvertError(f"{name}: node {nid} has no type")
            _check_node(node, f"{name}: node {nid} ({node['type']})")
            self.by_id[nid] = node
        raw = data.get("links")
        if raw is None:
            raw = data["links"] = []
        if not isinstance(raw, list):
            raise ConvertError(f"{name}: 'links' is not a list")
        self.links: dict[int, Link] = {}
        for entry in raw:
            if isinstance(entry, list) and len(entry) >= 6 or isinstance(entry, dict) and "id" in entry:
                link = Link(entry)
                lid = _int_id(link["id"], f"{name}: a link's id")
                for key in ("origin_id", "origin_slot", "target_id", "target_slot"):
                    _int_id(link[key], f"{name}: link {lid}'s {key}")
                self.links[lid] = link
            elif entry is not None:
                raise ConvertError(f"{name}: a link is neither [id, origin, slot, target, slot, type] nor an object")
        for kind in ("inputs", "outputs"):  # a subgraph's own input and output slots
            _check_slots(data.get(kind), f"{name}: its {kind}", "linkIds")
        for kind in ("inputNode", "outputNode"):
            if data.get(kind) is not None and not isinstance(data.get(kind), dict):
                raise ConvertError(f"{name}: {kind} is not an object")
        # the form new links take: the graph's own, else the frontend's (lists at the root of a version 0.4 workflow)
        forms = {type(e) for e in raw if e is not None}
        self.link_form = forms.pop() if len(forms) == 1 else (list if gid == ROOT and data.get("version") != 1
                                                              else dict)

    # ------------------------------------------------------------------------------------------------ reading
    @property
    def is_subgraph(self) -> bool:
        return self.gid != ROOT

    def node(self, nid: Any) -> dict[str, Any] | None:
        try:
            return self.by_id.get(int(nid))
        except (TypeError, ValueError):
            return None

    def link(self, lid: Any) -> Link | None:
        if lid is None or isinstance(lid, bool):
            return None
        try:
            return self.links.get(int(lid))
        except (TypeError, ValueError):
            return None

    def consumers(self, node: dict[str, Any], slot: int) -> list[Link]:
        """The links leaving output `slot` of `node`."""
        outputs = node.get("outputs") or []
        if slot >= len(outputs) or not isinstance(outputs[slot], dict):
            return []
        return [lk for lid in outputs[slot].get("links") or [] if (lk := self.link(lid)) is not None]

    def io_slots(self, kind: str) -> list[dict[str, Any]]:
        """A subgraph's input or output slots (`kind` "inputs" / "outputs")."""
        slots = self.data.get(kind)
        if not isinstance(slots, list):
            slots = self.data[kind] = []
        return slots

    # ------------------------------------------------------------------------------------------------ writing
    def add_link(self, lid: int, origin: int, origin_slot: int, target: int, target_slot: int, kind: str) -> None:
        """A new link entry in the graph's form (the ends' slot records are the caller's)."""
        if self.link_form is list:
            entry: Any = [lid, origin, origin_slot, target, target_slot, kind]
        else:
            entry = {"id": lid, "origin_id": origin, "origin_slot": origin_slot, "target_id": target,
                     "target_slot": target_slot, "type": kind}
        self.data["links"].append(entry)
        self.links[lid] = Link(entry)

    def add_node(self, node: dict[str, Any]) -> None:
        self.nodes.append(node)
        self.by_id[int(node["id"])] = node


class Workflow:
    """A UI workflow: the root graph, its subgraph definitions by id, and the shared id counters."""

    def __init__(self, data: Any) -> None:
        if not isinstance(data, dict):
            raise ConvertError(f"a workflow is a JSON object, got {type(data).__name__}")
        if not isinstance(data.get("nodes"), list):
            if any(isinstance(v, dict) and "class_type" in v for v in data.values()):
                raise ConvertError("this is ComfyUI's API format (a prompt): convert the workflow file the frontend "
                                   "saves (Workflow > Save, or Export), which has the layout")
            raise ConvertError("not a ComfyUI workflow: it has no 'nodes' list")
        self.data = data
        self.root = Graph(data, ROOT, "the workflow")
        self.subgraphs: dict[str, Graph] = {}
        defs = data.get("definitions")
        raw = defs.get("subgraphs") if isinstance(defs, dict) else None
        if raw is not None and not isinstance(raw, list):
            raise ConvertError("definitions.subgraphs is not a list")
        if raw and len(raw) > MAX_SUBGRAPHS:
            raise ConvertError(f"the workflow defines {len(raw)} subgraphs; at most {MAX_SUBGRAPHS} are read")
        for sub in raw or []:
            if not isinstance(sub, dict) or not isinstance(sub.get("id"), str):
                raise ConvertError("a subgraph definition has no id")
            if sub["id"] in self.subgraphs:
                raise ConvertError(f"subgraph {sub['id']} is defined twice")
            self.subgraphs[sub["id"]] = Graph(sub, sub["id"], f"subgraph {sub.get('name') or sub['id']!r}")
        total = sum(len(g.nodes) for g in self.graphs())
        if total > MAX_NODES:
            raise ConvertError(f"the workflow has {total} nodes; at most {MAX_NODES} are converted")
        self._check_nesting()

    def graphs(self) -> Iterator[Graph]:
        yield self.root
        yield from self.subgraphs.values()

    def graph(self, gid: str) -> Graph:
        return self.root if gid == ROOT else self.subgraphs[gid]

    def instances(self, graph: Graph) -> list[dict[str, Any]]:
        """The nodes of `graph` that are instances of a subgraph definition."""
        return [n for n in graph.nodes if n["type"] in self.subgraphs]

    def _check_nesting(self) -> None:
        """A subgraph that contains itself (directly or through others) is refused by name, in linear time."""
        state: dict[str, int] = {}
        for start in self.subgraphs:
            if state.get(start):
                continue
            stack = [(start, iter(self.instances(self.subgraphs[start])))]
            state[start] = 1
            while stack:
                gid, it = stack[-1]
                child = next(it, None)
                if child is None:
                    state[gid] = 2
                    stack.pop()
                    continue
                cid = child["type"]
                if state.get(cid) == 1:
                    raise ConvertError(f"{self.subgraphs[cid].name} contains itself (through "
                                       f"{' > '.join(self.subgraphs[g].name for g, _ in stack)}): not a workflow "
                                       f"ComfyUI can run")
                if not state.get(cid):
                    state[cid] = 1
                    stack.append((cid, iter(self.instances(self.subgraphs[cid]))))

    # --------------------------------------------------------------------------------------------- id counters
    def max_ids(self) -> tuple[int, int]:
        """The highest node and link ids in use or counted anywhere in the workflow."""
        node_ids = [nid for g in self.graphs() for nid in g.by_id]
        link_ids = [lid for g in self.graphs() for lid in g.links]
        for key, into in (("last_node_id", node_ids), ("last_link_id", link_ids)):
            value = self.data.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                into.append(int(value))
        for g in self.graphs():
            state = g.data.get("state")
            if isinstance(state, dict):
                for key, into in (("lastNodeId", node_ids), ("lastLinkId", link_ids)):
                    value = state.get(key)
                    if isinstance(value, (int, float)) and not isinstance(value, bool):
                        into.append(int(value))
        return max(node_ids, default=0), max(link_ids, default=0)

    def set_counters(self, last_node: int, last_link: int) -> None:
        """Every counter the workflow carries set to the new highest ids (the root's `last_*` and `state`, each
        subgraph's `state`)."""
        self.data["last_node_id"] = last_node
        self.data["last_link_id"] = last_link
        for g in self.graphs():
            state = g.data.get("state")
            if g.is_subgraph and not isinstance(state, dict):
                state = g.data["state"] = {"lastGroupId": 0, "lastRerouteId": 0}
            if isinstance(state, dict):
                state["lastNodeId"] = max(last_node, _num(state.get("lastNodeId")))
                state["lastLinkId"] = max(last_link, _num(state.get("lastLinkId")))


def _num(value: Any) -> int:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0


def is_active(node: dict[str, Any]) -> bool:
    """Neither muted (never) nor bypassed."""
    return node.get("mode", 0) not in MUTED_MODES


def widget_dict(node: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    """A node's widget values by name (`widgets_values` as a list in `names` order, or already a dict)."""
    values = node.get("widgets_values")
    if isinstance(values, dict):
        return {k: values[k] for k in names if k in values}
    if isinstance(values, list):
        return dict(zip(names, values))
    return {}
