"""The Layer Offload sidebar panel in a real ComfyUI frontend, driven by headless Chromium (selenium).

A ComfyUI server (--cpu, its own user/input/output/temp directories) runs with this pack; the page opens the Layer
Offload tab before any model exists; a prompt with an offloaded tiny Wan model is queued through the HTTP API and
the panel must show it without a reload: one chart mark per block, numeric figures, a priority control that changes
GET /layer_offload/report, an invalid budget refused with a message in the panel (the budget unchanged), and no
console error from the extension. A screenshot goes to pytest's tmp dir (LO_PANEL_PNG=path writes a copy too).

Runs when COMFYUI_PATH is set and selenium, Chromium and chromedriver are installed; skips with the reason otherwise.
`COMFYUI_PATH=... PY=... make test-browser`.
"""
from __future__ import annotations

import math
import os
import shutil

import pytest

from conftest import comfy_available, skip_reason

if not comfy_available():
    pytest.skip(skip_reason(), allow_module_level=True)

import browser  # noqa: E402
import comfy_server as cs  # noqa: E402
import tiny_wan  # noqa: E402

CHROMIUM, CHROMEDRIVER, MISSING = browser.find_chromium()
if MISSING:
    pytest.skip(MISSING, allow_module_level=True)

UNET = "tiny_wan.safetensors"
UNET_HI = "tiny_wan_hi.safetensors"
UNET_MD = "tiny_wan_two_devices.safetensors"  # test_two_devices_draw_a_bar_each: offloaded across sim:0 and sim:1
TAB = "layer-offload"
GIB = 1 << 30
# what identifies the extension's own console messages: its script URL, its routes, its log prefix
OURS = (cs.PACK_FOLDER, "layer_offload", "Layer Offload", "LayerOffload")


