"""The workflow reader against a real ComfyUI, in process: the loader table against this ComfyUI's own node classes
(every node whose combo lists a model folder's files), the running server's node definitions reading ComfyUI's
templates as the shipped table does, and the panel's route (POST /layer_offload/plan's work) and the Offload Report
node's plan reading a template built from subgraphs. Skipped unless COMFYUI_PATH is set; the template parts need the
`comfyui-workflow-templates-json` package ComfyUI's own requirements install.
"""
from __future__ import annotations

import asyncio
import inspect
import json
import os
from importlib import import_module
from pathlib import Path

import pytest

from conftest import comfy_available, skip_reason

if not comfy_available():
    pytest.skip(skip_reason(), allow_module_level=True)

# a loader's folder kind -> the ComfyUI folders its files may come from
KIND_FOLDERS = {"diffusion_models": {"diffusion_models", "unet"},
                "unet_gguf": {"diffusion_models", "unet", "unet_gguf"},
                "text_encoders": {"text_encoders", "clip"}, "clip_gguf": {"text_encoders", "clip", "clip_gguf"},
                "vae": {"vae", "vae_approx"}}
PROBE = "lo-probe-{}.safetensors"


@pytest.fixture(scope="module")
def comfy(pack):
    """ComfyUI's core nodes with comfy_extras loaded (as a server has them), and the pack's engine modules."""
    import nodes

    classes = nodes.NODE_CLASS_MAPPINGS
    if hasattr(nodes, "init_extra_nodes"):  # upstream ComfyUI: comfy_extras are loaded by the server at start
        if "VAELoader" in classes and "ImageOnlyCheckpointLoader" not in classes:
            init = nodes.init_extra_nodes
            kwargs = {k: False for k in ("init_custom_nodes", "init_api_nodes")
                      if k in inspect.signature(init).parameters}
            result = init(**kwargs)
            if inspect.iscoroutine(result):
                asyncio.run(result)
    else:  # the pip-installable fork (0.12): its own node registry
        from comfy.nodes.package import import_all_nodes_in_workspace

        classes = dict(import_all_nodes_in_workspace(vanilla_custom_nodes=False).NODE_CLASS_MAPPINGS)
    predict = import_module(pack.__name__ + ".offload.predict")
    return {"classes": classes, "predict": predict, "pack": pack,
            "comfy_nodes": import_module(pack.__name__ + ".offload.predict.comfy_nodes"),
            "graph": import_module(pack.__name__ + ".offload.predict.workflow_graph")}


def lists_safetensors(extensions) -> bool:
    """Whether a model folder lists .safetensors files (an empty set: every file; the fork's own extension type: yes,
    its folders are ComfyUI's)."""
    if isinstance(extensions, (set, frozenset, list, tuple)):
        return not extensions or ".safetensors" in extensions
    return True


def test_loader_table_matches_this_comfyui(comfy, tmp_path):
    """Every node class whose combo lists a model folder's files is in LOADERS with that widget and a folder kind
    that covers the folder; every LOADERS entry this ComfyUI has lists its folder's files."""
    import folder_paths

    loaders = comfy["comfy_nodes"].LOADERS
    kinds = {kind for entries in loaders.values() for _, kind, _ in entries}
    folders = sorted(set().union(*(KIND_FOLDERS.get(k, {k}) for k in kinds)) & set(folder_paths.folder_names_and_paths))
    # a folder listing no .safetensors files cannot list the probe; ComfyUI-GGUF's unet_gguf / clip_gguf (.gguf only,
    # imported in-process by earlier tests) share diffusion_models' / text_encoders' path list, so a probe there
    # would show in UNETLoader's and CLIPLoader's lists as if they read it
    folders = [f for f in folders if lists_safetensors(folder_paths.folder_names_and_paths[f][1])]
    for folder in folders:
        (tmp_path / folder).mkdir()
        (tmp_path / folder / PROBE.format(folder)).write_bytes(b"")
        folder_paths.add_model_folder_path(folder, str(tmp_path / folder))
    getattr(folder_paths, "filename_list_cache", {}).clear()
    found = {}
    for name, cls in comfy["classes"].items():
        try:
            spec = cls.INPUT_TYPES()
        except Exception:  # noqa: BLE001 - a node whose definition needs something absent here
            continue
        for section in ("required", "optional"):
            for widget, value in (spec.get(section) or {}).items():
                value = value if isinstance(value, (list, tuple)) else (value,)
                options = value[0] if value and isinstance(value[0], (list, tuple)) else \
                    (value[1].get("options", []) if len(value) > 1 and isinstance(value[1], dict) else [])
                for folder in folders:
                    if PROBE.format(folder) in options:
                        found.setdefault((name, widget), set()).add(folder)
    assert found, "no loader found: the probe files were not listed"
    wrong = []
    for (name, widget), seen in sorted(found.items()):
        entries = {w: kind for w, kind, _ in loaders.get(name, ())}
        if widget not in entries or not seen <= KIND_FOLDERS.get(entries[widget], {entries[widget]}):
            wrong.append(f"{name}.{widget} loads from {sorted(seen)}; LOADERS: {entries.get(widget)}")
    for name, entries in loaders.items():
        if name in comfy["classes"] and not name.startswith("Offload"):
            wrong += [f"LOADERS has {name}.{w}; this ComfyUI's node lists no model files there"
                      for w, _, _ in entries if (name, w) not in found]
    assert not wrong, "\n".join(wrong)


