"""The simulated device on its own clock (offload/backends/sim_clock.py): compute, copies and reads take the times
given, so what the engine measures, plans and reports is the same on every run, whatever the host's load."""
from __future__ import annotations

import threading

import pytest
import torch
import torch.nn as nn

from offload import OffloadConfig, VramBudget, offload_module
from offload.backends import get_backend
from offload.backends.sim_clock import ClockedSimBackend, SimClock
from offload.demo.reference_models import MixedCostStack
from tests.models import aligned_bytes, run


def _device(**kw) -> ClockedSimBackend:
    kw.setdefault("capacity_bytes", 1 << 24)
    return ClockedSimBackend(kw.pop("clock", None) or SimClock(), **kw)


def test_copies_take_latency_plus_bytes_over_bandwidth_one_after_another():
    dev = _device(bandwidth_gbps=0.1, latency_us=1000)  # 1 MB -> 10 ms + 1 ms
    dst = dev.alloc(1 << 20)
    events = [dev.copy_h2d(dst, torch.full((1 << 20,), i, dtype=torch.uint8)) for i in range(3)]
    assert int(dst[0]) == 2, "copies land in the order issued"
    spans = [t * 1e3 for e in events for t in (e.start, e.time)]
    assert spans == pytest.approx([0.0, 11.48576, 11.48576, 22.97152, 22.97152, 34.45728])
    assert all(dev.copy_span_ms(e) == pytest.approx(11.48576) for e in events)
    assert not dev.is_done(events[0]), "nothing waited yet: the compute lane is still at 0"
    assert dev.wait(events[1]) == pytest.approx(0.02297152), "the compute lane waited for the second copy"
    assert dev.clock.now_ms == pytest.approx(22.97152)
    assert dev.is_done(events[1]) and not dev.is_done(events[2])
    dev.synchronize()
    assert dev.clock.now_ms == pytest.approx(34.45728) and dev.is_done(events[2])


def test_a_copy_starts_after_its_event_and_the_compute_lane():
    clock = SimClock()
    dev = _device(clock=clock, bandwidth_gbps=1.0)
    dst = dev.alloc(1000)
    clock.advance(5.0)
    free = dev.record()  # "slot free" at 5 ms
    clock.advance(2.0)
    ev = dev.copy_h2d(dst, torch.ones(1000, dtype=torch.uint8), after=free)
    assert (ev.start * 1e3, ev.time * 1e3) == pytest.approx((7.0, 7.001)), "issued at 7 ms: not before"
    later = SimClock()
    dev2 = _device(clock=later, bandwidth_gbps=1.0)
    late_free = dev2.record()
    later.advance(3.0)
    gate = dev2.record()
    ev2 = dev2.copy_h2d(dev2.alloc(1000), torch.ones(1000, dtype=torch.uint8), after=gate)
    assert ev2.start == pytest.approx(0.003) and late_free.time == 0.0
    assert dev2.elapsed_ms(late_free, gate) == pytest.approx(3.0)


def test_charged_compute_moves_the_compute_lane_inside_the_modules_call():
    clock = SimClock()
    blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
    seen = []
    clock.charge(blocks, 2.0)  # a ModuleList is never called: its modules are charged
    blocks[0].register_forward_hook(lambda *_: seen.append(clock.now_ms))  # hooks after the charge see it
    for b in blocks:
        b(torch.ones(1, 4))
    assert clock.now_ms == pytest.approx(6.0) and seen == [pytest.approx(2.0)]
    clock.remove_charges()
    blocks[1](torch.ones(1, 4))
    assert clock.now_ms == pytest.approx(6.0)


def test_charge_flops_costs_linears_and_convolutions_by_their_multiply_adds():
    clock = SimClock()
    model = nn.ModuleList([nn.Linear(64, 32), nn.ReLU(), nn.Conv1d(32, 16, 3, padding=1)])
    clock.charge_flops(model, gflops=1.0)
    model[0](torch.ones(8, 64))  # Linear: 8 x 64 -> 8 x 32
    model[1](torch.ones(8, 64))  # free
    assert clock.now_ms == pytest.approx(2 * 64 * 8 * 32 / 1e9 * 1e3)
    before = clock.now_ms
    model[2](torch.ones(2, 32, 10))  # Conv1d: fan-in 32 x 3, output 2 x 16 x 10
    assert clock.now_ms - before == pytest.approx(2 * 96 * 2 * 16 * 10 / 1e9 * 1e3)


def test_a_read_before_a_copy_takes_its_time_on_the_transfer_lane():
    clock = SimClock(disk_gbps=0.001)  # 1 MB/s
    dev = _device(clock=clock, bandwidth_gbps=1.0)
    dst = dev.alloc(1000)
    n, ms = clock.timed("disk", 1000, lambda: 7)
    assert (n, ms) == (7, pytest.approx(1.0))
    ev = dev.copy_h2d(dst, torch.ones(1000, dtype=torch.uint8))
    assert (ev.start * 1e3, ev.time * 1e3) == pytest.approx((1.0, 1.001)), "the read, then the copy"
    ev2 = dev.copy_h2d(dst, torch.ones(1000, dtype=torch.uint8))
    assert ev2.start * 1e3 == pytest.approx(1.001), "a read is waited for by the next copy only"
    assert clock.timed("bounce", 1000, lambda: None)[1] == 0.0, "no rate set: free"
    got = []
    worker = threading.Thread(target=lambda: got.append(clock.timed("disk", 2000, lambda: None)[1]))
    worker.start()
    clock.hand_off(worker.join)  # what the read-ahead thread was handed is waited for
    assert got == [pytest.approx(2.0)] and clock.take_read() == 0.0, "a read belongs to the thread that did it"


