"""The example workflows (example_workflows/*.json) on a real ComfyUI: listed in the template browser, every node
type, widget and link valid against the server's /object_info, and run: the TTS workflow as it is (with the tiny
VibeVoice in place of the real model), the Wan workflow's diffusion part (a tiny Wan model, the text encoder and VAE,
which need the real multi-GB files, replaced by a conditioning stand-in) bitwise like the plain UNETLoader."""
from __future__ import annotations

import copy
import json
import os
from typing import Any, Dict, List, Tuple

import pytest

from conftest import REPO_ROOT, comfy_available, load_tests_module, skip_reason

if not comfy_available():
    pytest.skip(skip_reason(), allow_module_level=True)
pytest.importorskip("transformers")

import comfy_server as cs  # noqa: E402
import tiny_wan  # noqa: E402

tv = load_tests_module("tts/tiny_vibevoice.py")
tt = load_tests_module("tts/tiny_tts.py")
WORKFLOWS = os.path.join(REPO_ROOT, "example_workflows")
WAN = "wan2.1_t2v_layer_offload"
TTS = "vibevoice_tts_layer_offload"
# the TTS workflows, run with a tiny model of their type: (folder, writer, max_new_tokens, sample rate)
TTS_RUNS = {TTS: ("tiny-vibevoice", tv.write_tiny_vibevoice, 24, 24000),
            "higgs_audio_v2_tts_layer_offload": ("tiny-higgs", tt.write_tiny_higgs, 10, 24000),
            "dia_tts_layer_offload": ("tiny-dia", tt.write_tiny_dia, 12, 44100),
            "csm_tts_layer_offload": ("tiny-csm", tt.write_tiny_csm, 3, 24000)}
WIDGET_TYPES = ("INT", "FLOAT", "STRING", "BOOLEAN", "COMBO")


def workflow(name: str) -> Dict[str, Any]:
    with open(os.path.join(WORKFLOWS, name + ".json"), encoding="utf-8") as f:
        return json.load(f)


def _inputs(info: Dict[str, Any]) -> List[Tuple[str, Any, Dict[str, Any]]]:
    """(name, type, options) of a node's inputs in the frontend's order: required, then optional."""
    out = []
    for section in ("required", "optional"):
        order = info.get("input_order", {}).get(section) or list(info["input"].get(section, {}))
        for name in order:
            spec = info["input"][section][name]
            out.append((name, spec[0], spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}))
    return out


def _is_widget(kind: Any) -> bool:
    return isinstance(kind, list) or kind in WIDGET_TYPES


def _has_control(name: str, kind: Any, options: Dict[str, Any]) -> bool:
    """The frontend adds a 'control after generate' value after seed-like INT widgets."""
    return kind == "INT" and (name in ("seed", "noise_seed") or bool(options.get("control_after_generate")))


def widget_values(node: Dict[str, Any], info: Dict[str, Any]) -> Dict[str, Any]:
    """A UI node's widget values by input name (what the frontend turns them into in an API prompt)."""
    values = list(node.get("widgets_values") or [])
    linked = {i["name"] for i in node.get("inputs", []) if i.get("link") is not None}
    out: Dict[str, Any] = {}
    for name, kind, options in _inputs(info):
        if not _is_widget(kind) or name in linked or not values:
            continue
        out[name] = values.pop(0)
        if _has_control(name, kind, options) and values:
            values.pop(0)
        if isinstance(kind, list) and options.get("audio_upload") or options.get("image_upload"):
            values[:] = values[2:] if len(values) >= 2 else []  # the upload button's slots
    return out


def to_api(wf: Dict[str, Any], object_info: Dict[str, Any]) -> Dict[str, Any]:
    """A UI-format workflow as an API prompt (links become [node id, slot])."""
    links = {l[0]: l for l in wf["links"]}
    prompt: Dict[str, Any] = {}
    for node in wf["nodes"]:
        if node.get("mode", 0) != 0:
            continue
        inputs = widget_values(node, object_info[node["type"]])
        for i in node.get("inputs", []):
            if i.get("link") is not None:
                link = links[i["link"]]
                inputs[i["name"]] = [str(link[1]), link[2]]
        prompt[str(node["id"])] = {"class_type": node["type"], "inputs": inputs}
    return prompt


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("comfy_workflows"))
    paths = cs.prepare_base_dir(base)
    tiny_wan.write_wan(os.path.join(paths["diffusion_models"], "tiny_wan.safetensors"))
    for folder, write, _, _ in TTS_RUNS.values():
        write(os.path.join(paths["tts"], folder))
    from test_tts_server import write_voice

    write_voice(os.path.join(paths["input"], "voice.wav"))
    srv = cs.ComfyServer(os.environ["COMFYUI_PATH"], base, startup_timeout=600)
    srv.start()
    try:
        srv.info = srv.get_json("/object_info")
        yield srv
    finally:
        srv.stop()


