"""The simulated device itself: memory accounting, ordered copies, bandwidth, errors surfacing."""
from __future__ import annotations

import pytest
import torch

from offload.backends.sim import SimBackend


def test_capacity_is_enforced_and_accounted():
    dev = SimBackend(capacity_bytes=1000)
    a = dev.alloc(600)
    assert dev.used_bytes == 600 and dev.mem_get_info() == (400, 1000)
    with pytest.raises(torch.OutOfMemoryError, match="600 of 1000|400 of 1000"):
        dev.alloc(500)
    dev.release(a)
    assert dev.used_bytes == 0
    dev.alloc(1000)
    assert dev.peak_bytes == 1000


def test_owns_only_its_allocations():
    dev = SimBackend(capacity_bytes=1 << 20)
    buf = dev.alloc(4096)
    assert dev.owns(buf[100:200].view(torch.int8))
    assert not dev.owns(torch.empty(4096, dtype=torch.uint8))
    dev.release(buf)
    assert not dev.owns(buf)


def test_copies_run_in_order_and_take_the_simulated_time():
    """On the host's clock a throttled copy lasts at least latency + bytes / bandwidth (the copy engine sleeps out
    the rest): a floor the load of the host can only raise, read from the copy events themselves."""
    dev = SimBackend(capacity_bytes=1 << 24, bandwidth_gbps=0.1, latency_us=1000)  # 1 MB -> 10 ms + 1 ms
    dst = dev.alloc(1 << 20)
    srcs = [torch.full((1 << 20,), i, dtype=torch.uint8) for i in range(3)]
    events = [dev.copy_h2d(dst, s) for s in srcs]
    for e in events:
        dev.wait(e)
    assert int(dst[0]) == 2, "copies land in submission order"
    assert all(dev.copy_span_ms(e) >= 10.0 for e in events), [dev.copy_span_ms(e) for e in events]
    assert all(a.time <= b.start for a, b in zip(events, events[1:])), "one copy engine: one copy at a time"


def test_copy_waits_for_its_after_event():
    dev = SimBackend(capacity_bytes=1 << 20)
    dst = dev.alloc(16)
    gate = dev.copy_h2d(dev.alloc(16), torch.zeros(16, dtype=torch.uint8))  # any event
    dev.wait(gate)
    ev = dev.copy_h2d(dst, torch.ones(16, dtype=torch.uint8), after=gate)
    dev.wait(ev)
    assert bool((dst == 1).all())


def test_failed_copy_raises_in_the_waiter():
    dev = SimBackend(capacity_bytes=1 << 20)
    dst = dev.alloc(8)
    ev = dev.copy_h2d(dst, torch.ones(16, dtype=torch.uint8))  # size mismatch: the copy fails
    with pytest.raises(RuntimeError, match="copy failed"):
        dev.wait(ev)
    ok = dev.copy_h2d(dst, torch.ones(8, dtype=torch.uint8))
    dev.wait(ok)  # the copy engine keeps working after a failure


def test_sim_capacity_from_the_environment(monkeypatch):
    """LAYER_OFFLOAD_SIM_GB sizes a simulated device the config does not size (several ComfyUI processes as cards of
    different sizes); a bad value names the variable."""
    from offload.backends.sim import DEFAULT_SIM_CAPACITY, SimBackend

    monkeypatch.delenv("LAYER_OFFLOAD_SIM_GB", raising=False)
    assert SimBackend().capacity_bytes == DEFAULT_SIM_CAPACITY
    monkeypatch.setenv("LAYER_OFFLOAD_SIM_GB", "2.5")
    assert SimBackend().capacity_bytes == int(2.5 * (1 << 30))
    assert SimBackend(capacity_bytes=1 << 20).capacity_bytes == 1 << 20, "the config's own capacity wins"
    for bad in ("lots", "0", "-1", "inf"):
        monkeypatch.setenv("LAYER_OFFLOAD_SIM_GB", bad)
        with pytest.raises(ValueError, match="LAYER_OFFLOAD_SIM_GB"):
            SimBackend()
