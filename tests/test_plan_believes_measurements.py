"""Placement that believes its measurements (issue 24): the ring simulation sees the pass boundary, a disk read
counts before its copy, and a pass that stalls more than its plan predicted feeds the measured stalls to the next
plan, so a plan that removes the stall replaces it. Run on the simulated device with a bandwidth limit, on its own
clock (`SimClock`: compute, copies and reads take the times the test gives, whatever the host's load)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from offload import OffloadConfig, VramBudget, offload_module
from offload.backends.sim_clock import SimClock
from offload.plan.cost_model import CostTracker
from offload.demo.reference_models import FatCheapBlock, MixedCostStack
from offload.plan.ring_sim import UnitCosts, predict_stalls, simulate_pass
from tests.models import aligned_bytes, run


def _fat_lean(dim: int = 128, repeats: int = 2, fat_ms: float = 0.02, lean_ms: float = 3.0):
    """The issue's model: four fat blocks (4 MiB, almost no compute) then four lean ones (64 KiB, much compute),
    with a clock charging each call of a fat block `fat_ms` and of a lean one `lean_ms`."""
    torch.manual_seed(0)
    model = MixedCostStack("FFFFLLLL", dim=dim, repeats=repeats, input_layer=True).eval()
    fat, lean = aligned_bytes(model.blocks[0]), aligned_bytes(model.blocks[4])
    rest = aligned_bytes(model) - 4 * fat - 4 * lean
    clock = SimClock()
    clock.charge(model.blocks[:4], fat_ms)
    clock.charge(model.blocks[4:], lean_ms)
    return model, torch.randn(256, dim), rest + 4 * fat + 3 * lean, clock


def _tiers(handle) -> str:
    return "".join("R" if b.tier == "vram" else "s" for b in handle.report().blocks)


def test_ring_simulation_sees_the_first_unit_of_the_next_pass_wait():
    # a fat unit first, then lean ones: its copy for the next pass can start only when the unit two streamed
    # places before it (lean 2) frees its slot, and lean 3's compute is all it can hide behind
    costs = UnitCosts(compute_ms=[0.1, 2.0, 2.0, 2.0], copy_ms=[8.0, 0.1, 0.1, 0.1])
    stalls = predict_stalls([0, 1, 2, 3], costs, set(), slots=2)
    assert stalls[0] == pytest.approx(6.0, abs=0.05), stalls  # 8 ms of copy, 2 ms of compute to hide it
    assert stalls[1:] == [0.0, 0.0, 0.0]
    # work between passes (the gap) hides it; a wider ring lets the copy start a unit earlier
    assert simulate_pass([0, 1, 2, 3], costs, set(), 2, gap_ms=10.0).stall_ms == [0.0] * 4
    assert predict_stalls([0, 1, 2, 3], costs, set(), slots=3)[0] == pytest.approx(4.0, abs=0.05)
    # the first pass after a plan change starts with nothing in flight: it waits for every copy
    assert simulate_pass([0, 1, 2, 3], costs, set(), 2).first_pass_stall_ms > sum(stalls)


def test_auto_keeps_the_fat_blocks_resident_once_measured_and_the_stall_falls_to_zero():
    model, x, allowance, clock = _fat_lean()
    ref = run(model, (x,))
    cfg = OffloadConfig.from_preset("auto", device="sim", sim_bandwidth_gbps=0.5, sim_capacity_bytes=(64 << 20) + 241,
                                    sim_clock=clock)
    h = offload_module(model, cfg, budget=VramBudget(allowance))
    assert not {0, 1, 2, 3} <= h.plan.resident, "before anything is measured the count-based plan streams fat blocks"
    assert torch.equal(run(model, (x,)), ref)
    first = h.report().stall_ms
    assert first > 0
    for _ in range(5):
        assert torch.equal(run(model, (x,)), ref)
    h.reset_stats()
    for _ in range(3):
        assert torch.equal(run(model, (x,)), ref)
    rep = h.report()
    assert _tiers(h) == "RRRRssss", [b.placement for b in rep.blocks]
    assert rep.stall_ms == 0.0, f"{rep.stall_ms / 3:.2f} ms of stall per pass (first pass {first:.2f})"
    assert sum(b.predicted_stall_ms for b in rep.blocks) == 0.0
    assert rep.peak_device_bytes <= allowance
    # predicted and measured side by side: the blocks' compute per pass (4 x 0.02 + 4 x 3 ms), nothing stalls
    assert rep.predicted_step_ms == pytest.approx(12.08) and rep.step_ms == pytest.approx(12.08)
    assert all(b.placement.startswith("resident: streaming it would stall") for b in rep.blocks[:4])
    h.detach()


class _Underestimating(CostTracker):
    """A cost model that believes the fat blocks' copies take a thousandth of what they do (a source of error the
    simulation cannot see: a slow path on the host, another process on the link)."""

    def costs(self) -> UnitCosts:
        c = super().costs()
        return UnitCosts(c.compute_ms, [v / 1000 if size > 1 << 20 else v for v, size in zip(c.copy_ms, self.sizes)])


def test_a_stall_the_plan_did_not_predict_feeds_the_next_plan(monkeypatch):
    import offload.plan.replan as replan

    monkeypatch.setattr(replan, "CostTracker", _Underestimating)
    model, x, allowance, clock = _fat_lean(lean_ms=0.1)  # little compute: nothing can hide a fat block's copy
    ref = run(model, (x,))
    cfg = OffloadConfig(device="sim", prefetch=2, sim_bandwidth_gbps=0.5, sim_capacity_bytes=(64 << 20) + 242,
                        sim_clock=clock)
    h = offload_module(model, cfg, budget=VramBudget(allowance))
    for _ in range(16):  # measured: the (wrong) cost model predicts the fat copies hide; a plan from it runs,
        assert torch.equal(run(model, (x,)), ref)  # stalls, and (with feedback) gives way within a few passes
    h.reset_stats()
    for _ in range(2):
        assert torch.equal(run(model, (x,)), ref)
    rep = h.report()
    assert _tiers(h)[:4] == "RRRR", [b.placement for b in rep.blocks]
    h.detach()


def _synthetic_metrics(handle, fat_stall_ms: float):
    """The metrics' running totals as a pass of a fat/lean model gives them, where every fat block the plan streams
    stalls `fat_stall_ms` although its copy looks as cheap as a lean block's (what the cost model cannot see)."""
    sizes = list(handle.keeper.base.sizes)
    fat = [size > 1 << 20 for size in sizes]
    totals = [[0] * 8, [0.0] * 8, [0.0] * 8, [0] * 8, [0.0] * 8]

    def lifetime():
        plan = handle.keeper.plan
        for i in range(8):
            streamed = i not in plan.resident
            totals[0][i] += 1
            totals[1][i] += 0.01 if fat[i] else 2.0
            totals[2][i] += 0.02 if streamed else 0.0
            totals[3][i] += sizes[i] if streamed else 0
            totals[4][i] += fat_stall_ms if streamed and fat[i] else 0.0
        return tuple(list(t) for t in totals)

    return lifetime