def test_the_template_browser_lists_the_example_workflows(server):
    listed = server.get_json("/workflow_templates")
    assert sorted(listed.get(cs.PACK_FOLDER, [])) == sorted([*TTS_RUNS, WAN]), listed


@pytest.mark.parametrize("name", [WAN, *TTS_RUNS])
def test_every_node_widget_and_link_is_valid(server, name):
    wf = workflow(name)
    info = server.info
    optional_core = {"LoadAudio", "SaveAudio", "SaveAnimatedWEBP"}  # need torchaudio / PIL extras on some installs
    missing = [n["type"] for n in wf["nodes"] if n["type"] not in info]
    assert not [m for m in missing if m not in optional_core], "node types unknown to this ComfyUI: {}".format(missing)
    by_id = {n["id"]: n for n in wf["nodes"]}
    for link in wf["links"]:
        lid, src, src_slot, dst, dst_slot, kind = link
        assert by_id[src]["outputs"][src_slot]["type"] == kind and lid in by_id[src]["outputs"][src_slot]["links"]
        assert by_id[dst]["inputs"][dst_slot]["link"] == lid
    for node in wf["nodes"]:
        if node["type"] not in info:
            continue
        spec = info[node["type"]]
        widgets = [(n, k, o) for n, k, o in _inputs(spec) if _is_widget(k)]
        expected = sum(1 + _has_control(n, k, o) + 2 * bool(o.get("audio_upload") or o.get("image_upload"))
                       for n, k, o in widgets)
        assert len(node["widgets_values"]) == expected, (node["type"], node["widgets_values"], widgets)
        for wname, value in widget_values(node, spec).items():
            kind = next(k for n, k, _ in widgets if n == wname)
            if isinstance(kind, list) and wname not in ("unet_name", "clip_name", "vae_name", "model_name", "audio"):
                assert value in kind, (node["type"], wname, value)
        for i in node.get("inputs", []):
            if i.get("link") is not None:
                declared = dict((n, k) for n, k, _ in _inputs(spec))
                assert i["name"] in declared, (node["type"], i["name"])


@pytest.mark.parametrize("name", list(TTS_RUNS))
def test_the_tts_workflow_runs(server, name):
    folder, _, tokens, rate = TTS_RUNS[name]
    prompt = to_api(workflow(name), server.info)
    prompt["2"]["inputs"]["model_name"] = folder
    prompt["4"]["inputs"]["max_new_tokens"] = tokens
    if "LoadAudio" not in server.info:  # no torchaudio on this install: the same clip through a test node
        prompt["3"] = {"class_type": "LOTestWavAudio", "inputs": {"name": "voice.wav"}}
    if "SaveAudio" not in server.info:
        del prompt["5"]
    prompt["9"] = {"class_type": "LOTestAudioHash", "inputs": {"audio": ["4", 0]}}
    entry = server.run_prompt(prompt, timeout=600)
    assert "rate={}".format(rate) in cs.ui_texts(entry, "9")[0]
    report = json.loads(entry["outputs"]["6"]["report_json"][0])
    assert any(m["kind"] == "tts" for m in report["models"])
    if "5" in prompt:
        assert entry["outputs"]["5"]["audio"], entry["outputs"]["5"]


def test_the_wan_workflow_diffusion_part_runs_like_the_plain_loader(server):
    prompt = to_api(workflow(WAN), server.info)
    prompt["2"]["inputs"]["unet_name"] = "tiny_wan.safetensors"
    for nid in ("4", "5", "10", "11", "12"):  # text encoder and VAE: real multi-GB files only
        prompt.pop(nid)
    prompt["6"] = {"class_type": "LOTestConditioning", "inputs": {"tokens": 8, "seed": 1}}
    prompt["7"] = {"class_type": "LOTestConditioning", "inputs": {"tokens": 8, "seed": 2}}
    prompt["8"]["inputs"].update(width=64, height=64, length=1)
    prompt["9"]["inputs"]["steps"] = 3
    prompt["20"] = {"class_type": "LOTestLatentHash", "inputs": {"samples": ["9", 0]}}
    entry = server.run_prompt(prompt, timeout=600)
    offloaded = cs.ui_texts(entry, "20")[0].split()[0]
    assert json.loads(entry["outputs"]["13"]["report_json"][0])["models"]
    plain = copy.deepcopy(prompt)
    plain["2"] = {"class_type": "UNETLoader", "inputs": {"unet_name": "tiny_wan.safetensors", "weight_dtype": "default"}}
    plain.pop("1")
    plain.pop("13")
    assert cs.ui_texts(server.run_prompt(plain, timeout=600), "20")[0].split()[0] == offloaded
