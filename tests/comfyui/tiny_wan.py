"""A tiny Wan 2.1-shaped diffusion model and LoRA, generated in ComfyUI's key layout.

Plain torch + safetensors (no ComfyUI import) so the server test can write the files before the server
starts. Width 128, 4 blocks, text_dim 4096: UNETLoader detects it as WAN21_T2V.
"""
from __future__ import annotations

from typing import Dict

import torch
from safetensors.torch import save_file

DIM = 128
FFN = 256
FREQ = 256
TEXT_DIM = 4096
IN_DIM = 16
OUT_DIM = 16
NUM_BLOCKS = 4


def _block_shapes(i: int) -> Dict[str, tuple]:
    p = f"blocks.{i}."
    s: Dict[str, tuple] = {p + "modulation": (1, 6, DIM)}
    for attn in ("self_attn", "cross_attn"):
        for lin in ("q", "k", "v", "o"):
            s[f"{p}{attn}.{lin}.weight"] = (DIM, DIM)
            s[f"{p}{attn}.{lin}.bias"] = (DIM,)
        s[f"{p}{attn}.norm_q.weight"] = (DIM,)
        s[f"{p}{attn}.norm_k.weight"] = (DIM,)
    s[p + "norm3.weight"] = (DIM,)
    s[p + "norm3.bias"] = (DIM,)
    s[p + "ffn.0.weight"] = (FFN, DIM)
    s[p + "ffn.0.bias"] = (FFN,)
    s[p + "ffn.2.weight"] = (DIM, FFN)
    s[p + "ffn.2.bias"] = (DIM,)
    return s


def wan_shapes(num_blocks: int = NUM_BLOCKS) -> Dict[str, tuple]:
    """Every key of a Wan 2.1 T2V diffusion model (no 'model.diffusion_model.' prefix) and its shape."""
    s: Dict[str, tuple] = {
        "patch_embedding.weight": (DIM, IN_DIM, 1, 2, 2),
        "patch_embedding.bias": (DIM,),
        "text_embedding.0.weight": (DIM, TEXT_DIM),
        "text_embedding.0.bias": (DIM,),
        "text_embedding.2.weight": (DIM, DIM),
        "text_embedding.2.bias": (DIM,),
        "time_embedding.0.weight": (DIM, FREQ),
        "time_embedding.0.bias": (DIM,),
        "time_embedding.2.weight": (DIM, DIM),
        "time_embedding.2.bias": (DIM,),
        "time_projection.1.weight": (DIM * 6, DIM),
        "time_projection.1.bias": (DIM * 6,),
    }
    for i in range(num_blocks):
        s.update(_block_shapes(i))
    s["head.modulation"] = (1, 2, DIM)
    s["head.head.weight"] = (OUT_DIM * 4, DIM)
    s["head.head.bias"] = (OUT_DIM * 4,)
    return s


def make_wan_state_dict(seed: int = 0, dtype: torch.dtype = torch.float16,
                        num_blocks: int = NUM_BLOCKS) -> Dict[str, torch.Tensor]:
    """Random but well-scaled weights: norms near 1, matrices ~ 1/sqrt(fan_in), so sampling stays finite."""
    g = torch.Generator().manual_seed(seed)
    sd: Dict[str, torch.Tensor] = {}
    for k, shape in wan_shapes(num_blocks).items():
        if k.endswith("norm_q.weight") or k.endswith("norm_k.weight") or k.endswith("norm3.weight"):
            t = 1.0 + 0.05 * torch.randn(shape, generator=g)
        elif len(shape) == 1 or k.endswith("modulation"):
            t = 0.02 * torch.randn(shape, generator=g)
        else:
            fan_in = 1
            for d in shape[1:]:
                fan_in *= d
            t = torch.randn(shape, generator=g) / fan_in ** 0.5
        sd[k] = t.to(dtype).contiguous()
    return sd


def make_lora_state_dict(seed: int = 1, rank: int = 4, scale: float = 0.5) -> Dict[str, torch.Tensor]:
    """A LoRA in ComfyUI's generic 'diffusion_model.<module>.lora_up/lora_down' layout.

    It patches attention and FFN layers inside every block (streamed units) and two layers outside the
    blocks (text_embedding.0, head.head), so both the streamed and the resident/non-block paths are covered.
    """
    g = torch.Generator().manual_seed(seed)
    targets = ["text_embedding.0", "head.head"]
    for i in range(NUM_BLOCKS):
        targets += [f"blocks.{i}.self_attn.{x}" for x in ("q", "k", "v", "o")]
        targets += [f"blocks.{i}.cross_attn.q", f"blocks.{i}.ffn.0", f"blocks.{i}.ffn.2"]
    shapes = wan_shapes()
    sd: Dict[str, torch.Tensor] = {}
    for t in targets:
        out_f, in_f = shapes[t + ".weight"]
        sd[f"diffusion_model.{t}.lora_up.weight"] = (scale * torch.randn(out_f, rank, generator=g)).to(torch.float16)
        sd[f"diffusion_model.{t}.lora_down.weight"] = (torch.randn(rank, in_f, generator=g) / in_f ** 0.5).to(torch.float16)
        sd[f"diffusion_model.{t}.alpha"] = torch.tensor(float(rank))
    return sd


def write_wan(path: str, seed: int = 0, dtype: torch.dtype = torch.float16, num_blocks: int = NUM_BLOCKS) -> None:
    """Write the tiny model as a .safetensors file."""
    save_file(make_wan_state_dict(seed, dtype, num_blocks), path)


def write_checkpoint(path: str, seed: int = 0, dtype: torch.dtype = torch.float16) -> None:
    """The same model as a checkpoint ('model.diffusion_model.' prefix; no text encoder or VAE inside)."""
    sd = {"model.diffusion_model." + k: v for k, v in make_wan_state_dict(seed, dtype).items()}
    save_file(sd, path)


def write_lora(path: str, seed: int = 1) -> None:
    """Write the tiny LoRA as a .safetensors file."""
    save_file(make_lora_state_dict(seed), path)
