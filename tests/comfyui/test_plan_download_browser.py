"""Issue 43 in a real ComfyUI frontend (headless Chromium): the panel plans a workflow whose models are not on the
machine from their headers (parts 2), and the frontend's node help shows the pack's pages (part 4).

The Wan 2.1 example workflow, its three loaders renamed to files no model folder holds, each with the download link a
template carries (`properties.models`) to a loopback server in this process (tests/header_server.py, served as
http://localhost:<port>, one of the frontend's own download sources). The panel's plan lists them as not found and
offers *Plan the download*; the click makes the server read the three headers by range requests (nothing else) and
the plan shows them with the figures the same files on disk give; the download's bytes are each file's size. A later
re-plan reads the server's header cache, not the network. Then the Offload Loader node is selected and the selection
toolbox's info button opens ComfyUI's node help, which renders web/docs/OffloadDiffusionModelLoader.md.

Runs when COMFYUI_PATH is set and selenium, Chromium and chromedriver are installed; skips with the reason otherwise.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest

from conftest import comfy_available, load_tests_module, skip_reason

if not comfy_available():
    pytest.skip(skip_reason(), allow_module_level=True)

import browser  # noqa: E402
import comfy_server as cs  # noqa: E402
import tiny_wan  # noqa: E402

CHROMIUM, CHROMEDRIVER, MISSING = browser.find_chromium()
if MISSING:
    pytest.skip(MISSING, allow_module_level=True)

TAB = "layer-offload"
EXAMPLE = os.path.join(cs.REPO_ROOT, "example_workflows", "wan2.1_t2v_layer_offload.json")
OURS = (cs.PACK_FOLDER, "layer_offload", "Layer Offload", "LayerOffload")
# the example's loaders (node id: the folder of its file), its files, and the names they are served under
LOADERS = {2: "diffusion_models", 4: "text_encoders", 10: "vae"}
LOCAL = {"diffusion_models": "wan2.1_t2v_1.3B_fp16.safetensors",
         "text_encoders": "umt5_xxl_fp8_e4m3fn_scaled.safetensors", "vae": "wan_2.1_vae.safetensors"}
REMOTE = {"diffusion_models": "lo_dl_wan.safetensors", "text_encoders": "lo_dl_umt5.safetensors",
          "vae": "lo_dl_vae.safetensors"}


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    """(ComfyUI server, driver, header server, the served folder): the example's files in the server's model folders
    under their own names, and the same files served by the loopback server under other names."""
    panel = load_tests_module("comfyui/test_panel_browser.py")
    servers = load_tests_module("header_server.py")
    base = str(tmp_path_factory.mktemp("comfy_download"))
    cs.prepare_base_dir(base)
    panel.example_models(base)
    served = tmp_path_factory.mktemp("served")
    for folder, name in LOCAL.items():
        os.link(os.path.join(base, "models", folder, name), str(served / REMOTE[folder]))
    server = browser.BrowserServer(os.environ["COMFYUI_PATH"], base, startup_timeout=120)
    server.extra_env["LAYER_OFFLOAD_CACHE"] = str(tmp_path_factory.mktemp("header_cache"))
    server.seed_settings({"Comfy.Canvas.SelectionToolbox": True})
    with servers.HeaderServer(served) as headers:
        server.start()
        with browser.app_page(server, CHROMIUM, CHROMEDRIVER) as driver:
            yield server, driver, headers, served


def q(driver, css):
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, css)


def read_attrs(driver, css: str, key: str, *attrs: str) -> dict:
    return driver.execute_script(
        "const out = {}; for (const e of document.querySelectorAll(arguments[0])) "
        "out[e.getAttribute(arguments[1])] = [e.textContent.trim(), ...arguments[2].map((a) => e.getAttribute(a))];"
        "return out;", css, key, list(attrs))


def linked_example(headers) -> dict:
    """The example workflow with its loaders' files renamed and linked to the loopback server."""
    with open(EXAMPLE) as f:
        wf = json.load(f)
    for node in wf["nodes"]:
        folder = LOADERS.get(node["id"])
        if folder:
            node["widgets_values"][0] = REMOTE[folder]
            node["properties"]["models"] = [{"name": REMOTE[folder], "directory": folder,
                                             "url": headers.url("files", REMOTE[folder], host="localhost")}]
    return wf


def load(driver, workflow: dict) -> None:
    driver.execute_script("return Promise.resolve(window.app.loadGraphData(arguments[0])).then(() => true);", workflow)


