"""A model converted with `.to(memory_format=torch.channels_last)` streams with every tensor's exact strides (issue 25).

`Tensor.is_contiguous()` ignores size-1 dims, so a channels_last 1x1 conv weight `(C_out, C_in, 1, 1)` (strides
`(C_in, 1, C_in, C_in)`) counts as contiguous; staged with row-major strides, a conv over an NCHW input then returns
NCHW instead of channels_last and the next norm sums in another order. The fixtures imitate diffusers'
tests/models/unets/test_models_unet_2d.py (`Unet2DModelTesterConfig.get_init_dict`) and
tests/models/unets/test_models_unet_2d_condition.py (`UNet2DConditionTesterConfig.get_init_dict`): every block
streamed on the simulated device, bitwise against the plain channels_last model.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from offload import OffloadConfig, VramBudget, offload_module
from offload.model.layout import plan_layout, unit_tensors
from tests.host_master_guard import host_master_guard

diffusers = pytest.importorskip("diffusers")


def _unet2d() -> tuple[nn.Module, tuple, dict]:
    init = {"block_out_channels": (4, 8), "norm_num_groups": 2, "down_block_types": ("DownBlock2D", "AttnDownBlock2D"),
            "up_block_types": ("AttnUpBlock2D", "UpBlock2D"), "attention_head_dim": 3, "out_channels": 3,
            "in_channels": 3, "layers_per_block": 2, "sample_size": 32}
    g = torch.Generator("cpu").manual_seed(0)
    return diffusers.UNet2DModel(**init).eval(), (torch.randn(4, 3, 32, 32, generator=g), torch.tensor([10])), {}


def _unet2d_condition() -> tuple[nn.Module, tuple, dict]:
    init = {"block_out_channels": (4, 8), "norm_num_groups": 4,
            "down_block_types": ("CrossAttnDownBlock2D", "DownBlock2D"),
            "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D"), "cross_attention_dim": 8, "attention_head_dim": 2,
            "out_channels": 4, "in_channels": 4, "layers_per_block": 1, "sample_size": 16}
    g = torch.Generator("cpu").manual_seed(0)
    args = (torch.randn(4, 4, 16, 16, generator=g), torch.tensor([10]))
    return diffusers.UNet2DConditionModel(**init).eval(), args, {"encoder_hidden_states": torch.randn(4, 4, 8,
                                                                                                      generator=g)}


def _strides(model: nn.Module) -> dict[str, tuple[int, ...]]:
    return {n: t.stride() for n, t in list(model.named_parameters()) + list(model.named_buffers())}


@pytest.mark.parametrize("build", [_unet2d, _unet2d_condition], ids=["UNet2DModel", "UNet2DConditionModel"])
def test_channels_last_unet_streams_bitwise(build):
    """Before: the 1x1 conv weights came back with row-major strides; UNet2DConditionModel's `proj_out` (a 1x1 conv
    over an NCHW input) then returned NCHW and the output differed by ~3e-6."""
    torch.manual_seed(0)
    model, args, kwargs = build()
    model = model.to(memory_format=torch.channels_last)
    plain = copy.deepcopy(model)
    with torch.no_grad():
        ref = plain(*args, **kwargs).sample
    want = _strides(plain)
    ones = [n for n, p in plain.named_parameters() if p.dim() == 4 and p.shape[2:] == (1, 1)]
    assert ones and all(p.is_contiguous() and p.stride() != torch.empty(p.shape).stride()
                        for n, p in plain.named_parameters() if n in ones), "the fixture has channels_last 1x1 convs"
    handle = offload_module(model, OffloadConfig(device="sim", vram_fraction=0.0), budget=VramBudget(None))
    report = handle.report()
    assert all(b.tier != "vram" for b in report.blocks), "every block streams"
    for _ in range(2):
        with torch.no_grad(), host_master_guard(handle):
            out = model(*args, **kwargs).sample
        assert torch.equal(out, ref), f"max diff {(out - ref).abs().max().item():.3g}"
    assert _strides(model) == want, "host masters keep the exact strides"
    assert handle.report().total_bytes_streamed > 0
    handle.detach()
    assert _strides(model) == want
    with torch.no_grad():
        assert torch.equal(model(*args, **kwargs).sample, ref)


def test_slot_views_keep_size_one_strides():
    """The layout keeps strides that differ only on size-1 dims, and still counts as plain (its bytes are row-major,
    as a safetensors file holds them, so the disk tier and meta loading take it)."""
    conv = nn.Conv2d(8, 8, 1).to(memory_format=torch.channels_last)
    assert conv.weight.is_contiguous() and conv.weight.stride() == (8, 1, 8, 8)
    layout = plan_layout(unit_tensors(conv))
    assert layout.plain
    buf = torch.zeros(layout.nbytes, dtype=torch.uint8)
    views = layout.leaf_views(buf)
    assert views[0].stride() == (8, 1, 8, 8)


class _PointwiseBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 1)
        self.norm = nn.GroupNorm(2, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.conv(x)) + x


class _PointwiseStack(nn.Module):
    """1x1 convs only: every block's bytes are row-major though its weights are channels_last."""

    def __init__(self, c: int = 16, n: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_PointwiseBlock(c) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


@pytest.mark.parametrize("meta", [False, True], ids=["in_ram", "meta"])
def test_channels_last_pointwise_from_the_file(tmp_path, meta):
    """Blocks of channels_last 1x1 convs stream from their safetensors file (disk tier), or load into RAM from it
    when built on the meta device, with the channels_last strides kept."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    torch.manual_seed(0)
    plain = _PointwiseStack().eval()
    path = tmp_path / "pointwise.safetensors"
    safetensors_torch.save_model(plain, str(path))
    plain = plain.to(memory_format=torch.channels_last)
    x = torch.randn(2, 16, 8, 8)  # NCHW: the conv's output format follows the weight's strides
    with torch.no_grad():
        ref = plain(x)
    if meta:
        with torch.device("meta"):
            model = _PointwiseStack().eval().to(memory_format=torch.channels_last)
    else:
        model = copy.deepcopy(plain)
    unit = plan_layout(unit_tensors(plain.blocks[0])).nbytes  # as staged; four bounce buffers of one unit each
    handle = offload_module(model, OffloadConfig(device="sim", vram_fraction=0.0, disk_path=str(path),
                                                 ram_budget_bytes=None if meta else 6 * unit, disk_optional=True),
                            budget=VramBudget(None))
    tiers = [b.tier for b in handle.report().blocks]
    if not meta:
        assert "disk" in tiers, tiers
    assert _strides(model) == _strides(plain)
    for _ in range(2):
        with torch.no_grad(), host_master_guard(handle):
            assert torch.equal(model(x), ref)
    handle.detach()
    assert _strides(model) == _strides(plain)
