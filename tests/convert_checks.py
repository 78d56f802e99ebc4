"""Checks of a converted workflow against the one it came from, written from ComfyUI's frontend's rules and not from
the converter's code: every graph well formed (both link forms, slots and links agreeing both ways, ids unique across
the workflow, counters at or above them), every loader replaced or followed by an Offload node that takes over
exactly its consumers, everything else as it was, and every offload node linked to one VRAM Budget node through the
subgraphs' inputs. Used by tests/test_convert.py (ComfyUI's templates) and the ComfyUI tests.
"""
from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Set, Tuple

SUB_IN, SUB_OUT = -10, -20
OFFLOAD_AFTER = {"MODEL": "OffloadModel", "CLIP": "OffloadCLIP"}
REPLACED = {"UNETLoader": "OffloadDiffusionModelLoader", "CheckpointLoaderSimple": "OffloadCheckpointLoader"}
BUDGET_USERS = ("OffloadDiffusionModelLoader", "OffloadCheckpointLoader", "OffloadModel", "OffloadCLIP", "OffloadAny",
                "OffloadTTSLoader")
LOADER_WIDGETS = ("unet_name", "weight_dtype", "ckpt_name")  # the inputs UNETLoader / CheckpointLoaderSimple have
FIELDS = ("id", "origin_id", "origin_slot", "target_id", "target_slot", "type")


def graphs(wf: Dict[str, Any]) -> Iterator[Tuple[str, Dict[str, Any]]]:
    yield "root", wf
    for sub in (wf.get("definitions") or {}).get("subgraphs") or []:
        yield sub["id"], sub


def links_of(graph: Dict[str, Any]) -> Dict[int, Dict[str, Any]]:
    out = {}
    for entry in graph.get("links") or []:
        link = dict(zip(FIELDS, entry)) if isinstance(entry, list) else entry
        out[int(link["id"])] = link
    return out


def nodes_of(graph: Dict[str, Any]) -> Dict[int, Dict[str, Any]]:
    return {int(n["id"]): n for n in graph.get("nodes") or []}


def problems(wf: Dict[str, Any]) -> Set[Tuple[Any, ...]]:
    """Where links and slots disagree in a workflow (each as a tuple that names it): a link whose origin output does
    not list it or whose target input does not hold it, a slot naming a link that is not there or ends elsewhere, a
    subgraph input / output slot naming a missing link. ComfyUI's own templates have a few; a conversion must add
    none."""
    found: Set[Tuple[Any, ...]] = set()
    for gid, g in graphs(wf):
        nodes, links = nodes_of(g), links_of(g)
        if len(nodes) != len(g["nodes"]):
            found.add((gid, "duplicate node id"))
        if len({type(e) for e in g.get("links") or []}) > 1:
            found.add((gid, "links in two forms"))
        ins, outs = g.get("inputs") or [], g.get("outputs") or []
        for lid, lk in links.items():
            o, t = lk["origin_id"], lk["target_id"]
            try:
                if o == SUB_IN:
                    ok = lid in ins[lk["origin_slot"]]["linkIds"]
                else:
                    ok = lid in (nodes[o]["outputs"][lk["origin_slot"]].get("links") or [])
            except (KeyError, IndexError, TypeError):
                ok = False
            if not ok:
                found.add((gid, "origin does not list", lid))
            try:
                if t == SUB_OUT:
                    ok = lid in outs[lk["target_slot"]]["linkIds"]
                else:
                    ok = nodes[t]["inputs"][lk["target_slot"]].get("link") == lid
            except (KeyError, IndexError, TypeError):
                ok = False
            if not ok:
                found.add((gid, "target does not hold", lid))
        for nid, n in nodes.items():
            for i in n.get("inputs") or []:
                if i.get("link") is not None and (i["link"] not in links or links[i["link"]]["target_id"] != nid):
                    found.add((gid, "input names a link that ends elsewhere", nid, i.get("name")))
            for slot, o in enumerate(n.get("outputs") or []):
                for lid in o.get("links") or []:
                    if lid not in links or (links[lid]["origin_id"], links[lid]["origin_slot"]) != (nid, slot):
                        found.add((gid, "output names a link that starts elsewhere", nid, slot, lid))
        if gid != "root":
            for kind in ("inputs", "outputs"):
                for s in g.get(kind) or []:
                    for lid in s.get("linkIds") or []:
                        if lid not in links:
                            found.add((gid, kind, s.get("name"), lid))
    return found


