"""OffloadReport (DESIGN §3): per-unit tiers and bytes, streamed totals, JSON, and copy/compute overlap on a
bandwidth-limited simulated device."""
from __future__ import annotations

import json
import math

import pytest
import torch

from offload.backends.sim_clock import SimClock
from tests.models import (resident_modules, streamed_modules, ALIGN, CASES, HeavyStack, aligned_bytes, module_path, raw_bytes, run, seeded,
                          streaming_budget, unit_tensors)


def _by_name(rep):
    out = {}
    for b in rep.blocks:
        assert b.name not in out, f"unit {b.name} reported twice"
        out[b.name] = b
    return out


def _setup(sim_cfg, offload, slots=4, prefetch=2):
    """The transformer case streamed, on a simulated device whose own clock takes no time: no measured cost moves a
    block, so what is streamed after the first forward is streamed in every later one."""
    case = CASES["transformer"]
    model = case.build()
    x = case.inputs()
    ref = run(model, x)
    budget = streaming_budget(model, case.blocks(model), slots)
    handle = offload(model, sim_cfg(vram_budget_bytes=budget, prefetch=prefetch, sim_clock=SimClock()))
    return case, model, x, ref, handle, budget


def test_report_tiers_and_bytes(sim_cfg, offload):
    case = CASES["transformer"]
    model = case.build()
    x = case.inputs()
    run(model, x)
    blocks = case.blocks(model)
    # room for the non-block weights, a 3-slot ring and ~2 resident blocks
    budget = streaming_budget(model, blocks, slots=5)
    handle = offload(model, sim_cfg(vram_budget_bytes=budget, prefetch=2))
    run(model, x)
    rep = handle.report()
    names = _by_name(rep)
    streamed = streamed_modules(handle)
    resident = resident_modules(handle)
    assert streamed
    assert not ({id(m) for m in streamed} & {id(m) for m in resident}), "a unit is both streamed and resident"
    tiers = set()
    for u in streamed:
        path = module_path(model, u)
        assert path in names, f"streamed unit {path} missing from report ({sorted(names)})"
        b = names[path]
        assert b.tier in ("pinned", "pageable"), f"{path}: tier {b.tier}"
        tiers.add(b.tier)
        raw, n = raw_bytes(u), len(unit_tensors(u))
        assert raw <= b.bytes <= raw + n * ALIGN, f"{path}: reported {b.bytes} B for {raw} B of tensors"
        assert b.h2d_ms > 0, f"{path}: streamed but no copy time"
        assert b.compute_ms >= 0 and b.stall_ms >= 0
    assert len(tiers) == 1, f"streamed units disagree on host tier: {tiers}"
    for u in resident:
        path = module_path(model, u)
        assert path in names, f"resident unit {path} missing from report"
        assert names[path].tier == "vram"
        raw, n = raw_bytes(u), len(unit_tensors(u))
        assert raw <= names[path].bytes <= raw + n * ALIGN
    resident_unit_bytes = sum(names[module_path(model, u)].bytes for u in resident)
    assert rep.resident_bytes >= resident_unit_bytes
    assert 0 < rep.peak_device_bytes <= budget
    assert 0.0 <= rep.overlap_ratio <= 1.0
    assert rep.effective_gbps > 0 and math.isfinite(rep.effective_gbps)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_total_bytes_streamed_counts_forwards(prefetch, sim_cfg, offload):
    """Since reset_stats, bytes streamed = sum of streamed unit bytes x forwards. The warm-up forward's
    lookahead lands before the reset and each measured forward's lookahead lands inside it, so the count
    is exact in steady state."""
    case, model, x, ref, handle, _ = _setup(sim_cfg, offload, slots=prefetch + 2, prefetch=prefetch)
    run(model, x)
    handle.backend.synchronize()
    handle.reset_stats()
    assert handle.report().total_bytes_streamed == 0
    streamed = streamed_modules(handle)
    assert streamed
    for n in (1, 2, 3):
        assert torch.equal(run(model, x), ref)
        handle.backend.synchronize()
        rep = handle.report()
        names = _by_name(rep)
        padded = n * sum(names[module_path(model, u)].bytes for u in streamed)
        raw = n * sum(raw_bytes(u) for u in streamed)
        assert rep.total_bytes_streamed in (padded, raw), (
            f"after {n} forwards: {rep.total_bytes_streamed} B streamed, expected {padded} B "
            f"(or {raw} B unpadded)")
    handle.reset_stats()
    assert handle.report().total_bytes_streamed == 0


