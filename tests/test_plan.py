"""One plan, one function (issue 24): `planner.make_plan(facts)` is pure and decides where every unit lives (device,
tier, ring, bounce buffers, the reason); first placement, budget changes, out-of-memory shrinks, re-plans from
measured costs and secondary devices all go through it."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import offload.plan.planner as planner
from offload import OffloadConfig, VramBudget, offload_module
from offload.plan.planner import HostFacts, PlanFacts, RamCeilingError, make_plan
from offload.plan.ring_sim import UnitCosts
from tests.models import run

MB = 1 << 20


def _facts(**kw) -> PlanFacts:
    base = dict(name="m", sizes=(4 * MB,) * 4 + (MB,) * 4, names=tuple(f"blocks.{i}" for i in range(8)),
                rest_bytes=MB, prefetch=2, stream_all=False, device="sim:0", allowance=12 * MB)
    base.update(kw)
    return PlanFacts(**base)


def test_the_same_facts_give_the_same_plan_and_every_unit_says_where_and_why():
    facts = _facts(host=HostFacts(ram_budget=10 * MB, hard=False, pin_limit=0, pin=False, allow_disk=True,
                                  bounces_pageable=False, disk_optional=False, file_path="m.safetensors"),
                   disk_ok=(True,) * 8)
    a, b = make_plan(facts), make_plan(facts)
    assert a == b, "pure: nothing but the facts decides"
    assert len(a.units) == 8 and a.device_bytes <= facts.allowance
    for i, u in enumerate(a.units):
        assert u.name == f"blocks.{i}" and u.reason
        if i in a.resident:
            assert u.device == "sim:0" and u.tier == "vram"
        else:
            assert u.device is None and u.tier == u.host_tier
    assert {u.host_tier for u in a.units} <= {"pinned", "pageable", "disk"}
    assert a.disk_units and all(a.units[i].host_tier == "disk" for i in a.disk_units), "RAM is short: disk tier"
    assert a.rings == {"sim:0": (a.n_slots, a.slot_bytes)} and a.lookahead == a.n_slots - 1
    assert a.bounce_count == 4 and not a.from_costs and a.predicted_step_ms is None


def test_units_the_file_cannot_stream_stay_in_ram_and_a_hard_ceiling_is_kept_or_refused():
    host = HostFacts(ram_budget=MB + 2 * 4 * MB + 4 * 4096 * 4, hard=True, pin_limit=0, pin=False, allow_disk=True,
                     bounces_pageable=False, disk_optional=False, file_path="m.safetensors")
    plan = make_plan(_facts(host=host, disk_ok=(True,) * 8))
    assert plan.disk_units
    with pytest.raises(RamCeilingError, match="ram_budget_bytes=.* cannot be kept"):
        make_plan(_facts(host=host, disk_ok=(False,) * 8))  # nothing may go to disk: the ceiling cannot hold
    relaxed = make_plan(_facts(host=dataclasses.replace(host, disk_optional=True), disk_ok=(False,) * 8))
    assert not relaxed.disk_units and any("disk_optional=True keeps them in RAM" in m for _, m in relaxed.messages)


def test_measured_costs_and_stalls_are_facts_like_any_other():
    costs = UnitCosts(compute_ms=[0.1] * 4 + [5.0] * 4, copy_ms=[4.0] * 4 + [1.0] * 4)
    by_cost = make_plan(_facts(costs=costs, allowance=20 * MB))  # the fat units and a ring of three lean slots
    assert by_cost.from_costs and by_cost.resident == {0, 1, 2, 3} and by_cost.n_slots == 3
    assert by_cost.predicted_step_ms == pytest.approx(sum(costs.compute_ms) + sum(by_cost.predicted_stall_ms))
    # a lean unit measured stalling 3 ms per pass beyond the prediction (a slow path the costs do not show): the
    # plan that streams it is charged for it, so it stays resident when the budget allows
    roomy = make_plan(_facts(costs=costs, allowance=20 * MB, excess_ms=(0.0,) * 4 + (3.0, 0.0, 0.0, 0.0)))
    assert 4 in roomy.resident and 4 not in by_cost.resident and sum(roomy.predicted_stall_ms) == 0.0
    assert "stalled when streamed, more than predicted" in roomy.units[4].reason


def test_secondary_devices_are_in_the_same_plan():
    plan = make_plan(_facts(allowance=8 * MB, remote_allowances=(("sim:1", 13 * MB),)))
    assert plan.n_slots == 0 and len(plan.resident) + len(plan.remote) == 8, "together they hold every block"
    for i, d in plan.remote.items():
        assert plan.units[i].device == "sim:1" and plan.units[i].tier == "vram"
        assert plan.units[i].reason.startswith("resident on sim:1")


class _Spy:
    def __init__(self, real):
        self.real, self.calls = real, []

    def __call__(self, facts):
        self.calls.append(facts)
        return self.real(facts)


def test_setup_budget_changes_oom_shrinks_and_cost_replans_all_ask_make_plan(monkeypatch):
    from offload.demo.reference_models import MixedCostStack
    from tests.models import aligned_bytes

    spy = _Spy(planner.make_plan)
    monkeypatch.setattr(planner, "make_plan", spy)
    torch.manual_seed(0)
    model = MixedCostStack("FFLL", dim=32, width=256, repeats=4, input_layer=True).eval()
    x = torch.randn(8, 32)
    ref = run(model, (x,))
    total = aligned_bytes(model)
    budget = VramBudget(total - aligned_bytes(model.blocks[3]))  # one lean block streams
    h = offload_module(model, OffloadConfig(device="sim", sim_capacity_bytes=4 * total), budget=budget)
    assert spy.calls and spy.calls[0].host is not None, "setup: host and device from one call"
    assert any(f.host is None and f.allowance == budget.total_bytes for f in spy.calls), "the budget's share"
    n = len(spy.calls)
    assert torch.equal(run(model, (x,)), ref)
    assert torch.equal(run(model, (x,)), ref)
    assert any(f.costs is not None for f in spy.calls[n:]), "measured: planned again from costs"
    n = len(spy.calls)
    budget.set_total(h.floor_bytes() + 10)  # a budget change (the idle model shrinks now)
    assert any(f.allowance <= h.floor_bytes() + 10 for f in spy.calls[n:])
    assert torch.equal(run(model, (x,)), ref)
    n = len(spy.calls)
    backend = h.backend
    real_alloc, failed = backend.alloc, []

    def alloc(nbytes):  # the device has less than the budget thinks, once
        if not failed and nbytes > 0:
            failed.append(nbytes)
            raise torch.OutOfMemoryError("simulated")
        return real_alloc(nbytes)

    budget.set_total(total - aligned_bytes(model.blocks[3]))
    monkeypatch.setattr(backend, "alloc", alloc)
    assert torch.equal(run(model, (x,)), ref)
    assert failed and len(spy.calls) > n + 1, "the out-of-memory shrink planned again through make_plan"
    h.detach()


def test_no_stall_stays_none_with_one_more_resident_unit():
    """The cost search skips simulating a candidate when the plan it grows stalls nothing and the candidate keeps
    as many slots (plan_device._greedy): that holds only if keeping one more unit resident, with no fewer slots, never
    brings a stall back. Random rings (repeated calls, gaps between passes, free copies and free computes) check it."""
    import random

    from offload.plan.ring_sim import simulate_pass

    rng = random.Random(1)
    checked = 0
    for _ in range(3000):
        n = rng.randint(2, 12)
        costs = UnitCosts([rng.choice([0.0, rng.uniform(0, 5)]) for _ in range(n)],
                          [rng.choice([0.0, rng.uniform(0, 8)]) for _ in range(n)])
        order = list(range(n)) + (rng.sample(range(n), rng.randint(1, n)) if rng.random() < 0.3 else [])
        slots = rng.randint(1, 4)
        resident = set(rng.sample(range(n), rng.randint(0, n - 2)))
        gap = rng.choice([0.0, rng.uniform(0, 3)])
        if sum(simulate_pass(order, costs, resident, slots, gap).stall_ms) > 0:
            continue
        for u in set(range(n)) - resident:
            more = slots + rng.randint(0, 2)
            stall = sum(simulate_pass(order, costs, resident | {u}, more, gap).stall_ms)
            assert stall == 0.0, (order, costs, sorted(resident), u, slots, more, gap)
            checked += 1
    assert checked > 1000
