"""Helpers to drive ComfyUI's frontend in headless Chromium (selenium, the system chromium and chromedriver).

See /work/shared/notes/browser-testing.md for what was learned: wait for `window.app` and the side toolbar, seed
the settings so no dialog covers the page, find sidebar tabs by `<id>-tab-button` (a class on frontend 1.2x, a
data-testid on newer ones), filter the frontend's own startup errors out of the console log by source.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import comfy_server as cs

CHROMIUM_CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
DRIVER_CANDIDATES = ("chromedriver",)
SETTINGS = {  # a fresh user directory: no templates dialog, no tour, no release popups over the page
    "Comfy.TutorialCompleted": True,
    "Comfy.InstalledVersion": "99.0.0",
    "Comfy.Release.Version": "99.0.0",
    "Comfy.Release.Status": "changelog seen",
    "Comfy.Release.Timestamp": 4102444800000,
    "Comfy.Validation.Workflows": False,
    "Comfy.Workflow.ShowMissingModelsWarning": False,
    "Comfy.Workflow.ShowMissingNodesWarning": False,
}


def find_chromium() -> Tuple[Optional[str], Optional[str], str]:
    """(chromium binary, chromedriver, reason when either or selenium is missing)."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return None, None, "selenium is not installed in this python (pip install selenium)"
    def pick(env: str, names: Tuple[str, ...]) -> Optional[str]:
        if os.environ.get(env):  # an explicit path must be an executable
            return shutil.which(os.environ[env])
        return next((p for p in map(shutil.which, names) if p), None)

    binary = pick("CHROMIUM", CHROMIUM_CANDIDATES)
    driver = pick("CHROMEDRIVER", DRIVER_CANDIDATES)
    if not binary:
        return None, None, "Chromium is not installed (apt-get install chromium, or set CHROMIUM=/path/to/chromium)"
    if not driver:
        return None, None, ("chromedriver is not installed (apt-get install chromium-driver, or set "
                            "CHROMEDRIVER=/path/to/chromedriver)")
    return binary, driver, ""


class BrowserServer(cs.ComfyServer):
    """A ComfyServer whose user, input, output and temp directories are explicitly the test's own (besides
    --base-directory), so nothing is written into the ComfyUI checkout; the settings are seeded for a clean page."""

    def entry_point(self) -> List[str]:
        extra = []
        for flag, sub in (("--user-directory", "user"), ("--input-directory", "input"),
                          ("--output-directory", "output"), ("--temp-directory", "temp")):
            path = os.path.join(self.base_dir, sub)
            os.makedirs(path, exist_ok=True)
            extra += [flag, path]
        return super().entry_point() + extra

    def seed_settings(self, extra: Optional[Dict[str, Any]] = None) -> None:
        d = os.path.join(self.base_dir, "user", "default")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "comfy.settings.json"), "w") as f:
            json.dump({**SETTINGS, **(extra or {})}, f)


# Shims for the 0.12.1 fork's frontend in this offline test machine, run before the page's own scripts. They touch
# only what would stop the frontend from starting at all (nothing of this pack):
# - the fork serves an extension (comfy_extras/eval_web/eval_python.js) that awaits ace.js from a CDN at import time,
#   with no error handler: without network the frontend waits forever. A stub `window.ace` lets it go on.
# - two of the fork's own nodes (SplitImageWithAlpha, JoinImageWithAlpha) come with "python_module": null in
#   /object_info; frontend 1.5x calls python_module.split() and its setup aborts. The shim fills in "nodes" and
#   lists the names in window.__lo_fixed_defs.
PAGE_SHIMS = r"""
if (!window.ace) {
  const editor = () => ({ setValue() {}, getValue() { return ""; }, setOptions() {}, setTheme() {}, on() {},
    destroy() {}, resize() {}, clearSelection() {}, session: { on() {}, setMode() {}, setValue() {} } });
  window.ace = { config: { set() {} }, edit: editor, require() { return {}; } };
}
(() => {
  const realFetch = window.fetch.bind(window);
  window.__lo_fixed_defs = [];
  window.fetch = async (input, init) => {
    const response = await realFetch(input, init);
    const url = typeof input === "string" ? input : (input && input.url) || "";
    if (!/\/object_info(\?|$)/.test(url) || !response.ok) return response;
    const defs = await response.clone().json();
    for (const [name, def] of Object.entries(defs || {})) {
      if (def && typeof def === "object" && typeof def.python_module !== "string") {
        def.python_module = "nodes";
        window.__lo_fixed_defs.push(name);
      }
    }
    return new Response(JSON.stringify(defs), { status: response.status, headers: response.headers });
  };
})();
"""


