"""The smallest SD1.5 UNet ComfyUI still detects as SD15, as a full checkpoint ('model.diffusion_model.' keys).

SD15's detection pins model_channels 320 and context_dim 768, so the UNet is as small as the layout allows: one
level (channel_mult [1]), one res block with one transformer (needed to detect context_dim and the conv proj_in),
no middle block, two output res blocks without transformers: 13.6M parameters, ~27 MB in fp16.
No text encoder in the file: ComfyUI's SD1 CLIP has a fixed 12-layer, 768-wide config (sd1_clip_config.json), so a
tiny CLIP inside a checkpoint is never detected (see TINY_CLIP_KEYS and the test that probes it).
"""
from __future__ import annotations

from .common import Family, Sampling, Shapes, linear, norm

CH = 320
EMB = 4 * CH
CONTEXT = 768
IN_CH = 4


def _res(s: Shapes, p: str, cin: int, cout: int) -> None:
    norm(s, p + ".in_layers.0", cin)
    s[p + ".in_layers.2.weight"] = (cout, cin, 3, 3)
    s[p + ".in_layers.2.bias"] = (cout,)
    linear(s, p + ".emb_layers.1", cout, EMB)
    norm(s, p + ".out_layers.0", cout)
    s[p + ".out_layers.3.weight"] = (cout, cout, 3, 3)
    s[p + ".out_layers.3.bias"] = (cout,)
    if cin != cout:
        s[p + ".skip_connection.weight"] = (cout, cin, 1, 1)
        s[p + ".skip_connection.bias"] = (cout,)


def _transformer(s: Shapes, p: str) -> None:
    norm(s, p + ".norm", CH)
    s[p + ".proj_in.weight"] = (CH, CH, 1, 1)
    s[p + ".proj_in.bias"] = (CH,)
    b = p + ".transformer_blocks.0"
    for attn, kv in (("attn1", CH), ("attn2", CONTEXT)):
        linear(s, "{}.{}.to_q".format(b, attn), CH, CH, bias=False)
        linear(s, "{}.{}.to_k".format(b, attn), CH, kv, bias=False)
        linear(s, "{}.{}.to_v".format(b, attn), CH, kv, bias=False)
        linear(s, "{}.{}.to_out.0".format(b, attn), CH, CH)
    linear(s, b + ".ff.net.0.proj", 8 * CH, CH)
    linear(s, b + ".ff.net.2", CH, 4 * CH)
    for n in ("norm1", "norm2", "norm3"):
        norm(s, "{}.{}".format(b, n), CH)
    s[p + ".proj_out.weight"] = (CH, CH, 1, 1)
    s[p + ".proj_out.bias"] = (CH,)


def unet_shapes() -> Shapes:
    s: Shapes = {}
    linear(s, "time_embed.0", EMB, CH)
    linear(s, "time_embed.2", EMB, EMB)
    s["input_blocks.0.0.weight"] = (CH, IN_CH, 3, 3)
    s["input_blocks.0.0.bias"] = (CH,)
    _res(s, "input_blocks.1.0", CH, CH)
    _transformer(s, "input_blocks.1.1")
    _res(s, "output_blocks.0.0", 2 * CH, CH)
    _res(s, "output_blocks.1.0", 2 * CH, CH)
    norm(s, "out.0", CH)
    s["out.2.weight"] = (IN_CH, CH, 3, 3)
    s["out.2.bias"] = (IN_CH,)
    return s


_T = "input_blocks.1.1.transformer_blocks.0."
LORA_TARGETS = [_T + "attn1.to_q", _T + "attn1.to_v", _T + "attn2.to_k", _T + "ff.net.0.proj",
                "input_blocks.1.1.proj_in", "input_blocks.1.0.emb_layers.1", "output_blocks.0.0.in_layers.2",
                "output_blocks.1.0.skip_connection", "time_embed.0"]

SD15 = Family(
    name="sd15", kind="checkpoint", shapes=unet_shapes,
    expect={"model_channels": CH, "context_dim": CONTEXT, "channel_mult": [1], "num_res_blocks": [1],
            "transformer_depth": [1], "transformer_depth_middle": -2, "use_linear_in_transformer": False,
            "in_channels": IN_CH},
    model_class="SD15", prefix="model.diffusion_model.",
    sampling=Sampling(latent=(1, 4, 8, 8), context=(8, CONTEXT)),
    lora_targets=LORA_TARGETS, seed=120)

# A CLIP-L-shaped text encoder at width 64 / 2 layers, in the checkpoint's 'cond_stage_model.' layout: used to probe
# whether ComfyUI sizes a checkpoint's CLIP from its weights.
TINY_CLIP = {"hidden": 64, "layers": 2, "ffn": 128, "vocab": 49408, "positions": 77}


def tiny_clip_shapes() -> Shapes:
    h, f = TINY_CLIP["hidden"], TINY_CLIP["ffn"]
    p = "cond_stage_model.transformer.text_model."
    s: Shapes = {p + "embeddings.token_embedding.weight": (TINY_CLIP["vocab"], h),
                 p + "embeddings.position_embedding.weight": (TINY_CLIP["positions"], h)}
    for i in range(TINY_CLIP["layers"]):
        b = "{}encoder.layers.{}.".format(p, i)
        for n in ("q_proj", "k_proj", "v_proj", "out_proj"):
            linear(s, b + "self_attn." + n, h, h)
        norm(s, b + "layer_norm1", h)
        norm(s, b + "layer_norm2", h)
        linear(s, b + "mlp.fc1", f, h)
        linear(s, b + "mlp.fc2", h, f)
    norm(s, p + "final_layer_norm", h)
    return s
