"""Tiny SD3 (MMDiT) in ComfyUI's key layout (comfy/ldm/modules/diffusionmodules/mmdit.py).

ComfyUI reads depth from the patch embedding (hidden = 64 * depth, heads = depth): depth 2 = width 128, two heads
of 64. The last joint block's context half is pre-only (attention qkv and a 2x modulation, no proj / MLP).
Context (T5/CLIP) width 64, pooled width 64 (`y_embedder`), a 16x16 positional table.
"""
from __future__ import annotations

from .common import Family, Sampling, Shapes, linear

DEPTH = 2
HIDDEN = 64 * DEPTH
CONTEXT = 64
POOLED = 64
IN_CH = 16
PATCH = 2
POS = 16


def _half(s: Shapes, p: str, pre_only: bool) -> None:
    linear(s, p + ".attn.qkv", 3 * HIDDEN, HIDDEN)
    if pre_only:
        linear(s, p + ".adaLN_modulation.1", 2 * HIDDEN, HIDDEN)
        return
    linear(s, p + ".attn.proj", HIDDEN, HIDDEN)
    linear(s, p + ".mlp.fc1", 4 * HIDDEN, HIDDEN)
    linear(s, p + ".mlp.fc2", HIDDEN, 4 * HIDDEN)
    linear(s, p + ".adaLN_modulation.1", 6 * HIDDEN, HIDDEN)


def sd3_shapes() -> Shapes:
    s: Shapes = {"pos_embed": (1, POS * POS, HIDDEN),
                 "x_embedder.proj.weight": (HIDDEN, IN_CH, PATCH, PATCH), "x_embedder.proj.bias": (HIDDEN,)}
    linear(s, "t_embedder.mlp.0", HIDDEN, 256)
    linear(s, "t_embedder.mlp.2", HIDDEN, HIDDEN)
    linear(s, "y_embedder.mlp.0", HIDDEN, POOLED)
    linear(s, "y_embedder.mlp.2", HIDDEN, HIDDEN)
    linear(s, "context_embedder", HIDDEN, CONTEXT)
    for i in range(DEPTH):
        _half(s, "joint_blocks.{}.context_block".format(i), pre_only=(i == DEPTH - 1))
        _half(s, "joint_blocks.{}.x_block".format(i), pre_only=False)
    linear(s, "final_layer.linear", PATCH * PATCH * IN_CH, HIDDEN)
    linear(s, "final_layer.adaLN_modulation.1", 2 * HIDDEN, HIDDEN)
    return s


def _lora_targets():
    t = ["context_embedder", "final_layer.linear", "x_embedder.proj"]
    for i in range(DEPTH):
        t += ["joint_blocks.{}.x_block.attn.qkv".format(i), "joint_blocks.{}.x_block.mlp.fc1".format(i),
              "joint_blocks.{}.x_block.adaLN_modulation.1".format(i),
              "joint_blocks.{}.context_block.attn.qkv".format(i)]
    return t


SD3 = Family(
    name="sd3", kind="diffusion_model", shapes=sd3_shapes,
    expect={"in_channels": IN_CH, "depth": DEPTH, "patch_size": PATCH, "adm_in_channels": POOLED,
            "pos_embed_max_size": POS, "context_embedder_config": {"target": "torch.nn.Linear",
                                                                   "params": {"in_features": CONTEXT,
                                                                              "out_features": HIDDEN}}},
    model_class="SD3",
    sampling=Sampling(latent=(1, 16, 8, 8), context=(8, CONTEXT), pooled=POOLED),
    lora_targets=_lora_targets(), seed=100)
