"""Offloading moves bytes, it never changes them (DESIGN §3): bitwise-equal outputs on every model shape,
budget, prefetch depth and preset."""
from __future__ import annotations

import pytest
import torch

from tests.models import (resident_modules, streamed_modules, CASES, ReorderStack, ReusedBlockStack, TableStack, TransformerStack, TransposedStack,
                          run, seeded, streaming_budget)

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
    assert streamed_modules(handle), "a budget this small must stream some units"
    for rnd in range(2):  # several forwards in a row, and the same inputs again
        for x, ref in zip(inputs, refs):
            out = run(model, x)
            assert torch.equal(out, ref), f"{case_name}: forward differs (round {rnd})"


@pytest.mark.parametrize("prefetch", [0, 1, 2, 4, 16])
def test_prefetch_depths_bitwise_equal(prefetch, sim_cfg, offload):
    case = CASES["transformer"]
    model, inputs, refs = _reference(case)
    # prefetch=16 asks for more lookahead than there are units: the ring must clamp, not wrap onto itself
    budget = streaming_budget(model, case.blocks(model), slots=min(prefetch, 4) + 1)
    handle = offload(model, sim_cfg(vram_budget_bytes=budget, prefetch=prefetch))
    assert len(streamed_modules(handle)) >= 2
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


def test_block_order_changing_between_forwards(sim_cfg, offload):
    """Forwards that skip, repeat or reorder blocks (skip-layer patches, early exit): the prefetcher's guess
    of the next unit is wrong, and the outputs must still be exact."""
    model = seeded(ReorderStack, dim=64, depth=6)
    x = (torch.randn(2, 5, 64),)
    orders = [None, [5, 4, 3, 2, 1, 0], [0, 2, 4], None, [1, 1, 3, 3, 5], [0], None]
    refs = []
    for o in orders:
        model.order = o
        refs.append(run(model, x))
    blocks = list(model.blocks)
    offload(model, sim_cfg(vram_budget_bytes=streaming_budget(model, blocks, 3), prefetch=2))
    for _ in range(2):
        for o, ref in zip(orders, refs):
            model.order = o
            assert torch.equal(run(model, x), ref), f"order {o}"


def test_block_object_reused_at_several_depths(sim_cfg, offload):
    model = seeded(ReusedBlockStack, dim=64)
    x = (torch.randn(2, 5, 64),)
    ref = run(model, x)
    distinct = list({id(b): b for b in model.blocks}.values())
    offload(model, sim_cfg(vram_budget_bytes=streaming_budget(model, distinct, 2), prefetch=1))
    for _ in range(3):
        assert torch.equal(run(model, x), ref)


def test_unit_called_on_its_own(sim_cfg, offload):
    """A streamed block called directly, outside the model's forward (feature extraction, a node running one
    block): its weights must still be on the device for that call."""
    case = CASES["transformer"]
    model = case.build()
    x = case.inputs()[0]
    with torch.no_grad():
        h = model.embed(x)
        block_refs = [blk(h) for blk in model.blocks]
        ref = model(x)
    handle = offload(model, sim_cfg(vram_budget_bytes=streaming_budget(model, case.blocks(model), 3), prefetch=2))
    streamed = streamed_modules(handle)
    assert streamed
    with torch.no_grad():
        for i in (4, 1, 4):
            assert torch.equal(model.blocks[i](h), block_refs[i]), f"blocks.{i} called alone"
        assert torch.equal(model(x), ref)
        assert torch.equal(model.blocks[2](h), block_refs[2])
        assert torch.equal(model(x), ref)


def test_weights_changed_in_place_are_what_streams(sim_cfg, offload):
    """Host memory is the truth (DESIGN §4.5): weights loaded in place after offloading (load_state_dict,
    a merged LoRA) must be what the next forward computes with, including units whose copy for that forward
    was already started by the previous forward's lookahead."""
    case = CASES["transformer"]
    model = case.build()
    other = seeded(TransformerStack, dim=64, depth=6, heads=4, seed=7)
    x = case.inputs()
    ref_model, ref_other = run(model, x), run(other, x)
    handle = offload(model, sim_cfg(vram_budget_bytes=streaming_budget(model, case.blocks(model), 3), prefetch=2))
    assert streamed_modules(handle)
    assert torch.equal(run(model, x), ref_model)  # lookahead for the next forward is now in flight
    model.load_state_dict(other.state_dict())
    assert torch.equal(run(model, x), ref_other), "stale weights used after load_state_dict"
    assert torch.equal(run(model, x), ref_other)


def test_in_place_update_of_resident_units_survives_replanning(sim_cfg, offload):
    """Weights written in place while a unit is resident (its params point at device memory) must reach the
    host master too: after unload() the unit streams from the host again, and must stream the new bytes."""
    case = CASES["transformer"]
    model = case.build()
    other = seeded(TransformerStack, dim=64, depth=6, heads=4, seed=7)
    x = case.inputs()
    ref_other = run(other, x)
    handle = offload(model, sim_cfg(prefetch=2))  # roomy: the planner keeps units resident
    run(model, x)
    model.load_state_dict(other.state_dict())
    assert torch.equal(run(model, x), ref_other)
    handle.unload()  # everything back to host masters; the next forward re-plans
    assert torch.equal(run(model, x), ref_other), "host masters lost the in-place update made while resident"


