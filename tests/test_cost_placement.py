"""Placement from measured costs (issue 20): after the first passes are measured, the units whose copies cannot
hide behind compute stay resident; cheap-to-copy, compute-heavy units stream. The pure cost model is tested on
numbers, the engine on a bandwidth-limited simulated device on its own clock (which plan a cost leads to), and on
the host's clock (that costs are measured, used and reported, whatever they are)."""
from __future__ import annotations

import torch

from offload import OffloadConfig, VramBudget, offload_module
from offload.backends.sim_clock import SimClock
from offload.plan.cost_model import CostTracker, UnitCosts, plan_by_cost, predict_stalls
from offload.demo.reference_models import MixedCostStack
from offload.plan.planner import plan_units
from tests.models import aligned_bytes, run


def test_predict_stalls_hides_copies_behind_compute_and_counts_what_does_not_hide():
    costs = UnitCosts(compute_ms=[5.0, 5.0, 5.0, 5.0], copy_ms=[1.0, 1.0, 1.0, 1.0])
    assert predict_stalls([0, 1, 2, 3], costs, set(), slots=2) == [0.0, 0.0, 0.0, 0.0]
    slow = UnitCosts(compute_ms=[1.0] * 4, copy_ms=[4.0] * 4)
    stalls = predict_stalls([0, 1, 2, 3], slow, set(), slots=2)
    assert all(s > 0 for s in stalls)
    assert sum(stalls) == 12.0  # a copy every 4 ms, 1 ms of compute each: 3 ms waited per unit
    assert predict_stalls([0, 1, 2, 3], slow, {0, 1, 2, 3}, slots=0) == [0.0] * 4


def test_cost_plan_keeps_fat_cheap_units_and_streams_lean_expensive_ones():
    fat, lean = 1000, 100
    sizes = [fat] * 4 + [lean] * 4
    names = [f"blocks.{i}" for i in range(8)]
    costs = UnitCosts(compute_ms=[0.1] * 4 + [5.0] * 4, copy_ms=[4.0] * 4 + [0.4] * 4)
    allowance = 4 * fat + 3 * lean  # every fat block plus a ring of three lean slots
    count = plan_units(sizes, names, 0, allowance, prefetch=2)
    plan = plan_by_cost(sizes, names, 0, allowance, 2, costs)
    assert plan.resident == {0, 1, 2, 3}
    assert plan.device_bytes <= allowance
    assert sum(plan.predicted_stall_ms) < sum(predict_stalls(list(range(8)), costs, count.resident, count.n_slots))
    assert all(r.startswith("resident: streaming it would stall") for r in plan.reasons[:4]), plan.reasons
    assert all(r.startswith("streamed: its copy") for r in plan.reasons[4:]), plan.reasons


def test_cost_plan_keeps_the_count_plan_when_nothing_stalls():
    sizes = [100] * 6
    names = [f"b.{i}" for i in range(6)]
    costs = UnitCosts(compute_ms=[5.0] * 6, copy_ms=[0.1] * 6)
    count = plan_units(sizes, names, 0, 450, prefetch=2)
    plan = plan_by_cost(sizes, names, 0, 450, 2, costs)
    assert plan.resident == count.resident and plan.n_slots == count.n_slots


def test_cost_tracker_reads_totals_and_notices_shifts():
    t = CostTracker([100, 100])
    assert not t.update([0, 0], [0.0, 0.0], [0.0, 0.0], [0, 0])
    assert t.update([1, 1], [2.0, 4.0], [0.0, 1.0], [0, 100])
    assert t.ready
    c = t.costs()
    assert c.compute_ms == [2.0, 4.0] and c.copy_ms == [1.0, 1.0]  # the resident unit costed at the bandwidth
    assert t.shifted()
    t.planned(c)
    assert not t.shifted()
    t.update([2, 2], [4.0, 8.0], [0.0, 2.0], [0, 200])  # the same again
    assert not t.shifted()
    t.update([3, 3], [40.0, 12.0], [0.0, 3.0], [0, 300])  # unit 0 got 18x slower
    assert t.shifted()


