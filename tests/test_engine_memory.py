"""Where the bytes live (DESIGN §4, §6): parameters point at device slots only during their unit's forward,
host RAM holds each weight once, the device budget is never exceeded, errors and unload leave a usable model."""
from __future__ import annotations

import gc
import logging
import re
import warnings

import pytest
import torch

from offload.backends.sim_clock import SimClock
from tests.models import (ALIGN, CASES, Boom, LayersModel, MLPBlock, RaisingStack, TransformerStack, aligned_bytes,
                          module_path, param_inner_tensors, raw_bytes, run, same_tensor, seeded, snapshot,
                          streamed_modules, streaming_budget)


def _param_tensors(unit):
    """(name, plain tensor) for every parameter's bytes in the unit as the module sees it right now."""
    out = []
    for name, p in unit.named_parameters():
        for i, t in enumerate(param_inner_tensors(p)):
            out.append((f"{name}[{i}]", t))
    return out


def _attach_streaming(case_name, sim_cfg, offload, slots=3, prefetch=2):
    """The case streamed under a tight budget, on a simulated device with a clock of its own where nothing takes
    time: the plan from measured costs keeps the first plan's units where they are, whatever the host's load."""
    case = CASES[case_name]
    model = case.build()
    x = case.inputs()
    ref = run(model, x)
    handle = offload(model, sim_cfg(vram_budget_bytes=streaming_budget(model, case.blocks(model), slots),
                                    prefetch=prefetch, sim_clock=SimClock()))
    streamed = streamed_modules(handle)
    assert streamed, "expected streamed units under a tight budget"
    return case, model, x, ref, handle, streamed


