"""The pack in ComfyUI's memory manager (issue 26), in-process on the ComfyUI under test with fakes of the 0.39-era
functions where this ComfyUI lacks them (0.33 has most; 0.12 only MAX_PINNED_MEMORY; 0.3.64 none):

- ComfyUI's load of an offloaded model for a node (load_models_gpu -> the pack's patcher) makes it lead its priority in
  the budget: two experts of equal priority under a budget that fits one each hold every block while they sample,
  and outputs equal the plain loader's;
- the engine's pins count in ComfyUI's pin budget (MAX_PINNED_MEMORY / TOTAL_PINNED_MEMORY, ensure_pin_registerable),
  a pin it cannot fit is refused, and the count goes down when the engine frees it;
- ComfyUI's RAM-pressure path (free_pins) asks the engine's models for what it could not free: blocks go to the disk
  tier, fast_disk models and the least recently used first;
- a patcher's fast_disk survives clone(); strip_vbar_state clears the 0.33+ DynamicVRAM fields.
Skipped without COMFYUI_PATH.
"""
from __future__ import annotations

import gc
import importlib
import os

import pytest

from conftest import comfy_available, node_classes, skip_reason

if not comfy_available():
    pytest.skip(skip_reason(), allow_module_level=True)

import torch  # noqa: E402

import tiny_wan  # noqa: E402

HIGH, LOW = "lo_hm_high.safetensors", "lo_hm_low.safetensors"


@pytest.fixture(scope="module")
def env(pack, tmp_path_factory):
    import comfy.model_management as mm
    import folder_paths
    import nodes

    d = str(tmp_path_factory.mktemp("host_memory_models"))
    # float32 (what ComfyUI computes in on the CPU, so the file holds the staged bytes: the disk tier can take them)
    tiny_wan.write_wan(os.path.join(d, HIGH), seed=0, dtype=torch.float32, num_blocks=8)
    tiny_wan.write_wan(os.path.join(d, LOW), seed=5, dtype=torch.float32, num_blocks=8)
    folder_paths.add_model_folder_path("diffusion_models", d)
    mod = lambda name: importlib.import_module(pack.__name__ + "." + name)  # noqa: E731
    return {"pack": pack, "mm": mm, "nodes": nodes, "M": node_classes(pack), "hm": mod("nodes.host_memory"),
            "gate": mod("offload.backends.pin_gate"), "dynamic": mod("nodes.dynamic"), "VramBudget": mod("offload").VramBudget}


@pytest.fixture
def comfy_memory(env, monkeypatch):
    """ComfyUI's pin budget and RAM-pressure functions as 0.39 has them, faked on the ComfyUI under test; the pack's
    hooks installed over them, and everything put back afterwards."""
    mm, hm, gate = env["mm"], env["hm"], env["gate"]
    saved_gate = gate.pin_gate()
    calls = {"ensure": [], "free_pins": []}
    monkeypatch.setattr(mm, "MAX_PINNED_MEMORY", 64 << 20, raising=False)
    monkeypatch.setattr(mm, "TOTAL_PINNED_MEMORY", 0, raising=False)

    def ensure_pin_registerable(size, evict_active=True):
        calls["ensure"].append(size)
        return mm.TOTAL_PINNED_MEMORY + size <= mm.MAX_PINNED_MEMORY

    def free_pins(size, evict_active=False, loaded=False):
        calls["free_pins"].append(size)
        return 0  # ComfyUI's own models had nothing to give

    monkeypatch.setattr(mm, "ensure_pin_registerable", ensure_pin_registerable, raising=False)
    monkeypatch.setattr(mm, "free_pins", free_pins, raising=False)
    hm.install()
    yield calls
    hm.uninstall()
    gate.set_pin_gate(*saved_gate)
    monkeypatch.undo()  # ComfyUI's own functions back, then the pack's hooks over them again, as the pack left them
    hm.install()  # (uninstall also took the pack's wrapper off 0.12's RAMPressureCache.poll, which later tests use)


def sample(env, model, start=0, end=3, steps=6, seed=3):
    g = torch.Generator().manual_seed(1)
    cond = [[torch.randn(1, 8, 4096, generator=g) * 0.1, {}]]
    latent = {"samples": torch.zeros(1, 16, 1, 8, 8)}
    with torch.inference_mode():
        return env["nodes"].common_ksampler(model, seed, steps, 1.0, "euler", "simple", cond, cond, latent,
                                            start_step=start, last_step=end, force_full_denoise=False)[0]["samples"]


