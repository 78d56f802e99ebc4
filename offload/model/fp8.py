"""Float8 linear layers that keep their scales: weights stored (and streamed) as fp8, dequantized on the device.

`quantize_linears(module)` swaps every `nn.Linear` below `module` for an `Fp8Linear` holding the weight in float8
(e4m3fn or e5m2) and its float32 scale (per output channel, or one per tensor). The engine moves those bytes as
stored (half of bf16), and the forward dequantizes on the device: `weight.to(compute dtype) * scale`. A checkpoint
that already holds float8 weights with `weight_scale` (or `scale_weight` / `.scale`) tensors loads into
`Fp8Linear`s as it is (`Fp8Linear.from_state`). The same weights always dequantize to the same bytes, so outputs
are identical across presets.
"""
from __future__ import annotations

import logging
from typing import Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

log = logging.getLogger(__name__)

FP8_DTYPES = {"fp8_e4m3fn": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
SCALE_KEYS = ("weight_scale", "scale_weight", "weight.scale")


class Fp8Linear(nn.Module):
    """A linear layer whose weight is float8 with a float32 scale; computes in the input's dtype."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 dtype: torch.dtype = torch.float8_e4m3fn, per_channel: bool = True,
                 bias_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        scale_shape = (out_features, 1) if per_channel else ()
        self.weight_scale = nn.Parameter(torch.ones(scale_shape, dtype=torch.float32), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=bias_dtype), requires_grad=False) if bias else None

    @classmethod
    def quantize(cls, linear: nn.Linear, dtype: torch.dtype = torch.float8_e4m3fn,
                 per_channel: bool = True) -> "Fp8Linear":
        """An fp8 copy of `linear`: weight / scale rounded to `dtype`, scale = max |w| / the dtype's largest value."""
        w = linear.weight.detach().to(torch.float32)
        fmax = torch.finfo(dtype).max
        amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax()
        scale = torch.where(amax > 0, amax / fmax, torch.ones_like(amax))
        out = cls(linear.in_features, linear.out_features, linear.bias is not None, dtype, per_channel,
                  linear.bias.dtype if linear.bias is not None else torch.float32)
        with torch.no_grad():
            out.weight.copy_((w / scale).clamp(-fmax, fmax).to(dtype))
            out.weight_scale.copy_(scale.reshape(out.weight_scale.shape))
            if linear.bias is not None:
                out.bias.copy_(linear.bias.detach())
        return out.to(linear.weight.device)

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight in `dtype`, computed in float32 from the stored bytes and the scale (on the weight's device)."""
        return (self.weight.to(torch.float32) * self.weight_scale).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantized_weight(x.dtype), bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"weight={self.weight.dtype}, scale={'per channel' if self.weight_scale.dim() else 'per tensor'}")


def quantize_linears(module: nn.Module, dtype: torch.dtype = torch.float8_e4m3fn, per_channel: bool = True,
                     skip: Iterable[str] = ()) -> int:
    """Replace every nn.Linear below `module` (names in `skip` excepted) by an Fp8Linear; returns how many.

    Each layer is quantized and its original released before the next, so host memory rises by about one layer.
    """
    skip = tuple(skip)
    count = 0
    for name, parent in list(module.named_modules()):
        for child_name, child in list(parent.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if type(child) is nn.Linear and not any(full == s or full.startswith(s + ".") for s in skip):
                setattr(parent, child_name, Fp8Linear.quantize(child, dtype, per_channel))
                count += 1
    return count


def scale_key_for(weight_key: str, keys: Iterable[str]) -> str | None:
    """The scale tensor that goes with an fp8 weight in a checkpoint (`<layer>.weight_scale`, `.scale_weight`,
    `.weight.scale`), or None."""
    keys = set(keys)
    base = weight_key[: -len(".weight")] if weight_key.endswith(".weight") else weight_key
    for suffix in SCALE_KEYS:
        if f"{base}.{suffix}" in keys:
            return f"{base}.{suffix}"
    return None


def adopt_fp8_checkpoint(module: nn.Module, state: dict[str, torch.Tensor]) -> int:
    """Turn the nn.Linears whose checkpoint weights are float8 (with a scale tensor) into Fp8Linears holding those
    weights and scales as they are; returns how many. Call before loading the rest of the state dict."""
    count = 0
    names = dict(module.named_modules())
    for key, tensor in state.items():
        if tensor.dtype not in FP8_DTYPES.values() or not key.endswith(".weight"):
            continue
        layer_name = key[: -len(".weight")]
        layer = names.get(layer_name)
        scale_key = scale_key_for(key, state)
        if type(layer) is not nn.Linear or scale_key is None:
            continue
        scale = state[scale_key].to(torch.float32)
        per_channel = scale.numel() > 1
        fp8 = Fp8Linear(layer.in_features, layer.out_features, layer.bias is not None, tensor.dtype, per_channel,
                        layer.bias.dtype if layer.bias is not None else torch.float32)
        with torch.no_grad():
            fp8.weight.copy_(tensor)
            fp8.weight_scale.copy_(scale.reshape(fp8.weight_scale.shape))
            if layer.bias is not None:  # from the checkpoint if given, else the layer's own (already loaded)
                fp8.bias.copy_(state.get(f"{layer_name}.bias", layer.bias.detach()))
        parent_name, _, child = layer_name.rpartition(".")
        setattr(names[parent_name] if parent_name else module, child, fp8)
        count += 1
    return count
