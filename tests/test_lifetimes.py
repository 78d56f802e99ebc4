"""Models dropped without detach(): the budget must not keep them (or their device memory) alive."""
from __future__ import annotations

import gc

import torch

from offload import OffloadConfig, VramBudget, offload_module
from offload.demo.reference_models import TransformerStack
from tests.models import resident_modules


def _cfg(capacity: int) -> OffloadConfig:
    # a private simulated device (backends are shared per setting), so its accounting is this test's alone
    return OffloadConfig.from_preset("auto", device="sim", sim_capacity_bytes=capacity)


def test_dropped_model_leaves_the_budget_and_frees_its_device_memory():
    budget = VramBudget(64 << 20)
    model = TransformerStack(dim=64, depth=4)
    handle = offload_module(model, _cfg(96 << 20 | 1), budget=budget)
    with torch.no_grad():
        model(torch.randn(1, 4, 64))
    device = handle.backend
    assert len(budget.members) == 1 and budget.used_bytes > 0 and device.used_bytes > 0
    del model, handle
    gc.collect()
    assert budget.members == [] and budget.used_bytes == 0
    assert device.used_bytes == 0, "a garbage-collected model must give its simulated device memory back"


def test_model_kept_alive_by_either_itself_or_its_handle():
    budget = VramBudget(64 << 20)
    model = TransformerStack(dim=64, depth=4)
    handle = offload_module(model, _cfg(96 << 20 | 3), budget=budget)
    del handle
    gc.collect()
    assert len(budget.members) == 1, "the model holds its handle: still offloaded, still in the budget"
    x = torch.randn(1, 4, 64)
    with torch.no_grad():
        model(x)
    assert budget.used_bytes > 0


def test_others_grow_into_a_dropped_models_bytes():
    a, b = TransformerStack(dim=64, depth=6), TransformerStack(dim=64, depth=6)
    x = torch.randn(1, 4, 64)
    probe = offload_module(TransformerStack(dim=64, depth=6), _cfg(96 << 20 | 5), budget=VramBudget(64 << 20))
    unit = max(probe.unit_bytes().values())
    whole = probe.budget_for(resident_units=6)
    del probe
    gc.collect()
    budget = VramBudget(whole + 3 * unit)  # room for one model fully resident plus a ring, not for two
    ha = offload_module(a, _cfg(96 << 20 | 5), name="a", priority=1, budget=budget)
    hb = offload_module(b, _cfg(96 << 20 | 5), name="b", priority=0, budget=budget)
    with torch.no_grad():
        a(x), b(x)
    assert len(resident_modules(hb)) < 6
    del a, ha
    gc.collect()
    with torch.no_grad():
        b(x)
    assert len(resident_modules(hb)) == 6, "b grows into the bytes the dropped model held"


def test_self_sized_budget_follows_its_devices():
    """The process-wide budget sizes itself from the first device it sees; a small device seen first must not
    cap models on a bigger one, and an emptied budget sizes itself afresh."""
    budget = VramBudget(None)
    small = offload_module(TransformerStack(dim=32, depth=3), _cfg((2 << 20) + 11), budget=budget)
    small_total = budget.total_bytes
    assert small_total < 2 << 20
    model = TransformerStack(dim=128, depth=6)
    x = torch.randn(1, 4, 128)
    with torch.no_grad():
        ref = model(x)
    big = offload_module(model, _cfg((256 << 20) + 11), budget=budget)
    assert budget.total_bytes > 200 << 20, "a model on a bigger device grows a self-sized budget"
    with torch.no_grad():
        assert torch.equal(model(x), ref)
    assert len(resident_modules(big)) == 6
    small.detach()
    big.detach()
    offload_module(TransformerStack(dim=32, depth=3), _cfg((2 << 20) + 11), budget=budget).detach()
    assert budget.total_bytes == small_total, "an emptied self-sized budget is sized again from the new device"
    fixed = VramBudget(1 << 20)
    offload_module(TransformerStack(dim=32, depth=3), _cfg((256 << 20) + 11), budget=fixed).detach()
    assert fixed.total_bytes == 1 << 20, "a budget the user sized is never resized"