def plain(env, name):
    with torch.inference_mode():
        return env["nodes"].UNETLoader().load_unet(name, "default")[0]


def offloaded(env, name, budget=None, preset="budget"):
    with torch.inference_mode():
        return env["M"]["OffloadDiffusionModelLoader"]().load(name, "default", preset, budget)[0]


def handle_of(model):
    return model.model.diffusion_model.__dict__["_layer_offload"].handle


def managed(model):
    return model.model.diffusion_model.__dict__["_layer_offload"]


# the model ComfyUI loads for a node leads the budget -------------------------------------------------------------
def test_two_experts_each_hold_their_blocks_while_they_sample(env):
    """Wan 2.2's two experts, default priority, a budget with room for exactly one: ComfyUI loading an expert for its
    sampler makes it lead, so it samples with every block resident (nothing streamed), in every run; the other
    holds nothing meanwhile; outputs equal the plain loaders'."""
    ref_high, ref_low = sample(env, plain(env, HIGH)), sample(env, plain(env, LOW), 3, 6)
    probe = offloaded(env, HIGH, env["VramBudget"](1 << 30), preset="auto")
    full = handle_of(probe).want_bytes()
    del probe
    gc.collect()
    budget = env["VramBudget"](full)
    high, low = offloaded(env, HIGH, budget, preset="auto"), offloaded(env, LOW, budget, preset="auto")
    hh, hl = handle_of(high), handle_of(low)
    for _ in range(2):
        for model, h, other, ref, (a, b) in ((high, hh, hl, ref_high, (0, 3)), (low, hl, hh, ref_low, (3, 6))):
            out = sample(env, model, a, b)
            rep = h.report()
            assert torch.equal(out, ref), "sampling with the offloaded expert changed the result"
            assert rep.forwards >= 3 and rep.total_bytes_streamed == 0, (rep.forwards, rep.total_bytes_streamed,
                                                                           rep.budget_reason)
            assert all(b.tier == "vram" for b in rep.blocks)
            assert other.device_bytes() == 0 and h.device_bytes() <= full
            assert "leads priority 0" in rep.budget_reason, rep.budget_reason


# pinned memory -------------------------------------------------------------------------------------------------
def test_engine_pins_count_in_comfyui_pin_budget(env, comfy_memory):
    mm, gate = env["mm"], env["gate"]
    pinned = gate.pin_host(4 << 20, lambda: torch.empty(4 << 20, dtype=torch.uint8))
    assert pinned is not None and mm.TOTAL_PINNED_MEMORY == 4 << 20 and comfy_memory["ensure"] == [4 << 20]
    assert gate.pin_host(61 << 20, lambda: torch.empty(8, dtype=torch.uint8)) is None, "over ComfyUI's pin budget"
    assert mm.TOTAL_PINNED_MEMORY == 4 << 20
    del pinned
    gc.collect()
    assert mm.TOTAL_PINNED_MEMORY == 0, "the engine freed its pin: ComfyUI's count goes down"


def test_installed_when_the_pack_loads_where_comfyui_has_the_names(env):
    """Against this ComfyUI's own module (no fakes): the gate where it budgets pins (0.12+), free_pins wrapped where
    it has one (0.33+), nothing on 0.3.64."""
    mm, hm, gate = env["mm"], env["hm"], env["gate"]
    has_budget = hasattr(mm, "MAX_PINNED_MEMORY")
    assert gate.pin_gate() == ((hm.acquire_pin, hm.release_pin) if has_budget else (None, None))
    if callable(getattr(mm, "free_pins", None)):
        assert getattr(mm.free_pins, hm.WRAPPED_ATTR, None) is not None
    if has_budget and mm.MAX_PINNED_MEMORY <= 0:  # --cpu: ComfyUI pins nothing, nor does the engine
        assert gate.pin_host(64, lambda: torch.empty(64, dtype=torch.uint8)) is None