def plan_now(driver) -> None:
    browser.open_sidebar_tab(driver, TAB)
    browser.wait_for(lambda: q(driver, '[data-lo-plan] button[data-lo-control="plan"]'), 30, "the plan button")
    driver.execute_script("document.querySelector('[data-lo-plan] button[data-lo-control=\"plan\"]').click();")


def plan_cells(driver) -> dict:
    """{model key: {cell: text}} of the plan on show, once it is done (None while planning)."""
    if not q(driver, '[data-lo-plan][data-lo-plan-state="done"]'):
        return None
    rows = read_attrs(driver, "[data-lo-plan] [data-lo-plan-model]", "data-lo-plan-model")
    return {key: {k: v[0] for k, v in read_attrs(
        driver, '[data-lo-plan-model="{}"] [data-lo-plan-cell]'.format(key), "data-lo-plan-cell").items()}
        for key in rows}


def test_the_download_is_planned_from_the_headers(page, tmp_path):
    server, driver, headers, served = page
    console = browser.console_entries(driver)
    load(driver, linked_example(headers))
    plan_now(driver)
    cells = browser.wait_for(lambda: (lambda c: c if c and c.get("2", {}).get("fits") == "not found" else None)(
        plan_cells(driver)), 60, "the plan with the models not found")
    assert {k: c["fits"] for k, c in cells.items()} == {"2": "not found", "4": "not found", "10": "not found"}
    offer = browser.wait_for(lambda: q(driver, '[data-lo-download-plan][data-lo-download-state="offer"]'), 10,
                             "the offer to plan the download")
    assert "3 model file(s)" in offer[0].text
    assert not headers.requests(), "nothing is asked before the click"

    driver.execute_script("document.querySelector('button[data-lo-control=\"plan-download\"]').click();")
    browser.wait_for(lambda: q(driver, '[data-lo-download-plan][data-lo-download-state="planned"]')
                     and plan_cells(driver), 60, "the plan from the headers")
    rows = read_attrs(driver, "[data-lo-download]", "data-lo-download", "data-lo-bytes", "data-lo-download-source")
    sizes = {REMOTE[f]: os.path.getsize(str(served / REMOTE[f])) for f in REMOTE}
    assert {k: int(v[1]) for k, v in rows.items()} == sizes, rows
    assert {v[2] for v in rows.values()} == {"network"}
    total = q(driver, "[data-lo-download-total]")[0]
    assert int(total.get_attribute("data-lo-bytes")) == sum(sizes.values())
    assert sorted(r["range"].split("-")[0] for r in headers.requests()) == ["bytes=0"] * 3 + ["bytes=8"] * 3
    assert not q(driver, 'button[data-lo-control="plan-download"]'), "every linked model was planned"
    remote_cells = plan_cells(driver)
    assert all(c["fits"] == "yes" for c in remote_cells.values()), remote_cells
    shot = str(tmp_path / "panel_download.png")  # LO_PANEL_DOWNLOAD_PNG=path writes a copy
    driver.execute_script("const r = document.querySelector('[data-lo-download-plan]'); r && r.scrollIntoView();")
    assert driver.save_screenshot(shot) and os.path.getsize(shot) > 10000
    if os.environ.get("LO_PANEL_DOWNLOAD_PNG"):
        shutil.copyfile(shot, os.environ["LO_PANEL_DOWNLOAD_PNG"])

    # the same files on disk, under the example's own names: the same figures
    with open(EXAMPLE) as f:
        load(driver, json.load(f))
    plan_now(driver)
    local = browser.wait_for(lambda: (lambda c: c if c and c.get("2", {}).get("fits") == "yes" and not q(
        driver, "[data-lo-download-plan]") else None)(plan_cells(driver)), 60, "the plan of the local files")
    assert local == remote_cells

    # back to the linked workflow: re-planned on its own from the header cache, without a request
    asked = len(headers.requests())
    load(driver, linked_example(headers))
    again = browser.wait_for(lambda: (lambda c: c if c and c.get("2", {}).get("fits") == "yes" and q(
        driver, '[data-lo-download-plan][data-lo-download-state="planned"]') else None)(plan_cells(driver)), 60,
        "the re-plan from the header cache")
    assert again == remote_cells and len(headers.requests()) == asked
    sources = read_attrs(driver, "[data-lo-download]", "data-lo-download", "data-lo-download-source")
    assert {v[1] for v in sources.values()} == {"cache"}, sources
    console += browser.console_entries(driver)
    assert not browser.errors_from(console, OURS), "\n".join(browser.errors_from(console, OURS))


