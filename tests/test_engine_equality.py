"""Offloading moves bytes, it never changes them (DESIGN §3): bitwise-equal outputs on every model shape,
budget, prefetch depth and preset."""
from __future__ import annotations

import pytest
import torch

from tests.models import CASES, TransformerStack, run, seeded, streaming_budget

CASE_NAMES = list(CASES)
PRESET_NAMES = ["auto", "high_end", "mid_range", "consumer", "budget"]


def _reference(case):
    model = case.build()
    inputs = [case.inputs() for _ in range(3)]
    refs = [run(model, x) for x in inputs]
    return model, inputs, refs


@pytest.mark.parametrize("case_name", CASE_NAMES)
def test_streamed_outputs_bitwise_equal(case_name, sim_cfg, offload):
    case = CASES[case_name]
    model, inputs, refs = _reference(case)
    budget = streaming_budget(model, case.blocks(model), slots=3)
    handle = offload(model, sim_cfg(vram_budget_bytes=budget, prefetch=2))
    assert handle.streamed_unit_modules(), "a budget this small must stream some units"
    for rnd in range(2):  # several forwards in a row, and the same inputs again
        for x, ref in zip(inputs, refs):
            out = run(model, x)
            assert torch.equal(out, ref), f"{case_name}: forward differs (round {rnd})"


@pytest.mark.parametrize("prefetch", [0, 1, 2, 4])
def test_prefetch_depths_bitwise_equal(prefetch, sim_cfg, offload):
    case = CASES["transformer"]
    model, inputs, refs = _reference(case)
    budget = streaming_budget(model, case.blocks(model), slots=prefetch + 1)
    handle = offload(model, sim_cfg(vram_budget_bytes=budget, prefetch=prefetch))
    assert len(handle.streamed_unit_modules()) >= 3
    for _ in range(2):
        for x, ref in zip(inputs, refs):
            assert torch.equal(run(model, x), ref)


@pytest.mark.parametrize("slots", [1, 2, 5])
def test_dit_budgets_bitwise_equal(slots, sim_cfg, offload):
    """The DiT's two block lists under tight to roomy budgets (prefetch shrinks to fit where it must)."""
    case = CASES["dit"]
    model, inputs, refs = _reference(case)
    budget = streaming_budget(model, case.blocks(model), slots=slots)
    offload(model, sim_cfg(vram_budget_bytes=budget, prefetch=min(2, slots - 1)))
    for x, ref in zip(inputs, refs):
        assert torch.equal(run(model, x), ref)


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_every_preset_bitwise_equal(preset, offload):
    from offload import OffloadConfig

    case = CASES["dit"]
    model, inputs, refs = _reference(case)
    cfg = OffloadConfig.from_preset(preset, device="sim")
    assert cfg.device == "sim"
    offload(model, cfg)
    for x, ref in zip(inputs, refs):
        assert torch.equal(run(model, x), ref), preset


def test_auto_budget_bitwise_equal(sim_cfg, offload):
    """No explicit budget: the planner decides; outputs must not care."""
    case = CASES["decoder"]
    model, inputs, refs = _reference(case)
    offload(model, sim_cfg())
    for x, ref in zip(inputs, refs):
        assert torch.equal(run(model, x), ref)


def test_varying_input_shapes(sim_cfg, offload):
    case = CASES["transformer"]
    model = case.build()
    shapes = [(1, 3, 64), (4, 17, 64), (2, 1, 64), (3, 32, 64)]
    xs = [torch.randn(*s) for s in shapes]
    refs = [run(model, (x,)) for x in xs]
    offload(model, sim_cfg(vram_budget_bytes=streaming_budget(model, case.blocks(model), 3), prefetch=2))
    for x, ref in zip(xs, refs):
        assert torch.equal(run(model, (x,)), ref)


def test_forward_with_grad_enabled(sim_cfg, offload):
    """Plain `model(x)` outside no_grad (user code often forgets it) must still give the same values."""
    case = CASES["transformer"]
    model = case.build()
    x = case.inputs()
    ref = model(*x).detach()
    offload(model, sim_cfg(vram_budget_bytes=streaming_budget(model, case.blocks(model), 3), prefetch=2))
    for _ in range(2):
        assert torch.equal(model(*x).detach(), ref)


def test_inference_mode_then_grad_mode(sim_cfg, offload):
    """ComfyUI samples under torch.inference_mode(); a later ordinary forward on the same model must work
    (slots or views created under inference mode must not poison normal-mode forwards)."""
    case = CASES["transformer"]
    model = case.build()
    x = case.inputs()
    ref = run(model, x)
    offload(model, sim_cfg(vram_budget_bytes=streaming_budget(model, case.blocks(model), 3), prefetch=2))
    with torch.inference_mode():
        assert torch.equal(model(*x), ref)
    assert torch.equal(model(*x).detach(), ref)
    with torch.inference_mode():
        assert torch.equal(model(*x), ref)


def test_two_models_share_one_budget(sim_cfg):
    """Two models on one VramBudget smaller than both: each stays correct, together they fit the budget,
    and priority changes keep them correct."""
    from offload import VramBudget, offload_module

    case = CASES["transformer"]
    a = case.build()
    b = seeded(TransformerStack, dim=64, depth=6, heads=4, seed=1)
    x = case.inputs()
    ref_a, ref_b = run(a, x), run(b, x)
    per_model = streaming_budget(a, case.blocks(a), slots=3)
    shared = VramBudget(2 * per_model)
    ha = offload_module(a, sim_cfg(vram_budget_bytes=per_model, prefetch=2), name="a", priority=0, budget=shared)
    hb = offload_module(b, sim_cfg(vram_budget_bytes=per_model, prefetch=2), name="b", priority=1, budget=shared)
    try:
        for step in range(3):
            assert torch.equal(run(a, x), ref_a)
            assert torch.equal(run(b, x), ref_b)
            assert shared.used_bytes <= shared.total_bytes
            assert ha.device_bytes() + hb.device_bytes() <= shared.total_bytes
            if step == 0:
                ha.set_priority(5)
            if step == 1:
                hb.prioritize()
    finally:
        ha.detach()
        hb.detach()
    assert shared.used_bytes == 0, "detached models must give their share of the budget back"
    assert torch.equal(run(a, x), ref_a)
    assert torch.equal(run(b, x), ref_b)
