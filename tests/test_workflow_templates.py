"""ComfyUI's own workflow templates (the pinned `comfyui-workflow-templates-json` test dependency) planned with
`python -m offload plan --json`, as a user who opens one would, with none of its model files on disk.

Every template that loads a local model must be read whole: each model file the template declares (its nodes'
`properties.models`, which the frontend's missing-models dialog lists) is named in the plan, with its download link;
each sampler node the template holds either runs (with its steps and the model file it samples) or is said not to
run and why (muted, bypassed, a switch's other branch). The check is against the template's own records, not
against the reader's tables. Then, per feature, what ComfyUI would do: two experts splitting the steps, switches,
math that sets the frame count, nested subgraphs, promoted widget values, bypassed loaders, LTX-2's loaders.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from offload.__main__ import main
from offload.predict import plan_workflow
from offload.predict.comfy_nodes import LOADERS

templates_json = pytest.importorskip("comfyui_workflow_templates_json")
TEMPLATES = Path(templates_json.__file__).parent / "templates"
SAMPLERS = ("KSampler", "KSamplerAdvanced", "SamplerCustom", "SamplerCustomAdvanced")
# templates ComfyUI itself could not run as shipped (the plan says why, and is not read whole)
BROKEN = {"video_ltx2_i2v_lora": "its subgraph's VIDEO output names link 265, which the subgraph does not hold"}


def _raw_nodes(wf: dict) -> list[dict]:
    subs = (wf.get("definitions") or {}).get("subgraphs") or []
    return list(wf["nodes"]) + [n for s in subs for n in s.get("nodes") or []]


def _declared(wf: dict) -> set[str]:
    return {m["name"] for n in _raw_nodes(wf) for m in (n.get("properties") or {}).get("models") or []
            if isinstance(m, dict) and isinstance(m.get("name"), str)}


def _local_model_templates() -> list[Path]:
    found = []
    for path in sorted(TEMPLATES.glob("*.json")):
        wf = json.loads(path.read_text())
        if not isinstance(wf, dict) or not isinstance(wf.get("nodes"), list):
            continue  # the index files
        if _declared(wf) or any(n.get("type") in LOADERS for n in _raw_nodes(wf)):
            found.append(path)
    return found


LOCAL = _local_model_templates()


def _plan_cli(path: Path, capsys) -> dict:
    assert main(["plan", str(path), "--json", "--card", "rtx4090", "--ram", "64GB",
                 "--models-dir", str(path.parent / "no-models-here")]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_package_holds_the_templates():
    assert len(LOCAL) >= 250  # 261 in 0.1.123: Wan, Flux, Qwen-Image, LTX-2, HunyuanVideo, ACE-Step, Hunyuan3D ...


@pytest.mark.parametrize("path", LOCAL, ids=[p.stem for p in LOCAL])
def test_template_planned_whole(path, capsys):
    if path.stem in BROKEN:
        pytest.xfail(BROKEN[path.stem])
    wf = json.loads(path.read_text())
    d = _plan_cli(path, capsys)
    assert d["graph"]["read_whole"], d["graph"]["unread"]
    by_name = {m["name"]: m for m in d["models"]}
    assert _declared(wf) <= set(by_name), sorted(_declared(wf) - set(by_name))
    for m in d["models"]:
        assert not m["found"]  # no file on disk: said so, with where to get it where the template says
        assert m["notes"] and (("not found" in m["notes"][0]) if m["runs"] else m["notes"][0].startswith("not loaded"))
        if m["url"]:
            assert m["url"] in m["notes"][0] or not m["runs"]
    seen = {s["sampler"] for s in d["run"]["samplers"]}
    assert {s["node"] for s in d["graph"]["samplers_not_run"]} <= seen
    raw = [n for n in _raw_nodes(wf) if n.get("type") in SAMPLERS]
    for n in raw:  # each sampler of the template (in any subgraph instance) runs or is said not to
        assert any(s == str(n["id"]) or s.endswith(f":{n['id']}") for s in seen), n["id"]
    for s in d["run"]["samplers"]:  # the model file each sampler runs; those that do not run say why
        assert s["steps"] >= 0 and (s["model_file"] if s["runs"] else s["note"].startswith("not run: ")), s
    if raw and any(n.get("mode", 0) == 0 for n in raw):
        assert d["run"]["samplers"] or d["graph"]["samplers_not_run"]


def test_at_least_95_percent_planned_whole():
    whole = 0
    for path in LOCAL:
        d = plan_workflow(json.loads(path.read_text()), lambda kind, name: None, "rtx4090", 64 << 30).to_dict()
        whole += bool(d["graph"]["read_whole"] and _declared(json.loads(path.read_text())) <=
                      {m["name"] for m in d["models"]})
    assert whole / len(LOCAL) >= 0.95, f"{whole} of {len(LOCAL)}"


def _template(name: str) -> dict:
    return json.loads((TEMPLATES / name).read_text())


def _plan(wf: dict) -> dict:
    return plan_workflow(wf, lambda kind, name: None, "rtx4090", 64 << 30).to_dict()


def test_wan22_two_experts_switch_and_math():
    """Wan 2.2 14B text to video: one subgraph; two KSamplerAdvanced split 20 steps 10/10 (start/end from a
    switch over primitives), CFG 3.5; the frame count is Math Expression floor(5 s x 16 fps) + 1 = 81; the
    "enable_turbo_mode" boolean is off, so the lightx2v LoRAs are never loaded. Turned on (the promoted widget's
    primitive), the switches take the 4-step branch with the LoRAs and CFG 1."""
    wf = _template("video_wan2_2_14B_t2v.json")
    d = _plan(wf)
    high, low = d["run"]["samplers"]
    assert (high["model_file"], low["model_file"]) == ("wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors",
                                                       "wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors")
    assert (high["steps"], low["steps"], high["total_steps"]) == (10, 10, 20)
    assert (high["cfg"], high["width"], high["height"], high["frames"]) == (3.5, 640, 640, 81)
    assert high["subgraph"] == "Text to Video(Wan2.2)" and high["sampler"].startswith("128:")
    loras = [m for m in d["models"] if m["role"] == "lora"]
    assert len(loras) == 2 and not any(m["runs"] for m in loras)
    assert all("switch takes the other branch" in m["notes"][0] for m in loras)
    turbo = copy.deepcopy(wf)
    sub = turbo["definitions"]["subgraphs"][0]
    next(n for n in sub["nodes"] if n["type"] == "PrimitiveBoolean")["widgets_values"] = [True]
    d = _plan(turbo)
    high, low = d["run"]["samplers"]
    assert (high["steps"], low["steps"], high["total_steps"], high["cfg"]) == (2, 2, 4, 1.0)
    assert all(m["runs"] for m in d["models"])
    assert d["run"]["samplers"][0]["model"] == next(m["key"] for m in d["models"] if "high_noise_14B" in m["name"])


def test_split_sigmas_and_bypassed_loaders():
    """HunyuanVideo 1.5 720p: the 1080p super-resolution stage (its diffusion model and latent upsampler) is
    bypassed in the template: named, not loaded; the 720p sampler runs 20 steps at 1280x720, 121 frames."""
    d = _plan(_template("video_hunyuan_video_1.5_720p_t2v.json"))
    bypassed = {m["name"]: m for m in d["models"] if not m["runs"]}
    assert set(bypassed) == {"hunyuanvideo1.5_1080p_sr_distilled_fp16.safetensors",
                             "hunyuanvideo15_latent_upsampler_1080p.safetensors"}
    assert all(m["notes"][0] == "not loaded: bypassed" for m in bypassed.values())
    (s,) = [x for x in d["run"]["samplers"] if x["runs"]]
    assert (s["steps"], s["width"], s["height"], s["frames"]) == (20, 1280, 720, 121)
    assert [x["note"] for x in d["run"]["samplers"] if not x["runs"]] == ["not run: bypassed"] * 2  # the SR stage


def test_nested_subgraph_and_promoted_values():
    """A loader two subgraphs deep gets the execution id ComfyUI gives it (outer:inner:node) and both subgraphs'
    names; Hunyuan3D 2.1 stores its promoted widget values on the instance (the older frontend's way): 30 steps and
    CFG 5 come from there, and its ImageOnlyCheckpointLoader is the sampler's model."""
    d = _plan(_template("3d_triposplat_image_to_gaussian_splat.json"))
    birefnet = next(m for m in d["models"] if m["name"] == "birefnet.safetensors")
    assert birefnet["key"] == "88:85:82" and birefnet["role"] == "background_removal"
    assert birefnet["subgraph"] == "Image to Gaussian Splat (TripoSplat) > Remove Background (BiRefNet)"
    d = _plan(_template("3d_hunyuan3d-v2.1.json"))
    (s,) = d["run"]["samplers"]
    assert (s["steps"], s["cfg"], s["model_file"]) == (30, 5.0, "hunyuan_3d_v2.1.safetensors")
    wf = _template("3d_hunyuan3d-v2.1.json")
    inst = next(n for n in wf["nodes"] if n.get("widgets_values") and n["type"] != "MarkdownNote"
                and len(n["widgets_values"]) == 9)
    inst["widgets_values"][1] = 12  # the instance's promoted "steps"
    assert _plan(wf)["run"]["samplers"][0]["steps"] == 12


def test_ltx2_loaders_and_two_stages():
    """LTX-2.3 image to video: the audio VAE and the AV text encoder's two files are named with their roles; the
    second stage samples the latent the x2 spatial upscaler made (twice the first stage's size)."""
    d = _plan(_template("video_ltx2_3_i2v.json"))
    roles = {(m["role"], m["name"]) for m in d["models"] if m["runs"]}
    assert ("audio_vae", "ltx-2.3-22b-dev-fp8.safetensors") in roles
    assert ("text_encoder", "gemma_3_12B_it_fp4_mixed.safetensors") in roles
    assert ("text_projection", "ltx-2.3-22b-dev-fp8.safetensors") in roles
    assert ("latent_upscale_model", "ltx-2.3-spatial-upscaler-x2-1.1.safetensors") in roles
    first, second = d["run"]["samplers"]
    assert (second["width"], second["height"]) == (2 * first["width"], 2 * first["height"])
    assert first["model_file"] == second["model_file"] == "ltx-2.3-22b-dev-fp8.safetensors"


def test_cli_text_names_samplers_and_links(capsys):
    path = TEMPLATES / "video_wan2_2_14B_t2v.json"
    assert main(["plan", str(path), "--card", "rtx4070-12gb", "--models-dir", str(path.parent / "none")]) == 0
    text = capsys.readouterr().out
    assert "10 of 20 steps, CFG 3.5 at 640x640, 81 frames" in text
    assert "https://huggingface.co/Comfy-Org/Wan_2.2_ComfyUI_Repackaged/resolve/main/split_files/diffusion_models/" \
           "wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors" in text
    assert "workflow read whole (ui JSON): 6 model file(s) named, 4 loaded by this run, 2 sampler(s)" in text
    assert "INCOMPLETE: 4 model file(s) not found" in text