@pytest.mark.parametrize("case_name", ["transformer", "fp8_e4m3", "int8_subclass"])
def test_params_point_at_slots_only_during_forward(case_name, sim_cfg, offload):
    case, model, x, ref, handle, streamed = _attach_streaming(case_name, sim_cfg, offload)
    backend = handle.backend
    units = [streamed[0], streamed[len(streamed) // 2], streamed[-1]]
    host_ptrs = {id(u): {n: t.data_ptr() for n, t in _param_tensors(u)} for u in units}
    for u in units:
        for n, t in _param_tensors(u):
            assert not backend.owns(t), f"{module_path(model, u)}.{n} is on the device between forwards"

    seen = {}

    def make_hook(u):
        def hook(mod, args):
            # registered after offload_module, so it runs after the engine's swap-in
            seen[id(u)] = [(n, backend.owns(t), t.data_ptr()) for n, t in _param_tensors(u)]
        return hook

    hooks = [u.register_forward_pre_hook(make_hook(u)) for u in units]
    try:
        for _ in range(3):
            seen.clear()
            assert torch.equal(run(model, x), ref)
            for u in units:
                path = module_path(model, u)
                assert id(u) in seen, f"pre-hook of {path} never ran"
                for n, owned, ptr in seen[id(u)]:
                    assert owned, f"{path}.{n} not in device slot memory during its forward"
                    assert ptr != host_ptrs[id(u)][n], f"{path}.{n} still points at the host master in forward"
                # between forwards: back on the same host master, no new copy
                for n, t in _param_tensors(u):
                    assert not backend.owns(t), f"{path}.{n} left on the device after its forward"
                    assert t.data_ptr() == host_ptrs[id(u)][n], f"{path}.{n} host pointer changed"
    finally:
        for h in hooks:
            h.remove()


def test_host_values_unchanged_between_forwards(sim_cfg, offload):
    """Host masters are the truth: their bytes never change, and state_dict() reads them."""
    case = CASES["tied_buffers"]
    model = case.build()
    x = case.inputs()
    ref = run(model, x)
    before = snapshot(model)
    offload(model, sim_cfg(vram_budget_bytes=streaming_budget(model, case.blocks(model), 3), prefetch=2))
    for _ in range(3):
        assert torch.equal(run(model, x), ref)
        sd = model.state_dict()
        assert list(sd) == list(before)
        for k, v in before.items():
            assert same_tensor(sd[k].detach(), v), k


def test_host_ram_holds_each_weight_once(sim_cfg, offload):
    case = CASES["transformer"]
    model = case.build()
    x = case.inputs()
    ref = run(model, x)
    model_bytes = raw_bytes(model)
    # weak handles on every original storage (no strong reference kept)
    weak = [p.untyped_storage()._weak_ref() for p in model.parameters()]
    handle = offload(model, sim_cfg(vram_budget_bytes=streaming_budget(model, case.blocks(model), 3), prefetch=2))
    streamed = streamed_modules(handle)
    assert len(streamed) >= 2
    run(model, x)
    gc.collect()
    try:
        # every streamed unit's params are views of one staging storage
        for u in streamed:
            storages = {t.untyped_storage().data_ptr() for _, t in _param_tensors(u)}
            assert len(storages) == 1, f"{module_path(model, u)}: params spread over {len(storages)} storages"
        # the streamed units' original storages were released (no second host copy)
        streamed_ids = {id(p) for u in streamed for p in u.parameters()}
        params = list(model.parameters())
        for p, w in zip(params, weak):
            if id(p) in streamed_ids:
                assert torch.UntypedStorage._expired(w), "original storage of a streamed param still alive"
        # distinct storages behind all params add up to about the model size
        distinct = {}
        for p in params:
            for t in param_inner_tensors(p):
                s = t.untyped_storage()
                distinct[s.data_ptr()] = s.nbytes()
        total = sum(distinct.values())
        n_tensors = sum(len(param_inner_tensors(p)) for p in params) + sum(1 for _ in model.buffers())
        assert total <= model_bytes + n_tensors * ALIGN + 4096, (
            f"params' storages hold {total} B for a {model_bytes} B model: a second copy exists")
    finally:
        for w in weak:
            torch.UntypedStorage._free_weak_ref(w)
    assert torch.equal(run(model, x), ref)


@pytest.mark.parametrize("prefetch", [1, 2])
def test_device_budget_never_exceeded(prefetch, sim_cfg, offload):
    case = CASES["dit"]
    model = case.build()
    x = case.inputs()
    ref = run(model, x)
    budget = streaming_budget(model, case.blocks(model), slots=prefetch + 1)
    assert budget < aligned_bytes(model)
    handle = offload(model, sim_cfg(vram_budget_bytes=budget, prefetch=prefetch))
    backend = handle.backend
    assert backend.peak_bytes <= budget, "setup already went over the budget"
    backend.reset_peak()
    for _ in range(3):
        assert torch.equal(run(model, x), ref)
        assert handle.device_bytes() <= budget
    backend.synchronize()
    assert 0 < backend.peak_bytes <= budget, f"sim peak {backend.peak_bytes} B > budget {budget} B"
    rep = handle.report()
    assert 0 < rep.peak_device_bytes <= budget


def _warned(caplog, record, pattern):
    msgs = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    msgs += [str(w.message) for w in record]
    return [m for m in msgs if re.search(pattern, m, re.I)], msgs


def test_budget_too_small_for_ring_shrinks_prefetch(sim_cfg, offload, caplog):
    case = CASES["transformer"]
    model = case.build()
    x = case.inputs()
    ref = run(model, x)
    budget = streaming_budget(model, case.blocks(model), slots=2)  # room for 2 slots, prefetch=4 wants 5
    with caplog.at_level(logging.WARNING), warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        handle = offload(model, sim_cfg(vram_budget_bytes=budget, prefetch=4))
        for _ in range(2):
            assert torch.equal(run(model, x), ref)
    hits, msgs = _warned(caplog, rec, r"prefetch|slot|ring|budget")
    assert hits, f"no warning about shrinking prefetch; got {msgs}"
    handle.backend.synchronize()
    assert handle.backend.peak_bytes <= budget
    assert handle.report().peak_device_bytes <= budget


def _assert_clear_slot_error(excinfo, model, unit_paths):
    err = excinfo.value
    assert isinstance(err, (ValueError, MemoryError)) or type(err).__module__.startswith("offload"), (
        f"unexpected error type {type(err).__name__}: {err}")
    msg = str(err)
    assert any(p in msg for p in unit_paths), f"error does not name the unit: {msg!r}"
    assert re.search(r"\d", msg), f"error does not give the unit's size: {msg!r}"


def test_budget_below_one_slot_is_a_clear_error(sim_cfg, offload):
    case = CASES["transformer"]
    model = case.build()
    x = case.inputs()
    blocks = case.blocks(model)
    rest = aligned_bytes(model) - sum(aligned_bytes(b) for b in blocks)
    budget = rest + aligned_bytes(blocks[0]) // 2
    paths = [module_path(model, b) for b in blocks]
    with pytest.raises(Exception) as excinfo:
        offload(model, sim_cfg(vram_budget_bytes=budget, prefetch=2))
        run(model, x)
    _assert_clear_slot_error(excinfo, model, paths)


def test_sim_capacity_smaller_than_plan_shrinks(sim_cfg, offload):
    """The config asks for nothing specific; the simulated device only has room for ~2.5 slots."""
    case = CASES["transformer"]
    model = case.build()
    x = case.inputs()
    ref = run(model, x)
    blocks = case.blocks(model)
    rest = aligned_bytes(model) - sum(aligned_bytes(b) for b in blocks)
    cap = rest + (5 * aligned_bytes(blocks[0])) // 2 + 4 * ALIGN
    handle = offload(model, sim_cfg(sim_capacity_bytes=cap, prefetch=4))
    assert handle.backend.capacity_bytes == cap
    for _ in range(2):
        assert torch.equal(run(model, x), ref)
    handle.backend.synchronize()
    assert handle.backend.used_bytes <= cap
    assert handle.backend.peak_bytes <= cap
    assert streamed_modules(handle)


def test_sim_capacity_below_one_slot_is_a_clear_error(sim_cfg, offload):
    case = CASES["transformer"]
    model = case.build()
    x = case.inputs()
    blocks = case.blocks(model)
    rest = aligned_bytes(model) - sum(aligned_bytes(b) for b in blocks)
    cap = rest + aligned_bytes(blocks[0]) // 3
    paths = [module_path(model, b) for b in blocks]
    with pytest.raises(Exception) as excinfo:
        offload(model, sim_cfg(sim_capacity_bytes=cap, prefetch=2))
        run(model, x)
    _assert_clear_slot_error(excinfo, model, paths)


def _set_explode(model, where, on):
    if where == "head":
        model.explode_in_head = on
    else:
        model.blocks[where].explode = on


@pytest.mark.parametrize("where", [0, 3, 5, "head"])
def test_exception_inside_unit_leaves_model_usable(where, sim_cfg, offload):
    model = seeded(RaisingStack, dim=64, depth=6)
    x = (torch.randn(2, 5, 64),)
    ref = run(model, x)
    blocks = list(model.blocks)
    handle = offload(model, sim_cfg(vram_budget_bytes=streaming_budget(model, blocks, 3), prefetch=2))
    assert torch.equal(run(model, x), ref)
    handle.backend.synchronize()
    steady_handle, steady_backend = handle.device_bytes(), handle.backend.used_bytes
    for _ in range(3):  # repeated interrupts must not leak slots either
        _set_explode(model, where, True)
        with pytest.raises(Boom):
            run(model, x)
        _set_explode(model, where, False)
    for _ in range(2):
        assert torch.equal(run(model, x), ref)
    handle.backend.synchronize()
    assert handle.device_bytes() == steady_handle
    assert handle.backend.used_bytes == steady_backend
    for b in blocks:  # after a clean forward nothing streamed is left on the device
        if any(b is s for s in streamed_modules(handle)):
            for n, t in _param_tensors(b):
                assert not handle.backend.owns(t), n


@pytest.mark.parametrize("fraction", [0.0, 0.5, 0.95, 1.0])
def test_unload_partial_then_forward(fraction, sim_cfg, offload):
    """ComfyUI's partially_unload contract: free at least what is asked (else it detaches the whole model)."""
    case = CASES["decoder"]
    model = case.build()
    x = case.inputs()
    ref = run(model, x)
    handle = offload(model, sim_cfg(prefetch=2))  # roomy: the planner may keep much resident
    assert torch.equal(run(model, x), ref)
    handle.backend.synchronize()
    held = handle.device_bytes()
    assert held > 0
    ask = int(held * fraction)
    freed = handle.unload(ask)
    assert freed >= ask, f"asked for {ask} B, unload reports {freed} B"
    assert handle.device_bytes() <= held - ask
    for _ in range(2):
        assert torch.equal(run(model, x), ref)


def test_unload_all_then_forward(sim_cfg, offload):
    case = CASES["transformer"]
    model = case.build()
    x = case.inputs()
    ref = run(model, x)
    handle = offload(model, sim_cfg(vram_budget_bytes=streaming_budget(model, case.blocks(model), 4), prefetch=2))
    assert torch.equal(run(model, x), ref)
    handle.backend.synchronize()
    held = handle.device_bytes()
    freed = handle.unload()
    handle.backend.synchronize()
    assert freed >= held
    assert handle.device_bytes() == 0
    assert handle.backend.used_bytes == 0
    for p in model.parameters():
        for t in param_inner_tensors(p):
            assert not handle.backend.owns(t)
    assert torch.equal(run(model, x), ref)
    assert torch.equal(run(model, x), ref)


def test_contended_budget_follows_priority(sim_cfg):
    """Two equal models, one budget that cannot hold both fully (DESIGN §2 budget.py): each gets its floor,
    the rest goes by priority; both stay exact and together never exceed the budget."""
    from offload import VramBudget, offload_module

    case = CASES["transformer"]
    a = case.build()
    b = seeded(TransformerStack, dim=64, depth=6, heads=4, seed=3)
    x = case.inputs()
    ref_a, ref_b = run(a, x), run(b, x)
    full = aligned_bytes(a)
    shared = VramBudget(int(full * 1.3))  # one model resident, the other mostly streaming
    ha = offload_module(a, sim_cfg(prefetch=1), name="a", priority=0, budget=shared)
    hb = offload_module(b, sim_cfg(prefetch=1), name="b", priority=0, budget=shared)
    try:
        def step():
            assert torch.equal(run(a, x), ref_a)
            assert ha.device_bytes() + hb.device_bytes() <= shared.total_bytes
            assert torch.equal(run(b, x), ref_b)
            assert ha.device_bytes() + hb.device_bytes() <= shared.total_bytes
            assert shared.used_bytes <= shared.total_bytes

        step()
        hb.prioritize()
        step()
        step()
        assert hb.device_bytes() >= ha.device_bytes(), (
            f"prioritized model holds {hb.device_bytes()} B, the other {ha.device_bytes()} B")
        ha.set_priority(10)
        ha.prioritize()
        step()
        step()
        assert ha.device_bytes() >= hb.device_bytes(), (
            f"prioritized model holds {ha.device_bytes()} B, the other {hb.device_bytes()} B")
    finally:
        ha.detach()
        hb.detach()


def test_zero_budget_is_a_clear_error(sim_cfg, offload):
    """Nothing fits, not even the weights outside the blocks: a clear error saying what does not fit."""
    model = seeded(RaisingStack, dim=64, depth=6)
    with pytest.raises(Exception) as excinfo:
        offload(model, sim_cfg(vram_budget_bytes=0, prefetch=1))
        run(model, (torch.randn(2, 5, 64),))
    _assert_clear_slot_error(excinfo, model, ["blocks.", "head", "non-block", "budget"])
    for m in model.modules():
        assert not m._forward_pre_hooks and not m._forward_hooks, "refused model left half-attached"


def test_shrinking_the_shared_budget_at_runtime(sim_cfg):
    """The VRAM Budget node changes the total between prompts (DESIGN §1): the model shrinks to fit and
    stays exact; growing it back lets it grow again."""
    from offload import VramBudget, offload_module

    case = CASES["transformer"]
    model = case.build()
    x = case.inputs()
    ref = run(model, x)
    shared = VramBudget(aligned_bytes(model) * 2)
    handle = offload_module(model, sim_cfg(prefetch=2), budget=shared)
    try:
        assert torch.equal(run(model, x), ref)
        roomy = handle.device_bytes()
        small = streaming_budget(model, case.blocks(model), 2)
        assert small < roomy, "the roomy plan should hold more than two slots' worth"
        shared.set_total(small)
        for _ in range(2):
            assert torch.equal(run(model, x), ref)
            assert handle.device_bytes() <= small
            assert shared.used_bytes <= small
        assert streamed_modules(handle)
        shared.set_total(aligned_bytes(model) * 2)
        handle.prioritize()
        assert torch.equal(run(model, x), ref)
        assert torch.equal(run(model, x), ref)
        assert handle.device_bytes() > small
    finally:
        handle.detach()


def test_detach_gives_device_memory_back(sim_cfg):
    from offload import VramBudget, offload_module

    case = CASES["dit"]
    model = case.build()
    x = case.inputs()
    cfg = sim_cfg(vram_budget_bytes=streaming_budget(model, case.blocks(model), 3), prefetch=2)
    budget = VramBudget(None)
    h = offload_module(model, cfg, budget=budget)
    backend = h.backend
    h.detach()  # the sim device is shared per settings: measure the baseline with nothing of ours on it
    backend.synchronize()
    baseline = backend.used_bytes
    for _ in range(2):
        h = offload_module(model, cfg, budget=budget)
        run(model, x)
        assert backend.used_bytes > baseline
        h.detach()
        backend.synchronize()
        assert backend.used_bytes == baseline, f"{backend.used_bytes - baseline} device bytes leaked by detach"
        assert budget.used_bytes == 0


def test_offloading_twice_is_refused_clearly(sim_cfg, offload):
    case = CASES["transformer"]
    model = case.build()
    x = case.inputs()
    ref = run(model, x)
    cfg = sim_cfg(vram_budget_bytes=streaming_budget(model, case.blocks(model), 3), prefetch=2)
    offload(model, cfg)
    with pytest.raises(ValueError) as ei:
        offload(model, cfg)
    assert "detach" in str(ei.value) or "already" in str(ei.value)
    for _ in range(2):
        assert torch.equal(run(model, x), ref)


class _Outer(torch.nn.Module):
    """Calls another offloaded model (not a registered submodule) between its own blocks."""

    def __init__(self, inner):
        super().__init__()
        self.pre = torch.nn.ModuleList(MLPBlock(64) for _ in range(3))
        self.post = torch.nn.ModuleList(MLPBlock(64) for _ in range(3))
        self._inner = [inner]

    def forward(self, x):
        for b in self.pre:
            x = b(x)
        x = x + self._inner[0](x)
        for b in self.post:
            x = b(x)
        return x


def test_nested_models_share_a_tight_budget(sim_cfg):
    """A model whose forward calls a second offloaded model: while the outer one is busy (holding a slot),
    the inner one must still fit, and together they never exceed the shared budget."""
    from offload import VramBudget, offload_module

    torch.manual_seed(0)
    inner = seeded(LayersModel, dim=64, depth=4)
    outer = _Outer(inner).eval()
    x = (torch.randn(2, 5, 64),)
    ref = run(outer, x)
    blocks_o = list(outer.pre) + list(outer.post)
    need_o = streaming_budget(outer, blocks_o, 2)
    need_i = streaming_budget(inner, list(inner.layers), 2)
    shared = VramBudget(need_o + need_i)
    ho = offload_module(outer, sim_cfg(prefetch=1), name="outer", budget=shared)
    hi = offload_module(inner, sim_cfg(prefetch=1), name="inner", budget=shared)
    assert streamed_modules(ho) and streamed_modules(hi), "the budget should force both to stream"
    seen = []
    hook = inner.layers[2].register_forward_pre_hook(
        lambda m, a: seen.append(ho.device_bytes() + hi.device_bytes()))
    try:
        for _ in range(3):
            assert torch.equal(run(outer, x), ref)
            assert ho.device_bytes() + hi.device_bytes() <= shared.total_bytes
        assert seen and max(seen) <= shared.total_bytes, f"inside the nested call: {max(seen)} > {shared.total_bytes}"
    finally:
        hook.remove()
        hi.detach()
        ho.detach()
    assert torch.equal(run(outer, x), ref)


def test_unit_pre_hook_registered_before_offloading_sees_device_weights(sim_cfg, offload):
    """Hooks already on a block when it is offloaded (cache/skip hooks of diffusers or node packs, weight
    readers) run before the block's forward and may touch its weights: they must see the device copy, or on
    a GPU they compute with host tensors (device mismatch). The engine's swap-in has to run first
    (register_forward_pre_hook(..., prepend=True))."""
    case = CASES["transformer"]
    model = case.build()
    x = case.inputs()
    ref = run(model, x)
    seen = {}

    def early_hook(mod, args):
        seen[id(mod)] = [backend_ref[0].owns(t) for _, p in mod.named_parameters() for t in param_inner_tensors(p)]

    backend_ref = []
    hooks = [b.register_forward_pre_hook(early_hook) for b in model.blocks]
    try:
        handle = offload(model, sim_cfg(vram_budget_bytes=streaming_budget(model, case.blocks(model), 3),
                                        prefetch=2))
        backend_ref.append(handle.backend)
        streamed = streamed_modules(handle)
        assert streamed
        assert torch.equal(run(model, x), ref)
        for u in streamed:
            assert all(seen[id(u)]), f"{module_path(model, u)}: a pre-existing pre-hook saw host weights"
    finally:
        for h in hooks:
            h.remove()


def test_units_whose_children_are_called_directly(sim_cfg, offload):
    """ComfyUI's SD1.5/SDXL UNet never calls its block containers: `forward_timestep_embed` iterates each
    TimestepEmbedSequential and calls the layers inside. Hooks on the container never fire, so unless the
    engine notices, those weights are never put on the device (on a GPU: a device-mismatch crash; here: a
    forward that silently computes from host memory and streams nothing)."""
    case = CASES["comfy_unet"]
    model = case.build()
    x = case.inputs()
    ref = run(model, x)
    handle = offload(model, sim_cfg(vram_budget_bytes=streaming_budget(model, case.blocks(model), 3), prefetch=2))
    backend = handle.backend
    streamed = streamed_modules(handle)
    assert streamed
    off_device = []

    def check(mod, args):
        for n, p in mod.named_parameters(recurse=False):
            if not backend.owns(p):
                off_device.append(f"{module_path(model, mod)}.{n}")

    hooks = [m.register_forward_pre_hook(check) for u in streamed for m in u.modules()]
    try:
        handle.reset_stats()
        assert torch.equal(run(model, x), ref)
    finally:
        for h in hooks:
            h.remove()
    assert not off_device, f"{len(off_device)} weights computed from host memory, e.g. {off_device[:3]}"
    assert handle.report().total_bytes_streamed > 0


class _IteratedStages(torch.nn.Module):
    """Containers whose children the parent calls itself, sometimes skipping the first or in reverse."""

    def __init__(self):
        super().__init__()
        self.stages = torch.nn.ModuleList(torch.nn.Sequential(MLPBlock(64), MLPBlock(64), MLPBlock(64))
                                          for _ in range(5))
        self.skip_first = False
        self.reverse = False

    def forward(self, x):
        for st in self.stages:
            kids = list(st)[1:] if self.skip_first else list(st)
            for k in (kids[::-1] if self.reverse else kids):
                x = k(x)
        return x


def test_never_called_containers_with_changing_child_order(sim_cfg, offload):
    torch.manual_seed(0)
    model = _IteratedStages().eval()
    x = (torch.randn(2, 3, 64),)
    modes = [(False, False), (True, False), (False, True), (True, True), (False, False)]
    refs = []
    for sf, rv in modes:
        model.skip_first, model.reverse = sf, rv
        refs.append(run(model, x))
    handle = offload(model, sim_cfg(vram_budget_bytes=streaming_budget(model, list(model.stages), 2), prefetch=1),
                     units=[f"stages.{i}" for i in range(5)])
    backend = handle.backend
    off_device = []

    def check(mod, args):
        off_device.extend(n for n, p in mod.named_parameters(recurse=False) if not backend.owns(p))

    hooks = [m.register_forward_pre_hook(check) for st in model.stages for m in st.modules()]
    try:
        for (sf, rv), ref in zip(modes * 2, refs * 2):
            model.skip_first, model.reverse = sf, rv
            assert torch.equal(run(model, x), ref), (sf, rv)
            assert not off_device, f"skip_first={sf} reverse={rv}: computed from host memory: {off_device[:3]}"
    finally:
        for h in hooks:
            h.remove()
