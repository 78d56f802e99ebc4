"""Shared fixtures for the engine suite.

Every engine test runs on ``device="sim"`` (a simulated device whose tensors are CPU tensors) with its own
``VramBudget`` so tests never share the process-wide default budget. CUDA tests carry ``@pytest.mark.cuda``
and skip without a GPU.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)



def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA device (skipped without one)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _shared_sim_device_left_empty():
    """Tests share the default simulated device (device="sim"). A model a test left in a reference cycle (a
    `pytest.raises(...) as info` keeps the test's frame, and the models in it, until the cycle collector runs)
    still holds its device memory there, and a later test reading the device's peak would see it: collect such
    leftovers when the test ends and start the peak afresh (only then, so the suite pays nothing otherwise).
    tests/test_engine_contracts.py's RAM-ceiling test leaves one so; test_engine_memory's budget test read its peak
    whenever the collector had not run in between."""
    yield
    if "offload.backends" in sys.modules:
        from offload import OffloadConfig
        from offload.backends import get_backend

        backend = get_backend(OffloadConfig(device="sim"))
        if backend.used_bytes:
            import gc

            gc.collect()
            backend.reset_peak()  # its peak is the next test's own from here


@pytest.fixture
def sim_budget():
    """A fresh VramBudget of its own (isolates the test from default_budget()). Its total is left to the
    engine, which sizes it from the device on first use: a fixed "big" total would be rejected as larger
    than the device (DESIGN §6), and the per-model `vram_budget_bytes` is what the tests constrain."""
    from offload import VramBudget

    return VramBudget(None)


@pytest.fixture
def sim_cfg():
    """Factory: ``sim_cfg(**overrides)`` -> OffloadConfig on the simulated device."""
    from offload import OffloadConfig

    def make(**kw):
        kw.setdefault("device", "sim")
        return OffloadConfig(**kw)

    return make


@pytest.fixture
def offload():
    """Factory: ``offload(model, cfg, **kw)`` -> handle, with a private VramBudget (sized from the device)
    unless one is given.

    Handles still attached at teardown are detached so a failing test cannot leak hooks into another.
    """
    from offload import VramBudget, offload_module

    handles = []

    def attach(model, cfg, **kw):
        if kw.get("budget") is None:
            kw["budget"] = VramBudget(None)
        h = offload_module(model, cfg, **kw)
        handles.append(h)
        return h

    yield attach
    for h in handles:
        try:
            h.detach()
        except Exception:  # the test itself reports engine failures; teardown must not mask them
            pass
