"""The host-master guard (tests/host_master_guard.py) itself: it sees every op of a forward, lets the engine's own
copies through, and catches a compute op on a host master (what a GPU reports as a device mismatch)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from tests.host_master_guard import HostMasterRead, host_master_guard


class _Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.norm(x))


class _Stack(nn.Module):
    def __init__(self, dim: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(_Block(dim) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return x


def test_streamed_forward_passes_the_guard(sim_cfg, offload):
    model = _Stack().eval()
    x = torch.randn(2, 16)
    ref = model(x)
    handle = offload(model, sim_cfg(vram_fraction=0))
    assert all(b.tier != "vram" for b in handle.report().blocks)
    with torch.no_grad(), host_master_guard(handle) as guard:
        out = model(x)
    assert guard.checked > 10  # it saw the forward's ops, the engine's copies among them
    assert torch.equal(out, ref)


def test_compute_on_a_host_master_is_caught(sim_cfg, offload):
    """Between passes every streamed weight is bound to its host master: an op on it is what the guard exists for."""
    model = _Stack().eval()
    handle = offload(model, sim_cfg(vram_fraction=0))
    with torch.no_grad():
        model(torch.randn(2, 16))
        with pytest.raises(HostMasterRead, match=r"aten\.mm.*blocks\.2\.fc\.weight"):
            with host_master_guard(handle):
                torch.mm(torch.randn(2, 16), model.blocks[2].fc.weight.t())
        with pytest.raises(HostMasterRead, match=r"inp\.bias"):  # the weights outside the blocks, once unloaded
            handle.unload()
            with host_master_guard(handle):
                model.inp.bias + 1
