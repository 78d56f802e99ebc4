"""Families ComfyUI cannot build at a tiny width: only the keys its model detection reads, at width 128.

Each probe holds the keys `comfy.model_detection.detect_unet_config` looks at and `expect`, the detected fields a tiny
model would need. In ComfyUI 0.3.64 and 0.12.1 every one of them is sized by constants or by the model class's
full-size defaults, so the test skips with the detected values as the reason; if a future ComfyUI reads these sizes
from the file, the test fails and asks for a full generator instead of silently passing.
"""
from __future__ import annotations

from .common import Family, Shapes, linear
from .flux import qk_norm_param

W = 128


def chroma_shapes() -> Shapes:
    n = qk_norm_param()
    s: Shapes = {"double_blocks.0.img_attn.norm.key_norm." + n: (W,),
                 "double_blocks.0.img_attn.norm.query_norm." + n: (W,),
                 "single_blocks.0.norm.key_norm." + n: (W,), "distilled_guidance_layer.norms.0.scale": (W,)}
    linear(s, "img_in", W, 64)
    linear(s, "txt_in", W, 64)
    linear(s, "distilled_guidance_layer.in_proj", 2 * W, 64)
    linear(s, "distilled_guidance_layer.out_proj", W, 2 * W)
    return s


def lumina2_shapes() -> Shapes:
    s: Shapes = {"cap_embedder.0.weight": (64,), "layers.0.attention_norm1.weight": (W,)}
    linear(s, "cap_embedder.1", W, 64)
    linear(s, "x_embedder", W, 16 * 4)
    linear(s, "layers.0.attention.qkv", 3 * W, W, bias=False)
    return s


def qwen_image_shapes() -> Shapes:
    s: Shapes = {"txt_norm.weight": (64,)}
    linear(s, "img_in", W, 64)
    linear(s, "txt_in", W, 64)
    linear(s, "transformer_blocks.0.img_mod.1", 6 * W, W)
    return s


def ace_step_shapes() -> Shapes:
    s: Shapes = {"genre_embedder.weight": (1, W)}
    linear(s, "transformer_blocks.0.attn.to_q", W, W)
    return s


def ace_step15_shapes() -> Shapes:
    s: Shapes = {"encoder.lyric_encoder.layers.0.input_layernorm.weight": (W,),
                 "decoder.layers.0.self_attn_norm.weight": (W,)}
    linear(s, "layers.0.self_attn.q_proj", W, W, bias=False)
    # since 0.19 detection reads the decoder's and the lyric encoder's widths, heads (128 per head) and MLP sizes
    for p in ("decoder.layers.0", "encoder.lyric_encoder.layers.0"):
        linear(s, p + ".self_attn.q_proj", W, W, bias=False)
        linear(s, p + ".mlp.gate_proj", 3 * W, W, bias=False)
    return s


CHROMA = Family(name="chroma", kind="probe", shapes=chroma_shapes,
                expect={"image_model": "chroma", "hidden_size": W, "out_dim": W, "hidden_dim": 2 * W, "n_layers": 1})
LUMINA2 = Family(name="lumina2", kind="probe", shapes=lumina2_shapes,
                 expect={"image_model": "lumina2", "dim": W, "n_heads": 1, "n_kv_heads": 1, "n_layers": 1})
QWEN_IMAGE = Family(name="qwen_image", kind="probe", shapes=qwen_image_shapes,
                    expect={"image_model": "qwen_image", "num_attention_heads": 1, "attention_head_dim": W,
                            "joint_attention_dim": 64, "num_layers": 1})
ACE_STEP = Family(name="ace_step", kind="probe", shapes=ace_step_shapes,
                  expect={"audio_model": "ace", "inner_dim": W, "num_layers": 1, "num_attention_heads": 1})
# fsq_dim (and the text / timbre widths) are the model class's full-size defaults, never read from the file
ACE_STEP15 = Family(name="ace_step15", kind="probe", shapes=ace_step15_shapes,
                    expect={"audio_model": "ace1.5", "hidden_size": W, "num_dit_layers": 1, "num_heads": 1,
                            "fsq_dim": W})