def test_gapped_strided_tensors_stay_exact(sim_cfg, offload):
    """A column-sliced weight and a strided buffer (non-dense layouts): offloading moves bytes, it must not
    change which kernel runs, so results stay bitwise equal (DESIGN §3)."""
    model = seeded(TransposedStack, dim=64, depth=4, strided=True)
    x = (torch.randn(2, 5, 64),)
    ref = run(model, x)
    offload(model, sim_cfg(vram_budget_bytes=streaming_budget(model, list(model.blocks), 3), prefetch=2))
    for _ in range(2):
        assert torch.equal(run(model, x), ref)


@pytest.mark.parametrize("how", ["data_copy", "no_grad_copy"])
def test_weights_written_through_data_are_what_streams(how, sim_cfg, offload):
    """In-place weight writes between forwards must be what the next forward computes with, also for the units
    whose copy the previous forward's lookahead already started. `p.copy_()` is noticed by the engine on its
    own (version counters); `p.data.copy_()` (comfy.utils.copy_to_param's idiom) bypasses version counters,
    so the engine's documented contract is that the writer calls `handle.refresh()` afterwards."""
    case = CASES["transformer"]
    model = case.build()
    other = seeded(TransformerStack, dim=64, depth=6, heads=4, seed=7)
    x = case.inputs()
    ref_other = run(other, x)
    handle = offload(model, sim_cfg(vram_budget_bytes=streaming_budget(model, case.blocks(model), 3), prefetch=2))
    assert streamed_modules(handle)
    run(model, x)  # lookahead for the next forward is now in flight
    new = dict(other.named_parameters())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if how == "data_copy":
                p.data.copy_(new[name])
            else:
                p.copy_(new[name])
    if how == "data_copy":
        handle.refresh()
    assert torch.equal(run(model, x), ref_other), "stale weights used after an in-place write"
    assert torch.equal(run(model, x), ref_other)


def test_resident_weights_written_through_data_survive_eviction(sim_cfg, offload):
    case = CASES["transformer"]
    model = case.build()
    other = seeded(TransformerStack, dim=64, depth=6, heads=4, seed=7)
    x = case.inputs()
    ref_other = run(other, x)
    handle = offload(model, sim_cfg(prefetch=2))  # roomy: units resident
    run(model, x)
    assert resident_modules(handle)
    new = dict(other.named_parameters())
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.data.copy_(new[name])
    handle.refresh()  # .data writes are invisible to version counters: the writer says so
    assert torch.equal(run(model, x), ref_other)
    handle.unload()
    assert torch.equal(run(model, x), ref_other), "in-place write to a resident unit lost when it was evicted"


@pytest.mark.parametrize("prefetch", [0, 2])
def test_unit_output_aliasing_its_weights(prefetch, sim_cfg, offload):
    """A unit that returns a view of its own tensor, used after the unit finished: the slot it points into is
    reused for the next unit, so the engine must not let that view change under the caller."""
    model = seeded(TableStack, dim=64, depth=6)
    x = (torch.randn(2, 8, 64),)
    ref = run(model, x)
    offload(model, sim_cfg(vram_budget_bytes=streaming_budget(model, list(model.blocks), prefetch + 1),
                           prefetch=prefetch))
    for _ in range(2):
        assert torch.equal(run(model, x), ref)


def test_forward_on_another_thread(sim_cfg, offload):
    """ComfyUI runs prompts on a worker thread while models may be set up elsewhere: offload on one thread,
    run on another (and back), outputs exact."""
    import threading

    case = CASES["dit"]
    model = case.build()
    x = case.inputs()
    ref = run(model, x)
    offload(model, sim_cfg(vram_budget_bytes=streaming_budget(model, case.blocks(model), 3), prefetch=2))
    results, errors = [], []

    def worker():
        try:
            with torch.inference_mode():
                for _ in range(2):
                    results.append(torch.equal(model(*x), ref))
        except Exception as err:  # surfaced below
            errors.append(err)

    t = threading.Thread(target=worker)
    t.start()
    t.join(300)  # a guard against a hang only
    assert not t.is_alive(), "forward on a worker thread hung"
    assert not errors, errors
    assert results == [True, True]
    assert torch.equal(run(model, x), ref)


@pytest.mark.parametrize("case_name", ["transformer", "decoder"])
def test_backward_is_exact_or_refused(case_name, sim_cfg, offload):
    """Offloading is for inference, but plain PyTorch users can call backward (LoRA training on an offloaded
    base). Slots are overwritten by later units while autograd still holds views of them, so backward must
    either produce the resident gradients or raise; silently wrong gradients (a log line is not enough) are
    the one unacceptable outcome."""
    case = CASES[case_name]
    model = case.build()
    x = case.inputs()
    ref_out = run(model, x)
    for p in model.parameters():
        p.requires_grad_(True)
    model(*x).float().square().mean().backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    offload(model, sim_cfg(vram_budget_bytes=streaming_budget(model, case.blocks(model), 2), prefetch=1))
    try:
        model(*x).float().square().mean().backward()
    except Exception as err:  # refused: acceptable, if it says why and inference still works
        assert "backward" in str(err).lower(), f"unclear refusal: {type(err).__name__}: {err}"
        assert torch.equal(run(model, x), ref_out)
        return
    wrong = [n for n, p in model.named_parameters() if p.grad is None or not torch.equal(p.grad, ref[n])]
    assert not wrong, f"{len(wrong)} of {len(ref)} gradients silently wrong after backward, e.g. {wrong[:3]}"
