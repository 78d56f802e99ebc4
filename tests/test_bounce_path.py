"""Pageable host memory on a device that has pinned memory goes through the read-ahead thread's bounce buffers."""
from __future__ import annotations

import torch

from offload import OffloadConfig, VramBudget, offload_module
from offload.backends import get_backend
from offload.demo.reference_models import TransformerStack


def test_unpinned_units_stream_through_bounce_buffers_and_stay_exact():
    cfg = OffloadConfig.from_preset("budget", device="sim", sim_capacity_bytes=(200 << 20) + 7)
    backend = get_backend(cfg)
    backend.supports_pinned_host = True  # play a GPU: pinning is possible but refused (CPU-only torch)
    try:
        torch.manual_seed(0)
        model = TransformerStack(dim=64, depth=5)
        x = torch.randn(2, 6, 64)
        with torch.no_grad():
            ref = model(x)
        handle = offload_module(model, cfg, budget=VramBudget(100 << 20))
        try:
            with torch.no_grad():
                for _ in range(3):
                    assert torch.equal(model(x), ref)
            rep = handle.report()
            assert {b.tier for b in rep.blocks} == {"pageable"}
            assert all(b.reads >= 3 for b in rep.blocks), "every streamed use went through a bounce buffer"
            assert [n["kind"] for n in rep.notices] == ["pinned_fallback"], "the user is told pinning failed"
        finally:
            handle.detach()
        with torch.no_grad():
            assert torch.equal(model(x), ref)
    finally:
        backend.supports_pinned_host = False
