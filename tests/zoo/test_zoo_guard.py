"""The host-master guard (tests/host_master_guard.py) itself: it sees every op of a forward, lets the engine's own
copies through, and catches a compute op on a host master (what a GPU reports as a device mismatch)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from tests.host_master_guard import HostMasterRead, host_master_guard
from tests.zoo.zoo_models import ModelWithUnusedSubModulesForTest  # accelerate tests/test_big_modeling.py


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


LEAVES = ["linear1.linear", "linear2.linear", "linear3.linear", "linear4.linear", "batchnorm"]


def test_leaf_units_read_by_their_parent_fail_the_guard_without_the_merge(sim_cfg, offload, monkeypatch):
    """Leaf-level units (every module holding weights its own unit, diffusers' offload_type="leaf_level"): the parent
    reads `linear.weight` without calling `linear`, so the unit is never entered. Without the unit merge in
    offload/model/blocks.py the forward computes on the host master: the guard catches it."""
    monkeypatch.setattr("offload.model.blocks._reader_of", lambda model, unit: None)
    model = ModelWithUnusedSubModulesForTest().eval()
    handle = offload(model, sim_cfg(vram_fraction=0), units=LEAVES)
    assert [b.name for b in handle.report().blocks] == LEAVES
    with torch.no_grad(), pytest.raises(HostMasterRead, match=r"linear1\.linear\.weight"):
        with host_master_guard(handle):
            model(torch.randn(2, 3))


def test_leaf_units_read_by_their_parent_stream_as_the_parent(sim_cfg, offload, caplog):
    model = ModelWithUnusedSubModulesForTest().eval()
    x = torch.randn(2, 3)
    with torch.no_grad():
        ref = model(x)
    handle = offload(model, sim_cfg(vram_fraction=0), units=LEAVES)
    assert [b.name for b in handle.report().blocks] == ["linear1", "linear2", "linear3", "linear4", "batchnorm"]
    assert "linear1 reads linear1.linear.weight without calling linear1.linear" in caplog.text
    assert "(and 3 more like it)" in caplog.text
    with torch.no_grad(), host_master_guard(handle):
        for _ in range(2):
            assert torch.equal(model(x), ref)
    assert all(b.tier != "vram" and b.calls == 2 for b in handle.report().blocks)


class _ReadsFromRoot(nn.Module):
    """The model itself reads a block's weight: that block stays resident with the rest."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x @ self.blocks[1].weight


def test_a_block_the_model_reads_stays_resident(sim_cfg, offload):
    model = _ReadsFromRoot().eval()
    x = torch.randn(2, 8)
    with torch.no_grad():
        ref = model(x)
    handle = offload(model, sim_cfg(vram_fraction=0))
    assert [b.name for b in handle.report().blocks] == ["blocks.0", "blocks.2"]
    with torch.no_grad(), host_master_guard(handle):
        assert torch.equal(model(x), ref)


def test_multihead_attention_leaf_units(sim_cfg, offload):
    """torch's own nn.MultiheadAttention reads `out_proj.weight` without calling `out_proj`, and
    nn.TransformerEncoderLayer reads its attention's weights for its fused fast path: each layer becomes a unit."""
    model = nn.Sequential(nn.Linear(8, 8), nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True),
                          nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)).eval()
    leaves = [n for n, m in model.named_modules() if not list(m.children()) and list(m.parameters(recurse=False))]
    x = torch.randn(2, 5, 8)
    with torch.no_grad():
        ref = model(x)
    handle = offload(model, sim_cfg(vram_fraction=0), units=leaves)
    names = [b.name for b in handle.report().blocks]
    assert names == ["0", "1", "2"]
    with torch.no_grad(), host_master_guard(handle):
        assert torch.equal(model(x), ref)


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.blocks = nn.ModuleList(_Block(16) for _ in range(3))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x)
        return x


class _EncoderDecoder(nn.Module):
    """generate() calls the encoder on its own, before any forward of the whole model (T5, Whisper)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = _Encoder()
        self.head = nn.Linear(16, 50)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(ids))


def test_an_encoder_called_on_its_own_first_computes_on_the_device(sim_cfg, offload):
    """The embedding (outside the blocks) runs before the first block: it must find the weights outside the blocks
    on the device, right after offloading and after unload()."""
    model = _EncoderDecoder().eval()
    ids = torch.randint(0, 50, (2, 5))
    with torch.no_grad():
        ref = model.encoder(ids)
    handle = offload(model, sim_cfg(vram_fraction=0))
    for _ in range(2):
        with torch.no_grad(), host_master_guard(handle):
            assert torch.equal(model.encoder(ids), ref)
        handle.unload()