def prompt(seed: int = 3) -> dict:
    """VRAM Budget (20 MB) -> two Offload Loaders (the same weights under two names: preset budget streams every
    block, high_end keeps them resident) -> two KSamplers in a chain -> latent hashes, and an Offload Report."""
    def ksampler(model, latent, s):
        return {"class_type": "KSampler", "inputs": {"model": model, "positive": ["2", 0], "negative": ["2", 0],
                                                     "latent_image": latent, "seed": s, "steps": 3, "cfg": 1.0,
                                                     "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}}

    return {
        "8": {"class_type": "OffloadVramBudget", "inputs": {"budget_gb": 0.02, "preset": "auto"}},
        "1": {"class_type": "OffloadDiffusionModelLoader",
              "inputs": {"unet_name": UNET, "weight_dtype": "default", "preset": "budget", "priority": 0,
                         "budget": ["8", 0]}},
        "11": {"class_type": "OffloadDiffusionModelLoader",
               "inputs": {"unet_name": UNET_HI, "weight_dtype": "default", "preset": "high_end", "priority": 1,
                          "budget": ["8", 0]}},
        "2": {"class_type": "LOTestConditioning", "inputs": {"tokens": 8, "seed": 1}},
        "3": {"class_type": "EmptyHunyuanLatentVideo",
              "inputs": {"width": 64, "height": 64, "length": 1, "batch_size": 1}},
        "5": ksampler(["1", 0], ["3", 0], seed),
        "12": ksampler(["11", 0], ["5", 0], seed + 1),
        "6": {"class_type": "LOTestLatentHash", "inputs": {"samples": ["5", 0]}},
        "7": {"class_type": "OffloadReport", "inputs": {"anything": ["12", 0]}},
    }


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    """(server, driver, console entries so far) with the page loaded and the frontend started."""
    import torch

    base = str(tmp_path_factory.mktemp("comfy_browser"))
    paths = cs.prepare_base_dir(base)
    # float32, the dtype ComfyUI computes in on the CPU: the plan (from the files' headers) and the run then hold the
    # same bytes, as a GPU's float16 file and run do (the plan beside the run in the screenshot compares like for like)
    tiny_wan.write_wan(os.path.join(paths["diffusion_models"], UNET), dtype=torch.float32)
    tiny_wan.write_wan(os.path.join(paths["diffusion_models"], UNET_HI), dtype=torch.float32)
    tiny_wan.write_wan(os.path.join(paths["diffusion_models"], UNET_MD))
    example_models(base)
    server = browser.BrowserServer(os.environ["COMFYUI_PATH"], base, startup_timeout=600)
    server.seed_settings()
    old_env = os.environ.get("LAYER_OFFLOAD_SIM_DEVICES")
    os.environ["LAYER_OFFLOAD_SIM_DEVICES"] = "2"  # sim:1 is visible to the server (single-device models unchanged)
    try:
        server.start()
    finally:
        if old_env is None:
            os.environ.pop("LAYER_OFFLOAD_SIM_DEVICES", None)
        else:
            os.environ["LAYER_OFFLOAD_SIM_DEVICES"] = old_env
    with browser.app_page(server, CHROMIUM, CHROMEDRIVER) as driver:
        yield server, driver


EXAMPLE = os.path.join(cs.REPO_ROOT, "example_workflows", "wan2.1_t2v_layer_offload.json")


def header_only(path: str, shapes: dict, dtype: str = "BF16") -> None:
    """A .safetensors file of these tensors whose data is a hole: the plan reads headers only (as
    tests/test_workflow_plan.py's write_safetensors)."""
    import json
    import math
    import struct

    size = {"BF16": 2, "F16": 2, "F8_E4M3": 1}[dtype]
    header, offset = {}, 0
    for name, shape in shapes.items():
        n = size * math.prod(shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)


def example_models(base: str) -> None:
    """The files the Wan 2.1 example workflow names, in the server's model folders: the tiny Wan under the 1.3B's
    name, a three-block umT5-shaped text encoder and a Wan VAE's header."""
    models = os.path.join(base, "models")
    tiny_wan.write_wan(os.path.join(models, "diffusion_models", "wan2.1_t2v_1.3B_fp16.safetensors"))
    t5 = {"shared.weight": (1000, 64)}
    for i in range(3):
        for x in "qkvo":
            t5["encoder.block.{}.layer.0.SelfAttention.{}.weight".format(i, x)] = (64, 64)
        t5["encoder.block.{}.layer.1.DenseReluDense.wi_0.weight".format(i)] = (128, 64)
        t5["encoder.block.{}.layer.1.DenseReluDense.wo.weight".format(i)] = (64, 128)
    header_only(os.path.join(models, "text_encoders", "umt5_xxl_fp8_e4m3fn_scaled.safetensors"), t5, "F8_E4M3")
    header_only(os.path.join(models, "vae", "wan_2.1_vae.safetensors"), {
        "decoder.middle.0.residual.0.gamma": (384, 1, 1, 1), "decoder.head.0.gamma": (96, 1, 1, 1),
        "encoder.conv1.weight": (96, 3, 3, 3, 3), "decoder.conv1.weight": (384, 16, 3, 3, 3),
        "decoder.head.2.weight": (3, 96, 3, 3, 3)})


def q(driver, css):
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, css)


def row_css(name: str) -> str:
    return '[data-lo-panel] [data-lo-model="{}"]'.format(name)


def report_model(server, name: str) -> dict:
    found = [m for m in server.get_json("/layer_offload/report")["models"] if m["name"] == name]
    assert len(found) == 1, found
    return found[0]


def count_texts(driver, text: str, prefix: bool = False) -> int:
    """How many innermost elements of the page hold exactly this text (or start with it): toasts included, whatever
    the frontend's toast markup."""
    return driver.execute_script(
        "return Array.from(document.querySelectorAll('body *')).filter(e => e.children.length === 0 && "
        "(arguments[1] ? e.textContent.startsWith(arguments[0]) : e.textContent === arguments[0])).length;",
        text, prefix)


def type_into(driver, element, text: str) -> None:
    """Replace an input's text as a user would, then press Enter."""
    from selenium.webdriver.common.keys import Keys

    element.click()
    element.send_keys(Keys.CONTROL, "a")
    element.send_keys(Keys.BACKSPACE)
    element.send_keys(text)
    element.send_keys(Keys.ENTER)


def test_panel_end_to_end(page, tmp_path):
    server, driver = page
    console = browser.console_entries(driver)  # the frontend's own startup messages

    # the tab opens before any model exists: the GET fills it, with an empty list
    browser.open_sidebar_tab(driver, TAB)
    browser.wait_for(lambda: q(driver, "[data-lo-panel] [data-lo-budget]"), 30, "the panel to render the report")
    assert not q(driver, "[data-lo-model]")
    assert q(driver, 'input[data-lo-control="budget"]'), "no budget control"
    tiers = [e.get_attribute("data-lo-legend-tier") for e in q(driver, "[data-lo-legend] [data-lo-legend-tier]")]
    assert tiers == ["vram", "pinned", "pageable", "disk"], tiers
    driver.execute_script("window.__lo_no_reload = 1;")

    # a prompt queued through the HTTP API (with the page's client id, so the Report node shows its text)
    try:
        driver.execute_script("window.app.loadApiJson && window.app.loadApiJson(arguments[0], 'offload.json');",
                              prompt())
    except Exception:  # noqa: BLE001 - showing the workflow in the canvas is for the screenshot only
        pass
    server.client_id = browser.browser_client_id(driver) or server.client_id
    entry = server.wait(server.queue(prompt()), timeout=600)
    assert entry.get("status", {}).get("status_str") == "success", entry.get("status")

    # the row appears without a reload (the layer_offload.report event)
    browser.wait_for(lambda: q(driver, row_css(UNET)), 30, "the model's row")
    assert driver.execute_script("return window.__lo_no_reload;") == 1, "the page was reloaded"
    browser.wait_for(lambda: q(driver, row_css(UNET_HI)), 10, "the second model's row")[0]
    assert len(q(driver, "[data-lo-model]")) == 2

    # the chart: an svg with one mark per block
    charts = q(driver, row_css(UNET) + ' [data-lo-chart="blocks"]')
    assert len(charts) == 1 and charts[0].tag_name.lower() in ("svg", "canvas")
    marks = q(driver, row_css(UNET) + ' [data-lo-chart="blocks"] [data-lo-block]')
    assert [m.get_attribute("data-lo-block") for m in marks] == [str(i) for i in range(tiny_wan.NUM_BLOCKS)]
    rep = report_model(server, UNET)
    assert [m.get_attribute("data-lo-tier") for m in marks] == [b["tier"] for b in rep["blocks"]]
    assert charts[0].size["width"] > 100 and charts[0].size["height"] > 30, charts[0].size

    # the figures are numbers, the ones in the report
    figures = {}
    for key in ("overlap", "gbps"):
        els = q(driver, row_css(UNET) + ' [data-lo-figure="{}"]'.format(key))
        assert len(els) == 1, key
        figures[key] = float(els[0].text)
        assert math.isfinite(figures[key]) and figures[key] >= 0, (key, els[0].text)
    assert 0 <= figures["overlap"] <= 1
    assert figures["overlap"] == pytest.approx(rep["overlap_ratio"], abs=0.006)
    assert figures["gbps"] == pytest.approx(rep["effective_gbps"], abs=0.006)
    assert rep["forwards"] >= 3 and rep["streamed_blocks"] == tiny_wan.NUM_BLOCKS and rep["total_bytes_streamed"] > 0
    assert report_model(server, UNET_HI)["resident_blocks"] > 0
    assert len(q(driver, row_css(UNET_HI) + ' [data-lo-chart="blocks"] [data-lo-block]')) == tiny_wan.NUM_BLOCKS
    counts = {k: int(q(driver, row_css(UNET) + ' [data-lo-count="{}"]'.format(k))[0].text)
              for k in ("resident", "streamed", "disk")}
    assert counts == {"resident": 0, "streamed": tiny_wan.NUM_BLOCKS, "disk": 0}, counts

    # the budget bar: a visible segment for each model
    for name in (UNET, UNET_HI):
        seg = q(driver, '[data-lo-budget] [data-lo-budget-model="{}"]'.format(name))
        assert len(seg) == 1 and seg[0].size["width"] >= 3, (name, seg and seg[0].size)

    # the priority control changes GET /layer_offload/report, and the panel shows it at once
    assert rep["priority"] == 0
    prio = q(driver, row_css(UNET) + ' input[data-lo-control="priority"]')
    assert len(prio) == 1
    type_into(driver, prio[0], "7")
    browser.wait_for(lambda: report_model(server, UNET)["priority"] == 7, 15, "the priority to reach the server")
    browser.wait_for(lambda: q(driver, row_css(UNET) + ' input[data-lo-control="priority"]')[0]
                     .get_attribute("value") == "7", 10, "the panel to show priority 7")
    assert not q(driver, "[data-lo-error]")[0].text.strip()

    # an invalid budget: an error in the panel (and a toast), the budget unchanged
    total_before = server.get_json("/layer_offload/report")["budget"]["total_bytes"]
    budget_input = q(driver, 'input[data-lo-control="budget"]')[0]
    type_into(driver, budget_input, "100000")
    err = browser.wait_for(lambda: [e for e in q(driver, "[data-lo-error]") if e.is_displayed() and e.text.strip()],
                           15, "an error message in the panel")[0]
    assert "larger than the device" in err.text, err.text
    assert server.get_json("/layer_offload/report")["budget"]["total_bytes"] == total_before
    browser.wait_for(lambda: "budget change refused" in driver.find_element("tag name", "body").text, 10,
                     "the 'budget change refused' toast")
    # not a number ("1e" is all a number field lets through): refused in the page, nothing sent
    type_into(driver, q(driver, 'input[data-lo-control="budget"]')[0], "1e")
    browser.wait_for(lambda: "a number" in q(driver, "[data-lo-error]")[0].text, 15, "the not-a-number error")
    assert server.get_json("/layer_offload/report")["budget"]["total_bytes"] == total_before
    # an invalid priority too (a fraction): refused with a message, the priority unchanged
    type_into(driver, q(driver, row_css(UNET) + ' input[data-lo-control="priority"]')[0], "1.5")
    browser.wait_for(lambda: "whole number" in q(driver, "[data-lo-error]")[0].text, 15, "the priority error")
    assert report_model(server, UNET)["priority"] == 7

    # a valid budget clears the error and shows at once
    type_into(driver, q(driver, 'input[data-lo-control="budget"]')[0], "2")
    browser.wait_for(lambda: server.get_json("/layer_offload/report")["budget"]["total_bytes"] == 2 * GIB, 15,
                     "the budget to reach the server")
    browser.wait_for(lambda: not q(driver, "[data-lo-error]")[0].is_displayed(), 10, "the error to clear")
    browser.wait_for(lambda: "of 2.00 GB" in q(driver, "[data-lo-panel]")[0].text, 10, "the panel to show 2 GB")
    type_into(driver, q(driver, 'input[data-lo-control="budget"]')[0], "0.02")  # back to 20 MB
    browser.wait_for(lambda: server.get_json("/layer_offload/report")["budget"]["total_bytes"] == int(0.02 * GIB),
                     15, "the budget back at 20 MB")

    # notices toast once per model: the same report event three times, with two notices for one model
    data = server.get_json("/layer_offload/report")
    for m in data["models"]:
        if m["name"] == UNET:
            m["notices"] = [{"kind": "pinned_fallback", "message": "test: pinning refused, pageable memory used"},
                            {"kind": "oom_shrink", "message": "test: resident set shrunk to 1 block"}]
    def dispatch(times: int) -> None:
        driver.execute_script(
            "const a = window.app.api;"
            "for (let i = 0; i < arguments[2]; i++) a.dispatchCustomEvent ?"
            "  a.dispatchCustomEvent(arguments[1], arguments[0])"
            "  : a.dispatchEvent(new CustomEvent(arguments[1], { detail: arguments[0] }));",
            data, "layer_offload.report", times)

    def row_lists_notice() -> bool:
        if q(driver, row_css(UNET) + ' [data-lo-notice="pinned_fallback"]'):
            return True
        dispatch(1)  # the server's own event (the budget change above) may have redrawn the row since
        return False

    summaries = ("Layer Offload: Pinned memory refused: pageable memory used",
                 "Layer Offload: Resident set shrunk after an out-of-memory error")
    dispatch(3)
    for summary in summaries:
        browser.wait_for(lambda: count_texts(driver, summary) >= 1, 10, "the toast " + summary)
        assert count_texts(driver, summary) == 1, summary
    browser.wait_for(row_lists_notice, 10, "the notice listed in the row too")
    for summary in summaries:
        assert count_texts(driver, summary) <= 1, "a notice already shown must not toast again: " + summary
    assert count_texts(driver, "Layer Offload: Disk tier in use") == 0

    # a second run (the event again) keeps the rows and the controls' values
    server.wait(server.queue(prompt(seed=4)), timeout=600)
    browser.wait_for(lambda: report_model(server, UNET)["forwards"] >= 3, 10, "the second run's report")
    assert len(q(driver, "[data-lo-model]")) == 2
    assert q(driver, row_css(UNET) + ' input[data-lo-control="priority"]')[0].get_attribute("value") == "7"

    # the screenshot: the tab with the models' rows, and the Offload Report node in view on the canvas
    driver.execute_script("document.activeElement && document.activeElement.blur();"
                          "const t = window.app.extensionManager.toast; t && t.removeAll && t.removeAll();"
                          "try { const a = window.app, n = a.graph.getNodeById(7), ds = a.canvas.ds;"
                          "  const w = a.canvas.canvas.clientWidth; ds.scale = 0.8;"
                          "  ds.offset[0] = (w - 30) / ds.scale - (n.pos[0] + n.size[0]);"
                          "  ds.offset[1] = 110 / ds.scale - n.pos[1]; a.canvas.setDirty(true, true);"
                          "} catch (e) {}")
    try:  # the toasts' life is 8 s
        browser.wait_for(lambda: not count_texts(driver, "Layer Offload: ", prefix=True), 15, "the toasts to go")
    except AssertionError:
        pass
    shot = str(tmp_path / "panel.png")
    assert driver.save_screenshot(shot) and os.path.getsize(shot) > 10000
    if os.environ.get("LO_PANEL_PNG"):
        shutil.copyfile(shot, os.environ["LO_PANEL_PNG"])

    # no console error from the extension; the POSTs refused on purpose above are logged by Chrome as errors
    console += browser.console_entries(driver)
    ours = browser.errors_from(console, OURS)
    unexpected = [m for m in ours if not ("/api/layer_offload/" in m and "status of 400" in m)]
    assert not unexpected, "\n".join(unexpected)


def test_two_devices_draw_a_bar_each(page, tmp_path):
    """A model offloaded across sim:0 and sim:1 (devices input, per_device budget of sim:1): the panel draws one bar
    per device with that device's budget, lists the model's devices and marks each block's device in the chart."""
    server, driver = page
    console = browser.console_entries(driver)
    ksampler = {"class_type": "KSampler", "inputs": {
        "model": ["1", 0], "positive": ["2", 0], "negative": ["2", 0], "latent_image": ["3", 0], "seed": 3,
        "steps": 3, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}}
    wf = {
        "8": {"class_type": "OffloadVramBudget",
              "inputs": {"budget_gb": 0.02, "preset": "auto", "per_device": "sim:1=20MB"}},
        "1": {"class_type": "OffloadDiffusionModelLoader",
              "inputs": {"unet_name": UNET_MD, "weight_dtype": "default", "preset": "budget", "priority": 0,
                         "budget": ["8", 0], "devices": "sim:0, sim:1"}},
        "2": {"class_type": "LOTestConditioning", "inputs": {"tokens": 8, "seed": 1}},
        "3": {"class_type": "EmptyHunyuanLatentVideo",
              "inputs": {"width": 64, "height": 64, "length": 1, "batch_size": 1}},
        "5": ksampler,
        "7": {"class_type": "OffloadReport", "inputs": {"anything": ["5", 0]}},
    }
    browser.open_sidebar_tab(driver, TAB)
    entry = server.wait(server.queue(wf), timeout=600)
    assert entry.get("status", {}).get("status_str") == "success", entry.get("status")
    browser.wait_for(lambda: q(driver, row_css(UNET_MD)), 30, "the two-device model's row")
    rep = report_model(server, UNET_MD)
    assert list(rep["devices"]) == ["sim:0", "sim:1"] and rep["devices"]["sim:1"]["resident_blocks"] > 0, rep
    budget = server.get_json("/layer_offload/report")["budget"]
    assert budget["devices"]["sim:1"]["total_bytes"] == 20 << 20, budget["devices"]

    bars = browser.wait_for(lambda: q(driver, "[data-lo-devices] [data-lo-device-bar]"), 10, "the device bars")
    assert [b.get_attribute("data-lo-device-bar") for b in bars] == ["sim:0", "sim:1"]
    assert int(bars[1].get_attribute("data-lo-total")) == 20 << 20
    assert int(bars[0].get_attribute("data-lo-total")) == budget["total_bytes"]
    assert all(b.size["width"] > 100 for b in bars), [b.size for b in bars]
    legend = [e.get_attribute("data-lo-legend-device") for e in q(driver, "[data-lo-legend-device]")]
    assert legend == ["sim:0", "sim:1"], legend
    listed = [e.get_attribute("data-lo-model-device") for e in q(driver, row_css(UNET_MD) + " [data-lo-model-device]")]
    assert listed == ["sim:0", "sim:1"], listed
    marks = q(driver, row_css(UNET_MD) + ' [data-lo-chart="blocks"] [data-lo-block]')
    assert [m.get_attribute("data-lo-device") for m in marks] == [b["device"] for b in rep["blocks"]]
    assert "sim:1" in [m.get_attribute("data-lo-device") for m in marks]
    # the single-device models' rows stay as they were: no device list
    assert not q(driver, row_css(UNET) + " [data-lo-model-device]")
    driver.execute_script("const r = document.querySelector(arguments[0]); r && r.scrollIntoView();", row_css(UNET_MD))
    shot = str(tmp_path / "panel_devices.png")  # LO_PANEL_DEVICES_PNG=path writes a copy
    assert driver.save_screenshot(shot) and os.path.getsize(shot) > 10000
    if os.environ.get("LO_PANEL_DEVICES_PNG"):
        shutil.copyfile(shot, os.environ["LO_PANEL_DEVICES_PNG"])
    console += browser.console_entries(driver)
    ours = browser.errors_from(console, OURS)
    assert not [m for m in ours if not ("/api/layer_offload/" in m and "status of 400" in m)], "\n".join(ours)


def read_attrs(driver, css: str, key: str, *attrs: str) -> dict:
    """{element's `key` attribute: (text, *attrs)} of every element matching css, read in the page in one go (no
    stale element while the panel re-renders)."""
    return driver.execute_script(
        "const out = {}; for (const e of document.querySelectorAll(arguments[0])) "
        "out[e.getAttribute(arguments[1])] = [e.textContent.trim(), ...arguments[2].map((a) => e.getAttribute(a))];"
        "return out;", css, key, list(attrs))


def test_the_canvas_is_planned_in_the_panel(page, tmp_path):
    """The Wan 2.1 example workflow loaded onto the canvas: the panel plans it (POST /layer_offload/plan) on the
    card ComfyUI runs on and shows each model's figures and the run's; choosing a card plans it again on that card;
    a change on the canvas re-plans it by itself; nothing is loaded."""
    import json

    server, driver = page
    console = browser.console_entries(driver)
    before = [m["name"] for m in server.get_json("/layer_offload/report")["models"]]
    with open(EXAMPLE) as f:
        workflow = json.load(f)
    driver.execute_script("return Promise.resolve(window.app.loadGraphData(arguments[0])).then(() => true);", workflow)
    browser.open_sidebar_tab(driver, TAB)
    browser.wait_for(lambda: q(driver, '[data-lo-plan] button[data-lo-control="plan"]'), 30, "the button")
    driver.execute_script("document.querySelector('[data-lo-plan] button[data-lo-control=\"plan\"]').click();")

    def plan_rows():
        if not q(driver, '[data-lo-plan][data-lo-plan-state="done"]'):
            return None
        return read_attrs(driver, "[data-lo-plan] [data-lo-plan-model]", "data-lo-plan-model")

    rows = browser.wait_for(plan_rows, 60, "the plan's rows")
    assert set(rows) == {"2", "4", "10"}, rows  # the loaders: diffusion model, CLIP, VAE

    def cells(key):
        found = read_attrs(driver, '[data-lo-plan-model="{}"] [data-lo-plan-cell]'.format(key), "data-lo-plan-cell")
        return {k: v[0] for k, v in found.items()}

    diffusion = cells("2")
    assert diffusion["fits"] == "yes" and diffusion["preset"] == "consumer", diffusion
    assert diffusion["time"].endswith("x 30"), diffusion  # 30 steps, cond and uncond in one batch (cfg 6)
    assert diffusion["vram"].endswith(("MB", "GB")) and diffusion["ram"].endswith(("MB", "GB")), diffusion
    assert cells("4")["preset"] == "budget", cells("4")  # Offload CLIP's preset
    run = read_attrs(driver, "[data-lo-plan] [data-lo-plan-run]", "data-lo-plan-run", "data-lo-value")
    assert set(run) == {"fits", "total", "peak_vram", "ram", "ram_free", "disk"}, run
    assert run["fits"][0] in ("yes", "no")
    for key in ("total", "peak_vram", "ram", "ram_free"):
        assert float(run[key][1]) > 0, (key, run[key])
    assert "sim (" in q(driver, "[data-lo-plan]")[0].text
    total_here = float(run["total"][1])

    # another card, chosen by name: planned again on it
    driver.execute_script("const s = document.querySelector('select[data-lo-control=\"plan-card\"]');"
                          "s.value = 'rtx3060-12gb'; s.dispatchEvent(new Event('change'));")
    browser.wait_for(lambda: "on rtx3060-12gb" in driver.execute_script(
        "const e = document.querySelector('[data-lo-plan][data-lo-plan-state=\"done\"]');"
        "return e ? e.textContent : '';"), 60, "the plan on the RTX 3060")
    run = read_attrs(driver, "[data-lo-plan] [data-lo-plan-run]", "data-lo-plan-run", "data-lo-value")
    assert float(run["total"][1]) != total_here

    # a change on the canvas (20 steps instead of 30) is planned again without a click
    driver.execute_script("const n = window.app.graph.getNodeById(9);"
                          "const w = n.widgets.find((x) => x.name === 'steps'); w.value = 20;"
                          "window.app.graph.setDirtyCanvas(true, true);")
    browser.wait_for(lambda: cells("2").get("time", "").endswith("x 20"), 60, "the plan of 20 steps")

    shot = str(tmp_path / "panel_plan_card.png")
    driver.execute_script("const r = document.querySelector('[data-lo-plan]'); r && r.scrollIntoView();")
    assert driver.save_screenshot(shot) and os.path.getsize(shot) > 10000
    # nothing loaded: the report lists the same models as before
    assert [m["name"] for m in server.get_json("/layer_offload/report")["models"]] == before
    console += browser.console_entries(driver)
    ours = browser.errors_from(console, OURS)
    assert not ours, "\n".join(ours)


def test_after_a_run_the_panel_shows_the_plan_beside_the_measured_figures(page, tmp_path):
    """A prompt with an Offload Report node: the report node plans the prompt it ran in and the panel shows the
    workflow's planned and measured time, peak VRAM and host RAM side by side. Under --cpu the plan prices the
    simulated device at a table card's speeds while the CPU computes: the times are shown with why they do not
    compare, never flagged in red as a wrong plan. The screenshot (LO_PANEL_PLAN_PNG=path writes a copy, the
    README's docs/images/panel_plan.png) has both sections planned for the device the run is on."""
    import json

    server, driver = page
    browser.open_sidebar_tab(driver, TAB)
    entry = server.wait(server.queue(prompt(seed=8)), timeout=600)
    assert entry.get("status", {}).get("status_str") == "success", entry.get("status")
    texts = cs.ui_texts(entry, "7")
    assert texts and "Workflow plan on sim (" in texts[0] and "time: planned" in texts[0], texts
    w = server.get_json("/layer_offload/report")["workflow"]
    assert {r["name"] for r in w["models"]} == {UNET, UNET_HI}, w["models"]

    def figures():
        found = read_attrs(driver, "[data-lo-workflow] [data-lo-workflow-figure]", "data-lo-workflow-figure",
                           "data-lo-planned", "data-lo-measured")
        names = list(read_attrs(driver, "[data-lo-workflow-model]", "data-lo-workflow-model"))
        return (found, names) if UNET in names and UNET_HI in names else None

    found, names = browser.wait_for(figures, 30, "the plan beside the run of both models")
    assert set(found) == {"time", "peak_vram", "host", "disk"}, found
    for key in ("time", "peak_vram", "host"):
        assert float(found[key][1]) > 0 and float(found[key][2]) > 0, (key, found[key])
        assert "planned" in found[key][0] and "measured" in found[key][0], found[key][0]
    assert float(found["time"][2]) == pytest.approx(w["time_ms"]["measured"])
    assert w["times_note"] and "simulated device computes on the CPU" in w["times_note"], w
    note = q(driver, '[data-lo-workflow] [data-lo-workflow-note="times"]')
    assert note and "simulated device" in note[0].text, [n.text for n in note]
    assert not q(driver, '[data-lo-workflow-figure="time"] .lo-stall')  # not flagged as a plan that was wrong
    assert any("times: the simulated device" in t for t in texts), texts

    # the canvas (the Wan 2.1 example) planned on this process's device, the run's: the screenshot
    with open(EXAMPLE) as f:
        workflow = json.load(f)
    driver.execute_script("return Promise.resolve(window.app.loadGraphData(arguments[0])).then(() => true);", workflow)
    driver.execute_script("const s = document.querySelector('select[data-lo-control=\"plan-card\"]');"
                          "if (s) { s.value = ''; s.dispatchEvent(new Event('change')); }"
                          "const b = document.querySelector('[data-lo-plan] button[data-lo-control=\"plan\"]');"
                          "if (b) b.click();")
    browser.wait_for(lambda: "on sim (" in driver.execute_script(
        "const e = document.querySelector('[data-lo-plan][data-lo-plan-state=\"done\"]');"
        "return e ? e.textContent : '';"), 60, "the canvas planned on the simulated device")
    shot = str(tmp_path / "panel_plan.png")
    driver.execute_script("const r = document.querySelector('[data-lo-plan]'); r && r.scrollIntoView();")
    assert driver.save_screenshot(shot) and os.path.getsize(shot) > 10000
    if os.environ.get("LO_PANEL_PLAN_PNG"):
        shutil.copyfile(shot, os.environ["LO_PANEL_PLAN_PNG"])
