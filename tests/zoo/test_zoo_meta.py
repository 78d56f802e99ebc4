"""Meta-device models the zoo found refused or failing (issue 25), in isolation: tensors in no checkpoint are rebuilt
the way the model's library builds them, or refused up front by name; a transposed weight loads with its strides."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from offload import OffloadConfig, VramBudget, offload_module
from offload.model.meta_buffers import (materialize_non_persistent_buffers, materialize_tensor_attributes,
                                  meta_tensor_attributes)
from tests.host_master_guard import host_master_guard

safetensors_torch = pytest.importorskip("safetensors.torch")


def _offload(model: nn.Module, path, **kw):
    return offload_module(model, OffloadConfig(device="sim", vram_fraction=0, disk_path=str(path), **kw),
                          budget=VramBudget(None))


class _TransposedBlock(nn.Module):
    """A weight stored column-major (a transposed parameter, as some checkpoints' converters leave it)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim, dim).t())
        self.bias = nn.Parameter(torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight, self.bias)


class _TransposedStack(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_TransposedBlock(dim) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def test_transposed_parameter_on_meta_loads_with_its_strides(tmp_path):
    torch.manual_seed(0)
    plain = _TransposedStack().eval()
    x = torch.randn(2, 16)
    with torch.no_grad():
        ref = plain(x)
    path = tmp_path / "t.safetensors"
    safetensors_torch.save_model(plain, str(path))  # the file holds the row-major values
    with torch.device("meta"):
        model = _TransposedStack().eval()
    assert model.blocks[0].weight.stride() == (1, 16)
    handle = _offload(model, path)
    assert model.blocks[0].weight.stride() == (1, 16)
    with torch.no_grad(), host_master_guard(handle):
        assert torch.equal(model(x), ref)
    handle.detach()
    assert torch.equal(model.blocks[1].weight, plain.blocks[1].weight)


class _Table(nn.Module):
    """A rotary table kept as a plain tensor attribute (as Lumina2 and QwenImage do), from a kept argument."""

    def __init__(self, dim: int, theta: float = 10000.0) -> None:
        super().__init__()
        self.dim, self.theta = dim, theta
        self.freqs = 1.0 / theta ** (torch.arange(0, dim, 2).float() / dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.freqs.repeat(2)


class _Hidden(nn.Module):
    """A tensor attribute computed from an argument the module does not keep: it cannot be rebuilt."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.table = torch.arange(n).float()
        self.proj = nn.Linear(4, 4)


class _TableStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = _Table(8, theta=500.0)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.table(x)
        for b in self.blocks:
            x = b(x)
        return x


def test_tensor_attribute_on_meta_is_rebuilt_by_its_constructor(tmp_path):
    torch.manual_seed(0)
    plain = _TableStack().eval()
    x = torch.randn(2, 8)
    with torch.no_grad():
        ref = plain(x)
    path = tmp_path / "t.safetensors"
    safetensors_torch.save_model(plain, str(path))
    with torch.device("meta"):
        model = _TableStack().eval()
    assert list(meta_tensor_attributes(model)) == ["table"]
    handle = _offload(model, path)
    assert torch.equal(model.table.freqs, plain.table.freqs)
    with torch.no_grad(), host_master_guard(handle):
        assert torch.equal(model(x), ref)
    handle.detach()


def test_tensor_attribute_that_cannot_be_rebuilt_is_refused_by_name(tmp_path):
    with torch.device("meta"):
        holder = nn.Sequential(nn.Linear(4, 4), _Hidden(5), nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"1\.table: a tensor attribute .* meta device"):
        materialize_tensor_attributes(holder)


def test_rebuilding_leaves_the_random_generator_alone():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.CLIPTextConfig(vocab_size=99, hidden_size=32, projection_dim=32, num_hidden_layers=2,
                                      num_attention_heads=4, intermediate_size=37, bos_token_id=0, eos_token_id=2)
    with torch.device("meta"):
        model = transformers.CLIPTextModel(cfg)
    torch.manual_seed(5)
    before = torch.random.get_rng_state()
    done = materialize_non_persistent_buffers(model)
    assert done == ["embeddings.position_ids"]
    assert torch.equal(torch.random.get_rng_state(), before)
    assert torch.equal(model.embeddings.position_ids, torch.arange(cfg.max_position_embeddings)[None])


def test_diffusers_patch_embed_rebuilt_from_the_config_not_its_attributes():
    """PatchEmbed keeps `height` as the patched height: its constructor, fed that, makes a table of the wrong
    shape; the model's config (register_to_config) gives the right one."""
    diffusers = pytest.importorskip("diffusers")
    kw = dict(in_channels=4, out_channels=8, num_attention_heads=2, attention_head_dim=4, num_layers=2,
              norm_type="ada_norm_zero", num_embeds_ada_norm=8, patch_size=2, sample_size=8)
    torch.manual_seed(0)
    plain = diffusers.DiTTransformer2DModel(**kw)
    with torch.device("meta"):
        model = diffusers.DiTTransformer2DModel(**kw)
    assert materialize_non_persistent_buffers(model) == ["pos_embed.pos_embed"]
    assert torch.equal(model.pos_embed.pos_embed, plain.pos_embed.pos_embed)
