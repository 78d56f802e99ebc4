"""The pinned-memory gate (offload/backends/pin_gate.py): every pin of the engine is asked first and told when it goes, so a host
that budgets pinned memory (ComfyUI's MAX_PINNED_MEMORY) counts the engine's pins; a refused pin stages pageable and
streams through a bounce buffer, outputs unchanged."""
from __future__ import annotations

import gc
import logging

import pytest
import torch

from offload import OffloadConfig, VramBudget, offload_module
from offload.backends import pin_gate
from offload.backends import get_backend
from offload.demo.reference_models import TransformerStack


class Gate:
    """A pin budget: grants while `limit` allows, counts what is held (as ComfyUI's TOTAL_PINNED_MEMORY does)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.held, self.asked, self.released = limit, 0, [], []

    def acquire(self, n: int) -> bool:
        self.asked.append(n)
        if self.held + n > self.limit:
            return False
        self.held += n
        return True

    def release(self, n: int) -> None:
        self.released.append(n)
        self.held -= n


@pytest.fixture
def gate():
    g = Gate(1 << 30)
    pin_gate.set_pin_gate(g.acquire, g.release)
    yield g
    pin_gate.set_pin_gate(None, None)


def test_a_granted_pin_is_counted_until_its_storage_is_freed(gate):
    before = pin_gate.pinned_bytes()
    buf = pin_gate.pin_host(4096, lambda: torch.empty(4096, dtype=torch.uint8))
    assert buf is not None and gate.asked == [4096] and gate.held == 4096
    assert pin_gate.pinned_bytes() == before + 4096
    view = buf[100:200]  # a unit's weight viewing the buffer keeps the pinned memory alive
    del buf
    gc.collect()
    assert gate.released == [] and pin_gate.pinned_bytes() == before + 4096
    del view
    gc.collect()
    assert gate.released == [4096] and gate.held == 0 and pin_gate.pinned_bytes() == before


def test_a_refused_pin_allocates_nothing(gate):
    gate.limit = 1000
    called = []
    assert pin_gate.pin_host(4096, lambda: called.append(1) or torch.empty(4096, dtype=torch.uint8)) is None
    assert called == [] and gate.held == 0 and gate.asked == [4096]


def test_a_failed_pin_hands_the_grant_back(gate):
    def refuse():
        raise RuntimeError("locked-memory ulimit")

    with pytest.raises(RuntimeError):
        pin_gate.pin_host(4096, refuse)
    assert gate.asked == [4096] and gate.released == [4096] and gate.held == 0


def test_a_broken_gate_pins_as_without_one_with_one_log_line(caplog):
    def broken(n):
        raise KeyError("MAX_PINNED_MEMORY")

    pin_gate.set_pin_gate(broken, None)
    pin_gate._gate_failed = False
    try:
        with caplog.at_level(logging.WARNING, logger="offload"):
            for _ in range(3):
                assert pin_gate.pin_host(64, lambda: torch.empty(64, dtype=torch.uint8)) is not None
        assert len([r for r in caplog.records if "gate failed" in r.getMessage()]) == 1
    finally:
        pin_gate.set_pin_gate(None, None)


def test_set_pin_gate_refuses_what_is_not_callable():
    with pytest.raises(TypeError):
        pin_gate.set_pin_gate(5, None)
    with pytest.raises(TypeError):
        pin_gate.set_pin_gate(lambda n: True, "release")
    assert pin_gate.pin_gate() == (None, None)


def test_the_backend_asks_the_gate_and_a_refusal_streams_pageable_through_bounce_buffers(gate):
    """A simulated GPU (pinning possible) whose pin budget is spent: every unit stages pageable and streams through a
    bounce buffer, bitwise; the gate was asked for each, and nothing it did not grant is released."""
    gate.limit = 0
    cfg = OffloadConfig.from_preset("budget", device="sim", sim_capacity_bytes=(200 << 20) + 19)
    backend = get_backend(cfg)
    backend.supports_pinned_host = True
    try:
        torch.manual_seed(0)
        model = TransformerStack(dim=64, depth=5)
        x = torch.randn(2, 6, 64)
        with torch.no_grad():
            ref = model(x)
        handle = offload_module(model, cfg, budget=VramBudget(100 << 20))
        try:
            with torch.no_grad():
                for _ in range(2):
                    assert torch.equal(model(x), ref)
            rep = handle.report()
            assert {b.tier for b in rep.blocks} == {"pageable"}
            assert all(b.reads >= 2 for b in rep.blocks), "every streamed use went through a bounce buffer"
            unit_bytes = sorted(handle.unit_bytes().values())
            assert all(n in gate.asked for n in unit_bytes), (gate.asked, unit_bytes)
            assert gate.held == 0 and gate.released == []
            assert handle.host_memory()["pinned"] == 0
        finally:
            handle.detach()
    finally:
        backend.supports_pinned_host = False


def test_granted_pins_that_the_driver_refuses_are_handed_back(gate):
    """CPU-only torch cannot pin: each grant comes back at once, so the host's count is never left inflated."""
    cfg = OffloadConfig(device="sim", sim_capacity_bytes=(64 << 20) + 23)
    backend = get_backend(cfg)
    buf, pinned = backend.alloc_host(8192, True)
    if pinned:  # a machine with an accelerator pins for real: the grant is held until the buffer goes
        assert gate.held == 8192
        del buf
        gc.collect()
    assert gate.held == 0 and gate.asked == [8192]
