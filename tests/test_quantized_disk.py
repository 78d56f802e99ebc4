"""Quantized checkpoints get what plain ones get (issue 42): comfy_kitchen `QuantizedTensor` weights in every format
ComfyUI 0.33 loads (tests/quantized_models.py: quantized by comfy_kitchen, saved as ComfyUI saves them) stream each
inner tensor from the file that holds its bytes, keep a RAM ceiling, move their scales with their payload, give RAM
back to the disk tier, and are held compressed where that pays; all bitwise against the model run without the
engine, under the host-master guard."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("comfy_kitchen")

from offload import OffloadConfig  # noqa: E402
from offload.plan.planner import RamCeilingError  # noqa: E402
from tests.host_master_guard import disk_units_file_bytes, host_master_guard, step_disk_reads  # noqa: E402
from tests.quantized_models import (FORMATS, QuantizedTensor, available, comfy_state_dict, quant_stack,  # noqa: E402
                                    quantized_bytes, save_comfy_checkpoint)
from offload.store.pack_writer import pack_file  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

PARAMS = [pytest.param(f.name, marks=pytest.mark.skipif(not available(f), reason=f"comfy_kitchen lacks {f.layout}"))
          for f in FORMATS]


def _x(dim: int = 256) -> torch.Tensor:
    return torch.randn(2, 3, dim, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)


def _ceiling(model) -> int:
    """Host RAM for the weights outside the blocks, about half the blocks and the bounce buffers."""
    rest = quantized_bytes(model.inp) + quantized_bytes(model.out)
    return rest + (quantized_bytes(model) - rest) // 2 + (64 << 10)


def _cfg(**kw) -> OffloadConfig:
    kw.setdefault("host_compression", "off")
    return OffloadConfig.from_preset("budget", device="sim", **kw)


def _inner_tensors(model):
    """Every inner tensor a quantized weight's kernels read: the payload and its `_params` tensors."""
    for module in model.modules():
        w = module._parameters.get("weight")
        if isinstance(w, QuantizedTensor):
            yield f"{module}", w._qdata
            for name, value in vars(w._params).items():
                if isinstance(value, torch.Tensor):
                    yield name, value


@pytest.mark.parametrize("fmt", PARAMS)
def test_every_format_streams_from_its_file_under_a_ram_ceiling(fmt, tmp_path, offload):
    model = quant_stack(fmt)
    x = _x()
    ref = model(x)
    path = save_comfy_checkpoint(model, tmp_path / "q.safetensors")
    ceiling = _ceiling(model)
    h = offload(model, _cfg(disk_path=path, ram_budget_bytes=ceiling))
    read = step_disk_reads(h, model, x, ref)
    rep = h.report()
    assert "disk" in [b.tier for b in rep.blocks], [b.placement for b in rep.blocks]
    assert h.host_memory()["ram"] <= ceiling
    # a pass reads each disk-tier block's payload and scales as the file stores them, once (its comfy_quant never)
    staged = h.streamer.staged
    assert read == disk_units_file_bytes(h)
    assert not any(k.endswith("comfy_quant") for u in staged.units if u.master.host is None for k in u.master.keys)
    h.detach()
    assert torch.equal(model(x), ref)


@pytest.mark.parametrize("fmt", ["fp8_e4m3fn", "nvfp4", "mxfp8", "w4a8_int8"])
def test_kernels_read_the_scales_that_moved_with_their_payload(fmt, tmp_path, offload):
    """Between passes a quantized weight's payload AND the scales its kernels read (`_params`, not only the
    `_param_*` attributes `__tensor_flatten__` names) are the engine's host masters; a write through the weight
    (load_state_dict) reaches both, and the next pass is bitwise the new weights' output."""
    model, other = quant_stack(fmt), quant_stack(fmt, seed=1)
    x = _x()
    ref_other = other(x)
    h = offload(model, _cfg())
    model(x)
    spans = [(u.master.host.data_ptr(), u.master.host.data_ptr() + u.master.host.numel())
             for u in h.streamer.staged.units]
    for name, t in _inner_tensors(model.blocks):
        assert any(lo <= t.data_ptr() < hi for lo, hi in spans), f"{name} is not in a host master"
    model.load_state_dict(other.state_dict())
    with host_master_guard(h):
        assert torch.equal(model(x), ref_other)


@pytest.mark.parametrize("fmt", ["fp8_e4m3fn", "mxfp8"])
def test_a_write_to_a_disk_tier_quantized_block_is_streamed(fmt, tmp_path, offload):
    model, other = quant_stack(fmt), quant_stack(fmt, seed=1)
    x = _x()
    ref_other = other(x)
    path = save_comfy_checkpoint(model, tmp_path / "q.safetensors")
    h = offload(model, _cfg(disk_path=path, ram_budget_bytes=_ceiling(model)))
    model(x)
    assert "disk" in [b.tier for b in h.report().blocks]
    model.load_state_dict(other.state_dict())
    assert torch.equal(model(x), ref_other)


@pytest.mark.parametrize("fmt", ["fp8_e4m3fn", "nvfp4", "int8_convrot"])
def test_quantized_blocks_give_ram_back_to_the_disk_tier(fmt, tmp_path, offload):
    model = quant_stack(fmt, depth=10)
    x = _x()
    ref = model(x)
    path = save_comfy_checkpoint(model, tmp_path / "q.safetensors")
    h = offload(model, _cfg(disk_path=path, disk_optional=True))
    model(x)
    before = h.host_memory()["ram"]
    freed = h.release_host_memory(before)
    assert freed > 0 and h.host_memory()["ram"] <= before - freed
    assert set(b.tier for b in h.report().blocks) == {"disk"}
    with host_master_guard(h):
        assert torch.equal(model(x), ref)


