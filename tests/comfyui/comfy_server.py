"""Start a real ComfyUI server on 127.0.0.1 for the integration tests, queue API prompts, read history.

The server runs with --cpu and --base-directory pointing at a temporary folder that holds
custom_nodes/<hyphenated name> (a symlink to this repository), the test-only nodes and the tiny models.
Everything is bounded in time; the process is always stopped. Timeouts here guard against a hang only: they are
generous for a loaded machine, and no test's verdict rests on how long something took.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from typing import Any, Dict, List, Optional

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MISSING_MODULE = re.compile(r"ModuleNotFoundError: No module named '([^']+)'")
PACK_FOLDER = "layer-offload-under-test"  # hyphenated on purpose: the pack must use relative imports only


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare_base_dir(base: str) -> Dict[str, str]:
    """Lay out a ComfyUI base directory with the pack, the test nodes and the model folders."""
    paths = {
        "custom_nodes": os.path.join(base, "custom_nodes"),
        "diffusion_models": os.path.join(base, "models", "diffusion_models"),
        "tts": os.path.join(base, "models", "tts"),
        "loras": os.path.join(base, "models", "loras"),
        "output": os.path.join(base, "output"),
        "input": os.path.join(base, "input"),
        "temp": os.path.join(base, "temp"),
        "user": os.path.join(base, "user"),
    }
    for p in paths.values():
        os.makedirs(p, exist_ok=True)
    link = os.path.join(paths["custom_nodes"], PACK_FOLDER)
    if not os.path.exists(link):
        os.symlink(REPO_ROOT, link, target_is_directory=True)
    testnodes = os.path.join(paths["custom_nodes"], "layer_offload_testnodes")
    if not os.path.exists(testnodes):
        shutil.copytree(os.path.join(os.path.dirname(os.path.abspath(__file__)), "testnodes"), testnodes)
    return paths


class ComfyServer:
    """One ComfyUI process; use as a context manager."""

    def __init__(self, comfy_path: str, base_dir: str, python: Optional[str] = None,
                 startup_timeout: float = 600.0) -> None:
        self.comfy_path = comfy_path
        self.base_dir = base_dir
        self.python = python or sys.executable
        self.port = free_port()
        self.url = "http://127.0.0.1:{}".format(self.port)
        self.startup_timeout = startup_timeout
        self.log_path = os.path.join(base_dir, "comfyui.log")
        self.proc: Optional[subprocess.Popen] = None
        self.client_id = uuid.uuid4().hex
        self.extra_env: Dict[str, str] = {}  # set before start(): this server's own environment variables
        self.extra_args: List[str] = []  # set before start(): more command-line arguments (e.g. --cache-ram)

    def __enter__(self) -> "ComfyServer":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def entry_point(self) -> List[str]:
        """How to start this ComfyUI: `main.py`, or the pip-installable fork's module (its main.py ignores
        --base-directory for custom nodes)."""
        if os.path.isfile(os.path.join(self.comfy_path, "comfy", "cmd", "main.py")):
            return [self.python, "-m", "comfy.cmd.main"]
        return [self.python, "main.py"]

    def start(self) -> None:
        cmd = self.entry_point() + ["--cpu", "--listen", "127.0.0.1", "--port", str(self.port),
               "--base-directory", self.base_dir, "--disable-auto-launch", "--disable-metadata",
               "--database-url", "sqlite:///" + os.path.join(self.base_dir, "user", "comfyui.db")] + self.extra_args
        env = dict(os.environ)
        env.pop("COMFYUI_PATH", None)
        env["PYTHONUNBUFFERED"] = "1"
        env.update(self.extra_env)
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=self.comfy_path, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_tail()
                self._log.close()
                missing = MISSING_MODULE.search(tail)
                if missing:  # this python lacks ComfyUI's requirements: skip like the in-process tests do
                    import pytest

                    pytest.skip("{} cannot run ComfyUI at {}: no module named {!r} (install ComfyUI's requirements "
                                "into it, see docs/development.md, 'Running the ComfyUI tests')".format(
                                    self.python, self.comfy_path, missing.group(1)))
                raise RuntimeError("ComfyUI exited during startup (rc={}):\n{}".format(self.proc.returncode, tail))
            try:
                self.get_json("/system_stats", timeout=2)
                return
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.5)
        self.stop()
        raise RuntimeError("ComfyUI did not start within {}s:\n{}".format(self.startup_timeout, self.log_tail()))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
        if getattr(self, "_log", None) is not None:
            self._log.close()
            self._log = None

    def log_tail(self, n: int = 6000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                data = f.read()
            return data[-n:].decode("utf-8", "replace")
        except OSError:
            return ""

    def get_json(self, path: str, timeout: float = 120) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
            return json.loads(r.read().decode("utf-8"))

    def post_json(self, path: str, payload: Any, timeout: float = 120) -> Any:
        req = urllib.request.Request(self.url + path, data=json.dumps(payload).encode("utf-8"),
                                     headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                body = r.read().decode("utf-8")
        except urllib.error.HTTPError as e:
            raise RuntimeError("POST {} -> {}: {}".format(path, e.code, e.read().decode("utf-8", "replace")))
        return json.loads(body) if body else None

    def queue(self, prompt: Dict[str, Any]) -> str:
        """Queue an API-format prompt; return its id."""
        resp = self.post_json("/prompt", {"prompt": prompt, "client_id": self.client_id})
        if resp.get("node_errors"):
            raise RuntimeError("prompt rejected: {}".format(resp["node_errors"]))
        return resp["prompt_id"]

    def wait(self, prompt_id: str, timeout: float = 600.0) -> Dict[str, Any]:
        """Wait for a prompt's history entry, whatever its status."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            entry = self.get_json("/history/{}".format(prompt_id)).get(prompt_id)
            if entry is not None:
                return entry
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError("ComfyUI died:\n" + self.log_tail())
            time.sleep(0.1)
        raise RuntimeError("prompt {} did not finish in {}s\n{}".format(prompt_id, timeout, self.log_tail()))

    def is_running(self, prompt_id: str) -> bool:
        """Whether the prompt is running now (/queue lists [number, id, ...], or dicts with a prompt_id)."""
        def pid(item: Any) -> Any:
            return item.get("prompt_id") if isinstance(item, dict) else item[1]

        return any(pid(item) == prompt_id for item in self.get_json("/queue").get("queue_running", []))

    def interrupt(self) -> None:
        self.post_json("/interrupt", {})

    def run_prompt(self, prompt: Dict[str, Any], timeout: float = 600.0) -> Dict[str, Any]:
        """Queue an API-format prompt and wait for its history entry; raise with the log on error."""
        resp = self.post_json("/prompt", {"prompt": prompt, "client_id": self.client_id})
        if resp.get("node_errors"):
            raise RuntimeError("prompt rejected: {}".format(resp["node_errors"]))
        pid = resp["prompt_id"]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hist = self.get_json("/history/{}".format(pid))
            entry = hist.get(pid)
            if entry is not None:
                status = entry.get("status", {})
                if status.get("status_str") == "error" or not status.get("completed", True):
                    raise RuntimeError("prompt failed: {}\n{}".format(json.dumps(status.get("messages"))[-4000:], self.log_tail()))
                return entry
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError("ComfyUI died:\n" + self.log_tail())
            time.sleep(0.2)
        raise RuntimeError("prompt {} did not finish in {}s\n{}".format(pid, timeout, self.log_tail()))