def check_well_formed(wf: Dict[str, Any], allowed: Set[Tuple[Any, ...]] = frozenset()) -> None:
    """No disagreement between links and slots beyond `allowed`; the id counters not behind any id."""
    new = problems(wf) - set(allowed)
    assert not new, sorted(map(str, new))[:8]
    node_ids = [nid for _, g in graphs(wf) for nid in nodes_of(g)]
    link_ids = [lid for _, g in graphs(wf) for lid in links_of(g)]
    top_node, top_link = max(node_ids, default=0), max(link_ids, default=0)
    state = wf.get("state") if isinstance(wf.get("state"), dict) else {}
    assert max(wf.get("last_node_id", 0), state.get("lastNodeId", 0)) >= top_node
    assert max(wf.get("last_link_id", 0), state.get("lastLinkId", 0)) >= top_link
    for gid, g in graphs(wf):
        if gid != "root" and isinstance(g.get("state"), dict):
            assert g["state"]["lastNodeId"] >= top_node and g["state"]["lastLinkId"] >= top_link, gid


def _is_loader(node: Dict[str, Any]) -> bool:
    return ("loader" in node["type"].lower() and not node["type"].startswith("Offload") and
            node["type"] not in ("Reroute", "GetNode", "SetNode") and
            not any(str(i.get("type")) in ("MODEL", "CLIP", "*") for i in node.get("inputs") or []))


def _plain(node: Dict[str, Any]) -> Dict[str, Any]:
    """A node without what a conversion may renumber: its input and output slots as (name, type), no link ids."""
    out = {k: v for k, v in node.items() if k not in ("inputs", "outputs", "order")}
    out["outputs"] = [(o.get("name"), o.get("type")) for o in node.get("outputs") or []]
    return out


Wires = Dict[Tuple[Any, Any], Tuple[Any, Any]]


def wires(g: Dict[str, Any]) -> Wires:
    """(target node, input name) -> (origin node, output slot) of every link of a graph, link ids left out; a subgraph's
    input and output slots by name ("in", name) / ("out", name)."""
    nodes, out = nodes_of(g), {}
    ins, outs = g.get("inputs") or [], g.get("outputs") or []
    for lk in links_of(g).values():
        o, t = lk["origin_id"], lk["target_id"]
        try:
            origin = ("in", ins[lk["origin_slot"]]["name"]) if o == SUB_IN else (o, lk["origin_slot"])
            target = ("out", outs[lk["target_slot"]]["name"]) if t == SUB_OUT else \
                (t, nodes[t]["inputs"][lk["target_slot"]]["name"])
        except (KeyError, IndexError, TypeError):
            continue  # a broken link of the original (problems() lists them)
        if t == SUB_OUT or nodes[t]["inputs"][lk["target_slot"]].get("link") == lk["id"]:
            out[target] = origin
    return out


