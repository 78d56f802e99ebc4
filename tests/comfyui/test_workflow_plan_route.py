"""The workflow plan from ComfyUI, in process (CPU mode, simulated device): POST /layer_offload/plan's work
(nodes/routes.py `handle_post("plan", ...)`) and the plan beside the measured figures after a run (issue 34).

A tiny Wan model (its own file name) is planned from the API graph the panel sends: its file is found through
ComfyUI's model folders (never outside them), the card is the simulated device's (or one named), nothing is loaded
(no model appears in the report), and bad requests answer 400 with one line. After the model is offloaded and
sampled, the Offload Report node, given the prompt it runs in, reports the plan's figures beside the measured ones.
Skipped unless COMFYUI_PATH is set.
"""
from __future__ import annotations

import os
from importlib import import_module

import pytest

from conftest import comfy_available, node_classes, skip_reason

if not comfy_available():
    pytest.skip(skip_reason(), allow_module_level=True)

import torch  # noqa: E402

import tiny_wan  # noqa: E402

UNET = "lo_plan_tiny_wan.safetensors"
GIB = 1 << 30


def prompt(steps: int = 3, cfg: float = 1.0, unet: str = UNET) -> dict:
    """The API graph of Offload Loader -> KSampler -> Offload Report (what the panel sends for the canvas)."""
    return {
        "1": {"class_type": "OffloadDiffusionModelLoader",
              "inputs": {"unet_name": unet, "weight_dtype": "default", "preset": "budget", "priority": 0}},
        "2": {"class_type": "LOTestConditioning", "inputs": {"tokens": 8, "seed": 1}},
        "3": {"class_type": "EmptyHunyuanLatentVideo",
              "inputs": {"width": 64, "height": 64, "length": 1, "batch_size": 1}},
        "5": {"class_type": "KSampler", "inputs": {"model": ["1", 0], "positive": ["2", 0], "negative": ["2", 0],
                                                     "latent_image": ["3", 0], "seed": 3, "steps": steps, "cfg": cfg,
                                                     "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}},
        "7": {"class_type": "OffloadReport", "inputs": {"anything": ["5", 0]}},
    }


@pytest.fixture(scope="module")
def env(pack, tmp_path_factory):
    import folder_paths

    d = str(tmp_path_factory.mktemp("plan_models"))
    tiny_wan.write_wan(os.path.join(d, UNET))
    with open(os.path.join(str(tmp_path_factory.getbasetemp()), "outside.safetensors"), "wb") as f:
        f.write(b"\0" * 64)
    folder_paths.add_model_folder_path("diffusion_models", d)
    return {"pack": pack, "dir": d, "routes": import_module(pack.__name__ + ".nodes.routes"),
            "plan": import_module(pack.__name__ + ".nodes.workflow_plan"),
            "status": import_module(pack.__name__ + ".nodes.status"), "M": node_classes(pack)}


def post(env, body):
    return env["routes"].handle_post("plan", body)


def test_the_canvas_is_planned_on_this_process_card_and_nothing_loads(env):
    before = [m["name"] for m in env["status"].build_report()["models"]]
    status, data = post(env, {"prompt": prompt(steps=4, cfg=3.5)})
    assert status == 200 and data["ok"] is True, data
    plan = data["plan"]
    models = [m for m in plan["models"] if m["name"] == UNET]
    assert len(models) == 1, plan["models"]
    m = models[0]
    assert m["found"] and m["path"] == os.path.join(env["dir"], UNET), m
    assert m["family"] == "wan" and m["preset"] == "budget" and m["calls"] == 4, m
    assert m["fits"] is True and m["vram_bytes"] > 0 and m["host_bytes"] > 0 and m["ms_per_call"] > 0, m
    sampler = plan["run"]["samplers"][0]
    assert sampler["steps"] == 4 and sampler["forwards_per_step"] == 2, sampler  # cfg 3.5: cond and uncond
    assert plan["run"]["total_ms"] > 0 and plan["run"]["peak_vram_bytes"] > 0
    # the card: the simulated device's capacity (8 GiB unless LAYER_OFFLOAD_SIM_GB says otherwise)
    offload = import_module(env["pack"].__name__ + ".offload")
    assert plan["card"]["vram_bytes"] == offload.device_memory("sim")[1]
    assert data["card"].startswith("sim (") and "simulated device" in data["card_note"], data["card_note"]
    assert data["ram_bytes"] is None or data["ram_bytes"] > 0
    assert plan["ram"]["free_bytes"] == data["ram_bytes"] or data["ram_bytes"] is None
    assert "rtx4090" in data["cards"] and "rtx3060-12gb" in data["cards"]
    # nothing was loaded: no new model in the report
    assert [m["name"] for m in env["status"].build_report()["models"]] == before


def test_a_card_chosen_by_name_and_the_ui_form(env):
    status, data = post(env, {"prompt": prompt(), "card": "rtx3060-12gb"})
    assert status == 200, data
    assert data["card"] == "rtx3060-12gb" and data["plan"]["card"]["vram_bytes"] == 12 * GIB
    assert "chosen in the panel" in data["card_note"]
    status, other = post(env, {"prompt": prompt(), "card": "h100-sxm"})
    assert status == 200
    m = lambda d: [x for x in d["plan"]["models"] if x["name"] == UNET][0]  # noqa: E731
    assert m(other)["ms_per_call"] < m(data)["ms_per_call"], "an H100 plans faster than a 3060"


@pytest.mark.parametrize("body,needle", [
    ([], "must be a JSON object"),
    ({}, "give the graph as 'prompt'"),
    ({"prompt": "x"}, "must be a JSON object"),
    ({"prompt": {"1": 5}}, "neither ComfyUI API JSON"),
    ({"prompt": prompt(), "card": "rtx9999"}, "unknown card 'rtx9999'"),
    ({"prompt": prompt(), "card": 12}, "card must be a card's name"),
    ({"workflow": {"nodes": [{}] * 6000}}, "at most 5000"),
], ids=["not-object", "no-graph", "graph-not-object", "not-a-graph", "unknown-card", "card-not-text", "huge"])
def test_bad_requests_answer_400_with_one_line(env, body, needle):
    status, data = post(env, body)
    assert status == 400 and data["ok"] is False, data
    assert needle in data["error"] and "\n" not in data["error"], data["error"]


def test_a_missing_file_is_a_note_not_an_error(env):
    status, data = post(env, {"prompt": prompt(unet="no_such_model.safetensors")})
    assert status == 200, data
    m = [x for x in data["plan"]["models"] if x["name"] == "no_such_model.safetensors"][0]
    assert m["found"] is False and any("not found" in n for n in m["notes"]), m


def test_find_file_stays_inside_the_model_folders(env):
    find = env["plan"].find_file
    assert find("diffusion_models", UNET) == os.path.join(env["dir"], UNET)
    assert find("unet", UNET) == os.path.join(env["dir"], UNET)  # ComfyUI's legacy name
    assert find("diffusion_models", "../outside.safetensors") is None
    assert find("diffusion_models", os.path.join(env["dir"], UNET)) == os.path.join(env["dir"], UNET)
    assert find("diffusion_models", "/etc/passwd") is None
    assert find("unet_gguf", "none.gguf") is None  # a folder this ComfyUI may not know: None, no error
    assert find("no_such_kind", UNET) is None
    assert find("diffusion_models", "") is None and find("diffusion_models", None) is None


def test_the_report_sets_the_plan_beside_the_run(env):
    import comfy.sample

    model = env["M"]["OffloadDiffusionModelLoader"]().load(UNET, "default", "budget", None, 0)[0]
    g = torch.Generator().manual_seed(1)
    cond = [[torch.randn(1, 8, 4096, generator=g) * 0.1, {}]]
    latent = torch.zeros(1, 16, 1, 16, 16)
    with torch.inference_mode():
        noise = comfy.sample.prepare_noise(latent, 3)
        comfy.sample.sample(model, noise, 3, 1.0, "euler", "simple", cond, cond, latent, disable_pbar=True, seed=3)
    out = env["M"]["OffloadReport"].report(None, None, prompt=prompt(steps=3))
    import json

    data = json.loads(out["result"][0])
    w = data["workflow"]
    assert w is not None and w["card"].startswith("sim ("), w
    rows = [r for r in w["models"] if r["name"] == UNET]
    assert len(rows) == 1, w["models"]
    r = rows[0]
    assert r["calls"]["planned"] == 3 and r["calls"]["measured"] >= 3, r["calls"]
    for key in ("ms_per_call", "time_ms", "vram_bytes", "host_bytes"):
        assert r[key]["planned"] is not None and r[key]["planned"] > 0, (key, r[key])
        assert r[key]["measured"] is not None and r[key]["measured"] > 0, (key, r[key])
        assert r[key]["off_by"] == pytest.approx(r[key]["measured"] / r[key]["planned"] - 1), key
    assert w["time_ms"]["planned"] == pytest.approx(r["time_ms"]["planned"])
    assert w["time_ms"]["measured"] == pytest.approx(r["time_ms"]["measured"])
    assert w["run"]["total_ms"] >= w["time_ms"]["planned"]
    text = out["ui"]["text"][0]
    assert "Workflow plan on sim (" in text and "time: planned" in text and "peak VRAM: planned" in text, text
    # the simulated device is priced at a table card's speeds while the CPU computes: said, not compared
    assert w["times_note"] and "simulated device computes on the CPU" in w["times_note"], w
    assert "times: the simulated device computes on the CPU" in text, text
    # the same figures reach the panel: GET /layer_offload/report's build_report
    assert env["status"].build_report()["workflow"]["models"][0]["name"] == UNET
    del model