def test_node_help_shows_the_pack_page(page, tmp_path):
    server, driver, headers, served = page
    console = browser.console_entries(driver)
    with open(EXAMPLE) as f:
        load(driver, json.load(f))
    driver.execute_script("const s = window.app.extensionManager.setting;"
                          "return Promise.resolve(s && s.set && s.set('Comfy.Canvas.SelectionToolbox', true));")
    driver.execute_script("const c = window.app.canvas, n = window.app.graph.getNodeById(2);"
                          "c.centerOnNode && c.centerOnNode(n); c.deselectAll && c.deselectAll(); c.selectNode(n);"
                          "c.setDirty(true, true);")
    button = browser.wait_for(lambda: [b for b in q(driver, '[data-testid="info-button"]') if b.is_displayed()], 30,
                              "the selection toolbox's info button")[0]
    driver.execute_script("performance.clearResourceTimings(); performance.setResourceTimingBufferSize(5000);")
    driver.execute_script("arguments[0].click();", button)  # as a click on it (the toolbox may sit under a header)

    def help_page():
        return driver.execute_script(
            "for (const e of document.querySelectorAll('.node-help-content')) {"
            "  const h = e.querySelector('h1');"
            "  if (h) return {title: h.textContent.trim(), h2: Array.from(e.querySelectorAll('h2'))"
            "    .map((x) => x.textContent.trim()), code: Array.from(e.querySelectorAll('li > code:first-child'))"
            "    .map((x) => x.textContent.trim())};"
            "} return null;")

    try:
        found = browser.wait_for(help_page, 15, "the node help")
    except AssertionError:  # a frontend whose info button opens the properties panel: its Info tab
        tab = browser.wait_for(lambda: [t for t in q(driver, '[role="tab"]') if t.text.strip() == "Info"], 20,
                               "the properties panel's Info tab")
        tab[0].click()
        found = browser.wait_for(help_page, 30, "the node help in the Info tab")
    assert found["title"] == "Offload Loader (Diffusion Model)", found
    assert found["h2"] == ["Inputs", "Outputs", "Example"], found
    assert found["code"][:7] == ["unet_name", "weight_dtype", "preset", "budget", "priority", "devices",
                                 "host_compression"], found
    requested = driver.execute_script("return performance.getEntriesByType('resource').map((r) => r.name)"
                                      ".filter((n) => n.includes('/docs/'));")
    # where the frontend asks depends on the node's python_module: the pack's folder (upstream), or the core docs'
    # path where ComfyUI gives V3 nodes no module (the 0.12 fork: nodes/node_help.py answers for the pack's ids)
    assert any(n.endswith(("/extensions/{}/docs/OffloadDiffusionModelLoader.md".format(cs.PACK_FOLDER),
                           "/docs/OffloadDiffusionModelLoader/en.md")) for n in requested), requested
    shot = str(tmp_path / "node_help.png")  # LO_NODE_HELP_PNG=path writes a copy
    assert driver.save_screenshot(shot) and os.path.getsize(shot) > 10000
    if os.environ.get("LO_NODE_HELP_PNG"):
        shutil.copyfile(shot, os.environ["LO_NODE_HELP_PNG"])
    console += browser.console_entries(driver)
    # the frontend asks /extensions/<pack>/docs/<node>/<locale>.md first: its 404 is expected (one page, every locale)
    errors = [m for m in browser.errors_from(console, OURS) if not ("/docs/OffloadDiffusionModelLoader/en.md" in m
                                                                     and "404" in m)]
    assert not errors, "\n".join(errors)


def test_the_core_docs_path_answers_for_the_pack_nodes_only(page):
    """GET /docs/<node id>/<locale>.md (where a frontend asks for a core node's help) gives the pack's page for its
    node ids, in any locale, and leaves every other node's docs to ComfyUI."""
    import urllib.error
    import urllib.request

    server = page[0]

    def get(path):
        try:
            with urllib.request.urlopen(server.url + path, timeout=10) as r:
                return r.status, r.read().decode("utf-8", "replace")
        except urllib.error.HTTPError as e:
            return e.code, ""

    with open(os.path.join(cs.REPO_ROOT, "web", "docs", "OffloadModel.md"), encoding="utf-8") as f:
        ours = f.read()
    assert get("/docs/OffloadModel/en.md") == (200, ours)
    assert get("/docs/OffloadModel/zh.md") == (200, ours)
    assert get("/extensions/{}/docs/OffloadModel.md".format(cs.PACK_FOLDER)) == (200, ours)
    status, text = get("/docs/KSampler/en.md")  # ComfyUI's own (embedded docs), not ours
    assert "Offload" not in text and (status == 200 or status == 404)
    assert get("/docs/OffloadModelX/en.md")[0] == 404 and get("/docs/OffloadModel/../../x.md")[0] == 404