def make_driver(binary: str, driver_path: str, width: int = 1400, height: int = 900) -> Any:
    """Headless Chromium with the browser console log readable (get_log('browser')), a viewport of exactly
    width x height, and PAGE_SHIMS run before every page."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size={},{}".format(width, height), "--hide-scrollbars", "--mute-audio",
                "--no-first-run", "--disable-extensions", "--force-device-scale-factor=1"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    drv = webdriver.Chrome(service=Service(executable_path=driver_path), options=opts)
    drv.set_window_size(width, height)
    drv.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                        {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})
    drv.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": PAGE_SHIMS})
    drv.set_script_timeout(300)
    return drv


@contextlib.contextmanager
def app_page(server: "BrowserServer", binary: str, driver_path: str) -> Iterator[Any]:
    """A headless page of the started `server` with the frontend up (the driver); after it, or a failure on the
    way, the driver quits and the server stops."""
    driver = None
    try:
        driver = make_driver(binary, driver_path)
        driver.get(server.url)
        wait_for_app(driver)
        yield driver
    finally:
        if driver is not None:
            driver.quit()
        server.stop()


MIN_WAIT_S = 180.0  # every wait is a guard against a hang, never a bound on speed: at least this long on a loaded box


def wait_for(fn: Callable[[], Any], timeout: float, what: str, interval: float = 0.2) -> Any:
    """Poll until fn() returns something truthy; raise AssertionError naming `what` after `timeout` seconds (at least
    MIN_WAIT_S: what the UI must eventually show may take its time on a busy machine, the test's verdict does not)."""
    timeout = max(timeout, MIN_WAIT_S)
    deadline = time.monotonic() + timeout
    last_exc: Optional[BaseException] = None
    while time.monotonic() < deadline:
        try:
            value = fn()
            if value:
                return value
        except Exception as e:  # noqa: BLE001 - stale elements while the panel re-renders
            last_exc = e
        time.sleep(interval)
    raise AssertionError("timed out after {:.0f}s waiting for {}{}".format(
        timeout, what, " (last error: {!r})".format(last_exc) if last_exc else ""))


def wait_for_app(driver: Any, timeout: float = 300) -> None:
    """`window.app` is set after every extension's setup() ran; the side toolbar is there once the UI is built."""
    wait_for(lambda: driver.execute_script(
        "return !!(window.app && window.app.graph && window.app.extensionManager && "
        "document.querySelector('.side-tool-bar-container, [class*=side-tool-bar], nav'))"), timeout,
        "the ComfyUI frontend to start")


def tab_button(driver: Any, tab_id: str) -> Any:
    from selenium.webdriver.common.by import By

    found = driver.find_elements(By.CSS_SELECTOR, '[data-testid="{0}-tab-button"], .{0}-tab-button'.format(tab_id))
    return found[0] if found else None


def open_sidebar_tab(driver: Any, tab_id: str, timeout: float = 30) -> None:
    """Click the tab's toolbar button (as a user would) unless the tab is open already."""
    def active() -> Any:
        return driver.execute_script(
            "const s = window.app.extensionManager.sidebarTab; return s && s.activeSidebarTabId;")

    if active() == tab_id:
        return
    button = wait_for(lambda: tab_button(driver, tab_id), timeout, "the {} tab button".format(tab_id))
    try:
        button.click()
    except Exception:  # noqa: BLE001 - covered by an overlay: press Escape once and click again
        from selenium.webdriver.common.keys import Keys

        driver.find_element("tag name", "body").send_keys(Keys.ESCAPE)
        button.click()
    wait_for(lambda: active() == tab_id, timeout, "the {} tab to open".format(tab_id))


def browser_client_id(driver: Any) -> Optional[str]:
    """The page's websocket client id: prompts queued with it send their UI outputs to this page."""
    return driver.execute_script("return sessionStorage.getItem('clientId') || window.name || null;")


def console_entries(driver: Any) -> List[Dict[str, Any]]:
    """Every browser console entry since the last call (selenium drains the log)."""
    try:
        return list(driver.get_log("browser"))
    except Exception:  # noqa: BLE001 - a driver without the log endpoint
        return []


def errors_from(entries: List[Dict[str, Any]], needles: Tuple[str, ...]) -> List[str]:
    """SEVERE entries whose message (it holds the source URL and the stack) names one of `needles`."""
    return [e.get("message", "") for e in entries
            if e.get("level") == "SEVERE" and any(n in e.get("message", "") for n in needles)]
