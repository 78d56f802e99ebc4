"""Changes to a model after offloading it (issue 25): they take effect, or raise at the call naming detach(); never a
silent revert at the next pass. And `copy.deepcopy` of an offloaded model gives an ordinary model that runs.

Before: `model.to(torch.bfloat16)` / `.half()` were accepted, undone at the next pass, and the forward then failed
with a dtype mismatch; diffusers' `enable_layerwise_casting` and `param.data = ...` were silently undone (the model
computed with the old float32 weights); `copy.deepcopy(model)` raised "cannot pickle '_thread.lock'".

Diffusers fixtures imitate tests/models/transformers/test_models_transformer_flux.py and
test_models_transformer_wan.py (`get_init_dict`, `get_dummy_inputs`), and the layerwise casting check of
tests/models/testing_utils (`test_layerwise_casting_*`: float8 storage, float32 compute).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from offload import OffloadConfig, VramBudget, offload_module
from offload.model.layout import plan_layout, unit_tensors
from offload.model.model_changes import ModelChangedError
from tests.host_master_guard import host_master_guard


class Block(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)
        self.register_buffer("gain", torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x))) * self.gain


class Net(nn.Module):
    def __init__(self, n: int = 6, d: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _x(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(3, 16, generator=torch.Generator().manual_seed(2)).to(dtype)


def _net() -> Net:
    torch.manual_seed(0)
    return Net().eval()


def _offload(model: nn.Module, **kw):
    kw.setdefault("vram_fraction", 0.0)
    return offload_module(model, OffloadConfig(device="sim", **kw), budget=VramBudget(None))


def _run(handle, model, x):
    with torch.no_grad(), host_master_guard(handle):
        return model(x)


# conversions -------------------------------------------------------------------------------------------------------
CONVERSIONS = {
    "to(bfloat16)": lambda m: m.to(torch.bfloat16),
    "half()": lambda m: m.half(),
    "to(dtype=float16) of one block": lambda m: m.blocks[2].to(dtype=torch.float16),
    "double() of a layer": lambda m: m.blocks[0].fc.double(),
    "to('meta')": lambda m: m.to("meta"),
    "head.bfloat16()": lambda m: m.head.bfloat16(),
}


@pytest.mark.parametrize("name", list(CONVERSIONS))
def test_a_conversion_after_offloading_is_refused_at_the_call(name):
    model = _net()
    ref = model(_x()).detach()
    handle = _offload(model)
    assert torch.equal(_run(handle, model, _x()), ref)
    with pytest.raises(ModelChangedError, match="detach"):
        CONVERSIONS[name](model)
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in model.parameters()), "nothing changed"
    assert torch.equal(_run(handle, model, _x()), ref), "the model still runs as it was"
    handle.detach()
    CONVERSIONS[name](model)  # an ordinary model again: the conversion runs
    if name == "to(bfloat16)":
        assert torch.equal(model(_x(torch.bfloat16)), _net().to(torch.bfloat16)(_x(torch.bfloat16)))


def test_conversions_that_change_nothing_pass():
    """`.float()`, `.to(float32)`, `.cpu()` of host masters (ComfyUI moves models to their offload device) are no-ops,
    and a module added after offloading (an adapter) converts as usual."""
    model = _net()
    ref = model(_x()).detach()
    handle = _offload(model)
    model.float()
    model.to(torch.float32)
    model.cpu()
    model.blocks[0].fc.to("cpu", torch.float32)
    model.extra = nn.Linear(4, 4)
    model.extra.double()  # not the engine's: converts (no engine tensor under it)
    assert model.extra.weight.dtype == torch.float64
    assert torch.equal(_run(handle, model, _x()), ref)
    handle.detach()


def test_layerwise_casting_set_up_before_offloading_runs_inside_the_pass():
    """A hook that casts weights during the forward (layerwise casting enabled before offloading) is not refused;
    the engine binds its own tensors again after each block."""
    plain, inputs = _flux()
    model, _ = _flux()  # built again: a deepcopy of a layerwise-cast diffusers model keeps hooks on the original
    for m in (plain, model):
        m.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    with torch.no_grad():
        ref = plain(**inputs).sample
    handle = _offload(model)
    for _ in range(2):
        with torch.no_grad(), host_master_guard(handle):
            assert torch.equal(model(**inputs).sample, ref)
    assert handle.report().total_bytes_streamed > 0
    assert any(p.dtype == torch.float8_e4m3fn for p in model.parameters())
    handle.detach()
    with torch.no_grad():
        assert torch.equal(model(**inputs).sample, ref)


def _flux():
    diffusers = pytest.importorskip("diffusers")
    init = {"patch_size": 1, "in_channels": 4, "num_layers": 2, "num_single_layers": 2, "attention_head_dim": 16,
            "num_attention_heads": 2, "joint_attention_dim": 32, "pooled_projection_dim": 32,
            "axes_dims_rope": [4, 4, 8]}
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    inputs = dict(hidden_states=torch.randn(1, 16, 4, generator=g),
                  encoder_hidden_states=torch.randn(1, 24, 32, generator=g),
                  pooled_projections=torch.randn(1, 32, generator=g), img_ids=torch.randn(16, 3, generator=g),
                  txt_ids=torch.randn(24, 3, generator=g), timestep=torch.tensor([1.0]))
    return diffusers.FluxTransformer2DModel(**init).eval(), inputs


def _wan():
    diffusers = pytest.importorskip("diffusers")
    init = {"patch_size": (1, 2, 2), "num_attention_heads": 2, "attention_head_dim": 12, "in_channels": 4,
            "out_channels": 4, "text_dim": 16, "freq_dim": 256, "ffn_dim": 32, "num_layers": 2,
            "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "rope_max_seq_len": 32}
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    inputs = dict(hidden_states=torch.randn(1, 4, 2, 16, 16, generator=g),
                  encoder_hidden_states=torch.randn(1, 12, 16, generator=g), timestep=torch.tensor([500]))
    return diffusers.WanTransformer3DModel(**init).eval(), inputs


@pytest.mark.parametrize("build", [_flux, _wan], ids=["flux", "wan"])
def test_layerwise_casting_after_offloading_is_refused_at_the_call(build):
    """diffusers' enable_layerwise_casting casts every layer's weights to the storage dtype when it is enabled: on an
    offloaded model that is refused at the call (naming detach()), the model unchanged; enabled before offloading, it
    streams the float8 weights bitwise like the plain model with the same casting."""
    plain, inputs = build()
    model = copy.deepcopy(plain)
    with torch.no_grad():
        ref_fp32 = plain(**inputs).sample
    handle = _offload(model)
    with pytest.raises(ModelChangedError, match="detach"):
        model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    with torch.no_grad(), host_master_guard(handle):
        assert torch.equal(model(**inputs).sample, ref_fp32)
    handle.detach()

    # the order that works: cast, then offload
    plain.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    with torch.no_grad():
        ref = plain(**inputs).sample
    model, _ = build()  # built again (see above), same seed
    model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    handle = _offload(model)
    with torch.no_grad(), host_master_guard(handle):
        assert torch.equal(model(**inputs).sample, ref)
    handle.detach()


# param.data = ... ------------------------------------------------------------------------------------------------------
def _plan_kw(plan: str, model: Net, tmp_path) -> dict:
    if plan == "streamed":
        return {}
    unit = plan_layout(unit_tensors(model.blocks[0])).nbytes
    if plan == "mixed":
        rest = plan_layout(unit_tensors(model.head)).nbytes
        return {"vram_fraction": 1.0, "vram_budget_bytes": rest + 4 * unit + 4096, "prefetch": 1}
    safetensors_torch = pytest.importorskip("safetensors.torch")
    path = tmp_path / "net.safetensors"
    safetensors_torch.save_model(model, str(path))
    rest = plan_layout(unit_tensors(model.head)).nbytes
    return {"disk_path": str(path), "ram_budget_bytes": rest + 5 * unit, "disk_optional": True}  # 4 bounce buffers


@pytest.mark.parametrize("plan", ["streamed", "mixed", "disk"])
def test_data_replaced_after_offloading_takes_effect(plan, tmp_path):
    model = _net()
    handle = _offload(model, **_plan_kw(plan, model, tmp_path))
    _run(handle, model, _x())
    tiers = [b.tier for b in handle.report().blocks]
    if plan == "mixed":
        assert "vram" in tiers and any(t != "vram" for t in tiers), tiers
    if plan == "disk":
        assert "disk" in tiers, tiers
    changed = _net()
    with torch.no_grad():
        for i in range(len(model.blocks)):
            new = torch.randn_like(changed.blocks[i].fc.weight)
            changed.blocks[i].fc.weight.copy_(new)
            model.blocks[i].fc.weight.data = new.clone()  # the engine cannot see this call
        new_head = torch.randn_like(changed.head.bias)
        changed.head.bias.copy_(new_head)
        model.head.bias.data = new_head.clone()
    ref = changed(_x()).detach()
    for _ in range(2):
        assert torch.equal(_run(handle, model, _x()), ref), f"{plan}: the replaced data did not take effect"
    handle.unload()
    assert torch.equal(_run(handle, model, _x()), ref)
    handle.detach()
    for (k, a), (_, b) in zip(model.state_dict().items(), changed.state_dict().items()):
        assert torch.equal(a, b), k
    assert torch.equal(model(_x()), ref)


def test_data_replaced_with_another_dtype_is_refused_naming_detach():
    model = _net()
    handle = _offload(model)
    _run(handle, model, _x())
    model.blocks[1].fc.weight.data = model.blocks[1].fc.weight.data.to(torch.bfloat16)
    with pytest.raises(ModelChangedError, match="detach"):
        _run(handle, model, _x())
    handle.detach()


# deepcopy -------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("plan", ["streamed", "mixed", "disk"])
def test_deepcopy_gives_an_ordinary_independent_model(plan, tmp_path):
    model = _net()
    ref = model(_x()).detach()
    handle = _offload(model, **_plan_kw(plan, model, tmp_path))
    _run(handle, model, _x())
    streamed = handle.report().total_bytes_streamed
    twin = copy.deepcopy(model)
    assert "_layer_offload_handle" not in twin.__dict__
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in twin.modules()), "no engine hook was copied"
    assert not any("_apply" in m.__dict__ or "__deepcopy__" in m.__dict__ for m in twin.modules())
    ours = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    assert not any(t.untyped_storage().data_ptr() in ours for t in list(twin.parameters()) + list(twin.buffers()))
    with torch.no_grad():
        assert torch.equal(twin(_x()), ref)
    assert torch.equal(_run(handle, model, _x()), ref), "the original keeps streaming"
    assert handle.report().total_bytes_streamed > streamed
    with torch.no_grad():
        twin.blocks[0].fc.weight.add_(1.0)  # the copy is its own
    assert torch.equal(_run(handle, model, _x()), ref)
    twin_handle = _offload(twin)  # and can be offloaded on its own
    twin_ref = twin_handle.model(_x()).detach()
    handle.detach()
    with torch.no_grad():
        assert torch.equal(twin(_x()), twin_ref)
    twin_handle.detach()
    block = copy.deepcopy(model.blocks[3])  # after detach: plain deepcopy again
    assert torch.equal(block.fc.weight, model.blocks[3].fc.weight)


def test_deepcopy_of_one_block_while_offloaded():
    model = _net()
    handle = _offload(model)
    _run(handle, model, _x())
    block = copy.deepcopy(model.blocks[2])
    assert not block._forward_pre_hooks and not any(m._forward_pre_hooks for m in block.modules())
    x = torch.randn(2, 16)
    plain = _net().blocks[2]
    with torch.no_grad():
        assert torch.equal(block(x), plain(x))
    handle.detach()
