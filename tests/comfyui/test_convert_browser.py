""""Offload this workflow" in a real ComfyUI frontend (headless Chromium, selenium): ComfyUI's own Wan templates
(the second built from a subgraph holding both experts and the text encoder; a third made of two nested subgraphs by
the frontend's own Convert to Subgraph) are loaded onto the canvas, and
- the Layer Offload panel's button converts them with the frontend's graph API: the pack's nodes are in the graph,
  inside the subgraphs too (the canvas opened into the innermost shows them), and the graph the frontend serializes
  passes the same checks as the command line's output (tests/convert_checks.py);
- Ctrl+Z (ComfyUI's undo) gives back the original graph, prompt for prompt;
- `python -m offload convert` of the saved workflow, opened on the canvas, shows the pack's nodes inside the
  subgraphs and makes the panel's prompt but for the presets (the route's conversion makes it exactly);
- run on the server with tiny models under the templates' file names, the original, the panel's conversion and the
  command line's give the same latent bit for bit, the models offloaded;
- no console error from the extension.
Screenshots go to pytest's tmp dir (LO_CONVERT_PNG=path writes a copy of the subgraph's).
"""
from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import comfy_available, load_tests_module, skip_reason

if not comfy_available():
    pytest.skip(skip_reason(), allow_module_level=True)

import browser  # noqa: E402
import comfy_server as cs  # noqa: E402
import convert_runs as cr  # noqa: E402

CHROMIUM, CHROMEDRIVER, MISSING = browser.find_chromium()
if MISSING:
    pytest.skip(MISSING, allow_module_level=True)

checks = load_tests_module("convert_checks.py")
TAB = "layer-offload"
OURS = (cs.PACK_FOLDER, "layer_offload", "Layer Offload", "LayerOffload", "offload_convert")


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("comfy_convert_browser"))
    paths = cs.prepare_base_dir(base)
    cr.write_models(paths)
    server = browser.BrowserServer(os.environ["COMFYUI_PATH"], base, startup_timeout=120)
    server.seed_settings()
    server.start()
    with browser.app_page(server, CHROMIUM, CHROMEDRIVER) as driver:
        server.info = server.get_json("/object_info")
        yield server, driver


def load(driver, wf) -> None:
    driver.execute_script("return Promise.resolve(window.app.loadGraphData(arguments[0])).then(() => true);", wf)


def serialized(driver) -> dict:
    """The workflow as ComfyUI saves it (JSON.stringify of serialize(): a field left undefined is left out; handed
    over by WebDriver as it is, it would come back as null, and a frontend 1.58 load stops at `floatingLinks: null`)."""
    return driver.execute_script("const a = window.app;"
                                 "return JSON.parse(JSON.stringify((a.rootGraph || a.graph).serialize()));")


def prompt_of(driver) -> dict:
    """The API prompt the frontend makes of the canvas (its `_meta` titles left out: they are for people)."""
    out = driver.execute_script("return window.app.graphToPrompt().then((p) => p.output);")
    return {k: {"class_type": v["class_type"], "inputs": v["inputs"]} for k, v in out.items()}


def convert_state(driver) -> str:
    return driver.execute_script("const e = document.querySelector('[data-lo-convert]');"
                                 "return e ? e.getAttribute('data-lo-convert-state') : null;")


