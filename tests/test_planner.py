"""Auto-configuration (DESIGN §2 planner.py): free VRAM minus an activation reserve, host RAM from MemAvailable
and the cgroup limit (v1 and v2), the pin limit, the unit plan (resident set spread evenly, lookahead shrink,
clear PlanError) and the host-tier split; the presets as policies on the simulated device.

Everything here runs against fake memory readings: a fake cgroup tree under tmp_path and a monkeypatched
``psutil.virtual_memory``; no real machine figure is asserted.
"""
from __future__ import annotations

import itertools
from collections import namedtuple

import psutil
import pytest
import torch

from offload import PRESETS, OffloadConfig, PlanError, VramBudget, offload_module
from offload.plan.planner import HostMemory, plan_host, plan_units, read_cgroup_memory, read_host_memory
from tests.models import LayersModel, aligned_bytes, resident_modules, run, seeded, streamed_modules

GIB = 1 << 30
MIB = 1 << 20

_caps = itertools.count(1)


def _private_capacity() -> int:
    """A sim capacity no other test uses: sim backends are shared per setting, this one is ours alone."""
    return (3 << 30) + 4096 * next(_caps) + 97


# ------------------------------------------------------------------------------------------------------------
# cgroup and host memory readings
# ------------------------------------------------------------------------------------------------------------


def _v2(root, limit, usage):
    root.mkdir(parents=True, exist_ok=True)
    (root / "memory.max").write_text(f"{limit}\n")
    (root / "memory.current").write_text(f"{usage}\n")


def _v1(root, limit, usage):
    mem = root / "memory"
    mem.mkdir(parents=True, exist_ok=True)
    (mem / "memory.limit_in_bytes").write_text(f"{limit}\n")
    (mem / "memory.usage_in_bytes").write_text(f"{usage}\n")


def test_cgroup_v2_limit_and_usage(tmp_path):
    _v2(tmp_path, 3 * GIB, 1 * GIB)
    assert read_cgroup_memory(tmp_path) == (3 * GIB, 1 * GIB)


def test_cgroup_v1_limit_and_usage(tmp_path):
    _v1(tmp_path, 2 * GIB, 512 * MIB)
    assert read_cgroup_memory(tmp_path) == (2 * GIB, 512 * MIB)


def test_cgroup_unlimited_is_none(tmp_path):
    """v2 writes "max" and v1 a huge number when there is no limit: neither is a limit."""
    (tmp_path / "memory.max").write_text("max\n")
    (tmp_path / "memory.current").write_text("12345\n")
    _v1(tmp_path, 9223372036854771712, 777)
    assert read_cgroup_memory(tmp_path) == (None, None)


def test_cgroup_missing_tree_is_none(tmp_path):
    assert read_cgroup_memory(tmp_path) == (None, None)
    assert read_cgroup_memory(tmp_path / "does-not-exist") == (None, None)


def test_cgroup_v2_unlimited_falls_back_to_v1(tmp_path):
    (tmp_path / "memory.max").write_text("max\n")
    _v1(tmp_path, 2 * GIB, 3 * MIB)
    assert read_cgroup_memory(tmp_path) == (2 * GIB, 3 * MIB)


def test_cgroup_garbage_is_not_a_limit(tmp_path):
    (tmp_path / "memory.max").write_text("lots\n")
    assert read_cgroup_memory(tmp_path) == (None, None)


VM = namedtuple("VM", "total available percent used free")


def _fake_vm(monkeypatch, total, available):
    monkeypatch.setattr(psutil, "virtual_memory", lambda: VM(total, available, 0.0, total - available, available))


def test_host_memory_cgroup_limit_below_mem_available(tmp_path, monkeypatch):
    """Inside a container MemAvailable shows the host; the cgroup headroom (limit - usage) is what we get."""
    _fake_vm(monkeypatch, total=64 * GIB, available=40 * GIB)
    _v2(tmp_path, 6 * GIB, 2 * GIB)
    mem = read_host_memory(pin_fraction=0.5, cgroup_root=tmp_path)
    assert isinstance(mem, HostMemory)
    assert mem.mem_available == 40 * GIB
    assert mem.cgroup_limit == 6 * GIB
    assert mem.available == 4 * GIB, f"cgroup headroom is 4 GiB, planner says {mem.available / GIB:.2f} GiB"
    assert mem.pin_limit == 3 * GIB, "the pin limit is a fraction of the smaller of RAM and the cgroup limit"


