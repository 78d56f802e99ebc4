"""A ComfyUI workflow read as ComfyUI runs it: `flatten(graph)` gives the nodes the server would be sent.

UI JSON (the canvas, as the frontend saves it) is flattened the way the frontend's graphToPrompt does it:
- subgraphs (`definitions.subgraphs`, nested to any depth) are expanded; a node inside one gets the execution id
  ComfyUI gives it, the subgraph instance ids from the top down and its own joined by ':' ("128:75"), and its `path`
  (those instance ids). A link into a subgraph input continues outside the instance; a subgraph input left unlinked
  gives the instance's promoted widget value (older frontends store it in the instance's `widgets_values`, one per
  input that feeds a widget; newer ones show the inner node's own widget through `properties.proxyWidgets`, and the
  inner node's value stands);
- Reroute nodes pass their link through; a PrimitiveNode (the frontend's own) gives its value to the widgets it
  feeds; notes are dropped;
- a muted node (mode 2) is left out, and so is everything inside a muted subgraph; a bypassed node (mode 4) is left
  out and a link from one of its outputs continues from its input of the same type (same slot first), as the
  frontend resolves it; nodes inside a bypassed subgraph are not run;
- widget values are named by the node type's inputs (`comfy_nodes.NodeDefs`: the running ComfyUI's definitions,
  else the table shipped from ComfyUI's), else by the UI's own widget records when they name every value.

API JSON ({id: {"class_type", "inputs"}}, or {"prompt": ...}) is already flat; a `mode` key there (not ComfyUI's
API, but the pack's tests and tools write it) is honoured the same way.

A workflow is untrusted: a subgraph that contains itself (directly or through others), nesting deeper than
MAX_DEPTH, more than MAX_NODES nodes once expanded, and link cycles are refused with a WorkflowError naming them,
before anything is expanded (sizes are counted per definition) and in time and memory linear in the graph.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .comfy_nodes import VIRTUAL, NodeDefs
from .workflow_flat import (BYPASSED, INPUT_NODE, MAX_DEPTH, MAX_LINKS, MAX_NODES, MUTED, OUTPUT_NODE, FlatGraph,
                            FlatNode, WorkflowError, check_cycles, is_link, read_api)

__all__ = ["flatten", "FlatGraph", "FlatNode", "WorkflowError", "is_link", "MAX_NODES", "MAX_DEPTH"]


def flatten(graph: Any, defs: NodeDefs | None = None) -> FlatGraph:
    """The workflow (UI or API JSON) as ComfyUI runs it (see the module doc); WorkflowError when it cannot be."""
    defs = defs or NodeDefs()
    if not isinstance(graph, dict):
        raise WorkflowError(f"a workflow is a JSON object, got {type(graph).__name__}")
    if isinstance(graph.get("prompt"), dict) and not isinstance(graph.get("nodes"), list):
        graph = graph["prompt"]
    if isinstance(graph.get("nodes"), list):
        flat = _UIReader(graph, defs).read()
    else:
        flat = read_api(graph, defs)
    check_cycles(flat)
    return flat


# -------------------------------------------------------------------------------------------------------- UI JSON
@dataclass
class _Scope:
    """One graph being expanded: the top level, or one subgraph instance (its definition, where it sits)."""

    path: tuple[str, ...]
    nodes: dict[str, dict[str, Any]]  # local id -> UI node
    links: dict[Any, tuple[Any, int, Any, int, Any]]  # id -> (origin id, origin slot, target id, target slot, type)
    definition: dict[str, Any] | None = None
    instance: dict[str, Any] | None = None  # the instance node, in `parent`
    parent: _Scope | None = None
    mode: int = 0  # MUTED / BYPASSED when the instance (or one around it) is


def _id(v: Any) -> Any:
    """A node or link id as the UI stores it (a number or a string), else None."""
    return v if isinstance(v, (int, str)) and not isinstance(v, bool) else None


def _slot(raw: Any, links_key: str) -> dict[str, Any] | None:
    if not isinstance(raw, dict):
        return None
    slot = {"name": raw["name"] if isinstance(raw.get("name"), str) else "",
            "type": raw["type"] if isinstance(raw.get("type"), str) else "*"}
    if links_key == "link":
        slot["link"] = _id(raw.get("link"))
        if isinstance(raw.get("widget"), dict) and isinstance(raw["widget"].get("name"), str):
            slot["widget"] = {"name": raw["widget"]["name"]}
    else:
        ids = raw.get(links_key)
        slot[links_key] = [i for i in ids if _id(i) is not None] if isinstance(ids, list) else []
    return slot


def _clean(container: dict[str, Any], definition: bool = False) -> dict[str, Any]:
    """A (sub)graph with only well-formed parts: nodes with a string type and a number or string id, slots as
    dicts of the expected types; what is malformed is left out, as if it were not there (the reader then says
    what it could not read)."""
    nodes = []
    for raw in container.get("nodes") if isinstance(container.get("nodes"), list) else []:
        if not isinstance(raw, dict) or not isinstance(raw.get("type"), str) or _id(raw.get("id")) is None:
            continue
        node = dict(raw)
        node["inputs"] = [x for x in map(lambda i: _slot(i, "link"), raw.get("inputs") or []
                                         if isinstance(raw.get("inputs"), list) else []) if x]
        node["outputs"] = [x for x in map(lambda o: _slot(o, "links"), raw.get("outputs") or []
                                          if isinstance(raw.get("outputs"), list) else []) if x]
        node["mode"] = raw.get("mode") if isinstance(raw.get("mode"), int) else 0
        node["properties"] = raw.get("properties") if isinstance(raw.get("properties"), dict) else {}
        if not isinstance(raw.get("widgets_values"), (list, dict)):
            node["widgets_values"] = None
        nodes.append(node)
    clean = {"nodes": nodes, "links": container.get("links")}
    if definition:
        clean.update(id=container["id"], name=str(container.get("name") or container["id"]))
        for side in ("inputs", "outputs"):
            raw = container.get(side)
            clean[side] = [_slot(x, "linkIds") or {"name": "", "type": "*", "linkIds": []}
                           for x in (raw if isinstance(raw, list) else [])]
    return clean


def _links(raw: Any) -> dict[Any, tuple[Any, int, Any, int, Any]]:
    links: dict[Any, tuple[Any, int, Any, int, Any]] = {}
    for link in raw if isinstance(raw, list) else []:
        if isinstance(link, list) and len(link) >= 5 and _id(link[0]) is not None:
            links[link[0]] = (_id(link[1]), _int(link[2]), _id(link[3]), _int(link[4]),
                              link[5] if len(link) > 5 and isinstance(link[5], str) else None)
        elif isinstance(link, dict) and _id(link.get("id")) is not None:
            kind = link.get("type")
            links[link["id"]] = (_id(link.get("origin_id")), _int(link.get("origin_slot")), _id(link.get("target_id")),
                                 _int(link.get("target_slot")), kind if isinstance(kind, str) else None)
        if len(links) > MAX_LINKS:
            raise WorkflowError(f"the workflow has more than {MAX_LINKS} links")
    return links


def _int(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else -1


def _key(v: Any) -> str:
    return str(v)


class _UIReader:
    def __init__(self, graph: dict[str, Any], defs: NodeDefs) -> None:
        self.graph, self.defs = graph, defs
        subs = (graph.get("definitions") or {}).get("subgraphs") if isinstance(graph.get("definitions"), dict) else []
        self.subgraphs: dict[str, dict[str, Any]] = {}
        for sub in subs if isinstance(subs, list) else []:
            if isinstance(sub, dict) and isinstance(sub.get("id"), str):
                self.subgraphs[sub["id"]] = _clean(sub, definition=True)
        self.graph = _clean(graph)
        self.flat = FlatGraph({}, form="ui")
        self._sub_links: dict[str, dict] = {}

    def _nodes(self, container: dict[str, Any]) -> list[dict[str, Any]]:
        nodes = container.get("nodes")
        return [n for n in nodes if isinstance(n, dict) and "type" in n] if isinstance(nodes, list) else []

    def _name(self, sid: str) -> str:
        return str(self.subgraphs[sid].get("name") or sid)

    def check_sizes(self) -> None:
        """Refuse self-containing subgraphs, deep nesting and huge expansions, counting per definition."""
        size: dict[str, int] = {}
        depth: dict[str, int] = {}
        state: dict[str, int] = {}  # 1 visiting, 2 done

        def visit(sid: str, chain: list[str]) -> None:
            stack = [(sid, iter(self._children(sid)))]
            state[sid] = 1
            chain = chain + [sid]
            while stack:
                cur, children = stack[-1]
                child = next(children, None)
                if child is None:
                    stack.pop()
                    chain.pop()
                    state[cur] = 2
                    kids = self._children(cur)
                    total = len(self._nodes(self.subgraphs[cur])) + sum(size[k] for k in kids)
                    size[cur] = min(total, MAX_NODES + 1)
                    depth[cur] = 1 + max((depth[k] for k in kids), default=0)
                    continue
                if state.get(child) == 1:
                    loop = chain[chain.index(child):] + [child]
                    names = " > ".join(f"'{self._name(s)}'" for s in loop)
                    raise WorkflowError(f"subgraph '{self._name(child)}' contains itself ({names}): not a workflow "
                                        f"ComfyUI can run")
                if state.get(child) is None:
                    state[child] = 1
                    chain.append(child)
                    stack.append((child, iter(self._children(child))))

        for sid in self.subgraphs:
            if state.get(sid) is None:
                visit(sid, [])
        top = [n for n in self._nodes(self.graph)]
        total = len(top) + sum(size[n["type"]] for n in top if n["type"] in self.subgraphs)
        deepest = max((depth[n["type"]] for n in top if n["type"] in self.subgraphs), default=0)
        if deepest > MAX_DEPTH:
            raise WorkflowError(f"subgraphs nest {deepest} deep; at most {MAX_DEPTH} are read")
        if total > MAX_NODES:
            raise WorkflowError(f"the workflow expands to more than {MAX_NODES} nodes (with its subgraphs); "
                                f"not a workflow a person made")

    def _children(self, sid: str) -> list[str]:
        return [n["type"] for n in self._nodes(self.subgraphs[sid]) if n["type"] in self.subgraphs]

    def read(self) -> FlatGraph:
        self.check_sizes()
        top = _Scope((), {_key(n.get("id")): n for n in self._nodes(self.graph)}, _links(self.graph.get("links")))
        scopes = [top]
        i = 0
        while i < len(scopes):  # breadth first: every instance becomes a scope of its own
            scope = scopes[i]
            i += 1
            for lid, node in scope.nodes.items():
                sid = node["type"]
                if sid not in self.subgraphs:
                    continue
                sub = self.subgraphs[sid]
                mode = scope.mode or (node.get("mode") if node.get("mode") in (MUTED, BYPASSED) else 0)
                path = scope.path + (lid,)
                self.flat.subgraphs[":".join(path)] = self._name(sid)
                if sid not in self._sub_links:
                    self._sub_links[sid] = _links(sub.get("links"))
                scopes.append(_Scope(path, {_key(n.get("id")): n for n in self._nodes(sub)}, self._sub_links[sid],
                                     sub, node, scope, mode))
        for scope in scopes:
            for lid, node in scope.nodes.items():
                if node["type"] in self.subgraphs or node["type"] in VIRTUAL:
                    continue
                self._add(scope, lid, node)
        return self.flat

    # --- one node
    def _add(self, scope: _Scope, lid: str, node: dict[str, Any]) -> None:
        ctype = str(node["type"])
        own = node.get("mode") if node.get("mode") in (MUTED, BYPASSED) else 0
        mode = MUTED if MUTED in (scope.mode, own) else (own or scope.mode)
        inputs = self._widgets(ctype, node)
        for inp in node.get("inputs") or []:
            if not isinstance(inp, dict) or inp.get("link") is None or not isinstance(inp.get("name"), str):
                continue
            found = self._resolve_input(scope, inp["link"])
            if found is None:
                continue
            kind, value = found
            inputs[inp["name"]] = value
        outputs = [str(o.get("type")) for o in node.get("outputs") or [] if isinstance(o, dict)]
        eid = ":".join(scope.path + (lid,))
        props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        fn = FlatNode(eid, ctype, inputs, scope.path, str(node.get("title") or ""), props, mode, outputs,
                      node.get("widgets_values"), (scope.definition or {}).get("id"))
        (self.flat.skipped if mode else self.flat.nodes)[eid] = fn

    def _widgets(self, ctype: str, node: dict[str, Any]) -> dict[str, Any]:
        values = node.get("widgets_values")
        if isinstance(values, dict):
            return {str(k): v for k, v in values.items()}
        if not isinstance(values, list):
            return {}
        names = self.defs.widgets(ctype)
        if names is None:  # the UI's own records, where they name every value
            names = [i["widget"]["name"] for i in node.get("inputs") or []
                     if isinstance(i, dict) and isinstance(i.get("widget"), dict) and "name" in i["widget"]]
            if len(names) != len(values):  # unnamed: by position, so a file name among them is still seen
                return {f"#{i}": v for i, v in enumerate(values)}
        return {n: v for n, v in zip(names, values) if n not in ("control_after_generate", "upload")}

    # --- links
    def _resolve_input(self, scope: _Scope, link_id: Any) -> tuple[str, Any] | None:
        """Where an input's link comes from: ("link", [execution id, slot]), ("value", v) for a widget value
        promoted on a subgraph instance or held by a PrimitiveNode, None when nothing runs there."""
        seen: set[tuple] = set()
        want = None
        while True:
            key = (scope.path, "I", link_id)
            if key in seen:
                raise WorkflowError(f"link cycle through link {link_id}{self._in(scope)}")
            seen.add(key)
            link = scope.links.get(link_id)
            if link is None:
                return None
            origin, slot, _, _, kind = link
            want = want or kind
            if origin == INPUT_NODE and scope.instance is not None:  # out of the subgraph, through its instance
                found = self._through_instance_input(scope, slot)
                if found is None or found[0] == "value":
                    return found
                scope, link_id = found[1]
                continue
            node = scope.nodes.get(_key(origin))
            if node is None:
                return None
            result = self._resolve_output(scope, _key(origin), node, slot, want, seen)
            if result is None or result[0] != "follow":
                return result
            scope, link_id = result[1]

    def _through_instance_input(self, scope: _Scope, slot: int) -> tuple[str, Any] | None:
        sub, inst, parent = scope.definition or {}, scope.instance or {}, scope.parent
        ins = sub.get("inputs") if isinstance(sub.get("inputs"), list) else []
        if not 0 <= slot < len(ins) or not isinstance(ins[slot], dict):
            return None
        name = ins[slot].get("name")
        outer = next((i for i in inst.get("inputs") or [] if isinstance(i, dict) and i.get("name") == name), None)
        if outer is not None and outer.get("link") is not None and parent is not None:
            return "follow", (parent, outer["link"])
        values = inst.get("widgets_values")
        if isinstance(values, list) and values and not (inst.get("properties") or {}).get("proxyWidgets"):
            index = self._promoted_index(scope, ins, slot)
            if index is not None and index < len(values):
                return "value", values[index]
        return None  # the inner node's own widget value stands (proxy widgets show it on the instance)

    def _promoted_index(self, scope: _Scope, ins: list, slot: int) -> int | None:
        """The position of input `slot`'s promoted widget among the instance's: inputs whose first link reaches
        a widget input inside, in order."""
        index = 0
        for i, sub_input in enumerate(ins):
            widget = False
            for lid in (sub_input.get("linkIds") or []) if isinstance(sub_input, dict) else []:
                link = scope.links.get(lid)
                target = scope.nodes.get(_key(link[2])) if link else None
                inp = next((x for x in (target or {}).get("inputs") or []
                            if isinstance(x, dict) and x.get("link") == lid), None)
                if inp is not None and isinstance(inp.get("widget"), dict):
                    widget = True  # the first link that reaches a widget gives the instance its widget
                    break
            if i == slot:
                return index if widget else None
            index += widget
        return None

    def _resolve_output(self, scope: _Scope, lid: str, node: dict[str, Any], slot: int, want: Any,
                        seen: set) -> tuple[str, Any] | None:
        while True:
            key = (scope.path, "O", lid, slot)
            if key in seen:
                raise WorkflowError(f"link cycle through node {lid}{self._in(scope)}")
            seen.add(key)
            own = node.get("mode") if node.get("mode") in (MUTED, BYPASSED) else 0
            mode = MUTED if MUTED in (scope.mode, own) else (own or scope.mode)
            ctype = node["type"]
            if mode == MUTED:
                return None
            if own == BYPASSED:  # the bypassed node's input of the wanted type instead
                index = _bypass_input(node, slot, want)
                inputs = node.get("inputs") or []
                if index is None or inputs[index].get("link") is None:
                    return None
                return "follow", (scope, inputs[index]["link"])
            if ctype in self.subgraphs:  # into the instance, to what feeds its output
                inner = next((s for s in self._scope_of(scope, lid)), None)
                if inner is None:
                    return None
                feed = next((lk for lk in inner.links.values() if lk[2] == OUTPUT_NODE and lk[3] == slot), None)
                if feed is None:
                    outs = (inner.definition or {}).get("outputs") or []
                    out = outs[slot] if 0 <= slot < len(outs) and isinstance(outs[slot], dict) else {}
                    if out.get("linkIds"):  # it names a link the subgraph does not hold: ComfyUI cannot run it
                        self.flat.broken.append(f"subgraph '{self.flat.subgraphs.get(':'.join(inner.path), '?')}' "
                                                f"output '{out.get('name')}' names link(s) {out['linkIds']} it does "
                                                f"not have: what it feeds gets nothing")
                    return None
                if feed[0] == INPUT_NODE:
                    found = self._through_instance_input(inner, feed[1])
                    if found is None or found[0] == "value":
                        return found
                    return "follow", found[1]
                scope, lid, slot = inner, _key(feed[0]), feed[1]
                node = inner.nodes.get(lid)
                if node is None:
                    return None
                continue
            if ctype == "PrimitiveNode":
                values = node.get("widgets_values")
                return ("value", values[0]) if isinstance(values, list) and values else None
            if ctype in VIRTUAL:  # a reroute: its one input
                inputs = [i for i in node.get("inputs") or [] if isinstance(i, dict)]
                if not inputs or inputs[0].get("link") is None:
                    return None
                return "follow", (scope, inputs[0]["link"])
            if mode == BYPASSED:  # inside a bypassed subgraph: nothing runs there
                return None
            return "link", [":".join(scope.path + (lid,)), slot]

    def _scope_of(self, parent: _Scope, lid: str):
        """The scope of instance `lid` inside `parent` (made on demand: cheap, its links are cached)."""
        node = parent.nodes[lid]
        sid = node["type"]
        sub = self.subgraphs[sid]
        if sid not in self._sub_links:
            self._sub_links[sid] = _links(sub.get("links"))
        mode = parent.mode or (node.get("mode") if node.get("mode") in (MUTED, BYPASSED) else 0)
        yield _Scope(parent.path + (lid,), {_key(n.get("id")): n for n in self._nodes(sub)}, self._sub_links[sid],
                     sub, node, parent, mode)

    def _in(self, scope: _Scope) -> str:
        if not scope.path:
            return ""
        return f" in subgraph {self.flat.subgraphs.get(':'.join(scope.path), ':'.join(scope.path))}"


def _types(kind: Any) -> set[str]:
    return {t.strip() for t in str(kind).split(",")} if kind not in (None, "") else {"*"}


def _fits(a: Any, b: Any) -> bool:
    ta, tb = _types(a), _types(b)
    return "*" in ta or "*" in tb or bool(ta & tb)


def _bypass_input(node: dict[str, Any], slot: int, want: Any) -> int | None:
    """The input a bypassed node passes to output `slot` (the frontend's rule: any type -> the same slot; else the
    same slot when its type fits, else the first input of exactly the wanted type, else the first that fits)."""
    inputs = [i if isinstance(i, dict) else {} for i in node.get("inputs") or []]
    outputs = node.get("outputs") or []
    out_type = outputs[slot].get("type") if 0 <= slot < len(outputs) and isinstance(outputs[slot], dict) else want
    if not inputs:
        return None
    if want in (None, "", "*"):
        return slot if 0 <= slot < len(inputs) else 0
    if 0 <= slot < len(inputs) and _fits(inputs[slot].get("type"), out_type) and _fits(inputs[slot].get("type"), want):
        return slot
    exact = next((i for i, x in enumerate(inputs) if x.get("type") == want), None)
    if exact is not None:
        return exact
    return next((i for i, x in enumerate(inputs) if _fits(x.get("type"), out_type) and _fits(x.get("type"), want)),
                None)
