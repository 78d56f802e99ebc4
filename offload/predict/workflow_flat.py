"""The flattened workflow, as ComfyUI's server gets it: `FlatNode` / `FlatGraph` (what `workflow_read.flatten` gives),
the limits a workflow is read within, API JSON read into it (a `mode` key honoured: bypassed nodes' links continue
from their input of the same type), and the check that refuses link cycles (`check_cycles`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .comfy_nodes import NodeDefs

MAX_NODES = 20_000  # nodes once subgraphs are expanded (ComfyUI's largest templates: a few hundred)
MAX_DEPTH = 32  # subgraphs inside subgraphs
MAX_LINKS = 200_000
INPUT_NODE, OUTPUT_NODE = -10, -20  # a subgraph's input and output nodes in its links
MUTED, BYPASSED = 2, 4


class WorkflowError(ValueError):
    """A graph the plan cannot read: says what is wrong with it."""


@dataclass
class FlatNode:
    """One node as ComfyUI runs it: links are [source execution id, output slot]; widget values by name."""

    id: str
    class_type: str
    inputs: dict[str, Any]
    path: tuple[str, ...] = ()  # the subgraph instance ids it sits inside, outermost first
    title: str = ""
    properties: dict[str, Any] = field(default_factory=dict)  # the UI node's (models: name, url, directory)
    mode: int = 0  # 0 runs; MUTED or BYPASSED (its own, or its subgraph instance's)
    outputs: list[str] | None = None  # output types where the UI JSON lists them
    widgets_values: Any = None  # as stored (list or dict), for tools that rewrite the UI JSON
    definition: str | None = None  # the id of the subgraph definition it is a node of (None: the top level)


@dataclass
class FlatGraph:
    """The nodes the server would run (`nodes`), those left out as muted or bypassed (`skipped`), the subgraph
    instances (`subgraphs`: execution id -> the subgraph's name) and what could not be read (`notes`)."""

    nodes: dict[str, FlatNode]
    skipped: dict[str, FlatNode] = field(default_factory=dict)
    subgraphs: dict[str, str] = field(default_factory=dict)
    form: str = "api"  # "ui" or "api"
    notes: list[str] = field(default_factory=list)
    broken: list[str] = field(default_factory=list)  # links that lead nowhere (a damaged workflow)

    def api(self) -> dict[str, dict[str, Any]]:
        """API form: {id: {"class_type", "inputs"}}."""
        return {k: {"class_type": n.class_type, "inputs": dict(n.inputs)} for k, n in self.nodes.items()}

    def where(self, nid: str) -> str:
        """A node named for a person: its id, and the subgraphs it is inside."""
        node = self.nodes.get(nid) or self.skipped.get(nid)
        if node is None or not node.path:
            return f"node {nid}"
        inside = " > ".join(self.subgraphs.get(":".join(node.path[:i + 1]), "?") for i in range(len(node.path)))
        return f"node {nid} (in subgraph {inside})"


def is_link(value: Any) -> bool:
    return isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) and isinstance(value[1], int) \
        and not isinstance(value[1], bool)


# ------------------------------------------------------------------------------------------------------- API JSON
def read_api(graph: dict[str, Any], defs: NodeDefs) -> FlatGraph:
    api = {str(k): v for k, v in graph.items() if isinstance(v, dict) and isinstance(v.get("class_type"), str)}
    if not api:
        raise WorkflowError("neither ComfyUI API JSON (nodes with class_type) nor UI JSON (a nodes list)")
    if len(api) > MAX_NODES:
        raise WorkflowError(f"the workflow has {len(api)} nodes; at most {MAX_NODES} are read")
    flat = FlatGraph({}, form="api")
    for nid, node in api.items():
        inputs = node.get("inputs") if isinstance(node.get("inputs"), dict) else {}
        mode = node.get("mode", 0) if node.get("mode") in (MUTED, BYPASSED) else 0
        path = tuple(nid.split(":")[:-1])
        meta = node.get("_meta") if isinstance(node.get("_meta"), dict) else {}
        fn = FlatNode(nid, node["class_type"], dict(inputs), path, str(meta.get("title", "")), mode=mode)
        (flat.skipped if mode else flat.nodes)[nid] = fn
    for fn in flat.nodes.values():  # links through bypassed nodes continue from their input of the same type
        for name, value in list(fn.inputs.items()):
            if is_link(value) and value[0] in flat.skipped:
                target = _api_through(flat, value, defs.input_type(fn.class_type, name), defs)
                if target is None:
                    del fn.inputs[name]
                else:
                    fn.inputs[name] = target
    return flat


def _api_through(flat: FlatGraph, link: list, want: str | None, defs: NodeDefs) -> list | None:
    seen: set[str] = set()
    while is_link(link) and link[0] in flat.skipped:
        node = flat.skipped[link[0]]
        if node.id in seen:
            raise WorkflowError(f"link cycle through bypassed {flat.where(node.id)}")
        seen.add(node.id)
        if node.mode == MUTED:
            return None
        outs = defs.outputs(node.class_type) or []
        kind = want or (outs[link[1]] if link[1] < len(outs) else None)
        links = [(n, v) for n, v in node.inputs.items() if is_link(v)]
        typed = [v for n, v in links if kind and defs.input_type(node.class_type, n) == kind]
        named = [v for n, v in links if kind and n.lower() == kind.lower()]
        chosen = (typed or named or ([v for _, v in links[link[1]:link[1] + 1]] if kind in (None, "*") else []))
        if not chosen:
            return None
        link = chosen[0]
    return link if is_link(link) and link[0] in flat.nodes else None


def check_cycles(flat: FlatGraph) -> None:
    """Refuse a graph whose links go round (ComfyUI cannot order it): Kahn's algorithm, one cycle named."""
    deps = {nid: {v[0] for v in n.inputs.values() if is_link(v) and v[0] in flat.nodes}
            for nid, n in flat.nodes.items()}
    users: dict[str, list[str]] = {nid: [] for nid in deps}
    for nid, ds in deps.items():
        for d in ds:
            users[d].append(nid)
    left = {nid: len(ds) for nid, ds in deps.items()}
    ready = [nid for nid, c in left.items() if c == 0]
    while ready:
        nid = ready.pop()
        for u in users[nid]:
            left[u] -= 1
            if left[u] == 0:
                ready.append(u)
    stuck = {nid for nid, c in left.items() if c > 0}
    if not stuck:
        return
    start = min(stuck)
    walk, seen = [start], {start}
    while True:  # follow inputs inside the stuck set until a node repeats: that loop is a cycle
        nxt = min(d for d in deps[walk[-1]] if d in stuck)
        if nxt in seen:
            loop = walk[walk.index(nxt):] + [nxt]
            break
        walk.append(nxt)
        seen.add(nxt)
    shown = " <- ".join(f"{flat.nodes[n].class_type} {n}" for n in loop[:12])
    raise WorkflowError(f"the workflow's links go round in a cycle ({shown}): ComfyUI cannot run it")