def test_report_to_dict_is_json(sim_cfg, offload):
    case, model, x, ref, handle, _ = _setup(sim_cfg, offload)
    run(model, x)
    rep = handle.report()
    d = rep.to_dict()
    text = json.dumps(d)
    assert json.loads(text) == d
    # the JSON carries the per-unit figures, not just totals
    assert str(rep.total_bytes_streamed) in text
    for b in rep.blocks:
        assert b.name in text
    assert len(rep.blocks) >= len(streamed_modules(handle))


HEAVY = dict(dim=256, depth=6, reps=2)
HEAVY_BATCH = 64
UNIT_COMPUTE_MS = 5.0  # each block's compute on the simulated device's own clock


def _overlap_run(sim_cfg, offload, prefetch, gbps):
    model = seeded(HeavyStack, **HEAVY)
    x = (torch.randn(HEAVY_BATCH, HEAVY["dim"]),)
    ref = run(model, x)
    unit = aligned_bytes(model.blocks[0])
    budget = (prefetch + 1) * unit + 4 * ALIGN
    clock = SimClock()
    clock.charge(model.blocks, UNIT_COMPUTE_MS)
    handle = offload(model, sim_cfg(vram_budget_bytes=budget, prefetch=prefetch, sim_bandwidth_gbps=gbps,
                                    sim_clock=clock))
    assert len(streamed_modules(handle)) >= 4
    assert torch.equal(run(model, x), ref)  # warm-up
    handle.backend.synchronize()
    handle.reset_stats()
    for _ in range(3):
        assert torch.equal(run(model, x), ref)
    handle.backend.synchronize()
    rep = handle.report()
    handle.detach()
    return rep


def test_copies_hide_behind_compute(sim_cfg, offload):
    """A copy takes 40% of a block's compute: with a lookahead of two it hides behind the blocks before it; with
    none, every block waits for its own copy."""
    unit_bytes = aligned_bytes(seeded(HeavyStack, **HEAVY).blocks[0])
    gbps = unit_bytes / (0.4 * UNIT_COMPUTE_MS * 1e-3) / 1e9
    deep = _overlap_run(sim_cfg, offload, prefetch=2, gbps=gbps)
    none = _overlap_run(sim_cfg, offload, prefetch=0, gbps=gbps)
    h2d = sum(b.h2d_ms for b in deep.blocks)
    stall = sum(b.stall_ms for b in deep.blocks)
    assert h2d == pytest.approx(3 * 0.4 * UNIT_COMPUTE_MS * sum(b.tier != "vram" for b in deep.blocks))
    assert deep.overlap_ratio > 0.5, (
        f"prefetch=2: overlap {deep.overlap_ratio:.2f} (h2d {h2d:.1f} ms, stall {stall:.1f} ms)")
    assert stall < 0.5 * h2d, f"prefetch=2: stalled {stall:.1f} ms of {h2d:.1f} ms of copies"
    assert none.overlap_ratio < deep.overlap_ratio, (
        f"prefetch=0 overlap {none.overlap_ratio:.2f} not below prefetch=2 overlap {deep.overlap_ratio:.2f}")
    none_stall = sum(b.stall_ms for b in none.blocks)
    assert none_stall > stall, f"prefetch=0 stalled {none_stall:.1f} ms, prefetch=2 {stall:.1f} ms"


def test_report_before_any_forward(sim_cfg, offload):
    case = CASES["transformer"]
    model = case.build()
    handle = offload(model, sim_cfg(vram_budget_bytes=streaming_budget(model, case.blocks(model), 3), prefetch=2))
    rep = handle.report()
    assert rep.total_bytes_streamed == 0
    assert 0.0 <= rep.overlap_ratio <= 1.0 and math.isfinite(rep.effective_gbps)
    d = rep.to_dict()
    assert json.loads(json.dumps(d)) == d


