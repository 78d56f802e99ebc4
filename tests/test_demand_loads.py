"""Order that changes (issue 20): units called out of the predicted order are loaded on demand while the copies
still predicted stay in flight, and prediction comes from history (which pass follows which, which unit follows
which), so alternating call orders and repeating expert choices are prefetched."""
from __future__ import annotations

import torch
import torch.nn as nn

from offload import OffloadConfig, offload_module
from offload.model.blocks import expert_units
from offload.stream.prefetch import PrefetchWorker
from tests.models import aligned_bytes, run

DIM = 32


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x):
        return torch.tanh(self.fc(x))


class Router(nn.Module):
    """Picks 2 of 8 experts per input (from the input's first features): a mixture-of-experts layer."""

    def __init__(self, n: int = 8) -> None:
        super().__init__()
        self.gate = nn.Linear(DIM, n)
        self.experts = nn.ModuleList(Expert() for _ in range(n))

    def forward(self, x):
        scores = self.gate(x).mean(0)
        top = torch.topk(scores, 2).indices.tolist()
        out = x
        for i in top:
            out = out + self.experts[i](x)
        return out


class Alternating(nn.Module):
    """Eight blocks called in one order on even passes and another on odd ones."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Expert() for _ in range(8))
        self.calls = 0
        self.orders = ([0, 1, 2, 3, 4, 5, 6, 7], [0, 4, 1, 5, 2, 6, 3, 7])

    def forward(self, x):
        order = self.orders[self.calls % 2]
        self.calls += 1
        for i in order:
            x = x + self.blocks[i](x)
        return x


def _every_block_streamed(model, blocks, slots=3):
    rest = aligned_bytes(model) - sum(aligned_bytes(b) for b in blocks)
    return OffloadConfig(device="sim", prefetch=slots - 1, vram_fraction=0.0,
                         vram_budget_bytes=rest + slots * aligned_bytes(blocks[0]))


def test_router_picking_two_of_eight_experts_is_bitwise_and_counts_demand_loads():
    torch.manual_seed(0)
    model = Router().eval()
    xs = [torch.randn(4, DIM, generator=torch.Generator().manual_seed(k)) for k in range(30)]
    refs = [run(model, (x,)) for x in xs]
    assert expert_units(model) == [f"experts.{i}" for i in range(8)]
    h = offload_module(model, _every_block_streamed(model, list(model.experts)), units=expert_units(model))
    for x, ref in zip(xs, refs):
        assert torch.equal(run(model, (x,)), ref)
    rep = h.report()
    assert all(b.tier != "vram" for b in rep.blocks)
    calls = sum(b.calls for b in rep.blocks)
    assert calls == 2 * len(xs)
    assert rep.demand_loads > 0, "experts the prediction missed are loaded on demand"
    assert rep.demand_loads + rep.prefetch_hits == calls


def test_repeating_expert_choices_reach_a_high_prefetch_hit_rate():
    torch.manual_seed(0)
    model = Router().eval()
    cycle = [torch.randn(4, DIM, generator=torch.Generator().manual_seed(k)) for k in range(2)]
    refs = [run(model, (x,)) for x in cycle]
    assert torch.topk(model.gate(cycle[0]).mean(0), 2).indices.tolist() != \
        torch.topk(model.gate(cycle[1]).mean(0), 2).indices.tolist(), "the two inputs pick different experts"
    h = offload_module(model, _every_block_streamed(model, list(model.experts)),
                       units=[f"experts.{i}" for i in range(8)])
    for k in range(6):  # learn
        assert torch.equal(run(model, (cycle[k % 2],)), refs[k % 2])
    h.reset_stats()
    for k in range(20):
        assert torch.equal(run(model, (cycle[k % 2],)), refs[k % 2])
    rep = h.report()
    assert rep.prefetch_hits / (rep.prefetch_hits + rep.demand_loads) >= 0.9, (rep.prefetch_hits, rep.demand_loads)


def test_two_alternating_call_orders_are_predicted_as_they_alternate():
    torch.manual_seed(0)
    model = Alternating().eval()
    x = torch.randn(4, DIM)
    refs = [run(model, (x,)) for _ in range(2)]
    model.calls = 0
    h = offload_module(model, _every_block_streamed(model, list(model.blocks)))
    for k in range(6):  # learn
        assert torch.equal(run(model, (x,)), refs[k % 2])
    h.reset_stats()
    for k in range(20):
        assert torch.equal(run(model, (x,)), refs[k % 2])
    rep = h.report()
    assert rep.demand_loads + rep.prefetch_hits == 20 * 8
    assert rep.prefetch_hits / (20 * 8) >= 0.95, (rep.prefetch_hits, rep.demand_loads)
    assert h.streamer.worker.resyncs < 40


class _Recorder:
    def __init__(self):
        self.issued = []

    def source(self, unit):
        rec = self

        class Src:
            def issue(self, dst, after):
                rec.issued.append(unit)
                return f"copy-{len(rec.issued)}"
        return Src()


def test_a_demand_load_keeps_the_copies_still_predicted_in_flight():
    rec = _Recorder()
    w = PrefetchWorker()
    w.configure([0, 1, 2, 3, 4, 5], [torch.empty(1)] * 4, [rec.source(u) for u in range(8)])
    w.predictor.record_pass([0, 6, 2, 3, 4, 5])  # once, a pass took unit 6 where 1 usually runs
    w.predictor.record_pass([0, 1, 2, 3, 4, 5])
    w.predictor.record_pass([0, 1, 2, 3, 4, 5])
    w.set_order([0, 1, 2, 3, 4, 5])
    w.begin_pass()
    w.fill()
    assert [u for u, _, _ in w.inflight] == [0, 1, 2, 3]
    w.take(0)
    issued = len(rec.issued)
    w.take(6)  # not in flight: loaded on demand into the slot of the copy no longer predicted (1)
    assert w.demand_loads == 1 and rec.issued[issued:] == [6]
    assert [u for u, _, _ in w.inflight] == [2, 3], "the copies the new prediction still wants stay in flight"
