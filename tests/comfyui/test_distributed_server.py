"""ComfyUI-Distributed as a new user meets it, simulated: a master and two workers on loopback ports, this pack
unchanged in each, the same API workflow posted to every one of them (what the master's Distributed nodes do).

ComfyUI-Distributed is not on PyPI, so its behaviour is imitated here: three ComfyUI servers (--cpu) whose simulated
cards differ (LAYER_OFFLOAD_SIM_GB: 8, 4 and 2 GiB; the master has two simulated devices, each worker one), one
workflow whose VRAM Budget node asks for `budget_share` 50% and `per_device` sim:1=25%, and whose Offload Loader
lists `devices` "sim:0, sim:1". Each server must run it, budget half of its own card, keep blocks on sim:1 only
where it has one (the workers leave sim:1 out with one notice), and give the same latent bitwise. An absolute
budget_gb larger than a worker's card fails there with a message that points at budget_share.
Skipped unless COMFYUI_PATH is set.
"""
from __future__ import annotations

import os
import threading
from typing import Any, Dict, List

import pytest

from conftest import comfy_available, skip_reason

if not comfy_available():
    pytest.skip(skip_reason(), allow_module_level=True)

import comfy_server as cs  # noqa: E402
import tiny_wan  # noqa: E402

UNET = "tiny_wan.safetensors"
GIB = 1 << 30
MACHINES = [("master", 8, 2), ("worker1", 4, 1), ("worker2", 2, 1)]  # (name, sim GiB, sim devices)


@pytest.fixture(scope="module")
def machines(tmp_path_factory):
    """{name: server}: the master and two workers, started together (each its own base directory)."""
    servers: Dict[str, cs.ComfyServer] = {}
    for name, gib, count in MACHINES:
        base = str(tmp_path_factory.mktemp("distributed_" + name))
        paths = cs.prepare_base_dir(base)
        tiny_wan.write_wan(os.path.join(paths["diffusion_models"], UNET))
        srv = cs.ComfyServer(os.environ["COMFYUI_PATH"], base, startup_timeout=600)
        srv.extra_env = {"LAYER_OFFLOAD_SIM_GB": str(gib), "LAYER_OFFLOAD_SIM_DEVICES": str(count)}
        servers[name] = srv
    errors: List[BaseException] = []

    def start(srv: cs.ComfyServer) -> None:
        try:
            srv.start()
        except BaseException as e:  # noqa: BLE001 - raised below, after every start ended
            errors.append(e)

    threads = [threading.Thread(target=start, args=(srv,)) for srv in servers.values()]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        yield servers
    finally:
        for srv in servers.values():
            srv.stop()


def workflow(budget: Dict[str, Any], seed: int = 5) -> Dict[str, Any]:
    """VRAM Budget -> Offload Loader (devices sim:0, sim:1) -> KSampler -> latent hash, Offload Report."""
    return {
        "8": {"class_type": "OffloadVramBudget", "inputs": dict({"budget_gb": 0.0, "preset": "auto"}, **budget)},
        "1": {"class_type": "OffloadDiffusionModelLoader",
              "inputs": {"unet_name": UNET, "weight_dtype": "default", "preset": "auto", "priority": 0,
                         "budget": ["8", 0], "devices": "sim:0, sim:1"}},
        "2": {"class_type": "LOTestConditioning", "inputs": {"tokens": 8, "seed": 1}},
        "3": {"class_type": "EmptyHunyuanLatentVideo",
              "inputs": {"width": 64, "height": 64, "length": 1, "batch_size": 1}},
        "5": {"class_type": "KSampler", "inputs": {"model": ["1", 0], "positive": ["2", 0], "negative": ["2", 0],
                                                     "latent_image": ["3", 0], "seed": seed, "steps": 3, "cfg": 1.0,
                                                     "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}},
        "6": {"class_type": "LOTestLatentHash", "inputs": {"samples": ["5", 0]}},
        "7": {"class_type": "OffloadReport", "inputs": {"anything": ["5", 0]}},
    }


def test_one_workflow_on_a_master_and_two_workers_budgets_each_card(machines):
    wf = workflow({"budget_share": "50%", "per_device": "sim:1=25%"})
    ids = {name: srv.queue(wf) for name, srv in machines.items()}  # posted to all, as Distributed does
    hashes = {}
    for name, gib, count in MACHINES:
        srv = machines[name]
        entry = srv.wait(ids[name], timeout=600)
        assert entry.get("status", {}).get("status_str") == "success", (name, entry.get("status"), srv.log_tail())
        text = cs.ui_texts(entry, "6")
        assert text and "finite=True" in text[0], (name, entry.get("outputs"))
        hashes[name] = text[0].split()[0]
        report = srv.get_json("/layer_offload/report")
        assert report["budget"]["total_bytes"] == int(gib * GIB * 0.5), (name, report["budget"])
        assert "budget_share 50%" in report["budget"]["origin"], report["budget"]["origin"]
        model = [m for m in report["models"] if m["name"] == UNET]
        assert len(model) == 1, (name, [m["name"] for m in report["models"]])
        devices = list(model[0].get("devices") or ["sim:0"])
        log = srv.log_tail(200000)
        if count == 2:
            assert devices == ["sim:0", "sim:1"], (name, devices)
            assert report["budget"]["devices"]["sim:1"]["total_bytes"] == int(gib * GIB * 0.25)
            assert "does not have" not in log
        else:
            assert devices in (["sim:0"], ["sim"]), (name, devices)
            # one notice for the devices input, one for per_device; not repeated per call
            assert log.count("names sim:1, which this process does not have") == 2, (name, log[-3000:])
    assert len(set(hashes.values())) == 1, hashes

    # the same workflow again: no new notice (once per process)
    again = {name: srv.queue(workflow({"budget_share": "50%", "per_device": "sim:1=25%"}, seed=6))
             for name, srv in machines.items()}
    for name, srv in machines.items():
        assert srv.wait(again[name], timeout=600).get("status", {}).get("status_str") == "success", name
        if name != "master":
            assert srv.log_tail(200000).count("which this process does not have") == 2, name


def test_an_absolute_budget_larger_than_a_worker_card_fails_there_and_names_budget_share(machines):
    wf = workflow({"budget_gb": 3.0})  # fits the master (8 GiB) and worker1 (4 GiB), not worker2 (2 GiB)
    entries = {name: srv.wait(srv.queue(wf), timeout=600) for name, srv in machines.items()}
    assert entries["master"]["status"]["status_str"] == "success"
    assert entries["worker1"]["status"]["status_str"] == "success"
    assert entries["worker2"]["status"]["status_str"] == "error"
    messages = str(entries["worker2"]["status"].get("messages"))
    assert "larger than the device" in messages and "budget_share" in messages, messages[-2000:]
