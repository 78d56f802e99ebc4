"""offload/model/layout.py: tensor subclasses that do not flatten (ComfyUI-GGUF's GGMLTensor: quantized bytes with
`tensor_type` / `tensor_shape` attributes) stream as stored and keep their class and attributes, also when they
were made under torch.inference_mode (as ComfyUI runs its loaders), where staging gives them new objects."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from offload import OffloadConfig, VramBudget, offload_module
from offload.model.layout import align

ROWS, LOGICAL, STORED = 16, 32, 34  # one Q8_0-like block per row: 32 values stored as 34 bytes


class AttrTensor(torch.Tensor):
    """Like ComfyUI-GGUF's GGMLTensor: plain storage, a logical shape and a quantization type as attributes."""

    def __new__(cls, data: torch.Tensor, *, tensor_type: str, tensor_shape: torch.Size) -> "AttrTensor":
        return super().__new__(cls, data)

    def __init__(self, data: torch.Tensor, *, tensor_type: str, tensor_shape: torch.Size) -> None:
        super().__init__()
        self.tensor_type = tensor_type
        self.tensor_shape = tensor_shape
        self.patches: list = []

    def detach(self, *args, **kwargs):  # noqa: D102 - GGMLTensor returns itself
        return self

    @property
    def shape(self):  # noqa: D102 - the logical shape, not the stored one
        return self.tensor_shape


def dequant(w: torch.Tensor) -> torch.Tensor:
    """A stand-in dequantizer: the stored bytes, minus the per-row "scale" bytes, as floats of the logical shape."""
    assert type(w) is AttrTensor, type(w)
    assert w.tensor_type == "Q8_0" and tuple(w.shape) == (ROWS, LOGICAL), (w.__dict__.keys(), w.size())
    assert tuple(w.size()) == (ROWS, STORED) and w.dtype == torch.uint8
    return w.as_subclass(torch.Tensor)[:, 2:].float().reshape(w.tensor_shape) / 255


class QLinear(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        raw = torch.randint(0, 256, (ROWS, STORED), dtype=torch.uint8, generator=g)
        self.weight = nn.Parameter(AttrTensor(raw, tensor_type="Q8_0", tensor_shape=torch.Size([ROWS, LOGICAL])),
                                   requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ dequant(self.weight))


class QModel(nn.Module):
    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(QLinear(2 * i), nn.Linear(LOGICAL, ROWS)) for i in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


@pytest.mark.parametrize("inference", [False, True], ids=["grad-mode", "inference-mode"])
@pytest.mark.parametrize("preset", ["budget", "high_end"])
def test_attribute_subclass_streams_as_stored(inference, preset):
    torch.manual_seed(0)
    with torch.inference_mode(inference):
        model = QModel()
    weights = [b[0].weight for b in model.blocks]
    assert all(isinstance(w, nn.Parameter) and type(w) is AttrTensor for w in weights)
    x = torch.randn(3, ROWS)
    with torch.inference_mode(inference):
        ref = model(x)
    cfg = OffloadConfig.from_preset(preset, device="sim", sim_capacity_bytes=64 << 20)
    h = offload_module(model, cfg, budget=VramBudget(None if preset == "high_end" else 64 << 10))
    with torch.inference_mode(inference):
        out = model(x)
        again = model(x)
    assert torch.equal(out, ref) and torch.equal(again, ref)
    for b in model.blocks:
        w = b[0].weight
        assert type(w) is AttrTensor and isinstance(w, nn.Parameter), type(w)
        assert w.tensor_type == "Q8_0" and tuple(w.shape) == (ROWS, LOGICAL) and tuple(w.size()) == (ROWS, STORED)
    blocks = h.report().blocks
    assert all(b.bytes == align(ROWS * STORED) + align(LOGICAL * ROWS * 4) + align(ROWS * 4) for b in blocks), \
        "each block moves its quantized bytes as stored, not a dequantized copy"
    if preset == "budget":
        assert all(b.tier != "vram" for b in blocks) and sum(b.bytes_streamed for b in blocks) > 0, blocks
    h.detach()
    for b in model.blocks:
        w = b[0].weight
        assert type(w) is AttrTensor and w.tensor_type == "Q8_0" and tuple(w.shape) == (ROWS, LOGICAL)
    with torch.inference_mode(inference):
        assert torch.equal(model(x), ref)
