"""The multi-model VRAM budget (DESIGN §2 budget.py, §6): one budget, several models, split by priority.

Models are small LayersModel stacks (dim 64, 6 blocks of 67584 aligned bytes, 33792 bytes outside the blocks).
Every test builds its own VramBudget; tests that look at the device's own accounting (`backend.used_bytes`,
`backend.peak_bytes`) use a simulated capacity no other test uses, so nothing else lives on that device.
"""
from __future__ import annotations

import itertools
import logging

import pytest
import torch

from offload import DeviceMemoryError, OffloadConfig, VramBudget, default_budget, offload_module
from offload.backends.sim_clock import SimClock
from tests.models import LayersModel, aligned_bytes, resident_modules, run, seeded, streamed_modules

DEPTH = 6
_caps = itertools.count(1)


def _private_capacity(base: int = 64 << 20) -> int:
    """A sim capacity no other test uses: sim backends are shared per setting, this one is ours alone."""
    return base + 512 * next(_caps) + 11


def _model(seed=0, depth=DEPTH):
    return seeded(LayersModel, dim=64, depth=depth, seed=seed)


X = None


def _x():
    global X
    if X is None:
        g = torch.Generator().manual_seed(1234)
        X = torch.randn(2, 5, 64, generator=g)
    return X


def _sizes():
    m = _model()
    blk = aligned_bytes(m.layers[0])
    full = aligned_bytes(m)
    return full, blk, full - DEPTH * blk


FULL, BLK, REST = _sizes()
FLOOR = REST + BLK  # non-block weights plus a one-slot ring


class Fleet:
    """Models on one budget with their reference outputs; detaches everything at the end. They share a simulated
    device on a clock of its own where nothing takes time: how many blocks a share holds is the budget's doing, never
    a plan made from CPU timings (which the host's load changes)."""

    def __init__(self, budget, capacity=None, prefetch=1, **cfg):
        self.budget = budget
        self.capacity = capacity
        self.prefetch = prefetch
        cfg.setdefault("sim_clock", SimClock())
        self.cfg = cfg
        self.models, self.refs, self.handles = {}, {}, {}
        self.violations = []
        self.checks = 0
        self._hooks = []

    def add(self, name, priority, seed=None, **cfg):
        model = _model(seed=len(self.models) if seed is None else seed)
        self.refs[name] = run(model, (_x(),))
        kw = dict(self.cfg, **cfg)
        config = OffloadConfig(device="sim", prefetch=self.prefetch, sim_capacity_bytes=self.capacity, **kw)
        h = offload_module(model, config, name=name, priority=priority, budget=self.budget)
        self.models[name], self.handles[name] = model, h
        self.check(f"after registering {name}")
        return h

    def check(self, where):
        self.checks += 1
        b = self.budget
        total = b.total_bytes
        used = b.used_bytes
        if used > total:
            self.violations.append(f"{where}: budget.used_bytes {used} > total {total}")
        held = sum(h.device_bytes() for h in self.handles.values() if h.model is not None and
                   getattr(h.model, "_layer_offload_handle", None) is h)
        if held > total:
            self.violations.append(f"{where}: models hold {held} > total {total}")
        if self.capacity is not None:
            dev = next(iter(self.handles.values())).backend if self.handles else None
            if dev is not None and dev.used_bytes > total:
                self.violations.append(f"{where}: device holds {dev.used_bytes} > total {total}")

    def watch(self):
        """Check the ceiling inside every unit's forward of every model (pre and post hooks)."""
        for name, model in self.models.items():
            for i, layer in enumerate(model.layers):
                self._hooks.append(layer.register_forward_pre_hook(
                    lambda m, a, w=f"{name}.layers.{i} pre": self.check(w)))
                self._hooks.append(layer.register_forward_hook(
                    lambda m, a, o, w=f"{name}.layers.{i} post": self.check(w)))

    def fwd(self, name):
        y = run(self.models[name], (_x(),))
        assert torch.equal(y, self.refs[name]), f"{name}: output changed by offloading"
        self.check(f"after forward of {name}")
        return y

    def resident(self, name):
        return len(resident_modules(self.handles[name]))

    def close(self):
        for h in self._hooks:
            h.remove()
        for h in self.handles.values():
            try:
                h.detach()
            except Exception:
                pass


