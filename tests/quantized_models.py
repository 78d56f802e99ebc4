"""Models whose weights are comfy_kitchen `QuantizedTensor`s, in every format ComfyUI 0.33 loads, and their
checkpoints written as ComfyUI writes them.

The layers imitate ComfyUI's `mixed_precision_ops` Linear (comfy/ops.py of ComfyUI 0.33: the weight is an
`nn.Parameter` over a `QuantizedTensor`, the bias is plain, `F.linear` dispatches to the layout's kernel or its
dequantizing fallback), the checkpoint `_quantized_weight_state_dict` (the same file: `QuantizedTensor.state_dict`
under `<layer>.weight`, the bias, and `<layer>.comfy_quant`, the layer's format as UTF-8 JSON bytes). The formats
are `comfy.quant_ops.QUANT_ALGOS` (float8_e4m3fn / float8_e5m2: the `*_fp8_scaled` files; nvfp4; mxfp8 with
F8_E8M0 block scales; int8_tensorwise, rowwise and ConvRot; convrot_w4a4; asym_w4a8_int8), quantized by
comfy_kitchen itself (the package ComfyUI's quantizers call). Tests import this module only after
`pytest.importorskip("comfy_kitchen")`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from comfy_kitchen.tensor import QuantizedTensor
from comfy_kitchen.tensor.base import LAYOUTS
from safetensors.torch import save_file


@dataclass(frozen=True)
class Format:
    """One quantized format: ComfyUI's name for it (comfy_quant's "format"), comfy_kitchen's layout and the
    quantizer's arguments, and the extra comfy_quant fields ComfyUI writes for it."""

    name: str
    comfy_format: str
    layout: str
    kwargs: dict = field(default_factory=dict)
    conf: dict = field(default_factory=dict)


FORMATS = [
    Format("fp8_e4m3fn", "float8_e4m3fn", "TensorCoreFP8Layout", {"dtype": torch.float8_e4m3fn}),
    Format("fp8_e5m2", "float8_e5m2", "TensorCoreFP8Layout", {"dtype": torch.float8_e5m2}),
    Format("nvfp4", "nvfp4", "TensorCoreNVFP4Layout"),
    Format("mxfp8", "mxfp8", "TensorCoreMXFP8Layout"),
    Format("int8_tensorwise", "int8_tensorwise", "TensorWiseINT8Layout"),
    Format("int8_rowwise", "int8_tensorwise", "TensorWiseINT8Layout", {"per_channel": True}),
    Format("int8_convrot", "int8_tensorwise", "TensorWiseINT8Layout", {"per_channel": True, "convrot": True},
           {"convrot": True, "convrot_groupsize": 256}),
    Format("convrot_w4a4", "convrot_w4a4", "TensorCoreConvRotW4A4Layout", {}, {"convrot_groupsize": 256}),
    Format("w4a8_int8", "asym_w4a8_int8", "AsymW4A8Int8Layout", {}, {"group_size": 16, "convrot_groupsize": 256}),
]
FORMAT_NAMES = [f.name for f in FORMATS]


def format_named(name: str) -> Format:
    return next(f for f in FORMATS if f.name == name)


def available(fmt: Format) -> bool:
    """Whether the installed comfy_kitchen has the format's layout."""
    return fmt.layout in LAYOUTS


class QuantLinear(nn.Module):
    """A linear layer with a quantized weight, as ComfyUI's mixed-precision Linear holds one."""

    def __init__(self, dim_in: int, dim_out: int, fmt: Format) -> None:
        super().__init__()
        w = (torch.randn(dim_out, dim_in) * dim_in ** -0.5).to(torch.bfloat16)
        self.quant_format = fmt.comfy_format
        self.conf = fmt.conf
        self.weight = nn.Parameter(QuantizedTensor.from_float(w, fmt.layout, **fmt.kwargs), requires_grad=False)
        self.bias = nn.Parameter((torch.randn(dim_out) * 0.02).to(torch.bfloat16), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class QuantBlock(nn.Module):
    def __init__(self, dim: int, fmt: Format) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim, dtype=torch.bfloat16)
        self.fc1 = QuantLinear(dim, dim, fmt)
        self.fc2 = QuantLinear(dim, dim, fmt)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class QuantStack(nn.Module):
    """Plain bf16 layers around `depth` blocks of quantized linears (dims a multiple of 256: ConvRot's groups)."""

    def __init__(self, fmt: Format, dim: int = 256, depth: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim, dtype=torch.bfloat16)
        self.blocks = nn.ModuleList(QuantBlock(dim, fmt) for _ in range(depth))
        self.out = nn.Linear(dim, dim, dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def quant_stack(name: str, seed: int = 0, **kw) -> QuantStack:
    torch.manual_seed(seed)
    return QuantStack(format_named(name), **kw).eval()


def comfy_state_dict(model: nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    """The state dict ComfyUI 0.33 saves for `model` (`_quantized_weight_state_dict` for quantized layers)."""
    sd: dict[str, torch.Tensor] = {}
    for path, module in model.named_modules():
        p = f"{prefix}{path}." if path else prefix
        if isinstance(module, QuantLinear):
            sd.update(module.weight.state_dict(f"{p}weight"))
            sd[f"{p}bias"] = module.bias
            conf = {"format": module.quant_format, **module.conf}
            sd[f"{p}comfy_quant"] = torch.tensor(list(json.dumps(conf).encode("utf-8")), dtype=torch.uint8)
            for name, t in module._parameters.items():  # extra quantization parameters (input_scale) by their names
                if t is not None and name not in ("weight", "bias"):
                    sd[f"{p}{name}"] = t
            continue
        for name, t in list(module._parameters.items()) + list(module._buffers.items()):
            if t is not None:
                sd[f"{p}{name}"] = t
    return {k: v.detach().contiguous() for k, v in sd.items()}


def save_comfy_checkpoint(model: nn.Module, path, prefix: str = "model.diffusion_model.") -> str:
    """Write `model` as ComfyUI writes a quantized diffusion model (keys under `prefix`)."""
    save_file(comfy_state_dict(model, prefix), str(path))
    return str(path)


def quantized_bytes(model: nn.Module) -> int:
    """The bytes every quantized weight holds (payload and scales) plus the other tensors."""
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        if isinstance(t, QuantizedTensor):
            names, _ = t.__tensor_flatten__()
            total += sum(getattr(t, n).numel() * getattr(t, n).element_size() for n in names)
        else:
            total += t.numel() * t.element_size()
    return total
