"""offload/model/fp8.py: float8 linear layers with their scales, quantized once, streamed as stored, exact across presets."""
from __future__ import annotations

import itertools

import pytest
import torch

from offload import OffloadConfig, VramBudget, offload_module
from offload.model.fp8 import Fp8Linear, adopt_fp8_checkpoint, quantize_linears, scale_key_for
from tests.models import LayersModel, run, seeded

_caps = itertools.count(1)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("per_channel", [True, False])
def test_quantized_linear_is_close_and_keeps_its_scale(dtype, per_channel):
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32)
    q = Fp8Linear.quantize(lin, dtype, per_channel)
    assert q.weight.dtype == dtype and q.weight_scale.dtype == torch.float32
    assert q.weight_scale.shape == ((32, 1) if per_channel else ())
    x = torch.randn(4, 64)
    rel = (q(x) - lin(x)).norm() / lin(x).norm()
    assert rel < (0.05 if dtype == torch.float8_e4m3fn else 0.1), float(rel)
    assert torch.equal(q(x), q(x)), "dequantization is deterministic"


def test_streamed_fp8_model_is_bitwise_equal_across_presets():
    model = seeded(LayersModel, dim=64, depth=6)
    assert quantize_linears(model.layers) == 12
    x = torch.randn(2, 5, 64)
    ref = run(model, (x,))
    for preset in ("budget", "mid_range", "high_end"):
        cfg = OffloadConfig.from_preset(preset, device="sim", sim_capacity_bytes=(32 << 20) + next(_caps))
        h = offload_module(model, cfg, budget=VramBudget(None))
        assert torch.equal(run(model, (x,)), ref), preset
        blk = h.report().blocks[0]
        assert blk.bytes < 64 * 128 * 2 * 2 + 4096, "weights move as fp8 bytes (plus scales), not upcast"
        h.detach()
    assert all(isinstance(m, Fp8Linear) and m.weight.dtype == torch.float8_e4m3fn
               for layer in model.layers for m in (layer.fc1, layer.fc2))


def test_a_float8_checkpoint_with_scales_is_adopted_as_stored():
    src = seeded(LayersModel, dim=64, depth=2)
    quantize_linears(src.layers)
    state = src.state_dict()
    assert scale_key_for("layers.0.fc1.weight", state) == "layers.0.fc1.weight_scale"
    dst = seeded(LayersModel, dim=64, depth=2, seed=5)
    assert adopt_fp8_checkpoint(dst, state) == 4
    dst.load_state_dict(state)
    x = torch.randn(2, 5, 64)
    assert torch.equal(run(dst, (x,)), run(src, (x,)))
