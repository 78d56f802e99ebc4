"""The report shows the step time measured in the last runs beside the plan's prediction for it: in the report JSON
(`step`: measured_ms, predicted_ms, off_by; nodes/status.py), in the Offload Report node's text, and as the panel's
`data-lo-figure="step|predicted_step"` (web/layer_offload.js). In process (CPU mode, simulated device), with the
pattern and the tiny Wan model of tests/comfyui/test_routes.py; its own file name, so no other test's model answers.
Skipped unless COMFYUI_PATH is set."""
from __future__ import annotations

import json
import math
import os
from importlib import import_module

import pytest

from conftest import comfy_available, node_classes, skip_reason  # noqa: F401

if not comfy_available():
    pytest.skip(skip_reason(), allow_module_level=True)

import torch  # noqa: E402

import tiny_wan  # noqa: E402

UNET = "lo_step_times_tiny_wan.safetensors"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def sample(model, steps: int = 4) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    cond = [[torch.randn(1, 8, 4096, generator=g) * 0.1, {}]]
    latent = torch.zeros(1, 16, 1, 8, 8)
    import comfy.sample

    with torch.inference_mode():
        noise = comfy.sample.prepare_noise(latent, 3)
        return comfy.sample.sample(model, noise, steps, 1.0, "euler", "simple", cond, cond, latent,
                                   disable_pbar=True, seed=3)


@pytest.fixture(scope="module")
def env(pack, tmp_path_factory):
    import folder_paths

    d = str(tmp_path_factory.mktemp("step_models"))
    tiny_wan.write_wan(os.path.join(d, UNET))
    folder_paths.add_model_folder_path("diffusion_models", d)
    model = node_classes(pack)["OffloadDiffusionModelLoader"]().load(UNET, "default", "budget", None, 0)[0]
    sample(model)  # every block runs several times: the plan is made from measured costs, with its prediction
    return {"pack": pack, "model": model, "status": import_module(pack.__name__ + ".nodes.status")}


def entry(env):
    found = [m for m in env["status"].build_report()["models"] if m["name"] == UNET]
    assert len(found) == 1
    return found[0]


def test_report_has_measured_and_predicted_step(env):
    m = entry(env)
    json.dumps(m, allow_nan=False)  # what the route and the event send: strict JSON
    step = m["step"]
    assert set(step) == {"measured_ms", "predicted_ms", "off_by"}
    assert step["measured_ms"] == m["step_ms"] and step["predicted_ms"] == m["predicted_step_ms"]
    assert isinstance(step["measured_ms"], float) and step["measured_ms"] > 0
    assert isinstance(step["predicted_ms"], float) and step["predicted_ms"] > 0
    assert math.isclose(step["off_by"], step["measured_ms"] / step["predicted_ms"] - 1.0)


def test_report_node_text_shows_both(env):
    node = node_classes(env["pack"])["OffloadReport"]
    out = node.report(None, env["model"])
    text = out["ui"]["text"][0]
    line = [ln for ln in text.splitlines() if ln.strip().startswith("step:")]
    assert len(line) == 1 and "ms measured" in line[0] and "ms predicted by the plan" in line[0], text
    data = json.loads(out["result"][0])
    assert data["models"][0]["step"]["predicted_ms"] > 0


def test_step_line_before_anything_is_known(env):
    status = env["status"]
    assert status.step_line(status.step_times({"step_ms": None, "predicted_step_ms": None})) == \
        "  step: no forward measured yet"
    line = status.step_line(status.step_times({"step_ms": 12.5, "predicted_step_ms": float("nan")}))
    assert "12.5 ms measured" in line and "predicted once every block has run" in line


def test_panel_draws_both_figures():
    """The panel's contract names both figures, and the row draws them from the report's `step`."""
    js = open(os.path.join(REPO, "web", "layer_offload.js"), encoding="utf-8").read()
    assert '[data-lo-figure="step|predicted_step"]' in js
    assert '"data-lo-figure": "step"' in js and '"data-lo-figure": "predicted_step"' in js
    assert "step.measured_ms" in js and "step.predicted_ms" in js