def test_a_quantized_block_whose_scale_the_file_does_not_hold_stays_in_ram_by_name(tmp_path, offload):
    """A weight changed after loading (its scale here) has no file tensor with its bytes: its block stays in RAM and
    the reason names it; where that breaks a hard ceiling the refusal names it before anything changed."""
    model = quant_stack("fp8_e4m3fn")
    x = _x()
    path = save_comfy_checkpoint(model, tmp_path / "q.safetensors")
    for block in model.blocks:
        block.fc1.weight._params.scale.mul_(2)  # the scales the kernels read (and `_param_scale` views the same)
    ref = model(x)
    with pytest.raises(RamCeilingError, match=r"blocks\.\d"):
        _ = offload(model, _cfg(disk_path=path, ram_budget_bytes=_ceiling(model)))
    assert torch.equal(model(x), ref)
    h = offload(model, _cfg(disk_path=path, ram_budget_bytes=_ceiling(model), disk_optional=True))
    assert torch.equal(model(x), ref)
    placements = [b.placement for b in h.report().blocks]
    assert all(b.tier != "disk" for b in h.report().blocks)
    assert any("other values" in p and "q.safetensors" in p for p in placements), placements


def test_an_older_scaled_fp8_file_is_matched_by_bytes_whatever_its_scale_names(tmp_path, offload):
    """Older `*_fp8_scaled` files store a layer's scale as `scale_weight` (ComfyUI renames it to `weight_scale` when
    it loads the file: comfy/utils.py convert_old_quants) and block scales may be stored as uint8 (ComfyUI views
    them as float8_e8m0fnu): the inner tensors are found by their bytes beside the weight."""
    model = quant_stack("mxfp8")
    for block in model.blocks:  # ComfyUI registers a layer's input scale as `input_scale`; old files say scale_input
        block.fc1.input_scale = torch.nn.Parameter(torch.tensor(0.5), requires_grad=False)
    x = _x()
    ref = model(x)
    sd = comfy_state_dict(model)
    renamed = {}
    for k, v in sd.items():
        if k.endswith(".weight_scale"):
            renamed[k[:-len("weight_scale")] + "scale_weight"] = v.view(torch.uint8)
        elif k.endswith(".input_scale"):
            renamed[k[:-len("input_scale")] + "scale_input"] = v
        elif not k.endswith(".comfy_quant"):
            renamed[k] = v
    save_file(renamed, str(tmp_path / "old.safetensors"))
    h = offload(model, _cfg(disk_path=str(tmp_path / "old.safetensors"), ram_budget_bytes=_ceiling(model)))
    assert "disk" in [b.tier for b in h.report().blocks]
    with host_master_guard(h):
        assert torch.equal(model(x), ref)


@pytest.mark.parametrize("fmt", PARAMS)
def test_quantized_blocks_held_compressed_are_bitwise(fmt, offload):
    """host_compression='lossless': the payloads and scales are held in the codec's form where it pays (the codec
    decides: fp8 and tensorwise int8 payloads do under the byte code, NVFP4's near-uniform nibbles do not), decoded
    bitwise. Measured 2026-11-29: e4m3fn 0.87, e5m2 0.77, mxfp8 0.88, int8 tensorwise 0.91 of raw per block."""
    model = quant_stack(fmt, dim=512)
    x = _x(512)
    ref = model(x)
    h = offload(model, _cfg(host_compression="lossless"))
    with host_master_guard(h):
        assert torch.equal(model(x), ref)
    for b in h.report().blocks:
        assert (b.compression != "none") == (b.host_bytes < b.raw_bytes)
    most = {"fp8_e4m3fn": 0.89, "fp8_e5m2": 0.8, "mxfp8": 0.9, "int8_tensorwise": 0.93}.get(fmt)
    if most is not None:
        assert all(b.compression != "none" and b.host_bytes < most * b.raw_bytes for b in h.report().blocks)


@pytest.mark.parametrize("fmt", ["nvfp4", "w4a8_int8"])
@pytest.mark.parametrize("packed_from", ["handle", "file"])
def test_a_packed_quantized_model_streams_from_its_folder(fmt, packed_from, tmp_path, offload):
    """`handle.pack` writes a quantized block's inner tensors beside its weight's name (laid out as the engine's
    buffer: one read a unit); `pack_file` packs the ComfyUI file as it is; either folder is a disk tier."""
    model = quant_stack(fmt)
    x = _x()
    ref = model(x)
    if packed_from == "handle":
        h = offload(model, _cfg())
        model(x)
        h.pack(str(tmp_path / "packed"))
        h.detach()
    else:
        pack_file(save_comfy_checkpoint(model, tmp_path / "q.safetensors"), str(tmp_path / "packed"))
    model = quant_stack(fmt)
    h = offload(model, _cfg(disk_path=str(tmp_path / "packed"), ram_budget_bytes=_ceiling(model)))
    with host_master_guard(h), torch.no_grad():
        assert torch.equal(model(x), ref)
    assert "disk" in [b.tier for b in h.report().blocks]