def check_conversion(before: Dict[str, Any], after: Dict[str, Any]) -> List[str]:
    """`after` is `before` converted (see the module doc), whoever numbered the new links (the command line keeps the
    ids of the links it moves, the frontend's connect makes new ones); the loaders converted, as "<graph>:<node>
    <type>"."""
    check_well_formed(after, problems(before))
    old_nodes = {nid for _, g in graphs(before) for nid in nodes_of(g)}
    new_nodes = [nid for _, g in graphs(after) for nid in nodes_of(g) if nid not in old_nodes]
    assert len(set(new_nodes)) == len(new_nodes), "a new node id used twice"
    assert all(n > max(old_nodes, default=0) for n in new_nodes), "new node ids not fresh"
    done: List[str] = []
    defs = {gid: g for gid, g in graphs(after) if gid != "root"}
    for (gid, g0), (_, g1) in zip(graphs(before), graphs(after)):
        n0, n1 = nodes_of(g0), nodes_of(g1)
        w0, w1 = wires(g0), wires(g1)
        assert set(n0) <= set(n1), (gid, "a node was removed")
        moved: Dict[Tuple[Any, Any], Tuple[Any, Any]] = {}  # a loader's output -> the Offload node's output now
        for nid, old in n0.items():
            new = n1[nid]
            active = old.get("mode", 0) not in (2, 4)
            foreign = any(i.get("link") is not None and i.get("name") not in LOADER_WIDGETS
                          for i in old.get("inputs") or [])  # a link the pack's loader has no input for
            if old["type"] in REPLACED and active and not foreign:
                assert new["type"] == REPLACED[old["type"]], (gid, nid)
                assert new["pos"] == old["pos"] and new.get("mode", 0) == old.get("mode", 0)
                files = old["widgets_values"][:2 if old["type"] == "UNETLoader" else 1]
                assert new["widgets_values"][:len(files)] == files, (gid, nid)
                assert [(o["name"], o["type"]) for o in new["outputs"]] == [(o["name"], o["type"]) for o in old["outputs"]]
                done.append(f"{gid}:{nid} {old['type']}")
                continue
            if not (active and _is_loader(old)):
                a, b = _plain(old), _plain(new)
                if old["type"] in defs:  # an instance: the frontend may resize it for its new input
                    a.pop("size", None), b.pop("size", None)
                assert a == b, (gid, nid, old["type"])
                slots = tuple(s["name"] for s in defs[old["type"]].get("inputs") or []) if old["type"] in defs else ()
                _check_inputs(gid, old, new, slots)
                continue
            for slot, out in enumerate(old.get("outputs") or []):
                kind = str(out.get("type"))
                used = {t for t, o in w0.items() if o == (nid, slot)}
                if kind not in OFFLOAD_AFTER or not used:
                    continue
                targets = {n1[t[0]]["type"] if t[0] != "out" else "out" for t in used}
                if targets & {OFFLOAD_AFTER[kind], "OffloadAny"}:  # offloaded already: left as it was
                    continue
                (via,) = [t for t, o in w1.items() if o == (nid, slot)]
                off = n1[via[0]]
                assert off["type"] == OFFLOAD_AFTER[kind] and off["id"] not in n0, (gid, nid)
                assert {t for t, o in w1.items() if o == (off["id"], 0)} == used, (gid, nid)
                moved[(nid, slot)] = (off["id"], 0)
                done.append(f"{gid}:{nid} {old['type']}")
        for target, origin in w0.items():  # every wire still there, from the Offload node where one was put in
            assert w1.get(target) == moved.get(origin, origin), (gid, target, origin, w1.get(target))
        for target, origin in w1.items():  # and what is new: the Offload nodes' inputs, the budget links
            if target in w0 or target[0] == "out":
                continue
            kind = n1[target[0]]["inputs"][[i["name"] for i in n1[target[0]]["inputs"]].index(target[1])]["type"]
            assert target[0] not in n0 or kind == "OFFLOAD_BUDGET" or origin == ("in", target[1]) and \
                n1[target[0]]["type"] in REPLACED.values(), (gid, target, origin)
        assert g0.get("groups") == g1.get("groups"), (gid, "groups changed")
    check_budget_wiring(after)
    return done


def _check_inputs(gid: str, old: Dict[str, Any], new: Dict[str, Any], slots: Tuple[str, ...] = ()) -> None:
    """A node left alone keeps every input by name; what it gains is an OFFLOAD_BUDGET input (the budget link, or a
    subgraph instance's new budget input); a subgraph instance may list unlinked inputs it left out before, one per
    subgraph input (`slots`)."""
    before = {i["name"]: i.get("link") for i in old.get("inputs") or []}
    after = {i["name"]: (i.get("link"), str(i.get("type"))) for i in new.get("inputs") or []}
    for name, link in before.items():
        assert name in after, (gid, old["id"], name, "input lost")
        assert (link is None) == (after[name][0] is None) or after[name][1] == "OFFLOAD_BUDGET", \
            (gid, old["id"], name, "link lost or added")
    for name, (link, kind) in after.items():
        assert name in before or kind == "OFFLOAD_BUDGET" or (name in slots and link is None), \
            (gid, old["id"], name, "input added")


