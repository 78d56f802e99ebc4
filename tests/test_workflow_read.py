"""Reading a workflow as ComfyUI runs it (`offload.predict.workflow_read.flatten`, `workflow_values`,
`workflow_graph.read_graph`): UI JSON as the frontend saves it (links as [id, origin, slot, target, slot, type],
subgraph definitions with their input (-10) and output (-20) nodes), reroutes, PrimitiveNode, muted and bypassed
nodes, value nodes, and workflows crafted to make a reader loop, recurse or blow up, refused by name in bounded time.
The shapes follow ComfyUI's frontend serialisation (a subgraph's links as objects, the instance's `inputs` compressed
to linked and labelled slots, promoted widget values on the instance or shown through `proxyWidgets`).
"""
from __future__ import annotations

import json
import time

import pytest

from offload.__main__ import main
from offload.predict.workflow_graph import read_graph, to_api
from offload.predict.workflow_read import MAX_NODES, WorkflowError, flatten


def node(nid, ctype, widgets=(), inputs=(), outputs=(), mode=0, **extra):
    """A UI node: inputs as (name, type, link, widget?) and outputs as (type, [links])."""
    return {"id": nid, "type": ctype, "mode": mode, "widgets_values": list(widgets),
            "inputs": [{"name": n, "type": t, "link": lk, **({"widget": {"name": n}} if w else {})}
                       for n, t, lk, w in inputs],
            "outputs": [{"name": t, "type": t, "links": ls} for t, ls in outputs], **extra}


def wan_ui(lora_mode=0, steps_from_primitive=False, reroute=False):
    """UNETLoader -> LoraLoaderModelOnly -> (Reroute) -> KSampler <- EmptyHunyuanLatentVideo; -> VAEDecode -> Save."""
    links = [[1, 1, 0, 2, 0, "MODEL"], [2, 2, 0, 3 if reroute else 4, 0, "MODEL"], [3, 5, 0, 4, 3, "LATENT"],
             [4, 4, 0, 7, 0, "LATENT"], [5, 6, 0, 7, 1, "VAE"], [6, 7, 0, 8, 0, "IMAGE"]]
    nodes = [node(1, "UNETLoader", ["wan.safetensors", "default"], outputs=[("MODEL", [1])]),
             node(2, "LoraLoaderModelOnly", ["fast.safetensors", 1.0], [("model", "MODEL", 1, False)],
                  [("MODEL", [2])], mode=lora_mode),
             node(4, "KSampler", [1, "fixed", 30, 5.0, "euler", "simple", 1.0],
                  [("model", "MODEL", 7 if reroute else 2, False), ("latent_image", "LATENT", 3, False)]
                  + ([("steps", "INT", 9, True)] if steps_from_primitive else []), [("LATENT", [4])]),
             node(5, "EmptyHunyuanLatentVideo", [832, 480, 33, 1], outputs=[("LATENT", [3])]),
             node(6, "VAELoader", ["vae.safetensors"], outputs=[("VAE", [5])]),
             node(7, "VAEDecode", [], [("samples", "LATENT", 4, False), ("vae", "VAE", 5, False)], [("IMAGE", [6])]),
             node(8, "SaveImage", ["out"], [("images", "IMAGE", 6, False)])]
    if reroute:
        nodes.append(node(3, "Reroute", [], [("", "*", 2, False)], [("MODEL", [7])]))
        links.append([7, 3, 0, 4, 0, "MODEL"])
    if steps_from_primitive:
        nodes.append(node(9, "PrimitiveNode", [12, "fixed"], outputs=[("INT", [9])]))
        links.append([9, 9, 0, 4, 4, "INT"])
    return {"nodes": nodes, "links": links}


def test_reroute_primitive_node_and_bypass():
    facts = read_graph(wan_ui(reroute=True, steps_from_primitive=True))
    (s,) = facts.samplers
    assert (s.model_loader, s.loras, s.steps, s.frames) == ("1", ["2"], 12, 33)
    facts = read_graph(wan_ui(lora_mode=4))  # bypassed: its MODEL output is its model input
    (s,) = facts.samplers
    assert s.model_loader == "1" and s.loras == []
    assert not facts.loaders["2"].runs and facts.loaders["2"].why == "bypassed"
    api = to_api(wan_ui(lora_mode=4))
    assert "2" not in api and api["4"]["inputs"]["model"] == ["1", 0]  # as the frontend queues it