def ui_texts(entry: Dict[str, Any], node_id: str) -> List[str]:
    """The UI 'text' list an output node returned in a history entry."""
    return list(entry.get("outputs", {}).get(node_id, {}).get("text", []))


class WsEvents:
    """Events of the given types the server sends this client over /ws, collected on a background thread while the
    context is open (aiohttp, a ComfyUI dependency); `wait_for` blocks until one matches (bounded: a hang guard)."""

    def __init__(self, server: ComfyServer, types: tuple) -> None:
        self.url = server.url.replace("http://", "ws://") + "/ws?clientId=" + server.client_id
        self.types = set(types)
        self.events: List[Dict[str, Any]] = []
        self._seen = threading.Condition()
        self._ready = threading.Event()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import asyncio

        import aiohttp

        async def listen() -> None:
            async with aiohttp.ClientSession() as session:
                async with session.ws_connect(self.url) as ws:
                    self._ready.set()
                    while not self._closed.is_set():
                        try:
                            msg = await ws.receive(timeout=0.5)
                        except asyncio.TimeoutError:
                            continue
                        if msg.type != aiohttp.WSMsgType.TEXT:
                            if msg.type in (aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR):
                                return
                            continue
                        data = json.loads(msg.data)
                        if data.get("type") in self.types:
                            with self._seen:
                                self.events.append(dict(data.get("data") or {}, type=data.get("type")))
                                self._seen.notify_all()

        try:
            asyncio.run(listen())
        finally:
            self._ready.set()

    def wait_for(self, match: Any, timeout: float = 600.0) -> Optional[Dict[str, Any]]:
        """The first event `match(event)` accepts, waiting for it; None after `timeout` (a hang guard)."""
        deadline = time.monotonic() + timeout
        with self._seen:
            while True:
                found = next((e for e in self.events if match(e)), None)
                left = deadline - time.monotonic()
                if found is not None or left <= 0 or not self._thread.is_alive():
                    return found
                self._seen.wait(min(left, 1.0))

    def __enter__(self) -> "WsEvents":
        self._thread.start()
        self._ready.wait(300)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._closed.set()
        self._thread.join(300)