def test_host_memory_cgroup_v1_limit_below_mem_available(tmp_path, monkeypatch):
    _fake_vm(monkeypatch, total=32 * GIB, available=20 * GIB)
    _v1(tmp_path, 8 * GIB, 5 * GIB)
    mem = read_host_memory(pin_fraction=0.25, cgroup_root=tmp_path)
    assert mem.available == 3 * GIB
    assert mem.pin_limit == 2 * GIB


def test_host_memory_mem_available_below_cgroup_headroom(tmp_path, monkeypatch):
    _fake_vm(monkeypatch, total=16 * GIB, available=1 * GIB)
    _v2(tmp_path, 12 * GIB, 1 * GIB)
    mem = read_host_memory(pin_fraction=0.5, cgroup_root=tmp_path)
    assert mem.available == 1 * GIB
    assert mem.pin_limit == 6 * GIB


def test_host_memory_without_cgroup(tmp_path, monkeypatch):
    _fake_vm(monkeypatch, total=16 * GIB, available=10 * GIB)
    mem = read_host_memory(pin_fraction=0.5, cgroup_root=tmp_path)
    assert mem.cgroup_limit is None
    assert mem.available == 10 * GIB
    assert mem.pin_limit == 8 * GIB
    default = read_host_memory(cgroup_root=tmp_path)
    assert 0 < default.pin_limit <= 16 * GIB, "the default pin limit is a fraction of RAM"


def test_host_memory_cgroup_over_its_limit_is_zero(tmp_path, monkeypatch):
    _fake_vm(monkeypatch, total=16 * GIB, available=10 * GIB)
    _v2(tmp_path, 1 * GIB, 2 * GIB)
    assert read_host_memory(cgroup_root=tmp_path).available == 0


# ------------------------------------------------------------------------------------------------------------
# plan_units
# ------------------------------------------------------------------------------------------------------------

NAMES8 = [f"blocks.{i}" for i in range(8)]


def test_plan_everything_resident_when_it_fits():
    p = plan_units([100] * 8, NAMES8, 50, 850, prefetch=2)
    assert p.resident == set(range(8))
    assert p.n_slots == 0
    assert p.device_bytes == 850


def test_plan_stream_all_keeps_nothing_resident():
    p = plan_units([100] * 8, NAMES8, 50, 10_000, prefetch=2, stream_all=True)
    assert p.resident == set()
    assert p.n_slots == 3, "a ring of prefetch + 1 slots"
    assert p.slot_bytes == 100
    assert p.device_bytes == 50 + 300