def test_muted_node_leaves_its_users_without_the_input():
    wf = wan_ui()
    wf["nodes"][1]["mode"] = 2
    flat = flatten(wf)
    assert "model" not in flat.nodes["4"].inputs and flat.skipped["2"].mode == 2


def subgraph_workflow(promoted=None, proxy=False, instance_mode=0):
    """The loader and the sampler inside a subgraph whose inputs are the model's file (a widget) and the latent;
    its output the sampled LATENT. `promoted`: the instance's widgets_values (older frontends), else the inner
    loader's own value stands (with `proxy`, as newer frontends show it)."""
    sub = {"id": "sub-1", "name": "Sampler", "inputs": [
        {"name": "unet_name", "type": "COMBO", "linkIds": [11]},
        {"name": "latent", "type": "LATENT", "linkIds": [12]}],
        "outputs": [{"name": "LATENT", "type": "LATENT", "linkIds": [13]}],
        "nodes": [node(1, "UNETLoader", ["inner.safetensors", "default"], [("unet_name", "COMBO", 11, True)],
                       [("MODEL", [14])]),
                  node(2, "KSampler", [1, "fixed", 20, 4.0, "euler", "simple", 1.0],
                       [("model", "MODEL", 14, False), ("latent_image", "LATENT", 12, False)], [("LATENT", [13])])],
        "links": [{"id": 11, "origin_id": -10, "origin_slot": 0, "target_id": 1, "target_slot": 0, "type": "COMBO"},
                  {"id": 12, "origin_id": -10, "origin_slot": 1, "target_id": 2, "target_slot": 1, "type": "LATENT"},
                  {"id": 13, "origin_id": 2, "origin_slot": 0, "target_id": -20, "target_slot": 0, "type": "LATENT"},
                  {"id": 14, "origin_id": 1, "origin_slot": 0, "target_id": 2, "target_slot": 0, "type": "MODEL"}]}
    inst = node(10, "sub-1", promoted or [], [("latent", "LATENT", 1, False)], [("LATENT", [2])], mode=instance_mode,
                properties={"proxyWidgets": [["1", "unet_name"]]} if proxy else {})
    return {"nodes": [node(5, "EmptyLatentImage", [768, 512, 1], outputs=[("LATENT", [1])]), inst,
                      node(6, "VAELoader", ["vae.safetensors"], outputs=[("VAE", [3])]),
                      node(7, "VAEDecode", [], [("samples", "LATENT", 2, False), ("vae", "VAE", 3, False)],
                           [("IMAGE", [4])]),
                      node(8, "PreviewImage", [], [("images", "IMAGE", 4, False)])],
            "links": [[1, 5, 0, 10, 1, "LATENT"], [2, 10, 0, 7, 0, "LATENT"], [3, 6, 0, 7, 1, "VAE"],
                      [4, 7, 0, 8, 0, "IMAGE"]],
            "definitions": {"subgraphs": [sub]}}


@pytest.mark.parametrize("promoted, proxy, expected", [
    (["outer.safetensors"], False, "outer.safetensors"),  # older frontends: the instance's promoted value
    ([], True, "inner.safetensors"),  # proxyWidgets: the inner node's own value is what the instance shows
])
def test_subgraph_inputs_outputs_and_promoted_widgets(promoted, proxy, expected):
    flat = flatten(subgraph_workflow(promoted, proxy))
    assert set(flat.nodes) >= {"10:1", "10:2", "5", "7"} and flat.subgraphs == {"10": "Sampler"}
    assert flat.nodes["10:2"].inputs["latent_image"] == ["5", 0] and flat.nodes["10:2"].path == ("10",)
    assert flat.nodes["10:2"].definition == "sub-1" and flat.nodes["5"].definition is None
    assert flat.nodes["7"].inputs["samples"] == ["10:2", 0]  # out through the subgraph's output
    facts = read_graph(subgraph_workflow(promoted, proxy))
    assert facts.loaders["10:1"].name == expected and facts.loaders["10:1"].subgraph == "Sampler"
    (s,) = facts.samplers
    assert (s.model_loader, s.width, s.height, s.subgraph) == ("10:1", 768, 512, "Sampler")


