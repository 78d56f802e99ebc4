"""A model being loaded from its file takes its persistent buffers from the file too (issue 25).

`accelerate.init_empty_weights()` (accelerate's default, and how diffusers and transformers build a model before
loading it) puts parameters on the meta device and leaves buffers real, holding the constructor's values. Loaded
through `disk_path`, only the meta leaves used to be read from the file: BatchNorm running statistics (and any other
persistent buffer) kept their fresh values, so the loaded model computed with mean 0 / var 1. The rule now: whenever
the model is being loaded from a file (some tensor is on the meta device), everything in `state_dict()` the file
holds comes from the file; non-persistent buffers never do.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from offload import OffloadConfig, VramBudget, offload_module
from offload.model.layout import plan_layout, unit_tensors
from tests.host_master_guard import host_master_guard

accelerate = pytest.importorskip("accelerate")
safetensors_torch = pytest.importorskip("safetensors.torch")


class StatsBlock(nn.Module):
    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.bn = nn.BatchNorm2d(c)
        self.register_buffer("scale", torch.ones(c))  # persistent: in the checkpoint

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.conv(x)) * self.scale.view(1, -1, 1, 1)
        return torch.relu(h) + x


class StatsNet(nn.Module):
    def __init__(self, n: int = 8, c: int = 8) -> None:
        super().__init__()
        self.norm_in = nn.BatchNorm2d(c)  # outside the blocks
        self.register_buffer("table", torch.arange(c, dtype=torch.float32), persistent=False)  # in no checkpoint
        self.blocks = nn.ModuleList(StatsBlock(c) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm_in(x) + self.table.view(1, -1, 1, 1)
        for b in self.blocks:
            x = b(x)
        return x


def _trained() -> StatsNet:
    """A model whose persistent buffers differ from a fresh one's (a few train-mode forwards, scales changed)."""
    torch.manual_seed(0)
    model = StatsNet().train()
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(4, 8, 6, 6))
        for b in model.blocks:
            b.scale.uniform_(0.5, 1.5)
    return model.eval()


def _x() -> torch.Tensor:
    return torch.randn(2, 8, 6, 6, generator=torch.Generator().manual_seed(3))


def _same_state(a: nn.Module, b: nn.Module, when: str) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), f"{when}: {k} is not the file's"


@pytest.mark.parametrize("tier", ["ram", "disk"])
def test_init_empty_weights_model_takes_its_buffers_from_the_file(tmp_path, tier):
    plain = _trained()
    path = tmp_path / "net.safetensors"
    safetensors_torch.save_model(plain, str(path))
    with torch.no_grad():
        ref = plain(_x())
    with accelerate.init_empty_weights():  # parameters on meta, buffers real (fresh: mean 0, var 1, scale 1)
        model = StatsNet().eval()
    assert all(p.is_meta for p in model.parameters()) and not any(b.is_meta for b in model.buffers())
    unit = plan_layout(unit_tensors(plain.blocks[0])).nbytes
    cfg = OffloadConfig(device="sim", vram_fraction=0.0, disk_path=str(path),
                        ram_budget_bytes=6 * unit + 8192 if tier == "disk" else None)
    handle = offload_module(model, cfg, budget=VramBudget(None))
    tiers = [b.tier for b in handle.report().blocks]
    if tier == "disk":
        assert "disk" in tiers, "a block whose buffers come from the file can stream from it"
    _same_state(model, plain, "attached")
    for _ in range(2):
        with torch.no_grad(), host_master_guard(handle):
            assert torch.equal(model(_x()), ref)
    handle.detach()
    _same_state(model, plain, "after detach()")
    assert torch.equal(model.table, plain.table)  # non-persistent: constructed, not read
    with torch.no_grad():
        assert torch.equal(model(_x()), ref)


def test_a_buffer_the_file_lacks_keeps_its_value(tmp_path):
    """A checkpoint saved without one persistent buffer: that buffer keeps the model's value, the others load."""
    plain = _trained()
    state = {k: v for k, v in plain.state_dict().items() if k != "blocks.3.scale"}
    path = tmp_path / "net.safetensors"
    safetensors_torch.save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    with accelerate.init_empty_weights():
        model = StatsNet().eval()
    handle = offload_module(model, OffloadConfig(device="sim", vram_fraction=0.0, disk_path=str(path)),
                            budget=VramBudget(None))
    assert torch.equal(model.blocks[3].scale, torch.ones(8))
    assert torch.equal(model.blocks[3].bn.running_mean, plain.blocks[3].bn.running_mean)
    assert torch.equal(model.blocks[2].scale, plain.blocks[2].scale)
    handle.detach()


def test_a_model_not_being_loaded_keeps_its_buffers(tmp_path):
    """No meta tensor: the model is not being loaded, its RAM values are the truth (a file with other buffers is
    refused for the disk tier, never read over them)."""
    plain = _trained()
    path = tmp_path / "net.safetensors"
    safetensors_torch.save_model(plain, str(path))
    model = copy.deepcopy(plain)
    for b in model.blocks:
        b.bn.running_mean.add_(1.0)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    handle = offload_module(model, OffloadConfig(device="sim", vram_fraction=0.0, disk_path=str(path),
                                                 disk_optional=True), budget=VramBudget(None))
    for k, v in model.state_dict().items():
        assert torch.equal(v, want[k]), k
    handle.detach()


def test_transformers_resnet_built_as_from_pretrained_builds_it(tmp_path):
    """transformers' ResNet (a config like tests/models/resnet/test_modeling_resnet.py's ResNetModelTester) built
    under init_empty_weights and loaded from its own file: the BatchNorm statistics are the checkpoint's."""
    transformers = pytest.importorskip("transformers")
    config = transformers.ResNetConfig(num_channels=3, embedding_size=10, hidden_sizes=[10, 20, 30, 40],
                                       depths=[1, 1, 2, 1], hidden_act="relu")
    torch.manual_seed(0)
    plain = transformers.ResNetModel(config).train()
    with torch.no_grad():
        for _ in range(2):
            plain(torch.randn(3, 3, 32, 32))
    plain.eval()
    path = tmp_path / "resnet.safetensors"
    safetensors_torch.save_model(plain, str(path))
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = plain(x).last_hidden_state
    with accelerate.init_empty_weights():
        model = transformers.ResNetModel(config).eval()
    handle = offload_module(model, OffloadConfig(device="sim", vram_fraction=0.0, disk_path=str(path)),
                            budget=VramBudget(None))
    with torch.no_grad(), host_master_guard(handle):
        assert torch.equal(model(x).last_hidden_state, ref)
    handle.detach()
    _same_state(model, plain, "ResNet after detach()")
