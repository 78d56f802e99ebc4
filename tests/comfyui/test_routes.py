"""The panel's control routes, in process (CPU mode, simulated device): nodes/routes.py `handle_post` and the report.

One tiny Wan model (its own file name, so other tests' models never answer to it) is offloaded and sampled once.
Valid changes show in `build_report()` at once; invalid ones answer 400 / 404 with a message and change nothing;
changes made while a sampling run is in progress in another thread leave its output bitwise equal to a plain run.
The process-wide budget is restored at the end (other tests share the process). Skipped unless COMFYUI_PATH is set.
"""
from __future__ import annotations

import math
import os
import threading
import time
from importlib import import_module

import pytest

from conftest import combo_choices, comfy_available, display_names, node_classes, skip_reason  # noqa: F401

if not comfy_available():
    pytest.skip(skip_reason(), allow_module_level=True)

import torch  # noqa: E402

import tiny_wan  # noqa: E402

UNET = "lo_routes_tiny_wan.safetensors"  # the report name of this module's model
GIB = 1 << 30


def sample(nodes, model, seed: int = 3, steps: int = 3, callback=None) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    cond = [[torch.randn(1, 8, 4096, generator=g) * 0.1, {}]]
    latent = torch.zeros(1, 16, 1, 8, 8)
    import comfy.sample

    with torch.inference_mode():
        noise = comfy.sample.prepare_noise(latent, seed)
        return comfy.sample.sample(model, noise, steps, 1.0, "euler", "simple", cond, cond, latent,
                                   callback=callback, disable_pbar=True, seed=seed)


@pytest.fixture(scope="module")
def env(pack, tmp_path_factory):
    """The pack's routes/status/offload modules and one offloaded tiny Wan model, sampled once."""
    import folder_paths
    import nodes

    d = str(tmp_path_factory.mktemp("routes_models"))
    tiny_wan.write_wan(os.path.join(d, UNET))
    folder_paths.add_model_folder_path("diffusion_models", d)
    routes = import_module(pack.__name__ + ".nodes.routes")
    status = import_module(pack.__name__ + ".nodes.status")
    offload = import_module(pack.__name__ + ".offload")
    model = node_classes(pack)["OffloadDiffusionModelLoader"]().load(UNET, "default", "budget", None, 0)[0]
    plain = nodes.UNETLoader().load_unet(UNET, "default")[0]
    ref = sample(nodes, plain)
    assert torch.equal(ref, sample(nodes, model))
    ref4 = sample(nodes, plain, steps=4)  # the reference of the concurrent run
    budget = offload.default_budget()
    saved = (budget.total_bytes, budget.origin, budget.auto_sized)
    e = {"pack": pack, "nodes": nodes, "routes": routes, "status": status, "offload": offload, "model": model,
         "ref": ref, "ref4": ref4, "handle": model.model.diffusion_model.__dict__["_layer_offload"].handle}
    try:
        yield e
    finally:
        total, origin, auto = saved
        if total is not None and budget.total_bytes != total:
            budget.set_total(total, origin=origin)
        budget.origin, budget.auto_sized = origin, auto


def entry(env, name: str = UNET):
    found = [m for m in env["status"].build_report()["models"] if m["name"] == name]
    assert len(found) == 1, [m["name"] for m in env["status"].build_report()["models"]]
    return found[0]


def total(env) -> int:
    return env["offload"].default_budget().total_bytes


def restore(env, total_bytes, origin):
    budget = env["offload"].default_budget()
    if budget.total_bytes != total_bytes:
        budget.set_total(total_bytes, origin=origin)
    budget.origin = origin


def post(env, kind, body):
    status, data = env["routes"].handle_post(kind, body)
    assert isinstance(data, dict) and isinstance(data.get("ok"), bool), data
    return status, data


def assert_refused(env, kind, body, want_status=400):
    """A refused change: the status, a readable message, and nothing changed."""
    before_total = total(env)
    before_prio = env["handle"].priority
    status, data = post(env, kind, body)
    assert status == want_status, (body, status, data)
    assert data["ok"] is False and isinstance(data["error"], str) and len(data["error"]) > 10, data
    assert "Traceback" not in data["error"]
    assert total(env) == before_total, body
    assert env["handle"].priority == before_prio == entry(env)["priority"], body
    return data["error"]


