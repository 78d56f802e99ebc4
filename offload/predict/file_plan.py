"""A model file priced from its header alone for `python -m offload plan model.safetensors|.gguf`: every family
`model_kinds` tells apart (the ones the meta-device path cannot build too: CogVideoX, LTX-Video / LTX-2, Flux.2,
Chroma, Z-Image / Lumina 2, SDXL, GGUF files), with the workflow plan's costs (`header_costs`) and the engine's
plan per preset (`predict_profile`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..config import OffloadConfig
from ..store import codec
from ..store.compressed import codec_leaf
from .cards import Card
from .header_costs import Tokens, diffusion_analysis, encoder_analysis
from .model_files import read_tensor_infos
from .model_kinds import Family, ModelDesc, describe
from .prediction import Prediction, _profile_on_card, predict_profile


@dataclass
class FilePlan:
    desc: ModelDesc
    preds: dict[str, Prediction]
    tokens: int
    activation_bytes: int


def predict_file(path: str, width: int, height: int, frames: int, batch: int, card: Card,
                 configs: dict[str, OffloadConfig], ram_bytes: int | None, disk_tier: bool,
                 text_tokens: int | None = None) -> FilePlan:
    """Every config's prediction for the model file at `path`, one forward of `batch` samples at the size given."""
    desc = describe(read_tensor_infos(path))
    if desc.role in ("unknown", "lora"):
        raise ValueError(f"{path}: not a model family this command knows from its tensor names (Wan 2.x, Flux.1 / "
                         f"Flux.2 / Chroma, HunyuanVideo 1.0/1.5, Qwen-Image, LTX-Video / LTX-2, CogVideoX, Z-Image / "
                         f"Lumina 2, SD3.x, SD/SDXL UNets, text encoders); give the diffusers config.json instead")
    fam: Family | None = desc.family_spec
    if desc.role == "diffusion" and fam is not None:
        tokens = fam.image_tokens(width, height, frames)
        analysis = diffusion_analysis(desc, Tokens(tokens, text_tokens or fam.text_tokens, batch))
    elif desc.blocks:
        tokens = text_tokens or desc.text_tokens or 256
        analysis = encoder_analysis(desc, tokens, batch)
    else:
        raise ValueError(f"{path}: a {desc.role} file ({desc.family}) has no blocks to plan; give the diffusion "
                         f"model's file, or plan the workflow that uses it")
    profile = _profile_on_card(analysis, card)
    profile.names, profile.sizes = [b.name for b in desc.blocks], [b.nbytes for b in desc.blocks]
    profile.rest_bytes, profile.model_name = desc.rest_bytes, desc.family
    profile.packed_sizes = header_packed_sizes(desc)
    preds = {name: predict_profile(profile, cfg, ram_bytes=ram_bytes, disk_tier=disk_tier)
             for name, cfg in configs.items()}
    return FilePlan(desc, preds, tokens, analysis.activation_bytes)


# a header's stored dtype (safetensors' torch names, GGUF's float types) -> the torch dtype the codec sees; a
# quantized GGUF payload is bytes (uint8), which the estimate keeps raw
_HEADER_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "BF16": torch.bfloat16,
                  "F16": torch.float16, "F32": torch.float32}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        _HEADER_DTYPES[_name] = getattr(torch, _name)


def header_packed_sizes(desc: ModelDesc) -> list[int]:
    """Each block's size held compressed in RAM (host_compression), estimated from its tensors' stored dtypes as
    the engine estimates a model still on the meta device (`codec.estimate_by_dtype`)."""
    out = []
    for block in desc.blocks:
        leaves = [codec_leaf(info.nbytes, _HEADER_DTYPES.get(info.dtype, torch.uint8))
                  for info in block.tensors.values()]
        out.append(codec.estimate_by_dtype(leaves, block.nbytes))
    return out


def describe_family(desc: ModelDesc) -> dict[str, Any]:
    """What the command prints about a file: family, label, role, dtype, bytes."""
    return desc.to_dict()