def _templates():
    """ComfyUI's templates as its requirements install them (the JSON package; 0.3.64's older package holds them
    itself)."""
    try:
        import comfyui_workflow_templates_json as package
    except ImportError:
        package = pytest.importorskip("comfyui_workflow_templates")
    root = Path(package.__file__).parent / "templates"
    for path in sorted(root.glob("*.json")):
        wf = json.loads(path.read_text())
        if isinstance(wf, dict) and isinstance(wf.get("nodes"), list) and not path.stem.startswith("api_"):
            yield path.stem, wf


def _summary(facts) -> tuple:
    return (sorted((k, r.name, r.runs) for k, r in facts.loaders.items()),
            [(s.node, s.steps, s.model_loader, s.width, s.height, s.frames) for s in facts.samplers])


def test_this_comfyuis_definitions_read_the_templates_as_the_table_does(comfy):
    """The panel reads a graph with the running server's node definitions, the CLI with the table shipped from
    ComfyUI 0.33's: on ComfyUI's templates both find the same files and the same samplers, steps and sizes (a node
    whose inputs changed between versions may differ on an older ComfyUI; at most 5% of the templates)."""
    live = comfy["predict"].NodeDefs.from_input_types(comfy["classes"])
    read = comfy["graph"].read_graph
    same, differ = 0, []
    for name, wf in _templates():
        try:
            a, b = _summary(read(wf, live)), _summary(read(wf))
        except ValueError as exc:
            differ.append((name, str(exc)[:200]))
            continue
        if a == b:
            same += 1
        else:
            differ.append((name, a, b))
    total = same + len(differ)
    assert total > 100 and same / total >= 0.95, differ[:5]


def test_the_panel_and_the_report_plan_a_template_built_from_subgraphs(comfy):
    """Wan 2.2 14B text to video as the panel sends it (UI JSON) and as the Offload Report node gets it (the API
    prompt the frontend queues, with execution ids such as "128:75" where the template has subgraphs): both plans name its files, with their download links, and
    its two experts splitting one schedule (10 + 10 of 20 steps; 2 + 2 of 4 in 0.3.64's older
    template, whose 4-step LoRA pair is the one that runs)."""
    wf = dict(_templates()).get("video_wan2_2_14B_t2v")
    if wf is None:
        pytest.skip("this templates package has no video_wan2_2_14B_t2v")
    routes = import_module(comfy["pack"].__name__ + ".nodes.routes")
    status, data = routes.handle_post("plan", {"workflow": wf})
    assert status == 200 and data["ok"], data
    plan = data["plan"]
    assert plan["graph"]["read_whole"] and plan["graph"]["form"] == "ui", plan["graph"]
    assert {m["name"] for m in plan["models"]} >= {"wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors",
                                                   "wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors"}
    names = {m["name"]: m for m in plan["models"]}
    assert "wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors" in names
    assert names["wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors"]["url"].startswith("https://")
    experts = [(s["steps"], s["total_steps"]) for s in plan["run"]["samplers"] if s["runs"]]
    assert len(experts) == 2 and experts[0][0] + experts[1][0] == experts[0][1], experts  # one schedule split
    api = comfy["graph"].to_api(wf)
    plan_mod = import_module(comfy["pack"].__name__ + ".nodes.workflow_plan")
    report_plan = plan_mod.plan_for_prompt(api)
    assert report_plan is not None
    assert [(s["steps"], s["total_steps"]) for s in report_plan["run"]["samplers"] if s["runs"]] == experts
    assert {m["name"] for m in report_plan["models"]} == set(names)
    assert os.environ.get("COMFYUI_PATH")