def test_without_ensure_pin_registerable_the_limit_is_read(env, comfy_memory, monkeypatch):
    """0.12: MAX_PINNED_MEMORY and TOTAL_PINNED_MEMORY only."""
    mm, gate = env["mm"], env["gate"]
    monkeypatch.delattr(mm, "ensure_pin_registerable")
    mm.TOTAL_PINNED_MEMORY = 60 << 20  # ComfyUI's own pins
    assert gate.pin_host(8 << 20, lambda: torch.empty(8, dtype=torch.uint8)) is None
    buf = gate.pin_host(2 << 20, lambda: torch.empty(8, dtype=torch.uint8))
    assert buf is not None and mm.TOTAL_PINNED_MEMORY == 62 << 20
    del buf
    gc.collect()
    assert mm.TOTAL_PINNED_MEMORY == 60 << 20


def test_pinned_memory_off_in_comfyui_means_no_engine_pins(env, comfy_memory):
    env["mm"].MAX_PINNED_MEMORY = -1  # --disable-pinned-memory
    assert env["gate"].pin_host(4096, lambda: torch.empty(4096, dtype=torch.uint8)) is None
    assert comfy_memory["ensure"] == []


def test_a_comfyui_without_a_pin_budget_leaves_the_engine_pinning_as_before(env, monkeypatch):
    mm, hm, gate = env["mm"], env["hm"], env["gate"]
    saved = gate.pin_gate()
    gate.set_pin_gate(None, None)
    monkeypatch.delattr(mm, "MAX_PINNED_MEMORY", raising=False)
    monkeypatch.delattr(mm, "free_pins", raising=False)  # put back (wrapped, where it was) after the test
    try:
        hm.install()
        assert gate.pin_gate() == (None, None)
        assert gate.pin_host(64, lambda: torch.empty(64, dtype=torch.uint8)) is not None
    finally:
        gate.set_pin_gate(*saved)


# RAM pressure ----------------------------------------------------------------------------------------------------
def test_ram_pressure_moves_blocks_of_the_least_recently_used_model_to_disk_first(env, comfy_memory):
    mm = env["mm"]
    ref_a, ref_b = sample(env, plain(env, HIGH)), sample(env, plain(env, LOW))
    a, b = offloaded(env, HIGH), offloaded(env, LOW)
    assert torch.equal(sample(env, a), ref_a)
    assert torch.equal(sample(env, b), ref_b)  # b is the more recent
    ha, hb = handle_of(a), handle_of(b)
    ram_a, ram_b = ha.host_memory()["ram"], hb.host_memory()["ram"]
    block = max(ha.unit_bytes().values())
    freed = mm.free_pins(block)
    assert comfy_memory["free_pins"] == [block], "ComfyUI's own tiers are asked first"
    assert freed >= block
    assert ha.host_memory()["ram"] < ram_a and hb.host_memory()["ram"] == ram_b, "the least recently used gives first"
    managed(b).fast_disk = True  # a fast_disk model gives before any other
    ram_a, ram_b = ha.host_memory()["ram"], hb.host_memory()["ram"]
    assert mm.free_pins(block) >= block
    assert hb.host_memory()["ram"] < ram_b and ha.host_memory()["ram"] == ram_a
    assert "disk" in {x.tier for x in ha.report().blocks} and "disk" in {x.tier for x in hb.report().blocks}
    assert torch.equal(sample(env, a), ref_a) and torch.equal(sample(env, b), ref_b), "streaming from disk is exact"


def test_fast_disk_is_kept_on_clones(env):
    model = offloaded(env, HIGH)
    model.fast_disk = True
    assert model.clone().fast_disk is True
    assert model.clone().clone().fast_disk is True
    model.fast_disk = False
    assert model.clone().fast_disk is False


# DynamicVRAM's per-module state ------------------------------------------------------------------------------------
def test_strip_vbar_state_clears_the_dynamic_vram_fields_of_current_comfyui(env):
    layer = torch.nn.Linear(4, 4)
    root = torch.nn.Sequential(layer)
    fields = ("_v", "_v_signature", "_v_weight", "_v_bias", "_prefetch", "_v_block", "_v_block_faulted", "_pin_state")
    for name in fields:
        layer.__dict__[name] = object()
    root.__dict__["_v_block"] = (0, 0, 0)
    layer.__dict__["_pins"] = {}
    layer.weight.__dict__["_model_dtype"] = torch.float32
    assert env["dynamic"].strip_vbar_state(root) == 2
    assert not [f for f in fields if f in layer.__dict__] and "_v_block" not in root.__dict__
    assert "_model_dtype" not in layer.weight.__dict__
    assert "_pins" in layer.__dict__, "ComfyUI's own unpin empties _pins; it is not ours to drop"