def test_report_figures_follow_the_simulated_device(sim_cfg, offload):
    """Copy times and bandwidth in the report come from the device's events, not made up: with a 0.05 GB/s device
    and 1 ms latency on its own clock, every streamed copy takes bytes/bandwidth + latency, and the effective
    bandwidth is the bytes over that time."""
    gbps, lat_us = 0.05, 1000.0
    case = CASES["transformer"]
    model = case.build()
    x = case.inputs()
    ref = run(model, x)
    clock = SimClock()
    clock.charge_flops(model, gflops=20.0)
    handle = offload(model, sim_cfg(vram_budget_bytes=streaming_budget(model, case.blocks(model), 2), prefetch=1,
                                    sim_bandwidth_gbps=gbps, sim_latency_us=lat_us, sim_clock=clock))
    run(model, x)
    handle.backend.synchronize()
    handle.reset_stats()
    forwards = 2
    for _ in range(forwards):
        assert torch.equal(run(model, x), ref)
    handle.backend.synchronize()
    rep = handle.report()
    names = _by_name(rep)
    streamed = streamed_modules(handle)
    assert streamed
    for u in streamed:
        b = names[module_path(model, u)]
        assert b.h2d_ms == pytest.approx(forwards * (b.bytes / (gbps * 1e9) * 1e3 + lat_us / 1e3)), b.name
        assert b.compute_ms > 0 and b.calls == forwards
    copied = sum(names[module_path(model, u)].bytes for u in streamed) * forwards
    assert rep.total_bytes_streamed == copied
    assert rep.effective_gbps == pytest.approx(copied / (rep.h2d_ms * 1e6))
    assert rep.effective_gbps < gbps, "latency comes on top of bytes / bandwidth"


def test_pageable_tier_when_pinning_is_off(sim_cfg, offload):
    case = CASES["transformer"]
    model = case.build()
    x = case.inputs()
    ref = run(model, x)
    handle = offload(model, sim_cfg(vram_budget_bytes=streaming_budget(model, case.blocks(model), 3), prefetch=2,
                                    pin_memory=False))
    assert torch.equal(run(model, x), ref)
    names = _by_name(handle.report())
    for u in streamed_modules(handle):
        assert names[module_path(model, u)].tier == "pageable"


def test_profile_mode_keeps_outputs_and_report(sim_cfg, offload):
    case = CASES["dit"]
    model = case.build()
    x = case.inputs()
    ref = run(model, x)
    handle = offload(model, sim_cfg(vram_budget_bytes=streaming_budget(model, case.blocks(model), 3), prefetch=2,
                                    profile=True))
    for _ in range(2):
        assert torch.equal(run(model, x), ref)
    d = handle.report().to_dict()
    assert json.loads(json.dumps(d)) == d
    names = _by_name(handle.report())
    for u in streamed_modules(handle):
        b = names[module_path(model, u)]
        assert b.h2d_ms > 0 and b.compute_ms > 0


def test_next_forward_is_prefetched_across_the_gap(sim_cfg, offload):
    """DESIGN §4.4: at the end of a forward the first streamed units of the next forward are already on their
    way. With idle time between forwards (a sampler step, a UI round trip) the first unit must not stall; without
    it, the first unit waits for its copy (so the test can tell)."""
    case = CASES["transformer"]
    model = case.build()
    x = case.inputs()
    ref = run(model, x)
    unit = aligned_bytes(model.blocks[0])
    copy_ms = 20.0
    clock = SimClock()
    clock.charge(case.blocks(model), 1.0)  # far less than a copy: nothing but the gap can hide one
    handle = offload(model, sim_cfg(vram_budget_bytes=streaming_budget(model, case.blocks(model), 3), prefetch=2,
                                    sim_bandwidth_gbps=unit / (copy_ms * 1e-3) / 1e9, sim_clock=clock))

    def first_stall(gap_ms):
        handle.reset_stats()
        for _ in range(3):
            clock.advance(gap_ms)  # idle: the lookahead copies go on in the gap
            assert torch.equal(run(model, x), ref)
        first = module_path(model, streamed_modules(handle)[0])  # the plan from costs keeps the first ones resident
        return _by_name(handle.report())[first]

    for _ in range(3):
        run(model, x)  # measured: the plan from costs is in place
    idle = first_stall(5 * copy_ms)
    assert idle.h2d_ms > 0
    assert idle.stall_ms == 0.0, f"{first} stalled {idle.stall_ms:.1f} ms: the next forward was not prefetched"
    busy = first_stall(0.0)
    assert busy.stall_ms > 0, "back to back, the first unit's copy cannot hide behind a 1 ms compute"
