"""Tiny Wan models in ComfyUI's key layout (comfy/ldm/wan/model.py): Wan 2.1 T2V, the two Wan 2.2 A14B experts, and
the Wan 2.2 TI2V 5B layout (48 latent channels).

Width 128 (one head of 128), ffn 256, text_dim 4096 (WanModel's fixed text width; ComfyUI detects dim, ffn, layers and
in/out channels from the file). A14B experts share Wan 2.1's architecture and are detected as WAN21_T2V.
"""
from __future__ import annotations

from .common import Family, Sampling, Shapes, block_list, linear, norm

DIM = 128
FFN = 256
FREQ = 256
TEXT_DIM = 4096
NUM_BLOCKS = 4


def _block(s: Shapes, p: str) -> None:
    s[p + ".modulation"] = (1, 6, DIM)
    for attn in ("self_attn", "cross_attn"):
        for lin in ("q", "k", "v", "o"):
            linear(s, "{}.{}.{}".format(p, attn, lin), DIM, DIM)
        norm(s, "{}.{}.norm_q".format(p, attn), DIM, bias=False)
        norm(s, "{}.{}.norm_k".format(p, attn), DIM, bias=False)
    norm(s, p + ".norm3", DIM)
    linear(s, p + ".ffn.0", FFN, DIM)
    linear(s, p + ".ffn.2", DIM, FFN)


def wan_shapes(in_dim: int = 16, out_dim: int = 16, num_blocks: int = NUM_BLOCKS) -> Shapes:
    s: Shapes = {"patch_embedding.weight": (DIM, in_dim, 1, 2, 2), "patch_embedding.bias": (DIM,)}
    linear(s, "text_embedding.0", DIM, TEXT_DIM)
    linear(s, "text_embedding.2", DIM, DIM)
    linear(s, "time_embedding.0", DIM, FREQ)
    linear(s, "time_embedding.2", DIM, DIM)
    linear(s, "time_projection.1", DIM * 6, DIM)
    s.update(block_list(num_blocks, _block, "blocks"))
    s["head.modulation"] = (1, 2, DIM)
    linear(s, "head.head", out_dim * 4, DIM)
    return s


def lora_targets(num_blocks: int = NUM_BLOCKS):
    """Attention and FFN layers inside every block (streamed units), two layers outside the blocks."""
    t = ["text_embedding.0", "head.head"]
    for i in range(num_blocks):
        t += ["blocks.{}.self_attn.{}".format(i, x) for x in ("q", "k", "v", "o")]
        t += ["blocks.{}.cross_attn.q".format(i), "blocks.{}.ffn.0".format(i), "blocks.{}.ffn.2".format(i)]
    return t


# plain parameters (no ComfyUI layer type): every block's modulation table and the head's one
LORA_DIFFS = ["blocks.{}.modulation".format(i) for i in range(NUM_BLOCKS)] + ["head.modulation"]

_WAN_EXPECT = {"image_model": "wan2.1", "dim": DIM, "num_heads": 1, "ffn_dim": FFN, "num_layers": NUM_BLOCKS,
               "model_type": "t2v"}

WAN21 = Family(
    name="wan21", kind="diffusion_model", shapes=wan_shapes, expect=dict(_WAN_EXPECT, in_dim=16, out_dim=16),
    model_class="WAN21_T2V", sampling=Sampling(latent=(1, 16, 1, 8, 8), context=(8, TEXT_DIM)),
    lora_targets=lora_targets(), lora_diffs=LORA_DIFFS, seed=0)

# Wan 2.2 A14B: a high-noise and a low-noise expert (same architecture, different weights), sampled with two
# KSamplerAdvanced stages like ComfyUI's Wan 2.2 workflow.
WAN22 = Family(
    name="wan22", kind="diffusion_model", shapes=wan_shapes, expect=dict(_WAN_EXPECT, in_dim=16, out_dim=16),
    model_class="WAN21_T2V", sampling=Sampling(latent=(1, 16, 1, 8, 8), context=(8, TEXT_DIM), steps=4),
    lora_targets=lora_targets(), lora_diffs=LORA_DIFFS, files=("high_noise", "low_noise"), seed=20)

# Wan 2.2 TI2V 5B layout: 48-channel latent (Wan 2.2 VAE), detected as WAN22_T2V.
WAN22_5B = Family(
    name="wan22_5b", kind="diffusion_model", shapes=lambda: wan_shapes(48, 48),
    expect=dict(_WAN_EXPECT, in_dim=48, out_dim=48), model_class="WAN22_T2V",
    sampling=Sampling(latent=(1, 48, 1, 8, 8), context=(8, TEXT_DIM)),
    lora_targets=lora_targets(), lora_diffs=LORA_DIFFS, seed=40)