def undo(driver) -> None:
    """Ctrl+Z as a user presses it, with nothing focused (ComfyUI ignores it in text fields), a frame between the key
    events as between a person's: the frontend handles a keydown in the next animation frame, and a keyup that comes
    before the Z's frame but after the Control's makes it record the graph first (frontend 1.27's ChangeTracker.init;
    with the four events at once on a busy machine, one Ctrl+Z then took back only what drawing had changed)."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys

    driver.execute_script("document.activeElement && document.activeElement.blur && document.activeElement.blur();")
    driver.set_script_timeout(60)
    for step in (lambda a: a.key_down(Keys.CONTROL), lambda a: a.key_down("z"), lambda a: a.key_up("z"),
                 lambda a: a.key_up(Keys.CONTROL)):
        step(ActionChains(driver)).perform()
        driver.execute_async_script("const done = arguments[arguments.length - 1];"
                                    "requestAnimationFrame(() => requestAnimationFrame(() => done(true)));")


TRACKER = """const a = window.app, t = a.extensionManager?.workflow?.activeWorkflow?.changeTracker;
return {undo: t?.undoQueue?.length, redo: t?.redoQueue?.length, active: document.activeElement?.tagName,
        graph: a.canvas?.graph === (a.rootGraph || a.graph)};"""


def presets_of(api: dict) -> dict:
    return {k: n["inputs"]["preset"] for k, n in api.items()
            if str(n["class_type"]).startswith("Offload") and n["class_type"] != "OffloadVramBudget"}


def without_presets(api: dict) -> dict:
    return {k: dict(n, inputs={i: v for i, v in n["inputs"].items() if i != "preset" or k not in presets_of(api)})
            for k, n in api.items()}


def same_but_new_ids(a: dict, b: dict) -> bool:
    """Two prompts alike but for the ids of the nodes a conversion added (the frontend numbers them from its own
    counters): each node of one has a node of the other of its class with the same inputs, links by class."""
    def shape(api):
        def value(v):
            return ("link", api[v[0]]["class_type"], v[1]) if isinstance(v, list) and len(v) == 2 and v[0] in api else v
        return sorted(json.dumps([n["class_type"], {k: value(v) for k, v in sorted(n["inputs"].items())}])
                      for n in api.values())

    return shape(a) == shape(b)


def show_innermost_subgraph(driver, shot: str) -> None:
    """The canvas opened into the subgraph, and the subgraph inside it where there is one, as a user double-clicks
    into them: the pack's nodes are among the nodes it shows (a screenshot to `shot`); then back to the root."""
    shown = driver.execute_script(
        "const a = window.app, root = a.rootGraph || a.graph;"
        "let g = root, inst;"
        "while ((inst = g.nodes.find((n) => n.isSubgraphNode && n.isSubgraphNode()))) {"
        "  a.canvas.openSubgraph(inst.subgraph); g = inst.subgraph; }"
        "a.canvas.setDirty(true, true);"
        "return a.canvas.graph.nodes.map((n) => n.type);")
    assert "OffloadDiffusionModelLoader" in shown and "OffloadCLIP" in shown, shown
    driver.execute_script("const a = window.app; a.canvas.ds.scale = 0.45; a.canvas.ds.offset = [900, 500];"
                          "a.canvas.setDirty(true, true);")
    assert driver.save_screenshot(shot) and os.path.getsize(shot) > 10000
    driver.execute_script("const a = window.app; a.canvas.setGraph(a.rootGraph || a.graph);")


def subgraph_nodes(wf: dict) -> dict:
    return {s["id"]: sorted(n["type"] for n in s["nodes"]) for s in (wf.get("definitions") or {}).get("subgraphs", [])}


# text_to_video_wan made into nested subgraphs by the frontend itself (Convert to Subgraph, twice): the diffusion
# model, its ModelSamplingSD3 and the text encoder inside "inner", inner and both text encodes inside "outer"; the
# text encoder's CLIP leaves inner through its output, the MODEL both subgraphs' outputs
NESTED = "text_to_video_wan+nested"
MAKE_NESTED = """
const a = window.app, root = a.rootGraph || a.graph;
const pick = (...ids) => new Set(ids.map((id) => root.getNodeById(id)));
const inner = root.convertToSubgraph(pick(37, 48, 38));
root.convertToSubgraph(new Set([inner.node, root.getNodeById(6), root.getNodeById(7)]));
a.canvas.setDirty(true, true);
return root.subgraphs.size;
"""


