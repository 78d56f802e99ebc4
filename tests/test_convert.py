"""`python -m offload convert` / offload.convert on workflows it did not write: every template of ComfyUI's own
`comfyui-workflow-templates-json` package (a pinned test dependency) that loads a model, the pack's example
workflows, and crafted graphs for what the templates lack (GGUF loaders, reroutes, nested and shared subgraphs, a
subgraph inside itself, muted and bypassed loaders, schema-1 link objects). tests/convert_checks.py checks each
result against the original by the frontend's rules; converting twice changes nothing.
"""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest

from convert_checks import (check_budget_wiring, check_conversion, check_same_run, check_well_formed, graphs, links_of,
                            nodes_of)
from offload.convert import ConvertError, convert_workflow
from offload.convert import pack_nodes
from offload.convert.presets import choose_preset

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "example_workflows").glob("*.json"))


def _templates() -> list[Path]:
    try:
        import comfyui_workflow_templates_json as pkg
    except ImportError:
        return []
    folder = Path(pkg.__file__).parent / "templates"
    out = []
    for path in sorted(folder.glob("*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or not isinstance(data.get("nodes"), list):
            continue  # the package's index files
        types = [n.get("type", "") for _, g in graphs(data) for n in g.get("nodes") or []]
        if any("Loader" in t for t in types):
            out.append(path)
    return out


TEMPLATES = _templates()


def convert(wf, **kw):
    kw.setdefault("preset", "auto")
    return convert_workflow(wf, **kw)


# the pack's nodes as nodes/ defines them -------------------------------------------------------------------------
def test_pack_nodes_match_the_saved_workflow_contract():
    """The converter's node tables against tests/comfyui/node_defs_v1.json: the recorded inputs first, in order,
    with their types, sections and defaults; inputs added since are optional widgets after them."""
    v1 = json.loads((ROOT / "tests" / "comfyui" / "node_defs_v1.json").read_text())
    for name, node in pack_nodes.PACK_NODES.items():
        want = v1[name]
        order = [i.name for i in node.inputs]
        assert order[:len(want["input_order"])] == want["input_order"], name
        for inp in node.inputs:
            rec = want["inputs"].get(inp.name)
            if rec is None:
                assert inp.optional and inp.widget, (name, inp.name)
                continue
            assert rec["type"] == inp.type and (rec["section"] == "optional") == inp.optional, (name, inp.name)
            widget = rec["type"] in ("COMBO", "INT", "FLOAT", "STRING", "BOOLEAN")
            assert widget == inp.widget, (name, inp.name)
            if "default" in rec["options"]:
                assert rec["options"]["default"] == inp.default, (name, inp.name)
        assert [t for _, t in node.outputs] == want["return_types"], name
        assert node.display_name == want["display_name"]


# ComfyUI's templates ---------------------------------------------------------------------------------------------
@pytest.mark.skipif(not TEMPLATES, reason="comfyui-workflow-templates-json is not installed (pip install -e .[test])")
def test_the_templates_are_there():
    assert len(TEMPLATES) >= 240  # 254 of the 0.1.123 package's templates load a model, 252 a MODEL or CLIP


@pytest.mark.parametrize("path", TEMPLATES, ids=[p.stem for p in TEMPLATES])
def test_template_converts_and_converts_once(path):
    before = json.loads(path.read_text(encoding="utf-8"))
    original = copy.deepcopy(before)
    result = convert(before)
    assert before == original, "the argument was changed"
    done = check_conversion(before, result.workflow)
    assert bool(done) == result.changed == any(c.type != "OffloadVramBudget" for c in result.changes)
    assert len(done) == sum(1 for c in result.changes if c.type != "OffloadVramBudget")
    api = check_same_run(before, result.workflow)  # the server runs the same graph, the pack's nodes put in
    assert any(n["class_type"] in ("OffloadModel", "OffloadCLIP", "OffloadDiffusionModelLoader",
                                   "OffloadCheckpointLoader") for n in api.values()) == bool(done)
    if not done:  # only loaders of other model types (upscalers, frame interpolation): nothing the pack streams
        assert not any(str(o.get("type")) in ("MODEL", "CLIP") for _, g in graphs(before) for n in g["nodes"]
                       if "Loader" in n["type"] for o in n.get("outputs") or [])
    again = convert(result.workflow)
    assert not again.changed and again.workflow == result.workflow, again.edits[:4]
    kinds = [n["type"] for _, g in graphs(result.workflow) for n in g["nodes"]]
    assert kinds.count("OffloadVramBudget") == (1 if done else 0)
    assert json.loads(json.dumps(result.workflow)) == result.workflow  # strict JSON
    assert json.dumps(result.edits)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_workflows_are_offloaded_already(path):
    wf = json.loads(path.read_text(encoding="utf-8"))
    result = convert(wf)
    assert not result.changed and result.workflow == wf
    check_budget_wiring(wf)


@pytest.mark.skipif(not TEMPLATES, reason="comfyui-workflow-templates-json is not installed")
def test_wan22_subgraph_in_detail():
    """Wan 2.2 14B text to video: both experts and the text encoder live in one subgraph, their file names promoted
    to the instance. The experts become Offload Loaders with the same ids (the instance's promoted widgets still
    name them), the text encoder gets an Offload CLIP, and one VRAM Budget in the root reaches all three through a
    new subgraph input."""
    path = next(p for p in TEMPLATES if p.stem == "video_wan2_2_14B_t2v")
    before = json.loads(path.read_text(encoding="utf-8"))
    after = convert(before).workflow
    sub = after["definitions"]["subgraphs"][0]
    nodes = nodes_of(sub)
    assert nodes[75]["type"] == nodes[76]["type"] == "OffloadDiffusionModelLoader"
    assert nodes[75]["widgets_values"] == ["wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors", "default", "auto", 0,
                                           "", "preset"]
    links = links_of(sub)
    unet_in = next(i for i in nodes[75]["inputs"] if i["name"] == "unet_name")
    assert links[unet_in["link"]]["origin_id"] == -10  # the promoted widget still feeds it
    assert nodes[75]["inputs"].index(unet_in) == links[unet_in["link"]]["target_slot"] == 1  # after the budget socket
    clip = [n for n in sub["nodes"] if n["type"] == "OffloadCLIP"]
    assert len(clip) == 1 and links[clip[0]["inputs"][0]["link"]]["origin_id"] == 71
    assert sub["inputs"][-1]["type"] == "OFFLOAD_BUDGET" and len(sub["inputs"][-1]["linkIds"]) == 3
    inst = next(n for n in after["nodes"] if n["type"] == sub["id"])
    assert [i["name"] for i in inst["inputs"]] == [s["name"] for s in sub["inputs"]]  # one per subgraph input
    budget = next(n for n in after["nodes"] if n["type"] == "OffloadVramBudget")
    assert budget["widgets_values"] == [0.0, "auto", "", ""]
    assert after["last_node_id"] == sub["state"]["lastNodeId"] == 162  # the root's new VRAM Budget: 162
    assert max(nodes) == 161 and max(n["id"] for n in after["nodes"]) == 162
    assert after["last_link_id"] == sub["state"]["lastLinkId"]
    assert [p for p, _ in nodes[75]["properties"].items() if p in ("cnr_id", "ver")] == []
    assert nodes[75]["properties"]["models"][0]["name"].startswith("wan2.2_t2v_high_noise")  # download links kept


# crafted graphs --------------------------------------------------------------------------------------------------
def _node(nid, kind, inputs=(), outputs=(), widgets=None, pos=(0, 0), mode=0, size=(300, 100)):
    return {"id": nid, "type": kind, "pos": list(pos), "size": list(size), "flags": {}, "order": nid, "mode": mode,
            "inputs": [dict(name=n, type=t, link=lk) for n, t, lk in inputs],
            "outputs": [dict(name=n, type=t, links=list(lks)) for n, t, lks in outputs],
            "properties": {}, "widgets_values": list(widgets or [])}


def _gguf_workflow(link_objects: bool = False) -> dict:
    nodes = [_node(1, "UnetLoaderGGUF", outputs=[("MODEL", "MODEL", [1])], widgets=["wan-q4.gguf"]),
             _node(2, "CLIPLoaderGGUF", outputs=[("CLIP", "CLIP", [2, 3])], widgets=["umt5.gguf", "wan"],
                   pos=(0, 300)),
             _node(3, "Reroute", inputs=[("", "*", 2)], outputs=[("", "CLIP", [4])], pos=(400, 300)),
             _node(4, "CLIPTextEncode", inputs=[("clip", "CLIP", 4)], outputs=[("CONDITIONING", "CONDITIONING", [5])],
                   widgets=["a fox"], pos=(600, 300)),
             _node(5, "CLIPTextEncode", inputs=[("clip", "CLIP", 3)], outputs=[("CONDITIONING", "CONDITIONING", [6])],
                   widgets=[""], pos=(600, 500)),
             _node(6, "KSampler", inputs=[("model", "MODEL", 1), ("positive", "CONDITIONING", 5),
                                          ("negative", "CONDITIONING", 6)], outputs=[("LATENT", "LATENT", [])],
                   widgets=[1, "fixed", 20, 5.0, "euler", "simple", 1.0], pos=(1000, 0)),
             _node(7, "UNETLoader", outputs=[("MODEL", "MODEL", [])], widgets=["muted.safetensors", "default"],
                   mode=2, pos=(0, 800)),
             _node(8, "CLIPLoader", outputs=[("CLIP", "CLIP", [])], widgets=["x.safetensors", "wan", "default"],
                   pos=(0, 1000))]
    links = [[1, 1, 0, 6, 0, "MODEL"], [2, 2, 0, 3, 0, "CLIP"], [3, 2, 0, 5, 0, "CLIP"], [4, 3, 0, 4, 0, "CLIP"],
             [5, 4, 0, 6, 1, "CONDITIONING"], [6, 5, 0, 6, 2, "CONDITIONING"]]
    wf = {"last_node_id": 8, "last_link_id": 6, "nodes": nodes, "links": links, "groups": [], "version": 0.4}
    if link_objects:
        wf["links"] = [dict(zip(("id", "origin_id", "origin_slot", "target_id", "target_slot", "type"), lk))
                       for lk in links]
        wf["version"] = 1
        del wf["last_node_id"], wf["last_link_id"]
        wf["state"] = {"lastNodeId": 8, "lastLinkId": 6, "lastGroupId": 0, "lastRerouteId": 0}
    return wf


@pytest.mark.parametrize("link_objects", [False, True], ids=["link-lists", "link-objects"])
def test_gguf_loaders_get_offload_nodes_after_them(link_objects):
    """GGUF loaders have no Offload Loader twin: Offload Model / Offload CLIP go after them and take over every
    consumer (through a reroute too); a muted loader and an unused one are left alone; new links take the graph's
    own form."""
    wf = _gguf_workflow(link_objects)
    result = convert(wf)
    after = result.workflow
    done = check_conversion(wf, after)
    assert sorted(done) == ["root:1 UnetLoaderGGUF", "root:2 CLIPLoaderGGUF"]
    nodes = nodes_of(after)
    assert nodes[7]["type"] == "UNETLoader" and nodes[8]["type"] == "CLIPLoader"  # muted; nothing uses it
    kinds = sorted(n["type"] for n in after["nodes"] if n["id"] > 8)
    assert kinds == ["OffloadCLIP", "OffloadModel", "OffloadVramBudget"]
    assert {type(e) for e in after["links"]} == {dict if link_objects else list}
    if link_objects:
        assert after["state"]["lastNodeId"] == 11 and "last_node_id" in after
    # the links an Offload node takes over keep their ids (a reroute on the way still names them)
    moved = {lk["id"] if isinstance(lk, dict) else lk[0]: lk for lk in after["links"]}
    assert {1, 2, 3} <= set(moved) and nodes_of(after)[3]["inputs"][0]["link"] == 2
    assert not convert(after).changed


def _subgraph(sid, name, nodes, links, inputs=(), outputs=()):
    return {"id": sid, "version": 1, "state": {"lastGroupId": 0, "lastNodeId": 0, "lastLinkId": 0,
                                                "lastRerouteId": 0},
            "revision": 0, "config": {}, "name": name,
            "inputNode": {"id": -10, "bounding": [-400, 0, 120, 100]},
            "outputNode": {"id": -20, "bounding": [1400, 0, 120, 100]},
            "inputs": [dict(id=f"{sid}-in-{i}", name=n, type=t, linkIds=list(lk)) for i, (n, t, lk) in
                       enumerate(inputs)],
            "outputs": [dict(id=f"{sid}-out-{i}", name=n, type=t, linkIds=list(lk)) for i, (n, t, lk) in
                        enumerate(outputs)],
            "widgets": [], "nodes": nodes, "groups": [], "links": links, "extra": {}}


def _link(lid, o, os_, t, ts, kind):
    return {"id": lid, "origin_id": o, "origin_slot": os_, "target_id": t, "target_slot": ts, "type": kind}


def _nested_workflow() -> dict:
    """Root: two instances of 'outer'; outer holds a checkpoint loader and two instances of 'inner'; inner holds a
    CLIP loader whose CLIP leaves through the subgraph's output, and a UNETLoader whose file name comes in through
    a subgraph input (a promoted widget)."""
    inner = _subgraph("inner-id", "inner", [
        _node(20, "UNETLoader", inputs=[("unet_name", "COMBO", 31)], outputs=[("MODEL", "MODEL", [32])],
              widgets=["wan.safetensors", "default"]),
        _node(21, "CLIPLoader", outputs=[("CLIP", "CLIP", [33])], widgets=["t5.safetensors", "wan", "default"],
              pos=(0, 300))],
        [_link(31, -10, 0, 20, 0, "COMBO"), _link(32, 20, 0, -20, 0, "MODEL"), _link(33, 21, 0, -20, 1, "CLIP")],
        inputs=[("unet_name", "COMBO", [31])], outputs=[("MODEL", "MODEL", [32]), ("CLIP", "CLIP", [33])])
    inner["nodes"][0]["inputs"][0]["widget"] = {"name": "unet_name"}
    outer = _subgraph("outer-id", "outer", [
        _node(10, "CheckpointLoaderSimple", outputs=[("MODEL", "MODEL", [11]), ("CLIP", "CLIP", []),
                                                     ("VAE", "VAE", [])], widgets=["sd.safetensors"]),
        _node(11, "inner-id", inputs=[("unet_name", "COMBO", None)], outputs=[("MODEL", "MODEL", [12]),
                                                                               ("CLIP", "CLIP", [])], pos=(0, 400)),
        _node(12, "inner-id", outputs=[("MODEL", "MODEL", []), ("CLIP", "CLIP", [13])], pos=(0, 800)),
        _node(13, "ModelMergeSimple", inputs=[("model1", "MODEL", 11), ("model2", "MODEL", 12)],
              outputs=[("MODEL", "MODEL", [14])], widgets=[0.5], pos=(600, 0))],
        [_link(11, 10, 0, 13, 0, "MODEL"), _link(12, 11, 0, 13, 1, "MODEL"), _link(13, 12, 1, -20, 1, "CLIP"),
         _link(14, 13, 0, -20, 0, "MODEL")],
        outputs=[("MODEL", "MODEL", [14]), ("CLIP", "CLIP", [13])])
    root = [_node(1, "outer-id", outputs=[("MODEL", "MODEL", [1]), ("CLIP", "CLIP", [])]),
            _node(2, "outer-id", outputs=[("MODEL", "MODEL", []), ("CLIP", "CLIP", [])], pos=(0, 600)),
            _node(3, "KSampler", inputs=[("model", "MODEL", 1)], outputs=[("LATENT", "LATENT", [])], pos=(800, 0),
                  widgets=[1, "fixed", 20, 5.0, "euler", "simple", 1.0])]
    return {"last_node_id": 21, "last_link_id": 33, "nodes": root, "links": [[1, 1, 0, 3, 0, "MODEL"]], "groups": [],
            "definitions": {"subgraphs": [outer, inner]}, "version": 0.4}


def test_nested_and_shared_subgraphs():
    wf = _nested_workflow()
    after = convert(wf).workflow
    done = check_conversion(wf, after)
    assert sorted(done) == ["inner-id:20 UNETLoader", "inner-id:21 CLIPLoader", "outer-id:10 CheckpointLoaderSimple"]
    outer, inner = after["definitions"]["subgraphs"]
    assert [s["type"] for s in inner["inputs"]] == ["COMBO", "OFFLOAD_BUDGET"]
    assert [s["type"] for s in outer["inputs"]] == ["OFFLOAD_BUDGET"]
    assert sum(n["type"] == "OffloadVramBudget" for n in after["nodes"]) == 1  # one budget, reaching both levels
    for inst in (n for n in outer["nodes"] if n["type"] == "inner-id"):  # both instances get the budget
        assert [i["name"] for i in inst["inputs"]] == ["unet_name", "budget"]
        assert inst["inputs"][1]["link"] is not None
    clip_out = next(n for n in inner["nodes"] if n["type"] == "OffloadCLIP")  # CLIP leaves the subgraph offloaded
    assert links_of(inner)[33]["origin_id"] == clip_out["id"] and inner["outputs"][1]["linkIds"] == [33]
    ids = [n["id"] for _, g in graphs(after) for n in g["nodes"]]
    assert len(ids) == len(set(ids))
    assert not convert(after).changed


def test_a_subgraph_inside_itself_is_refused_by_name():
    wf = _nested_workflow()
    inner = wf["definitions"]["subgraphs"][1]
    inner["nodes"].append(_node(40, "outer-id", pos=(0, 900)))
    with pytest.raises(ConvertError, match="contains itself"):
        convert(wf)


def _loader(**fields):
    return {"nodes": [dict({"id": 5, "type": "UNETLoader", "outputs": [{"name": "MODEL", "type": "MODEL",
                                                                       "links": []}]}, **fields)], "links": []}


def _with_sub(**fields):
    wf = _nested_workflow()
    wf["definitions"]["subgraphs"][1].update(fields)
    return wf


@pytest.mark.parametrize("bad, needle", [
    ([], "JSON object"), ({"1": {"class_type": "KSampler", "inputs": {}}}, "API format"),
    ({"nodes": [{"id": 1, "type": "X"}, {"id": 1, "type": "Y"}], "links": []}, "used twice"),
    ({"nodes": [{"id": 1}], "links": []}, "no type"),
    ({"nodes": [], "links": [[1, 2]]}, "neither"),
    ({"nodes": [{"id": "a", "type": "X"}], "links": []}, "a node's id is not a number"),
    ({"nodes": [], "links": [[1, "x", 0, 2, 0, "MODEL"]]}, "link 1's origin_id is not a number"),
    (_loader(inputs=7), r"node 5 \(UNETLoader\): inputs is not a list"),
    (_loader(inputs=[{"name": "unet_name", "link": "3"}]), "'unet_name' holds a link that is not an id"),
    (_loader(inputs=[{"type": "COMBO", "link": None}]), "entry 0 has no name"),
    (_loader(outputs=[{"name": "MODEL", "type": "MODEL", "links": {"1": 2}}]), "links is not a list of link ids"),
    (_loader(outputs=[{"name": "MODEL", "type": ["MODEL"], "links": []}]), "'MODEL' has a type that is not a name"),
    (_loader(widgets_values="wan.safetensors"), "widgets_values is neither a list nor an object"),
    (_loader(mode="bypass"), "mode is not a number"),
    (_loader(properties=[1]), "properties is not an object"),
    (_with_sub(inputs=[{"name": "unet_name", "type": "COMBO", "linkIds": [31, None]}]),
     "subgraph 'inner': its inputs: 'unet_name': linkIds is not a list of link ids"),
    (_with_sub(inputNode=[-400, 0]), "subgraph 'inner': inputNode is not an object"),
    ({"nodes": [], "links": [], "definitions": {"subgraphs": {"a": {}}}}, "definitions.subgraphs is not a list"),
    ({"nodes": [], "links": [], "definitions": {"subgraphs": [{"nodes": []}]}}, "a subgraph definition has no id"),
    ({"nodes": [{"id": i, "type": "Note"} for i in range(20_001)], "links": []}, "20001 nodes; at most 20000"),
])
def test_bad_workflows_are_refused_by_name(bad, needle):
    with pytest.raises(ConvertError, match=needle):
        convert(bad)


def test_a_loader_with_a_link_its_offload_twin_lacks_is_followed_not_replaced():
    """A UNETLoader whose linked input the Offload Loader has no place for keeps its node (the link is not lost) and
    gets an Offload Model after it."""
    wf = _gguf_workflow()
    wf["nodes"][0]["type"] = "UNETLoader"
    wf["nodes"][0]["widgets_values"] = ["wan.safetensors", "default"]
    wf["nodes"].append(_node(9, "PrimitiveNode", outputs=[("value", "FLOAT", [7])], widgets=[1.0], pos=(0, 1200)))
    wf["nodes"][0]["inputs"] = [{"name": "strength", "type": "FLOAT", "link": 7, "widget": {"name": "strength"}}]
    wf["links"].append([7, 9, 0, 1, 0, "FLOAT"])
    after = convert(wf).workflow
    assert sorted(check_conversion(wf, after)) == ["root:1 UNETLoader", "root:2 CLIPLoaderGGUF"]
    nodes = nodes_of(after)
    assert nodes[1]["type"] == "UNETLoader" and nodes[1]["inputs"][0]["link"] == 7
    assert sorted(n["type"] for n in after["nodes"] if n["id"] > 9) == ["OffloadCLIP", "OffloadModel",
                                                                        "OffloadVramBudget"]


def _json_paths(value, path=()):
    yield path
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _json_paths(v, path + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _json_paths(v, path + (i,))


def _no_new_problems(wf, base) -> bool:
    from convert_checks import problems

    try:
        return problems(wf) <= problems(base)
    except (TypeError, KeyError, IndexError, ValueError):  # damage the oracle cannot read (a link that is null)
        return False


def test_damaged_workflows_are_converted_or_refused_by_name():
    """Workflows with one value replaced by junk (a seeded sample over ComfyUI's templates and the crafted graphs):
    each is refused with a ConvertError, or converted to strict JSON that converting again leaves as it is; where the
    damage left the graph's links and slots as consistent as the original's and did not rename a slot, the result
    also passes the oracle."""
    import random

    rng = random.Random(43)
    junk = [None, -1, 0, 1.5, "x", [], {}, [1], {"a": 1}, True, 10 ** 30, "999", -10, -20]
    bases = [_gguf_workflow(), _gguf_workflow(True), _nested_workflow()]
    bases += [json.loads(p.read_text(encoding="utf-8")) for p in TEMPLATES[::25]]
    refused = converted = checked = 0
    for _ in range(400):
        base = rng.choice(bases)
        wf = copy.deepcopy(base)
        path = rng.choice([p for p in _json_paths(wf) if p])
        holder = wf
        for key in path[:-1]:
            holder = holder[key]
        holder[path[-1]] = rng.choice(junk)
        try:
            result = convert(wf)
        except ConvertError as exc:
            assert str(exc) and "Traceback" not in str(exc)
            refused += 1
            continue
        converted += 1
        assert json.loads(json.dumps(result.workflow, allow_nan=False)) == result.workflow
        again = convert(result.workflow)
        assert not again.changed, (path, again.edits[:3])
        if path[-1] not in ("name", "type") and _no_new_problems(wf, base):
            check_conversion(wf, result.workflow)
            checked += 1
    assert refused > 50 and converted > 200 and checked > 150, (refused, converted, checked)


def test_existing_budget_node_and_offload_nodes_are_reused():
    """A workflow with a VRAM Budget and an Offload CLIP already: the budget node is the one every new node links
    to, the Offload CLIP's unlinked budget gets linked, nothing is added twice."""
    wf = _gguf_workflow()
    wf["nodes"].append(_node(9, "OffloadVramBudget", outputs=[("budget", "OFFLOAD_BUDGET", [])],
                             widgets=[6.0, "auto", "", ""], pos=(-600, 0)))
    after = convert(wf).workflow
    check_conversion(wf, after)
    budgets = [n for n in after["nodes"] if n["type"] == "OffloadVramBudget"]
    assert len(budgets) == 1 and budgets[0]["widgets_values"][0] == 6.0 and len(budgets[0]["outputs"][0]["links"]) == 2


def test_bypassed_loader_is_left_alone():
    wf = _gguf_workflow()
    wf["nodes"][0]["mode"] = 4
    after = convert(wf).workflow
    assert nodes_of(after)[1]["outputs"][0]["links"] == [1]


def test_new_nodes_do_not_cover_other_nodes():
    from offload.convert.layout import node_rect

    wf = _gguf_workflow()
    after = convert(wf).workflow
    old = [node_rect(n) for n in wf["nodes"]]
    for n in after["nodes"]:
        if n["id"] > 8:
            x, y, w, h = node_rect(n)
            assert not any(x < a + c and a < x + w and y < b + d and b < y + h for a, b, c, d in old), n["type"]


# presets ---------------------------------------------------------------------------------------------------------
def _plan_model(figs, calls=10, role="diffusion"):
    return {"found": True, "calls": calls, "role": role,
            "presets": {k: {"fits": f is not None, "ms_per_call": f} for k, f in figs.items()}}


def test_choose_preset():
    all5 = dict(auto=100.0, high_end=100.0, mid_range=120.0, consumer=150.0, budget=300.0)
    assert choose_preset([_plan_model(all5)]) == "auto"
    assert choose_preset([_plan_model(dict(all5, auto=150.0, mid_range=90.0))]) == "mid_range"
    assert choose_preset([_plan_model(dict(all5, auto=102.0, mid_range=100.0))]) == "auto"  # within 3%
    assert choose_preset([_plan_model(dict(all5, auto=None, high_end=None, mid_range=None))]) == "consumer"
    assert choose_preset([_plan_model({k: None for k in all5})]) == "auto"  # nothing fits: auto adapts
    assert choose_preset([]) == "auto"
    # two models in one loader (a checkpoint's parts): the total decides, and both must fit
    a = _plan_model(dict(all5, auto=None, budget=10.0), calls=1)
    b = _plan_model(dict(all5, auto=None, mid_range=10.0, budget=500.0))
    assert choose_preset([a, b]) == "mid_range"


def test_presets_come_from_the_plan(tmp_path):
    """text_to_video_wan with a Wan 14B header under its file name: the preset written is the plan's choice."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_workflow_plan import finder, t5_file, wan_vae_file, write_safetensors

    from offload.predict import plan_workflow
    from offload.predict.published import shapes_for

    path = next((p for p in TEMPLATES if p.stem == "text_to_video_wan"), None)
    if path is None:
        pytest.skip("comfyui-workflow-templates-json is not installed")
    wf = json.loads(path.read_text(encoding="utf-8"))
    shapes = {"model.diffusion_model." + k: v.shape for k, v in shapes_for("wan2.1-t2v-14b").items()}
    write_safetensors(tmp_path / "diffusion_models" / "wan2.1_t2v_1.3B_fp16.safetensors", shapes, pad_to=1 << 40)
    t5_file(tmp_path / "text_encoders" / "umt5_xxl_fp8_e4m3fn_scaled.safetensors")
    wan_vae_file(tmp_path / "vae" / "wan_2.1_vae.safetensors")
    for card in ("rtx3060-12gb", "h100-sxm"):
        result = convert_workflow(wf, finder(tmp_path), card, 64 << 30)
        plan = plan_workflow(wf, finder(tmp_path), card, 64 << 30).to_dict()
        want = choose_preset([m for m in plan["models"] if m["key"] == "37"])
        got = next(n for n in result.workflow["nodes"] if n["type"] == "OffloadDiffusionModelLoader")
        assert got["widgets_values"][2] == want and result.card == card
        assert plan["models"][[m["key"] for m in plan["models"]].index("37")]["presets"][want]["fits"]
    missing = convert_workflow(wf, finder(tmp_path / "nowhere"), "rtx4090", 64 << 30)
    assert any("not found" in n for n in missing.notes)
    assert all(c.preset in (None, "auto") for c in missing.changes)


# the command line ------------------------------------------------------------------------------------------------
def test_cli_writes_the_converted_workflow(tmp_path, capsys):
    from offload.__main__ import main

    src = tmp_path / "wf.json"
    src.write_text(json.dumps(_gguf_workflow()))
    out = tmp_path / "out.json"
    assert main(["convert", str(src), "-o", str(out), "--card", "rtx4090"]) == 0
    text = capsys.readouterr().out
    assert "UnetLoaderGGUF #1: Offload Model added after its MODEL output, preset auto" in text
    assert "CLIPLoaderGGUF #2: Offload CLIP added after its CLIP output" in text and f"wrote {out}" in text
    converted = json.loads(out.read_text())
    check_conversion(_gguf_workflow(), converted)
    assert main(["convert", str(src), "-o", str(out)]) == 2  # exists: --force
    assert "--force" in capsys.readouterr().err
    assert main(["convert", str(out), "-o", str(out)]) == 0  # in place, nothing to change
    assert "left as it was" in capsys.readouterr().out and json.loads(out.read_text()) == converted
    assert main(["convert", str(src), "-o", "-", "--preset", "budget", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["nodes"] and '"edits"' in captured.err
    assert {n["widgets_values"][0] for n in json.loads(captured.out)["nodes"]
            if n["type"] in ("OffloadModel", "OffloadCLIP")} == {"budget"}
    (tmp_path / "api.json").write_text(json.dumps({"1": {"class_type": "UNETLoader", "inputs": {}}}))
    assert main(["convert", str(tmp_path / "api.json")]) == 2
    assert "API format" in capsys.readouterr().err
    default = tmp_path / "wf_offload.json"
    assert main(["convert", str(src), "--preset", "auto"]) == 0 and default.exists()


def test_well_formed_check_catches_a_broken_link():
    """The oracle itself fails on a link whose target input does not hold it."""
    wf = _gguf_workflow()
    wf["nodes"][5]["inputs"][0]["link"] = None
    with pytest.raises(AssertionError):
        check_well_formed(wf)
