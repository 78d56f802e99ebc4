"""Tiny Flux (dev layout, guidance embedding) in ComfyUI's key layout (comfy/ldm/flux/model.py), plus the
double/single stream blocks HunyuanVideo shares with it.

Width 128 = one head of 128 (axes_dim 16+56+56), 2 double + 2 single blocks, T5 width 64, pooled (CLIP) width 64.
ComfyUI builds it at this width only where detection reads hidden_size from `img_in` / `txt_in` and derives the
heads from it (newer ComfyUI); older ComfyUI fixes hidden_size 3072 / 24 heads, and the test skips there.
"""
from __future__ import annotations

from typing import Iterator, List, Sequence

from .common import Family, Sampling, Shapes, block_list, linear

HIDDEN = 128
MLP = 4 * HIDDEN
CONTEXT = 64
VEC = 64
IN_CH = 16
DEPTH = 2
DEPTH_SINGLE = 2


def qk_norm_param() -> str:
    """The name of the QK RMSNorm's parameter in this ComfyUI: `scale` (flux.layers.RMSNorm, before 0.14) or `weight`
    (ComfyUI's own RMSNorm layer type since 0.14); asked of ComfyUI's QKNorm itself, never of a version number."""
    import comfy.ldm.flux.layers as layers
    import comfy.ops

    norm = layers.QKNorm(4, device="meta", operations=comfy.ops.disable_weight_init)
    return next(name for name, _ in norm.query_norm.named_parameters())


class QKNormKeys(Sequence):
    """Keys of QK-norm parameters, named once ComfyUI is imported (`{}` stands for the parameter's name)."""

    def __init__(self, templates: List[str]) -> None:
        self.templates = templates

    def _keys(self) -> List[str]:
        name = qk_norm_param()
        return [t.format(name) for t in self.templates]

    def __getitem__(self, i):  # type: ignore[override]
        return self._keys()[i]

    def __len__(self) -> int:
        return len(self.templates)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys())

    def __contains__(self, key: object) -> bool:
        return key in self._keys()


def mlp_embedder(s: Shapes, p: str, in_dim: int, hidden: int = HIDDEN) -> None:
    linear(s, p + ".in_layer", hidden, in_dim)
    linear(s, p + ".out_layer", hidden, hidden)


def double_block(s: Shapes, p: str, hidden: int = HIDDEN) -> None:
    for side in ("img", "txt"):
        linear(s, "{}.{}_mod.lin".format(p, side), 6 * hidden, hidden)
        linear(s, "{}.{}_attn.qkv".format(p, side), 3 * hidden, hidden)
        s["{}.{}_attn.norm.query_norm.{}".format(p, side, qk_norm_param())] = (hidden,)
        s["{}.{}_attn.norm.key_norm.{}".format(p, side, qk_norm_param())] = (hidden,)
        linear(s, "{}.{}_attn.proj".format(p, side), hidden, hidden)
        linear(s, "{}.{}_mlp.0".format(p, side), 4 * hidden, hidden)
        linear(s, "{}.{}_mlp.2".format(p, side), hidden, 4 * hidden)


def single_block(s: Shapes, p: str, hidden: int = HIDDEN) -> None:
    linear(s, p + ".linear1", 3 * hidden + 4 * hidden, hidden)
    linear(s, p + ".linear2", hidden, hidden + 4 * hidden)
    s[p + ".norm.query_norm." + qk_norm_param()] = (hidden,)
    s[p + ".norm.key_norm." + qk_norm_param()] = (hidden,)
    linear(s, p + ".modulation.lin", 3 * hidden, hidden)


def final_layer(s: Shapes, out_features: int, hidden: int = HIDDEN) -> None:
    linear(s, "final_layer.linear", out_features, hidden)
    linear(s, "final_layer.adaLN_modulation.1", 2 * hidden, hidden)


def flux_shapes() -> Shapes:
    s: Shapes = {}
    linear(s, "img_in", HIDDEN, IN_CH * 4)
    mlp_embedder(s, "time_in", 256)
    mlp_embedder(s, "vector_in", VEC)
    mlp_embedder(s, "guidance_in", 256)
    linear(s, "txt_in", HIDDEN, CONTEXT)
    s.update(block_list(DEPTH, double_block, "double_blocks"))
    s.update(block_list(DEPTH_SINGLE, single_block, "single_blocks"))
    final_layer(s, IN_CH * 4)
    return s


def stream_lora_targets(depth: int = DEPTH, depth_single: int = DEPTH_SINGLE):
    t = []
    for i in range(depth):
        t += ["double_blocks.{}.img_attn.qkv".format(i), "double_blocks.{}.txt_attn.proj".format(i),
              "double_blocks.{}.img_mlp.0".format(i), "double_blocks.{}.txt_mod.lin".format(i)]
    for i in range(depth_single):
        t += ["single_blocks.{}.linear1".format(i), "single_blocks.{}.linear2".format(i)]
    return t


# the QK norms' RMSNorm parameters: plain parameters before ComfyUI 0.14 (flux.layers.RMSNorm is no ComfyUI layer
# type), a ComfyUI RMSNorm layer's weight since
STREAM_LORA_DIFFS = QKNormKeys(["double_blocks.0.img_attn.norm.key_norm.{}", "single_blocks.1.norm.query_norm.{}"])

FLUX = Family(
    name="flux", kind="diffusion_model", shapes=flux_shapes,
    expect={"image_model": "flux", "hidden_size": HIDDEN, "num_heads": 1, "context_in_dim": CONTEXT,
            "vec_in_dim": VEC, "in_channels": IN_CH, "depth": DEPTH, "depth_single_blocks": DEPTH_SINGLE,
            "guidance_embed": True},
    model_class="Flux",
    sampling=Sampling(latent=(1, 16, 8, 8), context=(8, CONTEXT), pooled=VEC, extra={"guidance": 3.5}),
    lora_targets=["img_in", "final_layer.linear"] + stream_lora_targets(),
    lora_diffs=STREAM_LORA_DIFFS, diffs_take_effect=True,
    dtype=__import__("torch").bfloat16, seed=60)