@pytest.fixture
def fleet_factory():
    made = []

    def make(*a, **kw):
        f = Fleet(*a, **kw)
        made.append(f)
        return f

    yield make
    for f in made:
        f.close()


# ------------------------------------------------------------------------------------------------------------
# totals
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [-1, -(1 << 30), float("nan"), float("inf"), float("-inf"), "8GB", True])
def test_invalid_totals_raise(bad):
    with pytest.raises(ValueError):
        VramBudget(bad)
    b = VramBudget(1 << 20)
    with pytest.raises(ValueError):
        b.set_total(bad)
    assert b.total_bytes == 1 << 20, "a refused total must leave the old one in place"


def test_budget_larger_than_device_is_refused_with_the_limit():
    cap = _private_capacity()
    model = _model()
    before = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    budget = VramBudget(cap + 1)
    with pytest.raises(ValueError) as ei:
        offload_module(model, OffloadConfig(device="sim", sim_capacity_bytes=cap), budget=budget)
    assert str(cap) in str(ei.value), f"the error should give the device limit ({cap} bytes): {ei.value}"
    assert budget.members == []
    for m in model.modules():
        assert not m._forward_pre_hooks and not m._forward_hooks, "refused model left hooks behind"
    for n, p in model.named_parameters():
        assert p is before[n][0] and torch.equal(p, before[n][1]), f"{n} changed by a refused offload"
        assert type(p) is torch.nn.Parameter and p.device.type == "cpu"
    # exactly the device is fine
    budget = VramBudget(cap)
    h = offload_module(model, OffloadConfig(device="sim", sim_capacity_bytes=cap), budget=budget)
    try:
        assert torch.equal(run(model, (_x(),)), run(_model(), (_x(),)))
    finally:
        h.detach()


