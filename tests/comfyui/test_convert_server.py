"""`python -m offload convert` against a real ComfyUI: the converter's tables of the pack's nodes are the live node
classes' inputs (order, widget or socket, optional, default) and outputs; ComfyUI's own Wan templates converted
(subgraphs and all), flattened as the server gets them and run on the CPU with tiny models under the templates'
file names give the same latent bit for bit as the templates unconverted, with the models offloaded.

The browser test (test_convert_browser.py) does the same through the frontend and the panel's button.
"""
from __future__ import annotations

import os

import pytest

from conftest import comfy_available, node_classes, skip_reason

if not comfy_available():
    pytest.skip(skip_reason(), allow_module_level=True)

import comfy_server as cs  # noqa: E402
import convert_runs as cr  # noqa: E402

WIDGET_TYPES = ("INT", "FLOAT", "STRING", "BOOLEAN", "COMBO")


def test_pack_node_tables_are_the_live_nodes(pack):
    from offload.convert.pack_nodes import PACK_NODES

    classes = node_classes(pack)
    for name, node in PACK_NODES.items():
        spec = classes[name].INPUT_TYPES()
        live = [(n, s, section) for section in ("required", "optional") for n, s in spec.get(section, {}).items()]
        assert [n for n, _, _ in live] == [i.name for i in node.inputs], name
        for (n, s, section), inp in zip(live, node.inputs):
            combo = isinstance(s[0], (list, tuple)) or s[0] == "COMBO"
            kind = "COMBO" if combo else str(s[0])
            assert kind == inp.type and (section == "optional") == inp.optional, (name, n)
            assert (kind in WIDGET_TYPES) == inp.widget, (name, n)
            opts = s[1] if len(s) > 1 and isinstance(s[1], dict) else {}
            if "default" in opts:
                assert opts["default"] == inp.default, (name, n, opts["default"])
        assert [str(t) for t in classes[name].RETURN_TYPES] == [t for _, t in node.outputs], name


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("comfy_convert"))
    paths = cs.prepare_base_dir(base)
    cr.write_models(paths)
    srv = cs.ComfyServer(os.environ["COMFYUI_PATH"], base, startup_timeout=120)
    srv.start()
    try:
        srv.info = srv.get_json("/object_info")
        yield srv
    finally:
        srv.stop()


@pytest.mark.parametrize("name", cr.TEMPLATES)
def test_converted_template_runs_bitwise_like_the_original(server, name):
    from offload.convert import convert_workflow
    from offload.predict.workflow_read import flatten

    wf = cr.template(name)
    if wf is None:
        pytest.skip("ComfyUI's templates are not installed ({}: `make env` installs them into .venv)".format(cr.PINNED))
    api_before = cr.runnable(flatten(wf).api())
    missing = sorted({n["class_type"] for n in api_before.values()} - set(server.info))
    if missing:
        pytest.skip("this ComfyUI lacks the template's nodes {}".format(missing))
    converted = convert_workflow(wf, preset="budget").workflow  # every block streams
    api_after = cr.runnable(flatten(converted).api())
    loaders = [n for n in api_after.values() if n["class_type"] == "OffloadDiffusionModelLoader"]
    assert loaders and all(n["inputs"]["budget"] for n in loaders)
    assert any(n["class_type"] == "OffloadVramBudget" for n in api_after.values())
    plain = cr.run_hash(server, api_before)
    offloaded = cr.run_hash(server, api_after)
    assert offloaded == plain
    names = {m["name"] for m in server.get_json("/layer_offload/report")["models"]}
    assert {n["inputs"]["unet_name"] for n in loaders} <= names, names


def test_the_convert_route(pack, tmp_path):
    """POST /layer_offload/convert (nodes/routes.py handle_post): the edits for the open workflow, the same the
    command line applies; a request it cannot read is refused with a message naming what to change."""
    import copy
    from importlib import import_module

    import folder_paths

    from offload.convert import convert_workflow

    routes = import_module(pack.__name__ + ".nodes.routes")
    wf = cr.template("text_to_video_wan")
    if wf is None:
        pytest.skip("ComfyUI's templates are not installed ({})".format(cr.PINNED))
    paths = {"diffusion_models": str(tmp_path), "loras": str(tmp_path)}
    cr.write_models(paths)
    folder_paths.add_model_folder_path("diffusion_models", str(tmp_path))
    status, data = routes.handle_post("convert", {"workflow": copy.deepcopy(wf), "card": "rtx4090"})
    assert status == 200 and data["ok"], data
    assert data["card"] == "rtx4090" and "chosen in the panel" in data["card_note"]
    assert [e["op"] for e in data["edits"]] == ["replace", "add", "insert", "add", "link", "link"]
    def shape(edits):  # the edits but their presets (the route plans with this machine's free RAM)
        return [dict(e, widgets={k: v for k, v in e.get("widgets", {}).items() if k != "preset"}) for e in edits]

    assert shape(data["edits"]) == shape(convert_workflow(wf, preset="auto").edits)
    assert {e["widgets"].get("preset") for e in data["edits"] if e["op"] in ("replace", "add")} <= \
        {None, "auto", "high_end", "mid_range", "consumer", "budget"}
    assert data["workflow"]["nodes"] and data["changes"][0]["type"] == "UNETLoader"
    status, again = routes.handle_post("convert", {"workflow": data["workflow"]})
    assert status == 200 and again["edits"] == [] and "nothing to change" in " ".join(again["notes"])
    for body, needle in (({"prompt": {"1": {"class_type": "UNETLoader", "inputs": {}}}}, "UI form"),
                         ({"workflow": {"1": {"class_type": "KSampler", "inputs": {}}}}, "UI form"),
                         ({"workflow": wf, "card": "rtx9999"}, "rtx9999"),
                         ({"workflow": {"nodes": [{"id": 1}], "links": []}}, "no type")):
        status, data = routes.handle_post("convert", body)
        assert status == 400 and needle in data["error"], (status, data)