@pytest.mark.parametrize("fat_stall_ms", [8.0, 0.0])
def test_measured_stalls_beyond_the_prediction_move_the_plan(fat_stall_ms):
    """The same, with the measurements given exactly: the fat blocks' copies look cheap (the prediction says they
    hide), yet each streamed fat block stalls 8 ms per pass. After a pass on the plan made from those costs, the
    measured stall beyond the prediction is a fact of the next plan, which keeps the fat blocks resident. When the
    measurements agree with the prediction (0 ms), the plan in place stays."""
    model, x, allowance, _ = _fat_lean()
    cfg = OffloadConfig(device="sim", prefetch=2, sim_capacity_bytes=(64 << 20) + 243)
    h = offload_module(model, cfg, budget=VramBudget(allowance))
    h.streamer.metrics.lifetime = _synthetic_metrics(h, fat_stall_ms)
    count_plan = "".join("R" if i in h.plan.resident else "s" for i in range(8))  # placed at the first forward
    assert count_plan[:4] != "RRRR"
    for _ in range(4):
        run(model, (x,))
    if fat_stall_ms:
        assert _tiers(h) == "RRRRssss", h.plan.reasons
        assert h.keeper.excess is not None and all(h.keeper.excess[i] == pytest.approx(8.0)
                                                   for i in range(4) if count_plan[i] == "s")
        stalled = [i for i in range(4) if count_plan[i] == "s"]
        assert all("it stalled when streamed, more than predicted" in h.plan.reasons[i] for i in stalled), \
            h.plan.reasons
    else:
        assert _tiers(h) == count_plan and h.keeper.excess is None
    h.detach()


class _Stack(nn.Module):
    """Eight blocks of 256 KiB with almost no compute (nothing hides a slow read)."""

    def __init__(self, n: int = 8, dim: int = 256) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(FatCheapBlock(dim, dim) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def test_a_slow_disk_read_counts_before_its_copy(tmp_path):
    """Blocks on the disk tier are read into a bounce buffer before their copy: the plan keeps the disk blocks
    resident and streams the ones in RAM, once it measured the reads."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = _Stack().eval()
    x = torch.randn(4, 256)
    ref = run(model, (x,))
    path = tmp_path / "m.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    size = aligned_bytes(model.blocks[0])
    clock = SimClock(disk_gbps=size / 0.02 / 1e9)  # a slow disk: 20 ms to read a block
    clock.charge(model.blocks, 0.1)
    cfg = OffloadConfig.from_preset("auto", device="sim", prefetch=1, disk_path=str(path), sim_bandwidth_gbps=8.0,
                                    ram_budget_bytes=7 * size + 8 * 4096, host_compression="off", sim_clock=clock)
    h = offload_module(model, cfg, budget=VramBudget(6 * size))
    host = [b.tier for b in h.report().blocks]
    assert host[:4] == ["pageable"] * 4 and host[4:] == ["disk"] * 4, host
    for _ in range(4):
        assert torch.equal(run(model, (x,)), ref)
    h.reset_stats()
    for _ in range(2):
        assert torch.equal(run(model, (x,)), ref)
    rep = h.report()
    assert [b.tier for b in rep.blocks] == ["pageable"] * 4 + ["vram"] * 4, [b.placement for b in rep.blocks]
    assert all(b.reads == 0 for b in rep.blocks), "the blocks left streaming come from RAM: no disk read"
    assert rep.stall_ms == 0.0, "nothing waits for a 20 ms disk read"
    h.detach()