# priority ---------------------------------------------------------------------------------------------------------
def test_priority_change_shows_in_the_report_at_once(env):
    try:
        status, data = post(env, "priority", {"model": UNET, "priority": 7})
        assert status == 200 and data["ok"] is True, data
        assert [m["priority"] for m in data["report"]["models"] if m["name"] == UNET] == [7]
        assert entry(env)["priority"] == 7 and env["handle"].priority == 7
        status, data = post(env, "priority", {"model": UNET, "priority": "-3"})  # a numeric string from a form
        assert status == 200 and env["handle"].priority == -3 and entry(env)["priority"] == -3
        status, _ = post(env, "priority", {"model": UNET, "priority": 100.0})  # whole float: accepted
        assert status == 200 and env["handle"].priority == 100
    finally:
        post(env, "priority", {"model": UNET, "priority": 0})
    assert env["handle"].priority == 0


@pytest.mark.parametrize("body", [
    {"model": UNET, "priority": "high"},
    {"model": UNET, "priority": float("nan")},
    {"model": UNET, "priority": float("inf")},
    {"model": UNET, "priority": 1.5},
    {"model": UNET, "priority": 1000},
    {"model": UNET, "priority": -101},
    {"model": UNET, "priority": True},
    {"model": UNET, "priority": None},
    {"model": UNET},
    {"priority": 3},
    {"model": "", "priority": 3},
    {"model": 5, "priority": 3},
    {"model": UNET, "priority": 10 ** 400},
], ids=["string", "nan", "inf", "fraction", "too-high", "too-low", "bool", "null", "no-priority", "no-model",
        "empty-model", "model-not-a-string", "int-beyond-float"])
def test_invalid_priority_is_refused_and_changes_nothing(env, body):
    post(env, "priority", {"model": UNET, "priority": 2})
    try:
        assert_refused(env, "priority", body)
        assert env["handle"].priority == 2
    finally:
        post(env, "priority", {"model": UNET, "priority": 0})


def test_unknown_model_is_404(env):
    msg = assert_refused(env, "priority", {"model": "no_such_model.safetensors", "priority": 1}, want_status=404)
    assert "no_such_model.safetensors" in msg


@pytest.mark.parametrize("body", [None, [], "priority=3", 42])
def test_non_dict_body_is_refused(env, body):
    assert_refused(env, "priority", body)
    assert_refused(env, "budget", body)


def test_unknown_control_is_404(env):
    assert_refused(env, "volume", {"model": UNET, "priority": 1}, want_status=404)


# budget -----------------------------------------------------------------------------------------------------------
def test_budget_change_by_gb_and_bytes(env):
    before, origin = total(env), env["offload"].default_budget().origin
    try:
        status, data = post(env, "budget", {"total_gb": 1.5})
        assert status == 200 and data["ok"] is True, data
        assert total(env) == int(1.5 * GIB) == data["report"]["budget"]["total_bytes"]
        assert env["status"].build_report()["budget"]["total_bytes"] == int(1.5 * GIB)
        assert "panel" in env["status"].build_report()["budget"]["origin"]
        status, data = post(env, "budget", {"total_bytes": 3 * GIB})
        assert status == 200 and total(env) == 3 * GIB
        status, data = post(env, "budget", {"total_gb": "2"})  # a numeric string from a form
        assert status == 200 and total(env) == 2 * GIB
    finally:
        restore(env, before, origin)


@pytest.mark.parametrize("body,needle", [
    ({"total_gb": 100000}, "larger than the device"),
    ({"total_bytes": 1 << 50}, "larger than the device"),
    ({"total_gb": 0.000001}, "minimum"),
    ({"total_gb": 0}, "minimum"),
    ({"total_gb": -2}, "minimum"),
    ({"total_gb": "lots"}, "number"),
    ({"total_gb": float("nan")}, "number"),
    ({"total_gb": float("inf")}, "number"),
    ({"total_gb": None}, "number"),
    ({"total_gb": True}, "number"),
    ({"total_gb": [4]}, "number"),
    ({}, "total_gb"),
    ({"budget": 4}, "total_gb"),
    ({"total_bytes": 10 ** 400}, "number"),  # beyond float range: was an OverflowError and a 500 (issue 35)
    ({"total_gb": 10 ** 400}, "number"),
    ({"total_gb": "9" * 400}, "number"),
    ({"total_gb": 1e308}, "number"),  # x GiB is inf
], ids=["over-device-gb", "over-device-bytes", "tiny", "zero", "negative", "string", "nan", "inf", "null", "bool",
        "list", "empty", "wrong-key", "int-beyond-float", "gb-beyond-float", "400-nines", "gb-overflows"])