def test_a_failed_copy_still_raises_where_it_is_waited_for():
    dev = _device()
    ev = dev.copy_h2d(dev.alloc(8), torch.ones(16, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="copy failed"):
        dev.wait(ev)


def test_config_takes_a_clock_for_the_simulated_device_only():
    clock = SimClock()
    assert get_backend(OffloadConfig(device="sim", sim_clock=clock)) is get_backend(OffloadConfig(device="sim",
                                                                                                 sim_clock=clock))
    other = get_backend(OffloadConfig(device="sim", sim_clock=SimClock()))
    assert other is not get_backend(OffloadConfig(device="sim", sim_clock=clock))
    assert type(get_backend(OffloadConfig(device="sim"))).__name__ == "SimBackend"
    assert get_backend(OffloadConfig(device="sim")).clock.virtual is False
    with pytest.raises(ValueError, match="needs device='sim'"):
        OffloadConfig(device="cuda", sim_clock=clock)
    with pytest.raises(ValueError, match="sim_clock must be"):
        OffloadConfig(device="sim", sim_clock=1.5)
    with pytest.raises(ValueError, match="disk_gbps"):
        SimClock(disk_gbps=0)
    with pytest.raises(ValueError, match="ms must be"):
        clock.charge(nn.Linear(2, 2), -1.0)


def _fat_lean_report(clock: SimClock):
    torch.manual_seed(0)
    model = MixedCostStack("FFFFLLLL", repeats=2, input_layer=True).eval()
    clock.charge(model.blocks[:4], 0.05)
    clock.charge(model.blocks[4:], 3.0)
    clock.charge(model.inp, 0.5)
    x = torch.randn(64, 64)
    ref = run(model, (x,))
    fat, lean = aligned_bytes(model.blocks[0]), aligned_bytes(model.blocks[4])
    budget = VramBudget(aligned_bytes(model) - 4 * lean + 3 * lean)
    h = offload_module(model, OffloadConfig(device="sim", prefetch=2, sim_bandwidth_gbps=1.0, sim_latency_us=20.0,
                                            sim_capacity_bytes=(64 << 20) + 4111, sim_clock=clock), budget=budget)
    tiers = []
    for _ in range(6):
        assert torch.equal(run(model, (x,)), ref)
        tiers.append("".join("R" if b.tier == "vram" else "s" for b in h.report().blocks))
    rep = h.report().to_dict()
    h.detach()
    # The setup's times are host wall time by design (how long reading and staging took on this machine; the clock
    # simulates the device, not the host): only its counts are the run's own facts.
    rep["setup"] = {k: v for k, v in rep["setup"].items() if not k.endswith("_ms")}
    return tiers, rep, clock.now_ms


def test_the_same_run_gives_the_same_measurements_plans_and_report_every_time():
    """Two runs on two fresh clocks: every figure the engine measured, planned and reported is equal (the setup's
    host wall times aside: see _fat_lean_report)."""
    first, second = _fat_lean_report(SimClock()), _fat_lean_report(SimClock())
    assert first[0] == second[0] and first[0][-1] == "RRRRssss", first[0]
    assert first[1] == second[1]
    assert first[2] == second[2]
    assert first[1]["step_ms"] > 0 and first[1]["predicted_step_ms"] == pytest.approx(4 * 0.05 + 4 * 3.0)


def test_disk_reads_on_the_read_ahead_thread_take_the_clocks_time(tmp_path):
    """A disk-tier block is read on the read-ahead thread at the clock's disk rate: the time reported for its reads
    is its bytes over that rate, and its copy on the transfer lane comes after the read."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(4))).eval()
    x = torch.randn(2, 64)
    ref = run(model, (x,))
    path = tmp_path / "m.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    clock = SimClock(disk_gbps=0.01)
    size = aligned_bytes(model[0])
    cfg = OffloadConfig.from_preset("budget", device="sim", disk_path=str(path), ram_budget_bytes=size,
                                    host_compression="off", sim_bandwidth_gbps=1.0, sim_clock=clock)
    h = offload_module(model, cfg, budget=VramBudget(None))
    assert torch.equal(run(model, (x,)), ref)
    rep = h.report()
    disk = [i for i, b in enumerate(rep.blocks) if b.tier == "disk"]
    assert disk, [b.tier for b in rep.blocks]
    sources = h.streamer.sources
    for i in disk:
        assert sources[i].reads >= 1
        assert sources[i].read_ms == pytest.approx(sources[i].reads * sources[i].nbytes / 0.01e9 * 1e3)
    assert [rep.blocks[i].stall_ms for i in disk][0] >= sources[disk[0]].nbytes / 0.01e9 * 1e3 - 1e-9, \
        "the first disk block waited for its read and copy"
    h.detach()