def _fat_lean_budget(model):
    fat = aligned_bytes(model.blocks[0])
    lean = aligned_bytes(model.blocks[4])
    rest = aligned_bytes(model) - 4 * fat - 4 * lean
    return VramBudget(rest + 4 * fat + 3 * lean)


def test_engine_keeps_the_fat_blocks_resident_once_measured_and_stalls_fall():
    torch.manual_seed(0)
    model = MixedCostStack("FFFFLLLL", repeats=2, input_layer=True).eval()
    x = torch.randn(256, 64)
    ref = run(model, (x,))
    budget = _fat_lean_budget(model)
    clock = SimClock()  # fat blocks: 4 MiB (4.2 ms to copy at 1 GB/s), 0.05 ms of compute; lean: 3 ms, 17 KB
    clock.charge(model.blocks[:4], 0.05)
    clock.charge(model.blocks[4:], 3.0)
    cfg = OffloadConfig(device="sim", prefetch=2, sim_bandwidth_gbps=1.0, sim_capacity_bytes=(64 << 20) + 4099,
                        sim_clock=clock)
    h = offload_module(model, cfg, budget=budget)
    first = [b.tier for b in h.report().blocks]
    assert first[:4] != ["vram"] * 4, "the count-based plan (before any measurement) streams fat blocks"
    assert torch.equal(run(model, (x,)), ref)  # the one pass on the count-based plan
    before = h.report().stall_ms
    assert before > 0, "fat blocks streamed back to back must stall"
    for _ in range(3):  # measured: the next pass re-plans from costs
        assert torch.equal(run(model, (x,)), ref)
    h.reset_stats()
    for _ in range(2):
        assert torch.equal(run(model, (x,)), ref)
    rep = h.report()
    tiers = [b.tier for b in rep.blocks]
    assert tiers[:4] == ["vram"] * 4 and "vram" not in tiers[4:], tiers
    assert all(b.placement.startswith("resident: streaming it would stall") for b in rep.blocks[:4]), \
        [b.placement for b in rep.blocks]
    assert all(b.placement.startswith("streamed") for b in rep.blocks[4:])
    assert rep.peak_device_bytes <= budget.total_bytes
    assert rep.stall_ms == 0.0, f"stall per pass {rep.stall_ms / 2:.2f} ms, count-based {before:.2f} ms"
    assert all(b.predicted_stall_ms == 0.0 for b in rep.blocks)
    h.detach()


def test_engine_measures_uses_and_reports_costs_on_the_hosts_clock():
    """The same model on the host's clock: which plan noisy CPU timings lead to is not this test's business; that
    they are measured (every block's compute, the streamed blocks' copies), used (a plan from costs is in place)
    and reported (per block: the prediction and the reason; per pass: predicted beside measured) is."""
    torch.manual_seed(0)
    model = MixedCostStack("FFFFLLLL", repeats=4, input_layer=True).eval()
    x = torch.randn(64, 64)
    ref = run(model, (x,))
    budget = _fat_lean_budget(model)
    cfg = OffloadConfig(device="sim", prefetch=2, sim_bandwidth_gbps=1.0, sim_capacity_bytes=(64 << 20) + 4097)
    h = offload_module(model, cfg, budget=budget)
    for _ in range(3):
        assert torch.equal(run(model, (x,)), ref)
    assert h.keeper.costs.ready and h.plan.from_costs, "every block ran and a copy was timed: the plan uses costs"
    costs = h.keeper.costs.costs()
    assert all(c > 0 for c in costs.compute_ms), costs.compute_ms
    assert all(c > 0 for c in costs.copy_ms), costs.copy_ms
    rep = h.report()
    assert rep.predicted_step_ms is not None and rep.predicted_step_ms > 0 and rep.step_ms > 0
    assert all(b.placement.startswith(("resident", "streamed")) for b in rep.blocks), [b.placement for b in rep.blocks]
    assert [b.predicted_stall_ms for b in rep.blocks] == list(h.plan.predicted_stall_ms)
    assert all(b.h2d_ms > 0 for b in rep.blocks if b.tier != "vram")
    assert rep.peak_device_bytes <= budget.total_bytes
    h.detach()