def test_muted_and_bypassed_subgraph_instances():
    facts = read_graph(subgraph_workflow(instance_mode=2))
    assert not facts.samplers and facts.loaders["10:1"].why == "muted"
    flat = flatten(subgraph_workflow(instance_mode=4))  # bypassed: its LATENT output is its LATENT input
    assert flat.nodes["7"].inputs["samples"] == ["5", 0] and "10:2" in flat.skipped


def test_api_json_from_the_frontend_keeps_subgraph_paths():
    api = to_api(subgraph_workflow(["outer.safetensors"]))
    facts = read_graph({"prompt": api})
    assert facts.loaders["10:1"].name == "outer.safetensors" and facts.samplers[0].model_loader == "10:1"


def self_containing(names):
    """Subgraphs each holding an instance of the next, the last one of the first: a loop through all of them."""
    subs = [{"id": n, "name": n.upper(), "inputs": [], "outputs": [], "links": [],
             "nodes": [node(1, names[(i + 1) % len(names)])]} for i, n in enumerate(names)]
    return {"nodes": [node(1, names[0])], "links": [], "definitions": {"subgraphs": subs}}


@pytest.mark.parametrize("names", [["a"], ["a", "b"], ["a", "b", "c"]])
def test_a_subgraph_that_contains_itself_is_refused_by_name(names):
    with pytest.raises(WorkflowError, match=f"subgraph '{names[0].upper()}' contains itself"):
        flatten(self_containing(names))


def test_huge_and_deep_expansions_are_refused_before_expanding():
    """12 levels of 10 instances each would be 10^12 nodes; 40 levels of one, too deep: both refused at once."""
    subs = [{"id": f"s{i}", "name": f"S{i}", "inputs": [], "outputs": [], "links": [],
             "nodes": [node(j, f"s{i + 1}") for j in range(10)] if i < 11 else [node(1, "KSampler")]}
            for i in range(12)]
    started = time.perf_counter()
    with pytest.raises(WorkflowError, match=f"more than {MAX_NODES} nodes"):
        flatten({"nodes": [node(1, "s0")], "links": [], "definitions": {"subgraphs": subs}})
    deep = [{"id": f"d{i}", "name": f"D{i}", "inputs": [], "outputs": [], "links": [],
             "nodes": [node(1, f"d{i + 1}")] if i < 39 else []} for i in range(40)]
    with pytest.raises(WorkflowError, match="nest 40 deep"):
        flatten({"nodes": [node(1, "d0")], "links": [], "definitions": {"subgraphs": deep}})
    assert time.perf_counter() - started < 2


def test_link_cycles_are_refused_by_name():
    api = {"1": {"class_type": "ModelSamplingSD3", "inputs": {"model": ["2", 0], "shift": 5.0}},
           "2": {"class_type": "LoraLoaderModelOnly", "inputs": {"model": ["1", 0], "lora_name": "a.safetensors"}},
           "3": {"class_type": "KSampler", "inputs": {"model": ["2", 0], "steps": 4}}}
    with pytest.raises(WorkflowError, match="cycle .*LoraLoaderModelOnly 2"):
        flatten(api)
    loop = {"nodes": [node(1, "Reroute", [], [("", "*", 2, False)], [("*", [1])]),
                      node(2, "Reroute", [], [("", "*", 1, False)], [("*", [2])]),
                      node(3, "KSampler", [], [("model", "MODEL", 1, False)])],
            "links": [[1, 1, 0, 2, 0, "*"], [2, 2, 0, 1, 0, "*"], [3, 1, 0, 3, 0, "MODEL"]]}
    loop["nodes"][2]["inputs"][0]["link"] = 3
    with pytest.raises(WorkflowError, match="link cycle"):
        flatten(loop)


def test_big_legitimate_graph_reads_in_bounded_time():
    """5000 nodes in a chain of model patches: read whole in well under a second per thousand nodes."""
    api = {"0": {"class_type": "UNETLoader", "inputs": {"unet_name": "m.safetensors"}}}
    for i in range(1, 5000):
        api[str(i)] = {"class_type": "ModelSamplingSD3", "inputs": {"model": [str(i - 1), 0], "shift": 1.0}}
    api["s"] = {"class_type": "KSampler", "inputs": {"model": ["4999", 0], "steps": 8, "cfg": 1.0}}
    api["o"] = {"class_type": "SaveLatent", "inputs": {"samples": ["s", 0]}}
    started = time.perf_counter()
    facts = read_graph(api)
    assert facts.samplers[0].model_loader == "0" and time.perf_counter() - started < 5