def test_invalid_budget_is_refused_and_unchanged(env, body, needle):
    msg = assert_refused(env, "budget", body)
    assert needle in msg, msg


def test_budget_under_the_loaded_models_minimum_is_refused(env):
    minimum = env["status"].build_report()["budget"]["minimum_bytes"]
    assert minimum > 0, "an offloaded model is loaded: its floor is the minimum"
    msg = assert_refused(env, "budget", {"total_bytes": minimum - 1})
    assert "minimum" in msg


# concurrency ------------------------------------------------------------------------------------------------------
def test_changes_while_sampling_in_another_thread(env):
    """The panel's controls hit the engine while a prompt samples: no exception, output bitwise unchanged.

    A second model (high_end: blocks resident while the budget allows) samples in a thread while the main thread
    changes both models' priorities and swings the budget between its minimum (everything streams) and 4 GB."""
    import gc

    budget = env["offload"].default_budget()
    before, origin = budget.total_bytes, budget.origin
    budget.set_total(4 * GIB)
    hi_name = "lo_routes_tiny_wan_hi.safetensors"
    import folder_paths

    d = os.path.dirname(folder_paths.get_full_path("diffusion_models", UNET))
    tiny_wan.write_wan(os.path.join(d, hi_name))  # the same weights under another name
    hi = node_classes(env["pack"])["OffloadDiffusionModelLoader"]().load(hi_name, "default", "high_end", None,
                                                                               0)[0]
    assert torch.equal(env["ref4"], sample(env["nodes"], hi, steps=4))
    assert entry(env, hi_name)["resident_blocks"] > 0, "under 4 GB the high_end model keeps blocks resident"
    minimum = max(env["status"].build_report()["budget"]["minimum_bytes"], 8 << 20)
    totals = [minimum + (1 << 20), 2 * GIB, minimum, 4 * GIB]
    started = threading.Event()
    changed = threading.Event()
    result = {}

    def cb(step, x0, x, total_steps):
        started.set()
        if step == 0:  # hold the run until some changes happened, so they land mid-run for sure
            changed.wait(300)

    def run():
        try:
            result["out"] = sample(env["nodes"], hi, steps=4, callback=cb)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            result["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    codes = []
    try:
        assert started.wait(600), "sampling did not start"
        i = 0
        deadline = time.monotonic() + 600
        while (t.is_alive() or i < 8) and time.monotonic() < deadline:
            codes.append(post(env, "priority", {"model": hi_name, "priority": (i * 37) % 201 - 100})[0])
            codes.append(post(env, "priority", {"model": UNET, "priority": (i * 53) % 201 - 100})[0])
            codes.append(post(env, "budget", {"total_bytes": totals[i % len(totals)]})[0])
            codes.append(post(env, "priority", {"model": hi_name, "priority": "x"})[0])  # refused mid-run
            i += 1
            if i == 4:
                changed.set()
            time.sleep(0.005)
        changed.set()
        t.join(600)
        assert not t.is_alive(), "sampling did not finish"
        assert "error" not in result, repr(result.get("error"))
        assert codes.count(200) == 3 * codes.count(400) and set(codes) == {200, 400}, codes
        assert torch.equal(env["ref4"], result["out"]), "a change made mid-run changed the output"
        # the last change (budget at 4 GB) holds; the model samples the same again
        assert torch.equal(env["ref4"], sample(env["nodes"], hi, steps=4))
    finally:
        changed.set()
        t.join(600)
        post(env, "priority", {"model": UNET, "priority": 0})
        del hi
        gc.collect()  # the second model leaves the budget with its last patcher
        restore(env, before, origin)


# the report's shape -----------------------------------------------------------------------------------------------
NUM = (int, float)
MODEL_KEYS = {
    "name": str, "kind": str, "device": str, "device_name": str, "preset": (str, type(None)), "priority": int,
    "blocks": list, "tiers": dict, "tier_bytes": dict, "resident_blocks": int, "streamed_blocks": int,
    "resident_bytes": int, "streamed_bytes": int, "device_bytes": int, "peak_device_bytes": int,
    "total_bytes_streamed": int, "overlap_ratio": NUM, "effective_gbps": NUM, "stall_ms": NUM, "h2d_ms": NUM,
    "compute_ms": NUM, "forwards": int, "slots": int, "slot_bytes": int, "disk_bytes_read": int, "notices": list,
    "host": dict, "devices": dict,
}
BLOCK_KEYS = {"name": str, "tier": str, "bytes": int, "h2d_ms": NUM, "compute_ms": NUM, "stall_ms": NUM,
              "calls": int, "bytes_streamed": int, "reads": int, "device": str}
DEVICE_KEYS = {"device_bytes": int, "peak_device_bytes": int, "resident_blocks": int}
TIERS = ("vram", "pinned", "pageable", "disk")


def check_types(d, spec, where):
    for key, typ in spec.items():
        assert key in d, "{}: no {!r} in {}".format(where, key, sorted(d))
        value = d[key]
        assert isinstance(value, typ) and not (typ is not bool and isinstance(value, bool)), \
            "{}.{} is {!r}".format(where, key, value)
        if isinstance(value, float):
            assert math.isfinite(value), "{}.{} = {}".format(where, key, value)


def test_report_schema(env):
    import json

    data = env["status"].build_report()
    json.dumps(data, allow_nan=False)  # what the route and the event send: strict JSON
    check_types(data, {"time": NUM, "budget": dict, "models": list}, "report")
    b = data["budget"]
    check_types(b, {"total_bytes": int, "used_bytes": int, "minimum_bytes": int, "origin": str, "models": list,
                    "devices": dict}, "budget")
    for name, d in b["devices"].items():  # each device a reported model keeps blocks on (one here: the compute one)
        check_types(d, {"total_bytes": int, "used_bytes": int, "origin": str, "compute": bool}, name)
    assert b["devices"]["sim:0"]["compute"] is True and b["devices"]["sim:0"]["total_bytes"] == b["total_bytes"]
    assert 0 < b["minimum_bytes"] <= b["total_bytes"] and 0 <= b["used_bytes"] <= b["total_bytes"]
    for m in b["models"]:
        check_types(m, {"name": str, "used_bytes": int, "share_bytes": int}, "budget.models[]")
    assert UNET in [m["name"] for m in b["models"]]
    m = entry(env)
    check_types(m, MODEL_KEYS, "model")
    assert m["kind"] == "model" and m["device"] == "sim" and m["preset"] == "budget"
    assert set(m["tiers"]) == set(TIERS) and set(m["tier_bytes"]) == set(TIERS)
    assert all(isinstance(m["tiers"][t], int) and isinstance(m["tier_bytes"][t], int) for t in TIERS)
    assert len(m["blocks"]) == tiny_wan.NUM_BLOCKS == sum(m["tiers"].values())
    assert m["resident_blocks"] == m["tiers"]["vram"]
    assert m["streamed_blocks"] == len(m["blocks"]) - m["tiers"]["vram"]
    assert m["forwards"] >= 3 and m["total_bytes_streamed"] > 0
    for i, blk in enumerate(m["blocks"]):
        check_types(blk, BLOCK_KEYS, "blocks[{}]".format(i))
        assert blk["tier"] in TIERS and blk["bytes"] > 0
        assert blk["device"] == "sim", "one device: every block computes on the compute device"
    assert list(m["devices"]) == ["sim"], m["devices"]  # one device unless the node's devices input names more
    check_types(m["devices"]["sim"], DEVICE_KEYS, "devices.sim")
    assert m["devices"]["sim"]["resident_blocks"] == m["resident_blocks"]
    for n in m["notices"]:
        check_types(n, {"kind": str, "message": str}, "notices[]")
        assert n["kind"] in ("pinned_fallback", "oom_shrink", "disk_tier", "lookahead_shrunk")
    check_types(m["host"], {"ram": int, "pinned": int, "disk": int}, "host")


def test_post_answers_carry_the_same_report_shape(env):
    status, data = post(env, "priority", {"model": UNET, "priority": 0})
    assert status == 200
    assert set(data["report"]) == {"time", "budget", "models", "workflow"}
    m = [x for x in data["report"]["models"] if x["name"] == UNET][0]
    check_types(m, MODEL_KEYS, "model")
