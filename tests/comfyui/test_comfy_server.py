"""End to end: a real ComfyUI server (--cpu) with this repository in custom_nodes under a hyphenated name.

A tiny Wan 2.1-shaped model (width 128, 4 blocks) is written in ComfyUI's key layout; prompts go through
/prompt and /history. The offloaded loader must sample bitwise like UNETLoader, with and without a LoRA,
the report must describe streamed blocks, and runs must repeat. Skipped unless COMFYUI_PATH is set.
"""
from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from typing import Any, Dict, List, Optional

import pytest

from conftest import combo_choices, comfy_available, skip_reason

if not comfy_available():
    pytest.skip(skip_reason(), allow_module_level=True)

import comfy_server as cs  # noqa: E402
import tiny_wan  # noqa: E402

UNET = "tiny_wan.safetensors"
LORA = "tiny_wan_lora.safetensors"
NODE_IDS = ["OffloadDiffusionModelLoader", "OffloadCheckpointLoader", "OffloadModel", "OffloadCLIP", "OffloadAny",
            "OffloadVramBudget", "OffloadReport", "OffloadTTSLoader", "OffloadTTSGenerate"]
PRESETS = ["auto", "high_end", "mid_range", "consumer", "budget"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("comfy_base"))
    paths = cs.prepare_base_dir(base)
    tiny_wan.write_wan(os.path.join(paths["diffusion_models"], UNET))
    tiny_wan.write_lora(os.path.join(paths["loras"], LORA))
    srv = cs.ComfyServer(os.environ["COMFYUI_PATH"], base, startup_timeout=600)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def prompt(loader: Dict[str, Any], seed: int = 3, lora: Optional[float] = None, report: bool = False,
           budget_gb: Optional[float] = None) -> Dict[str, Any]:
    """Loader -> [LoRA] -> KSampler -> latent hash (+ Offload Report after the sampler)."""
    p: Dict[str, Any] = {
        "1": loader,
        "2": {"class_type": "LOTestConditioning", "inputs": {"tokens": 8, "seed": 1}},
        "3": {"class_type": "EmptyHunyuanLatentVideo",
              "inputs": {"width": 64, "height": 64, "length": 1, "batch_size": 1}},
        "5": {"class_type": "KSampler", "inputs": {"model": ["1", 0], "positive": ["2", 0], "negative": ["2", 0],
                                                     "latent_image": ["3", 0], "seed": seed, "steps": 3, "cfg": 1.0,
                                                     "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}},
        "6": {"class_type": "LOTestLatentHash", "inputs": {"samples": ["5", 0]}},
    }
    if lora is not None:
        p["4"] = {"class_type": "LoraLoaderModelOnly",
                  "inputs": {"model": ["1", 0], "lora_name": LORA, "strength_model": lora}}
        p["5"]["inputs"]["model"] = ["4", 0]
    if report:
        p["7"] = {"class_type": "OffloadReport", "inputs": {"anything": ["5", 0]}}
    if budget_gb is not None:
        p["8"] = {"class_type": "OffloadVramBudget", "inputs": {"budget_gb": budget_gb, "preset": "auto"}}
        loader["inputs"]["budget"] = ["8", 0]
    return p


def unet_loader() -> Dict[str, Any]:
    return {"class_type": "UNETLoader", "inputs": {"unet_name": UNET, "weight_dtype": "default"}}


def offload_loader(preset: str = "budget", priority: int = 0) -> Dict[str, Any]:
    return {"class_type": "OffloadDiffusionModelLoader",
            "inputs": {"unet_name": UNET, "weight_dtype": "default", "preset": preset, "priority": priority}}


def latent_hash(server: cs.ComfyServer, p: Dict[str, Any]) -> str:
    entry = server.run_prompt(p, timeout=600)
    texts = cs.ui_texts(entry, "6")
    assert texts, "no hash output: {}".format(entry.get("outputs"))
    assert "finite=True" in texts[0], texts[0]
    return texts[0].split()[0]


class EventListener:
    """Collects websocket events of one client id in a background thread (bounded in time)."""

    def __init__(self, server: cs.ComfyServer, wanted: str) -> None:
        self.url = server.url.replace("http://", "ws://") + "/ws?clientId=" + server.client_id
        self.wanted = wanted
        self.events: List[Dict[str, Any]] = []
        self.ready = threading.Event()
        self.done = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        import aiohttp

        try:
            async with aiohttp.ClientSession() as session:
                async with session.ws_connect(self.url) as ws:
                    self.ready.set()
                    deadline = time.monotonic() + 600
                    while time.monotonic() < deadline and not self.done.is_set():
                        try:
                            msg = await ws.receive(timeout=0.5)
                        except asyncio.TimeoutError:
                            continue
                        if msg.type != aiohttp.WSMsgType.TEXT:
                            continue
                        data = json.loads(msg.data)
                        if data.get("type") == self.wanted:
                            self.events.append(data.get("data"))
                            self.done.set()
        finally:
            self.ready.set()

    def __enter__(self) -> "EventListener":
        self.thread.start()
        self.ready.wait(300)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.done.set()
        self.thread.join(300)


def test_pack_imports_and_registers_every_node(server):
    info = server.get_json("/object_info")
    missing = [n for n in NODE_IDS if n not in info]
    assert not missing, "not registered: {}\n{}".format(missing, server.log_tail())
    loader = info["OffloadDiffusionModelLoader"]
    assert loader["category"] == "Layer Offload"
    assert loader["display_name"] == "Offload Loader (Diffusion Model)"
    assert combo_choices(loader["input"]["required"]["preset"]) == PRESETS
    assert UNET in combo_choices(loader["input"]["required"]["unet_name"])
    assert "budget" in loader["input"]["optional"] and "priority" in loader["input"]["optional"]
    assert info["OffloadVramBudget"]["output"] == ["OFFLOAD_BUDGET"]
    assert info["OffloadReport"]["output_node"] is True
    scripts = server.get_json("/extensions")
    assert "/extensions/{}/layer_offload.js".format(cs.PACK_FOLDER) in scripts, scripts
    with cs.urllib.request.urlopen(server.url + "/extensions/{}/layer_offload.js".format(cs.PACK_FOLDER)) as r:
        assert b"registerExtension" in r.read()
    failed = [line for line in server.log_tail(200000).splitlines()
              if cs.PACK_FOLDER in line and ("IMPORT FAILED" in line or "Cannot import" in line)]
    assert not failed, failed


def test_offload_loader_samples_bitwise_like_unet_loader_and_reports(server):
    ref = latent_hash(server, prompt(unet_loader()))
    with EventListener(server, "layer_offload.report") as listener:
        entry = server.run_prompt(prompt(offload_loader("budget"), report=True), timeout=600)
        listener.done.wait(300)
    assert cs.ui_texts(entry, "6")[0].split()[0] == ref
    summary = cs.ui_texts(entry, "7")
    assert summary and "streamed" in summary[0] and "sim" in summary[0], summary
    in_history = json.loads(entry["outputs"]["7"]["report_json"][0])
    assert any(m["name"] == UNET and m["streamed_blocks"] == 4 for m in in_history["models"]), in_history
    data = server.get_json("/layer_offload/report")
    models = [m for m in data["models"] if m["name"] == UNET]
    assert models, data
    m = models[-1]
    assert m["device"] == "sim" and m["preset"] == "budget"
    assert m["streamed_blocks"] == 4 and m["total_bytes_streamed"] > 0
    assert all(b["tier"] != "vram" and b["bytes"] > 0 for b in m["blocks"])
    assert listener.events and listener.events[-1]["models"], "no layer_offload.report event"


def test_report_event_after_sampling_without_a_report_node(server):
    """The panel is live in every workflow: sampling with an offloaded model publishes the report by itself."""
    with EventListener(server, "layer_offload.report") as listener:
        server.run_prompt(prompt(offload_loader("budget"), seed=4), timeout=600)
        listener.done.wait(300)
    assert listener.events, "no layer_offload.report event from a workflow without an Offload Report node"
    models = [m for m in listener.events[-1]["models"] if m["name"] == UNET]
    assert models and models[-1]["forwards"] >= 3 and len(models[-1]["blocks"]) == 4


def test_lora_after_offload_loader_matches_plain_loader_with_lora(server):
    base = latent_hash(server, prompt(unet_loader(), seed=5))
    ref = latent_hash(server, prompt(unet_loader(), seed=5, lora=0.8))
    assert ref != base
    assert latent_hash(server, prompt(offload_loader("budget"), seed=5, lora=0.8)) == ref
    # the pinned host weights were not patched: without the LoRA the offloaded model is the base model again
    assert latent_hash(server, prompt(offload_loader("budget"), seed=5)) == base


def test_repeated_runs_and_budget_node(server):
    ref6 = latent_hash(server, prompt(unet_loader(), seed=6))
    ref7 = latent_hash(server, prompt(unet_loader(), seed=7))
    assert latent_hash(server, prompt(offload_loader("consumer"), seed=6, budget_gb=2.0)) == ref6
    assert latent_hash(server, prompt(offload_loader("consumer"), seed=7, budget_gb=2.0)) == ref7
    assert latent_hash(server, prompt(offload_loader("consumer"), seed=6, budget_gb=2.0)) == ref6
    data = server.get_json("/layer_offload/report")
    assert data["budget"]["total_bytes"] == 2 << 30


def test_interrupt_mid_sampling_then_next_prompt_matches_fresh(server):
    ref = latent_hash(server, prompt(unet_loader(), seed=8))
    long = prompt(offload_loader("budget"), seed=9)
    long["5"]["inputs"]["steps"] = 2000
    pid = server.queue(long)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not server.is_running(pid):
        time.sleep(0.05)
    time.sleep(0.5)  # well inside the sampler loop
    server.interrupt()
    entry = server.wait(pid, timeout=600)
    status = entry.get("status", {})
    kinds = [m[0] if isinstance(m, (list, tuple)) else m for m in status.get("messages", [])]  # the fork: strings
    assert "execution_interrupted" in kinds, status
    assert latent_hash(server, prompt(offload_loader("budget"), seed=8)) == ref
    assert latent_hash(server, prompt(offload_loader("budget"), seed=8, lora=0.8)) == \
        latent_hash(server, prompt(unet_loader(), seed=8, lora=0.8))