def test_plan_resident_set_spread_evenly():
    """Streamed units are spread out so their copies hide behind resident compute, not bunched at one end."""
    n = 12
    sizes = [100] * n
    rest = 40
    # room for 6 resident + a ring of 2 slots: 6 units stream
    p = plan_units(sizes, [f"b{i}" for i in range(n)], rest, rest + 8 * 100, prefetch=1)
    assert p.device_bytes <= rest + 800
    streamed = sorted(set(range(n)) - p.resident)
    assert len(p.resident) == 6 and p.n_slots == 2, (p.resident, p.n_slots)
    gaps = [b - a for a, b in zip(streamed, streamed[1:])]
    assert min(gaps) >= 1 and max(gaps) - min(gaps) <= 1, f"streamed units {streamed} are not spread evenly"
    assert streamed != list(range(6)) and streamed != list(range(6, 12))
    # 3 streamed of 12: one in each third
    p = plan_units(sizes, [f"b{i}" for i in range(n)], rest, rest + 11 * 100, prefetch=1)
    streamed = sorted(set(range(n)) - p.resident)
    assert len(streamed) == 3, streamed
    assert [s // 4 for s in streamed] == [0, 1, 2], f"streamed units {streamed} are not one per third"


def test_plan_lookahead_shrinks_to_fit():
    sizes = [100] * 8
    p = plan_units(sizes, NAMES8, 50, 50 + 2 * 100 + 10, prefetch=4)
    assert p.resident == set()
    assert p.n_slots == 2
    assert p.shrunk_lookahead
    assert p.notes and "lookahead" in p.notes[0]
    assert p.device_bytes <= 50 + 210
    p = plan_units(sizes, NAMES8, 50, 50 + 100, prefetch=4)
    assert p.n_slots == 1 and p.shrunk_lookahead


def test_plan_lookahead_not_shrunk_when_it_fits():
    p = plan_units([100] * 8, NAMES8, 50, 50 + 5 * 100, prefetch=2)
    assert p.n_slots == 3 or (p.n_slots == 2 and p.resident), p
    assert not p.shrunk_lookahead


def test_plan_error_names_the_unit_and_its_size():
    sizes = [1000, 1000, 3072, 1000]
    names = ["double.0", "double.1", "single.0", "single.1"]
    with pytest.raises(PlanError) as ei:
        plan_units(sizes, names, 500, 500 + 2000, prefetch=2)
    msg = str(ei.value)
    assert isinstance(ei.value, ValueError)
    assert "single.0" in msg and "3072" in msg, msg


def test_plan_error_when_rest_does_not_fit():
    with pytest.raises(PlanError) as ei:
        plan_units([100] * 4, NAMES8[:4], 5000, 4000, prefetch=1)
    assert "5000" in str(ei.value)


@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_plan_never_exceeds_allowance(prefetch):
    """Over a sweep of allowances: within the allowance, at least one slot, and the plan's figure is what it
    holds. (The resident count may drop where a bigger allowance buys back lookahead: not asserted.)"""
    sizes = [96, 128, 96, 128, 96, 128, 96, 128, 96, 128]
    names = [f"u{i}" for i in range(len(sizes))]
    rest = 64
    for allowance in range(rest + 128, rest + sum(sizes) + 64, 16):
        p = plan_units(sizes, names, rest, allowance, prefetch)
        assert p.device_bytes <= allowance, (allowance, p)
        streamed = set(range(len(sizes))) - p.resident
        if streamed:
            assert 1 <= p.n_slots <= min(prefetch + 1, len(streamed)), (allowance, p)
            assert p.slot_bytes >= max(sizes[i] for i in streamed)
            expect = rest + sum(sizes[i] for i in p.resident) + p.n_slots * p.slot_bytes
            assert p.device_bytes == expect, (allowance, p)
    assert plan_units(sizes, names, rest, rest + sum(sizes), prefetch).resident == set(range(len(sizes)))


# ------------------------------------------------------------------------------------------------------------
# plan_host
# ------------------------------------------------------------------------------------------------------------


def test_plan_host_pinned_then_pageable_then_disk():
    p = plan_host([10] * 6, ram_budget=35, pin_limit=20, allow_disk=True, pin=True)
    assert p.tiers == {0: "pinned", 1: "pinned", 2: "pageable", 3: "disk", 4: "disk", 5: "disk"}
    assert p.ram_bytes == 30
    assert p.pinned_bytes == 20


def test_plan_host_without_disk_keeps_everything_in_ram():
    p = plan_host([10] * 6, ram_budget=35, pin_limit=20, allow_disk=False, pin=True)
    assert "disk" not in p.tiers.values()
    assert p.ram_bytes == 60
    assert list(p.tiers.values()).count("pinned") == 2


def test_plan_host_no_pinning():
    p = plan_host([10] * 4, ram_budget=100, pin_limit=100, allow_disk=True, pin=False)
    assert set(p.tiers.values()) == {"pageable"}
    assert p.pinned_bytes == 0


def test_plan_host_zero_ram_all_disk():
    p = plan_host([10] * 4, ram_budget=0, pin_limit=100, allow_disk=True, pin=True)
    assert set(p.tiers.values()) == {"disk"}
    assert p.ram_bytes == 0


# ------------------------------------------------------------------------------------------------------------
# The engine uses the planner
# ------------------------------------------------------------------------------------------------------------


def _model(depth=8, seed=0):
    return seeded(LayersModel, dim=64, depth=depth, seed=seed)


def test_auto_budget_is_free_vram_minus_reserve():
    cap = _private_capacity()
    model = _model()
    budget = VramBudget(None)
    reserve = 100 * MIB
    h = offload_module(model, OffloadConfig(device="sim", sim_capacity_bytes=cap, reserve_bytes=reserve),
                       budget=budget)
    try:
        assert budget.total_bytes == cap - reserve
    finally:
        h.detach()
    budget2 = VramBudget(None)
    h = offload_module(model, OffloadConfig(device="sim", sim_capacity_bytes=cap), budget=budget2)
    try:
        assert 0 < budget2.total_bytes < cap, "with no reserve given, some device memory is kept for activations"
    finally:
        h.detach()


def test_ram_budget_from_mem_available(tmp_path, monkeypatch):
    """No ram_budget_bytes: the planner reads MemAvailable. Nearly none left means blocks go to disk; plenty
    means none do."""
    from safetensors.torch import save_file

    import offload.plan.planner as planner

    model = _model(depth=6)
    x = torch.randn(2, 5, 64)
    ref = run(model, (x,))
    path = tmp_path / "m.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    monkeypatch.setattr(planner, "read_cgroup_memory", lambda root=None: (None, None))

    _fake_vm(monkeypatch, total=64 * GIB, available=48 * GIB)
    h = offload_module(model, OffloadConfig.from_preset("budget", device="sim", disk_path=str(path)),
                       budget=VramBudget(None))
    try:
        assert "disk" not in [b.tier for b in h.report().blocks]
        assert torch.equal(run(model, (x,)), ref)
    finally:
        h.detach()

    _fake_vm(monkeypatch, total=64 * GIB, available=0)
    h = offload_module(model, OffloadConfig.from_preset("budget", device="sim", disk_path=str(path)),
                       budget=VramBudget(None))
    try:
        tiers = [b.tier for b in h.report().blocks]
        assert "disk" in tiers, f"no MemAvailable left, yet no block streams from disk: {tiers}"
        assert torch.equal(run(model, (x,)), ref)
    finally:
        h.detach()
    assert torch.equal(run(model, (x,)), ref)


def test_ram_budget_from_cgroup_limit(tmp_path, monkeypatch):
    """MemAvailable is plentiful, but the container's cgroup has no headroom: blocks go to disk."""
    from safetensors.torch import save_file

    import offload.plan.planner as planner

    model = _model(depth=6)
    x = torch.randn(2, 5, 64)
    ref = run(model, (x,))
    path = tmp_path / "m.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    fake = tmp_path / "cg"
    _v2(fake, 1 * GIB, 1 * GIB)
    real = planner.read_cgroup_memory
    monkeypatch.setattr(planner, "read_cgroup_memory", lambda root=None: real(fake))
    _fake_vm(monkeypatch, total=64 * GIB, available=48 * GIB)
    h = offload_module(model, OffloadConfig.from_preset("budget", device="sim", disk_path=str(path)),
                       budget=VramBudget(None))
    try:
        tiers = [b.tier for b in h.report().blocks]
        assert "disk" in tiers, f"the cgroup is full, yet no block streams from disk: {tiers}"
        assert torch.equal(run(model, (x,)), ref)
    finally:
        h.detach()


# ------------------------------------------------------------------------------------------------------------
# Presets
# ------------------------------------------------------------------------------------------------------------


def test_presets_are_policies():
    for name, policy in PRESETS.items():
        assert 0.0 <= policy.vram_fraction <= 1.0
        assert isinstance(policy.prefetch, int) and policy.prefetch >= 0
        assert isinstance(policy.allow_disk, bool)
        cfg = OffloadConfig.from_preset(name, device="sim")
        assert (cfg.vram_fraction, cfg.prefetch, cfg.allow_disk) == \
            (policy.vram_fraction, policy.prefetch, policy.allow_disk), name
    assert PRESETS["budget"].vram_fraction == 0.0
    assert PRESETS["high_end"].vram_fraction > PRESETS["consumer"].vram_fraction
    with pytest.raises(ValueError) as ei:
        OffloadConfig.from_preset("turbo")
    assert all(n in str(ei.value) for n in PRESETS)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_offloads_bitwise(preset):
    model = _model()
    x = torch.randn(2, 5, 64)
    ref = run(model, (x,))
    budget = VramBudget(aligned_bytes(model))
    h = offload_module(model, OffloadConfig.from_preset(preset, device="sim"), name=preset, budget=budget)
    try:
        for _ in range(3):
            assert torch.equal(run(model, (x,)), ref)
            assert budget.used_bytes <= budget.total_bytes
        if preset == "budget":
            assert resident_modules(h) == [], "the budget preset streams every block"
            assert len(streamed_modules(h)) == 8
            assert all(b.tier != "vram" for b in h.report().blocks)
    finally:
        h.detach()
    assert torch.equal(run(model, (x,)), ref)


def test_high_end_keeps_more_resident_than_consumer():
    x = torch.randn(2, 5, 64)
    resident = {}
    for preset in ("budget", "consumer", "mid_range", "high_end", "auto"):
        model = _model()
        ref = run(model, (x,))
        budget = VramBudget(aligned_bytes(model))  # the same total for each
        h = offload_module(model, OffloadConfig.from_preset(preset, device="sim"), budget=budget)
        try:
            assert torch.equal(run(model, (x,)), ref)
            resident[preset] = (len(resident_modules(h)), h.report().resident_bytes)
        finally:
            h.detach()
    assert resident["budget"][0] == 0
    assert resident["high_end"][0] > resident["consumer"][0], resident
    assert resident["high_end"][1] > resident["consumer"][1], resident
    assert resident["consumer"][0] <= resident["mid_range"][0] <= resident["high_end"][0] <= resident["auto"][0]
    assert resident["auto"][0] == 8, "auto keeps everything resident when it fits"