@pytest.mark.parametrize("name", [*cr.TEMPLATES, NESTED])
def test_offload_this_workflow(page, name, tmp_path):
    server, driver = page
    wf = cr.template(name.split("+")[0])
    screenshot = "convert_{}.png".format(name.replace("+", "_"))
    if wf is None:
        pytest.skip("ComfyUI's templates are not installed ({}: `make env` installs them into .venv)".format(cr.PINNED))
    from offload.predict.workflow_read import flatten

    missing = sorted({n["class_type"] for n in cr.runnable(flatten(wf).api()).values()} - set(server.info))
    if missing:  # nodes only the parts the run leaves out use (a frame count's math) may be missing
        pytest.skip("this ComfyUI lacks the template's nodes {}".format(missing))
    console = browser.console_entries(driver)
    load(driver, copy.deepcopy(wf))
    if name == NESTED:
        assert driver.execute_script(MAKE_NESTED) == 2
        load(driver, serialized(driver))  # a fresh start from the saved form (no undo step before the conversion)
    original = serialized(driver)
    api_original = prompt_of(driver)
    assert not any(str(n["class_type"]).startswith("Offload") for n in api_original.values())

    # the panel's button
    browser.open_sidebar_tab(driver, TAB)
    browser.wait_for(lambda: driver.find_elements("css selector", 'button[data-lo-control="convert"]'), 30,
                     "the Offload this workflow button")
    dialogs = driver.execute_script("return [...document.querySelectorAll('[role=dialog]')].map((d) => d.textContent"
                                    ".slice(0, 300));")
    assert not dialogs, dialogs  # nothing in front of the canvas (a dialog a load opened)
    driver.execute_script("document.querySelector('button[data-lo-control=\"convert\"]').click();")
    browser.wait_for(lambda: convert_state(driver) in ("done", "error"), 60, "the conversion")
    error = driver.execute_script("return document.querySelector('[data-lo-convert-error]').textContent;")
    assert convert_state(driver) == "done", error
    edits = int(driver.execute_script("return document.querySelector('[data-lo-convert-result]')"
                                      ".getAttribute('data-lo-edits');"))
    assert edits > 0
    converted = serialized(driver)
    api_panel = prompt_of(driver)
    done = checks.check_conversion(original, converted)
    assert done and any(n["class_type"] == "OffloadDiffusionModelLoader" for n in api_panel.values())
    assert any(n["class_type"] == "OffloadVramBudget" for n in api_panel.values())
    assert checks.without_offload(api_panel) == api_original
    for sid, kinds in subgraph_nodes(converted).items():  # the pack's nodes inside the subgraphs
        before = subgraph_nodes(original)[sid]
        if "UNETLoader" in before:
            assert "OffloadDiffusionModelLoader" in kinds and "UNETLoader" not in kinds, kinds
        if "CLIPLoader" in before:
            assert "OffloadCLIP" in kinds, kinds
    if name == NESTED:  # the budget reaches the inner subgraph through both subgraphs' new inputs
        assert [[i["type"] for i in s["inputs"]][-1:] for s in converted["definitions"]["subgraphs"]] == \
            [["OFFLOAD_BUDGET"], ["OFFLOAD_BUDGET"]]
    if subgraph_nodes(converted):  # and the canvas opened into the subgraph (the innermost) shows them
        show_innermost_subgraph(driver, str(tmp_path / screenshot))
        if os.environ.get("LO_CONVERT_PNG") and name == cr.TEMPLATES[-1]:
            shutil.copyfile(str(tmp_path / screenshot), os.environ["LO_CONVERT_PNG"])

    # ComfyUI's undo takes the whole conversion back in one step
    undo(driver)
    try:
        browser.wait_for(lambda: prompt_of(driver) == api_original, 30, "Ctrl+Z to restore the original graph")
    except AssertionError as e:
        now = prompt_of(driver)
        pytest.fail("{}: now like the conversion: {}; differing nodes: {}; tracker: {}".format(
            e, now == api_panel, sorted(k for k in set(now) | set(api_original) if now.get(k) != api_original.get(k)),
            driver.execute_script(TRACKER)))
    restored = serialized(driver)
    assert sorted(n["type"] for n in restored["nodes"]) == sorted(n["type"] for n in original["nodes"])
    assert subgraph_nodes(restored) == subgraph_nodes(original)

    # `python -m offload convert` on the saved workflow (every block streamed), opened on the canvas: the pack's
    # nodes inside the subgraphs, the prompt the panel's but for the presets, the command line's the route's
    src, out = tmp_path / "original.json", tmp_path / "converted.json"
    src.write_text(json.dumps(original))
    cli = subprocess.run([sys.executable, "-m", "offload", "convert", str(src), "-o", str(out), "--preset", "budget"],
                         cwd=cs.REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0 and "wrote" in cli.stdout, cli.stdout + cli.stderr
    from_cli = json.loads(out.read_text())
    checks.check_conversion(original, from_cli)
    load(driver, from_cli)
    loaded = serialized(driver)
    try:
        assert checks.check_conversion(original, loaded)  # as the frontend loaded it
    except AssertionError as e:
        inst = [n for n in from_cli["nodes"] if n["type"] in {s["id"] for s in from_cli["definitions"]["subgraphs"]}]
        back = [n for n in loaded["nodes"] if n["id"] in {i["id"] for i in inst}]
        pytest.fail("the command line's output as the frontend loaded it: {}\nwritten: {}\nloaded: {}\n"
                    "console: {}".format(e, json.dumps(inst)[:3000], json.dumps(back)[:3000],
                                         [c.get("message", "")[:300] for c in browser.console_entries(driver)][-8:]))
    if subgraph_nodes(from_cli):
        show_innermost_subgraph(driver, str(tmp_path / ("cli_" + screenshot)))
    api_cli = prompt_of(driver)
    assert presets_of(api_cli) and set(presets_of(api_cli).values()) == {"budget"}
    assert checks.without_offload(api_cli) == api_original
    assert same_but_new_ids(without_presets(api_cli), without_presets(api_panel))
    answer = server.post_json("/layer_offload/convert", {"workflow": original}, timeout=60)
    load(driver, answer["workflow"])
    assert prompt_of(driver) == api_panel

    # run: the original, the panel's and the command line's conversions give the same latent
    plain = cr.run_hash(server, cr.runnable(api_original))
    assert cr.run_hash(server, cr.runnable(api_panel)) == plain
    assert cr.run_hash(server, cr.runnable(api_cli)) == plain
    names = {m["name"] for m in server.get_json("/layer_offload/report")["models"]}
    unets = {n["inputs"]["unet_name"] for n in api_panel.values() if n["class_type"] == "OffloadDiffusionModelLoader"}
    assert unets <= names, names

    console += browser.console_entries(driver)
    ours = browser.errors_from(console, OURS)
    assert not ours, "\n".join(ours)


def test_an_offloaded_workflow_has_nothing_to_change(page):
    """The pack's own example workflow: the button says so, and changes nothing (no undo step either)."""
    import json

    server, driver = page
    with open(os.path.join(cs.REPO_ROOT, "example_workflows", "wan2.1_t2v_layer_offload.json")) as f:
        wf = json.load(f)
    load(driver, wf)
    before = prompt_of(driver)
    browser.open_sidebar_tab(driver, TAB)
    driver.execute_script("document.querySelector('button[data-lo-control=\"convert\"]').click();")
    browser.wait_for(lambda: driver.execute_script(
        "const e = document.querySelector('[data-lo-convert-result]');"
        "return e && e.getAttribute('data-lo-edits') === '0' && e.textContent;"), 60, "the 'nothing to change' line")
    assert "Nothing to change" in driver.find_element("css selector", "[data-lo-convert-result]").text
    assert prompt_of(driver) == before


APPLY_FROM_MODULE = """
const done = arguments[arguments.length - 1];
import(arguments[1]).then((m) => {
  return Promise.resolve(m.applyEdits(arguments[0])).then(() => done("applied"), (e) => done(String(e.message || e)));
}).catch((e) => done("import: " + e));
"""


@pytest.mark.parametrize("name", [cr.TEMPLATES[-1], NESTED])
def test_a_conversion_that_fails_halfway_leaves_the_graph_as_it_was(page, name):
    """The panel's edits with one at the end that cannot be carried out (a node that is not there): the error names
    it, the graph is the original (the subgraphs' nodes too, nested ones included), and there is no undo step to
    take."""
    server, driver = page
    wf = cr.template(name.split("+")[0])
    if wf is None:
        pytest.skip("ComfyUI's templates are not installed ({})".format(cr.PINNED))
    missing = sorted(set(cr.node_types(wf)) - set(server.info))
    if missing:
        pytest.skip("this ComfyUI lacks the template's nodes {}".format(missing))
    load(driver, copy.deepcopy(wf))
    if name == NESTED:
        assert driver.execute_script(MAKE_NESTED) == 2
        load(driver, serialized(driver))
    original = serialized(driver)
    api_original = prompt_of(driver)
    answer = server.post_json("/layer_offload/convert", {"workflow": original}, timeout=60)
    assert len(answer["edits"]) > 3
    bad = {"op": "link", "graph": "root", "from": {"node": answer["edits"][-1]["to"]["node"], "slot": 0},
           "to": {"node": 987654, "input": "budget"}}
    driver.set_script_timeout(60)
    message = driver.execute_async_script(APPLY_FROM_MODULE, answer["edits"] + [bad],
                                          "/extensions/{}/offload_convert.js".format(cs.PACK_FOLDER))
    assert "987654" in message, message
    assert prompt_of(driver) == api_original
    restored = serialized(driver)
    assert sorted(n["type"] for n in restored["nodes"]) == sorted(n["type"] for n in original["nodes"])
    assert subgraph_nodes(restored) == subgraph_nodes(original)
    undo(driver)  # nothing to undo: still the original
    assert prompt_of(driver) == api_original