def test_two_experts_on_one_schedule_with_split_sigmas():
    """SamplerCustomAdvanced twice on SplitSigmas(BasicScheduler(30), step 12): 12 + 18 steps, each expert its own."""
    api = {"1": {"class_type": "UNETLoader", "inputs": {"unet_name": "high.safetensors"}},
           "2": {"class_type": "UNETLoader", "inputs": {"unet_name": "low.safetensors"}},
           "3": {"class_type": "BasicScheduler", "inputs": {"model": ["1", 0], "steps": 30, "denoise": 1.0}},
           "4": {"class_type": "SplitSigmas", "inputs": {"sigmas": ["3", 0], "step": 12}},
           "5": {"class_type": "CFGGuider", "inputs": {"model": ["1", 0], "cfg": 3.0}},
           "6": {"class_type": "CFGGuider", "inputs": {"model": ["2", 0], "cfg": 3.0}},
           "7": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 1024, "height": 768, "batch_size": 1}},
           "8": {"class_type": "SamplerCustomAdvanced", "inputs": {"guider": ["5", 0], "sigmas": ["4", 0],
                                                                   "latent_image": ["7", 0]}},
           "9": {"class_type": "SamplerCustomAdvanced", "inputs": {"guider": ["6", 0], "sigmas": ["4", 1],
                                                                   "latent_image": ["8", 0]}},
           "10": {"class_type": "SaveLatent", "inputs": {"samples": ["9", 0]}}}
    high, low = read_graph(api).samplers
    assert (high.model_loader, high.steps, low.model_loader, low.steps, high.total_steps) == ("1", 12, "2", 18, 30)
    assert high.cfg == 3.0 and (low.width, low.height) == (1024, 768)


def test_a_30_mb_workflow_is_refused_as_a_workflow(tmp_path, capsys):
    path = tmp_path / "huge_workflow.json"
    nodes = [{"id": i, "type": "Note", "widgets_values": ["x" * 100]} for i in range(170_000)]
    path.write_text(json.dumps({"nodes": nodes, "links": []}))
    assert path.stat().st_size > 25 << 20
    started = time.perf_counter()
    assert main(["plan", str(path)]) != 0
    err = capsys.readouterr().err
    assert "workflow" in err and "config.json" not in err and time.perf_counter() - started < 30


def _mutate(value, rng, junk, p):
    """Each value of a JSON tree replaced by junk with probability p."""
    if isinstance(value, dict):
        for k in list(value):
            value[k] = rng.choice(junk) if rng.random() < p else _mutate(value[k], rng, junk, p)
    elif isinstance(value, list):
        for i in range(len(value)):
            value[i] = rng.choice(junk) if rng.random() < p else _mutate(value[i], rng, junk, p)
    return value


def test_damaged_templates_are_read_or_refused_never_a_traceback():
    """ComfyUI's templates with values swapped for junk of every JSON type (ids that are lists, links that are
    strings, slots past the end ...): the plan is made, or a ValueError says why; no TypeError / KeyError /
    IndexError from inside the reader (the panel turns ValueErrors into a 400 with one line)."""
    import random
    from pathlib import Path

    from offload.predict import plan_workflow

    package = pytest.importorskip("comfyui_workflow_templates_json")
    files = sorted(p for p in (Path(package.__file__).parent / "templates").glob("*.json")
                   if not p.name.startswith(("index", "api_")))
    rng = random.Random(43)
    junk = [None, 1, -10, -20, "x", [], {}, [1, 2], [None], {"a": 1}, 1.5, True, "-10", [1, 2, 3, 4, 5, 6], 10 ** 30]
    for _ in range(80):
        wf = json.loads(rng.choice(files).read_text())
        if rng.random() < 0.5:
            wf = to_api(wf)
        _mutate(wf, rng, junk, rng.choice([0.002, 0.02, 0.1]))
        try:
            json.dumps(plan_workflow(wf, lambda kind, name: None, "rtx4090", 32 << 30).to_dict(), allow_nan=False)
        except ValueError:
            pass