def test_set_total_larger_than_known_device_is_refused():
    """Once a model on a known device is registered, the budget knows the device: a bigger total is an error."""
    cap = _private_capacity()
    model = _model()
    budget = VramBudget(cap // 2)
    h = offload_module(model, OffloadConfig(device="sim", sim_capacity_bytes=cap), budget=budget)
    try:
        with pytest.raises(ValueError) as ei:
            budget.set_total(cap + (1 << 20))
        assert str(cap) in str(ei.value), f"the error should give the device limit ({cap} bytes): {ei.value}"
        assert budget.total_bytes == cap // 2
        budget.set_total(cap)  # the device itself is the limit, not an error
        assert budget.total_bytes == cap
    finally:
        h.detach()


def test_per_model_budget_larger_than_device_is_refused():
    cap = _private_capacity()
    model = _model()
    with pytest.raises(ValueError) as ei:
        offload_module(model, OffloadConfig(device="sim", sim_capacity_bytes=cap, vram_budget_bytes=cap + 1),
                       budget=VramBudget(None))
    assert str(cap) in str(ei.value), str(ei.value)
    for m in model.modules():
        assert not m._forward_pre_hooks and not m._forward_hooks


def test_budget_above_the_default_sim_capacity_is_refused():
    """The simulated device has 8 GiB unless told otherwise: a bigger budget is refused when a model joins."""
    model = _model()
    budget = VramBudget((8 << 30) + 1)
    with pytest.raises(ValueError) as ei:
        offload_module(model, OffloadConfig(device="sim"), budget=budget)
    assert str(8 << 30) in str(ei.value), str(ei.value)
    assert budget.members == []
    for m in model.modules():
        assert not m._forward_pre_hooks and not m._forward_hooks


def test_default_budget_is_process_wide():
    assert default_budget() is default_budget()
    model = _model()
    ref = run(model, (_x(),))
    total = default_budget().total_bytes  # another test may have sized it already: pick a device it fits
    cap = None if total is None or total <= (8 << 30) else int(total)
    h = offload_module(model, OffloadConfig(device="sim", sim_capacity_bytes=cap), name="default-member")
    try:
        b = default_budget()
        assert h.budget is b
        assert h in b.members
        assert b.total_bytes is not None and b.total_bytes > 0
        assert torch.equal(run(model, (_x(),)), ref)
        assert b.used_bytes <= b.total_bytes
    finally:
        h.detach()
    assert h not in default_budget().members


# ------------------------------------------------------------------------------------------------------------
# priorities
# ------------------------------------------------------------------------------------------------------------


def test_two_models_priority_decides_residency(fleet_factory):
    """Room for one model fully plus the other's floor: the higher priority keeps everything resident."""
    budget = VramBudget(FULL + FLOOR + BLK // 2)
    f = fleet_factory(budget)
    low = f.add("low", priority=0)   # registered first: order must not beat priority
    high = f.add("high", priority=5)
    f.watch()
    for _ in range(2):
        f.fwd("low")
        f.fwd("high")
    assert f.resident("high") == DEPTH
    assert f.resident("low") < f.resident("high")
    assert high.report().resident_bytes > low.report().resident_bytes
    assert streamed_modules(low), "the low-priority model must stream"
    assert low.device_bytes() + high.device_bytes() <= budget.total_bytes
    # the sum of their peaks stays within the budget (no priority change happened here)
    assert low.report().peak_device_bytes + high.report().peak_device_bytes <= budget.total_bytes
    assert not f.violations, f.violations


def test_raising_priority_rebalances_after_next_forward(fleet_factory):
    budget = VramBudget(FULL + FLOOR + BLK // 2)
    f = fleet_factory(budget)
    a = f.add("a", priority=0)
    b = f.add("b", priority=1)
    f.watch()
    f.fwd("a")
    f.fwd("b")
    assert f.resident("b") == DEPTH and f.resident("a") < DEPTH
    a_before = f.resident("a")
    a.set_priority(5)
    f.check("after set_priority")
    f.fwd("a")
    assert f.resident("a") == DEPTH, "after its next forward the raised model keeps everything resident"
    assert f.resident("b") <= a_before, "the other model gave its bytes up"
    f.fwd("b")
    assert f.resident("a") == DEPTH and f.resident("b") < DEPTH
    # and back with prioritize()
    b.prioritize()
    assert b.priority > a.priority
    f.fwd("b")
    f.fwd("a")
    assert f.resident("b") == DEPTH and f.resident("a") < DEPTH
    assert not f.violations, f.violations


def test_three_models_priorities_and_detach(fleet_factory):
    cap = _private_capacity()
    mid_share = REST + 4 * BLK  # two resident + a two-slot ring (prefetch=1)
    budget = VramBudget(FULL + mid_share + FLOOR)
    f = fleet_factory(budget, capacity=cap)
    f.add("low", priority=0)
    f.add("top", priority=9)
    f.add("mid", priority=4)
    f.watch()
    dev = f.handles["top"].backend
    dev.synchronize()
    dev.reset_peak()
    for _ in range(2):
        for n in ("low", "mid", "top"):
            f.fwd(n)
    res = {n: f.resident(n) for n in f.models}
    assert res["top"] == DEPTH
    assert res["top"] > res["mid"] > res["low"], res
    rb = {n: f.handles[n].report().resident_bytes for n in f.models}
    assert rb["top"] > rb["mid"] > rb["low"], rb

    top_bytes = f.handles["top"].device_bytes()
    used = budget.used_bytes
    f.handles["top"].detach()
    assert budget.used_bytes == used - top_bytes, "detach must return the model's bytes at once"
    assert f.handles["top"] not in budget.members
    for n in ("low", "mid"):
        f.fwd(n)
    for n in ("low", "mid"):
        f.fwd(n)
    assert f.resident("mid") == DEPTH, "the next in line grows back into the freed bytes"
    assert f.resident("low") > res["low"], "the lowest one grows back too"
    assert budget.used_bytes <= budget.total_bytes
    assert dev.peak_bytes <= budget.total_bytes, f"device peak {dev.peak_bytes} > budget {budget.total_bytes}"
    assert not f.violations, f.violations


def test_two_models_detach_others_grow_back(fleet_factory):
    budget = VramBudget(FULL + FLOOR)
    f = fleet_factory(budget)
    f.add("a", priority=0)
    f.add("b", priority=1)
    f.fwd("a")
    f.fwd("b")
    assert f.resident("a") < DEPTH
    a_bytes = f.handles["a"].device_bytes()
    f.handles["b"].detach()
    assert budget.used_bytes == a_bytes, "detach returns b's bytes at once"
    assert f.handles["a"].device_bytes() == a_bytes, "a grows at the start of its own forward, not before"
    at_start = []
    hook = f.models["a"].layers[0].register_forward_pre_hook(lambda m, args: at_start.append(f.resident("a")))
    try:
        f.fwd("a")
    finally:
        hook.remove()
    assert at_start == [DEPTH], f"a had not grown by the start of its forward: {at_start}"
    assert f.resident("a") == DEPTH
    assert not f.violations, f.violations


def test_idle_model_is_shrunk_at_once(fleet_factory):
    """A model that is loaded and idle gives its bytes back as soon as a higher-priority one registers."""
    budget = VramBudget(FULL + FLOOR)
    f = fleet_factory(budget)
    a = f.add("a", priority=0)
    f.fwd("a")
    assert f.resident("a") == DEPTH and a.device_bytes() == FULL
    b = f.add("b", priority=1)
    at_start = []
    hook = f.models["b"].layers[0].register_forward_pre_hook(
        lambda m, args: at_start.append((a.device_bytes(), b.device_bytes())))
    try:
        f.fwd("b")  # b needs its share now: the idle a gives it up before b's first unit runs
    finally:
        hook.remove()
    assert len(at_start) == 1
    a_bytes, b_bytes = at_start[0]
    assert b_bytes == FULL, "b (higher priority) keeps everything resident"
    assert a_bytes + b_bytes <= budget.total_bytes, (
        f"a still holds {a_bytes} bytes beside b's {b_bytes} (budget {budget.total_bytes})")
    assert a.device_bytes() <= budget.total_bytes - FULL
    assert f.resident("b") == DEPTH
    f.fwd("a")
    assert not f.violations, f.violations


def test_ceiling_holds_at_every_moment(fleet_factory):
    """Priority changes, prioritize, unload/load, a total shrunk and grown, detach: the device never holds more
    than the budget, checked inside every unit's forward and against the device's own peak."""
    cap = _private_capacity()
    budget = VramBudget(FULL + FLOOR + 2 * BLK)
    f = fleet_factory(budget, capacity=cap, prefetch=2)
    f.add("a", priority=0)
    f.add("b", priority=1)
    f.add("c", priority=2)
    f.watch()
    dev = f.handles["a"].backend
    dev.synchronize()
    dev.reset_peak()
    names = ["a", "b", "c"]
    for step in range(9):
        for n in names:
            f.fwd(n)
        dev.synchronize()
        assert dev.peak_bytes <= budget.total_bytes, (
            f"step {step}: device peak {dev.peak_bytes} > budget {budget.total_bytes}")
        if step == 1:
            f.handles["a"].set_priority(10)
        elif step == 2:
            f.handles["b"].prioritize()
        elif step == 3:
            f.handles["c"].unload()
            f.handles["a"].load()
            f.check("after load")
        elif step == 4:
            budget.set_total(REST * 3 + BLK * 5)
            f.check("after set_total down")
        elif step == 5:
            budget.set_total(FULL + FLOOR + 2 * BLK)
            f.handles["c"].prioritize()
        elif step == 6:
            f.handles["c"].detach()
            names.remove("c")
        f.check(f"after the change of step {step}")
        dev.synchronize()
        assert dev.used_bytes <= budget.total_bytes
        dev.reset_peak()
    assert f.checks > 9 * 2 * DEPTH * 2, f"the ceiling was checked only {f.checks} times"
    assert not f.violations, "\n".join(f.violations[:10])


def test_rebalancing_waits_for_a_safe_point(fleet_factory):
    """A priority change while a model is in the middle of its forward does not touch it until it is done."""
    budget = VramBudget(FULL + FLOOR)
    f = fleet_factory(budget)
    a = f.add("a", priority=0)
    b = f.add("b", priority=1)
    f.fwd("a")
    f.fwd("b")
    assert f.resident("b") == DEPTH
    seen = []

    def during(m, args):
        # b is busy: lower it and raise a; b must keep its resident set until its forward ends
        b.set_priority(-5)
        a.prioritize()
        seen.append(("changed", b.device_bytes(), frozenset(map(id, resident_modules(b)))))

    def watch(m, args):
        seen.append(("after", b.device_bytes(), frozenset(map(id, resident_modules(b)))))

    h1 = f.models["b"].layers[2].register_forward_pre_hook(during)
    hooks = [f.models["b"].layers[i].register_forward_pre_hook(watch) for i in range(3, DEPTH)]
    try:
        before = (b.device_bytes(), frozenset(map(id, resident_modules(b))))
        f.fwd("b")
    finally:
        h1.remove()
        for h in hooks:
            h.remove()
    assert len(seen) == DEPTH - 2
    for kind, nbytes, res in seen:
        assert (nbytes, res) == before, f"b was rebalanced in the middle of its forward ({kind})"
    f.fwd("a")
    assert f.resident("a") == DEPTH, "a grows at the start of its own next forward"
    f.fwd("b")
    assert f.resident("b") < DEPTH
    assert not f.violations, f.violations


# ------------------------------------------------------------------------------------------------------------
# watermark
# ------------------------------------------------------------------------------------------------------------


def test_watermark_keeps_lost_units_streaming_until_prioritize(fleet_factory):
    budget = VramBudget(FULL + FLOOR + 2 * BLK)
    f = fleet_factory(budget)
    a = f.add("a", priority=0)
    f.fwd("a")
    assert f.resident("a") == DEPTH, "alone, a keeps everything resident"
    b = f.add("b", priority=1)
    f.fwd("b")
    f.fwd("a")
    lost = f.resident("a")
    assert lost < DEPTH, "a lost resident units to the higher-priority b"
    assert f.resident("b") == DEPTH
    # b goes idle and gives its device memory up: a keeps streaming what it lost
    b.unload()
    for _ in range(2):
        f.fwd("a")
        assert f.resident("a") == lost, "a won units back from an unloaded b without prioritize()"
    f.fwd("b")
    # b steps down: a could win its units back, but the watermark keeps them streaming
    b.set_priority(-1)
    for _ in range(3):
        f.fwd("a")
        assert f.resident("a") == lost, f"a won units back ({f.resident('a')} vs {lost}) without prioritize()"
        f.fwd("b")
    # prioritize() resets the watermark
    a.prioritize()
    f.fwd("a")
    assert f.resident("a") == DEPTH, "prioritize() must let a grow back"
    f.fwd("b")
    assert f.resident("b") < DEPTH
    assert not f.violations, f.violations


def test_watermark_does_not_flap_between_forwards(fleet_factory):
    """Alternating forwards of a low- and a high-priority model: the low one's resident set stays put."""
    budget = VramBudget(FULL + FLOOR + 2 * BLK)
    f = fleet_factory(budget)
    f.add("low", priority=0)
    f.add("high", priority=1)
    counts = []
    for _ in range(4):
        f.fwd("high")
        f.fwd("low")
        counts.append((f.resident("low"), f.resident("high")))
    assert len(set(counts[1:])) == 1, f"residency flapped between forwards: {counts}"
    assert counts[-1][1] == DEPTH
    assert not f.violations, f.violations


# ------------------------------------------------------------------------------------------------------------
# graceful degradation: out of device memory
# ------------------------------------------------------------------------------------------------------------


def _oom_records(caplog):
    return [r for r in caplog.records if r.name.startswith("offload") and r.levelno >= logging.WARNING
            and "memory" in r.getMessage().lower()]


def test_oom_while_growing_shrinks_and_retries_with_one_log_line(caplog):
    """Two budgets on one simulated device: b's budget would let it grow, but a's allocations (on another
    budget) leave no room. The out-of-memory while placing b's units shrinks its resident set; one log line."""
    cap = FULL + FULL // 2 + 4096 + 13
    cfg = OffloadConfig(device="sim", prefetch=1, sim_capacity_bytes=cap)
    a, b = _model(0), _model(1)
    ra, rb = run(a, (_x(),)), run(b, (_x(),))
    ba, bb = VramBudget(FULL), VramBudget(REST + 2 * BLK)
    hb = offload_module(b, cfg, name="b", budget=bb)
    ha = None
    try:
        assert torch.equal(run(b, (_x(),)), rb)
        ha = offload_module(a, cfg, name="a", budget=ba)
        assert torch.equal(run(a, (_x(),)), ra)
        assert ha.device_bytes() == FULL
        bb.set_total(cap)  # b may now want everything resident, which the device cannot hold
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="offload"):
            for _ in range(3):
                assert torch.equal(run(b, (_x(),)), rb)
                assert hb.backend.used_bytes <= cap
        assert hb.backend.peak_bytes <= cap
        assert streamed_modules(hb), "b cannot be fully resident beside a"
        assert ha.device_bytes() == FULL, "a's allocations (another budget) are not b's to take"
        oom = _oom_records(caplog)
        assert len(oom) == 1, f"expected one log line about the shrink, got {[r.getMessage() for r in oom]}"
        warnings = [r.getMessage() for r in caplog.records if r.name.startswith("offload")
                    and r.levelno >= logging.WARNING]
        assert len(warnings) == 1, f"one log line for the shrink, got {warnings}"
    finally:
        hb.detach()
        if ha is not None:
            ha.detach()


def test_oom_on_first_load_shrinks_and_retries(caplog):
    """The second model's first plan collides with the first model's allocations on the same device
    (each has its own budget, each budget fits the device): its first forward must shrink, not fail."""
    cap = FULL + FULL // 2 + 4096 + 29
    cfg = OffloadConfig(device="sim", prefetch=1, sim_capacity_bytes=cap)
    a, b = _model(0), _model(1)
    ra, rb = run(a, (_x(),)), run(b, (_x(),))
    ha = offload_module(a, cfg, name="a", budget=VramBudget(FULL))
    hb = None
    try:
        assert torch.equal(run(a, (_x(),)), ra)
        hb = offload_module(b, cfg, name="b", budget=VramBudget(cap - 1024))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="offload"):
            for _ in range(3):
                assert torch.equal(run(b, (_x(),)), rb)
                assert hb.backend.used_bytes <= cap
        assert hb.backend.peak_bytes <= cap
        assert streamed_modules(hb)
        assert 0 < hb.device_bytes() <= cap - FULL
        assert len(_oom_records(caplog)) == 1, [r.getMessage() for r in _oom_records(caplog)]
        assert torch.equal(run(a, (_x(),)), ra)
    finally:
        ha.detach()
        if hb is not None:
            hb.detach()


def test_oom_on_load_call_shrinks_and_retries():
    """handle.load() places the plan too: the same shrink applies."""
    cap = FULL + FULL // 2 + 4096 + 31
    cfg = OffloadConfig(device="sim", prefetch=1, sim_capacity_bytes=cap)
    a, b = _model(0), _model(1)
    rb = run(b, (_x(),))
    ha = offload_module(a, cfg, name="a", budget=VramBudget(FULL))
    hb = None
    try:
        ha.load()
        assert ha.device_bytes() == FULL
        hb = offload_module(b, cfg, name="b", budget=VramBudget(cap))
        hb.load()
        assert hb.backend.used_bytes <= cap
        assert 0 < hb.device_bytes() <= cap - FULL
        assert torch.equal(run(b, (_x(),)), rb)
    finally:
        ha.detach()
        if hb is not None:
            hb.detach()


def test_oom_when_not_even_one_slot_fits_names_the_unit():
    """The device has less room left than one block: a clear error naming a unit and its size, no traceback
    from deep inside, and the model stays usable once the room is there."""
    cap = FULL + REST + BLK // 2 + 37
    cfg = OffloadConfig(device="sim", prefetch=1, sim_capacity_bytes=cap)
    a, b = _model(0), _model(1)
    rb = run(b, (_x(),))
    ha = offload_module(a, cfg, name="a", budget=VramBudget(FULL))
    hb = None
    try:
        ha.load()
        hb = offload_module(b, cfg, name="b", budget=VramBudget(cap))
        with pytest.raises(ValueError) as ei:
            run(b, (_x(),))
        msg = str(ei.value)
        assert isinstance(ei.value, DeviceMemoryError) or "memory" in msg.lower()
        assert any(f"layers.{i}" in msg for i in range(DEPTH)), f"the error should name the unit: {msg}"
        assert str(BLK) in msg or f"{BLK / 1e6:.1f}" in msg or f"{BLK / (1 << 20):.2f}" in msg, (
            f"the error should give the unit's size ({BLK} bytes): {msg}")
        assert hb.backend.used_bytes <= cap
        ha.detach()
        assert torch.equal(run(b, (_x(),)), rb), "with the room back, the model runs"
    finally:
        ha.detach()
        if hb is not None:
            hb.detach()
