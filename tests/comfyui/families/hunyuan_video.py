"""Tiny HunyuanVideo (T2V) in ComfyUI's key layout (comfy/ldm/hunyuan_video/model.py).

Width 128 = one head of 128, 2 double + 2 single stream blocks, a 2-block token refiner (fixed depth), text width 64,
pooled CLIP width 768 (`vector_in`: detection fixes vec_in_dim at 768, and without it the file is detected as
HunyuanImage 2.1), no guidance embedding.
"""
from __future__ import annotations

import torch

from .common import Family, Sampling, Shapes, block_list, linear, norm
from .flux import double_block, final_layer, mlp_embedder, single_block, stream_lora_targets, STREAM_LORA_DIFFS

HIDDEN = 128
CONTEXT = 64
VEC = 768
IN_CH = 16
DEPTH = 2
DEPTH_SINGLE = 2


def _refiner_block(s: Shapes, p: str) -> None:
    linear(s, p + ".adaLN_modulation.1", 2 * HIDDEN, HIDDEN)
    norm(s, p + ".norm1", HIDDEN)
    linear(s, p + ".self_attn.qkv", 3 * HIDDEN, HIDDEN)
    linear(s, p + ".self_attn.proj", HIDDEN, HIDDEN)
    norm(s, p + ".norm2", HIDDEN)
    linear(s, p + ".mlp.0", 4 * HIDDEN, HIDDEN)
    linear(s, p + ".mlp.2", HIDDEN, 4 * HIDDEN)


def hunyuan_video_shapes() -> Shapes:
    s: Shapes = {"img_in.proj.weight": (HIDDEN, IN_CH, 1, 2, 2), "img_in.proj.bias": (HIDDEN,)}
    mlp_embedder(s, "time_in", 256)
    mlp_embedder(s, "vector_in", VEC)
    linear(s, "txt_in.input_embedder", HIDDEN, CONTEXT)
    mlp_embedder(s, "txt_in.t_embedder", 256)
    mlp_embedder(s, "txt_in.c_embedder", CONTEXT)
    s.update(block_list(2, _refiner_block, "txt_in.individual_token_refiner.blocks"))
    s.update(block_list(DEPTH, double_block, "double_blocks"))
    s.update(block_list(DEPTH_SINGLE, single_block, "single_blocks"))
    final_layer(s, IN_CH * 4)
    return s


HUNYUAN_VIDEO = Family(
    name="hunyuan_video", kind="diffusion_model", shapes=hunyuan_video_shapes,
    expect={"image_model": "hunyuan_video", "hidden_size": HIDDEN, "num_heads": 1, "in_channels": IN_CH,
            "context_in_dim": CONTEXT, "vec_in_dim": VEC, "depth": DEPTH, "depth_single_blocks": DEPTH_SINGLE,
            "guidance_embed": False},
    model_class="HunyuanVideo",
    sampling=Sampling(latent=(1, 16, 1, 8, 8), context=(8, CONTEXT), pooled=VEC),
    lora_targets=["txt_in.input_embedder", "txt_in.individual_token_refiner.blocks.0.self_attn.qkv"]
    + stream_lora_targets(DEPTH, DEPTH_SINGLE),
    lora_diffs=STREAM_LORA_DIFFS, diffs_take_effect=True, dtype=torch.bfloat16, seed=80)