def check_budget_wiring(wf: Dict[str, Any]) -> None:
    """Every offload node's budget input comes from a VRAM Budget node: in its graph, or through the subgraph's
    inputs from every instance, up to one in the root."""
    defs = {gid: g for gid, g in graphs(wf) if gid != "root"}

    def budget_source(gid: str, g: Dict[str, Any], link_id: Optional[int], seen: Tuple[str, ...]) -> bool:
        if link_id is None:
            return False
        lk = links_of(g)[link_id]
        if lk["origin_id"] != SUB_IN:
            return nodes_of(g)[lk["origin_id"]]["type"] == "OffloadVramBudget"
        name = g["inputs"][lk["origin_slot"]]["name"]
        parents = [(pid, pg, n) for pid, pg in graphs(wf) for n in pg["nodes"] if n["type"] == gid]
        assert parents, (gid, "a subgraph input with no instance")
        assert gid not in seen
        return all(budget_source(pid, pg, next((i.get("link") for i in n.get("inputs") or [] if i["name"] == name),
                                               None), seen + (gid,)) for pid, pg, n in parents)

    for gid, g in graphs(wf):
        if gid != "root" and not any(n["type"] == gid for _, pg in graphs(wf) for n in pg["nodes"]):
            continue  # a definition no instance uses
        for n in g["nodes"]:
            if n["type"] in BUDGET_USERS:
                link = next((i.get("link") for i in n.get("inputs") or [] if i["name"] == "budget"), None)
                assert budget_source(gid, g, link, ()), (gid, n["id"], n["type"], "budget not linked to a VRAM Budget")


UNDO_LOADERS = {"OffloadDiffusionModelLoader": ("UNETLoader", ("unet_name", "weight_dtype")),
                "OffloadCheckpointLoader": ("CheckpointLoaderSimple", ("ckpt_name",))}


def without_offload(api: Dict[str, Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """An API prompt with the pack's nodes taken out again: Offload Model / CLIP bridged (their consumers read what
    they read), the Offload Loaders back to ComfyUI's loaders with the loaders' own inputs, budget links and the VRAM
    Budget node gone."""
    bridge = {nid: n["inputs"].get("model", n["inputs"].get("clip")) for nid, n in api.items()
              if n["class_type"] in ("OffloadModel", "OffloadCLIP")}
    budgets = {nid for nid, n in api.items() if n["class_type"] == "OffloadVramBudget"}
    out = {}
    for nid, node in api.items():
        if nid in bridge or node["class_type"] == "OffloadVramBudget":
            continue
        kind, inputs = node["class_type"], dict(node["inputs"])
        if kind in UNDO_LOADERS:
            kind, keep = UNDO_LOADERS[kind]
            inputs = {k: v for k, v in inputs.items() if k in keep}
        if isinstance(inputs.get("budget"), list) and inputs["budget"][0] in budgets:
            del inputs["budget"]
        for key, value in list(inputs.items()):
            while isinstance(value, list) and len(value) == 2 and value[0] in bridge:
                value = bridge[value[0]]
            inputs[key] = value
        out[nid] = {"class_type": kind, "inputs": inputs}
    return out


def check_same_run(before: Dict[str, Any], after: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """What the server would run (the workflow reader's flattening, offload.predict.workflow_read) is the same before
    and after, once the pack's nodes are taken out again; the converted API prompt is returned."""
    from offload.predict.workflow_read import flatten

    api_before = flatten(before).api()
    api_after = flatten(after).api()
    assert without_offload(api_after) == api_before
    return api_after
