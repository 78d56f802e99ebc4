"""Published measurements the predictions are held against (docs/benchmarks.md's table; tests/test_workflow_plan.py
recomputes it): each row names its source, card, shape, steps and CFG, and what it measured (seconds per step, or
the whole run: text encode + steps + VAE decode).

The models are described by their ComfyUI-layout tensor shapes (`shapes_for`), written here from the families'
published configs (Wan 2.1 14B / 1.3B, HunyuanVideo 13B, Flux.1-dev, CogVideoX 2B / 5B / 1.5-5B), and priced
by the same code as a workflow's models (`header_costs`, `predict_profile`).
"""
from __future__ import annotations

from dataclasses import dataclass

from .model_files import TensorInfo

BF16 = 2


def _t(*shape: int) -> TensorInfo:
    n = BF16
    for d in shape:
        n *= d
    return TensorInfo(tuple(shape), "bfloat16", n)


def wan_shapes(dim: int, ffn: int, layers: int, i2v: bool) -> dict[str, TensorInfo]:
    s = {"patch_embedding.weight": _t(dim, 36 if i2v else 16, 1, 2, 2), "text_embedding.0.weight": _t(dim, 4096),
         "text_embedding.2.weight": _t(dim, dim), "time_embedding.0.weight": _t(dim, 256),
         "time_embedding.2.weight": _t(dim, dim), "time_projection.1.weight": _t(6 * dim, dim),
         "head.modulation": _t(1, 2, dim), "head.head.weight": _t(64, dim)}
    if i2v:
        s.update({"img_emb.proj.1.weight": _t(1280, 1280), "img_emb.proj.3.weight": _t(dim, 1280),
                  "img_emb.proj.0.bias": _t(1280)})
    for i in range(layers):
        p = f"blocks.{i}."
        s[p + "modulation"] = _t(1, 6, dim)
        for attn in ("self_attn", "cross_attn"):
            for lin in "qkvo":
                s[f"{p}{attn}.{lin}.weight"] = _t(dim, dim)
        if i2v:
            s[p + "cross_attn.k_img.weight"] = _t(dim, dim)
            s[p + "cross_attn.v_img.weight"] = _t(dim, dim)
        s[p + "ffn.0.weight"] = _t(ffn, dim)
        s[p + "ffn.2.weight"] = _t(dim, ffn)
    return s


def _double(p: str, h: int, mlp: int, mod: str) -> dict[str, TensorInfo]:
    s = {}
    for side in ("img", "txt"):
        s[f"{p}{side}_mod.{mod}.weight"] = _t(6 * h, h)
        s[f"{p}{side}_attn.qkv.weight"] = _t(3 * h, h)
        s[f"{p}{side}_attn.proj.weight"] = _t(h, h)
        s[f"{p}{side}_mlp.0.weight"] = _t(mlp, h)
        s[f"{p}{side}_mlp.2.weight"] = _t(h, mlp)
        s[f"{p}{side}_attn.norm.key_norm.scale"] = _t(128)
    return s


def flux_shapes(h: int, double: int, single: int, mod: str = "lin") -> dict[str, TensorInfo]:
    mlp = 4 * h
    s = {"img_in.weight": _t(h, 64), "txt_in.weight": _t(h, 4096), "vector_in.in_layer.weight": _t(h, 768),
         "time_in.in_layer.weight": _t(h, 256), "guidance_in.in_layer.weight": _t(h, 256),
         "final_layer.linear.weight": _t(64, h), "final_layer.adaLN_modulation.1.weight": _t(2 * h, h)}
    for i in range(double):
        s.update(_double(f"double_blocks.{i}.", h, mlp, mod))
    for i in range(single):
        s[f"single_blocks.{i}.linear1.weight"] = _t(3 * h + mlp, h)
        s[f"single_blocks.{i}.linear2.weight"] = _t(h, h + mlp)
        s[f"single_blocks.{i}.modulation.{mod}.weight"] = _t(3 * h, h)
    return s


def _hunyuan_video() -> dict[str, TensorInfo]:
    h = 3072
    s = {k: v for k, v in flux_shapes(h, 20, 40, "linear").items() if not k.startswith(("img_in", "txt_in"))}
    s.update({"img_in.proj.weight": _t(h, 16, 1, 2, 2), "txt_in.input_embedder.weight": _t(h, 4096)})
    for i in range(2):
        p = f"txt_in.individual_token_refiner.blocks.{i}."
        s.update({p + "norm1.weight": _t(h), p + "self_attn_qkv.weight": _t(3 * h, h),
                  p + "self_attn_proj.weight": _t(h, h), p + "mlp.fc1.weight": _t(4 * h, h),
                  p + "mlp.fc2.weight": _t(h, 4 * h), p + "adaLN_modulation.1.weight": _t(2 * h, h)})
    return s


def _cogvideox(dim: int, layers: int) -> dict[str, TensorInfo]:
    s = {"patch_embed.proj.weight": _t(dim, 16, 2, 2), "patch_embed.text_proj.weight": _t(dim, 4096),
         "time_embedding.linear_1.weight": _t(512, dim), "proj_out.weight": _t(64, dim)}
    for i in range(layers):
        p = f"blocks.{i}."
        s.update({p + "norm1.linear.weight": _t(6 * dim, 512), p + "norm2.linear.weight": _t(6 * dim, 512),
                  p + "attn1.to_q.weight": _t(dim, dim), p + "attn1.to_k.weight": _t(dim, dim),
                  p + "attn1.to_v.weight": _t(dim, dim), p + "attn1.to_out.0.weight": _t(dim, dim),
                  p + "ff.net.0.proj.weight": _t(4 * dim, dim), p + "ff.net.2.weight": _t(dim, 4 * dim)})
    return s


MODELS = {
    "wan2.1-i2v-14b": lambda: wan_shapes(5120, 13824, 40, True),
    "wan2.1-t2v-14b": lambda: wan_shapes(5120, 13824, 40, False),
    "wan2.1-t2v-1.3b": lambda: wan_shapes(1536, 8960, 30, False),
    "hunyuan-video": _hunyuan_video,
    "flux.1-dev": lambda: flux_shapes(3072, 19, 38),
    "cogvideox-2b": lambda: _cogvideox(1920, 30),
    "cogvideox-5b": lambda: _cogvideox(3072, 42),
    "cogvideox1.5-5b": lambda: _cogvideox(3072, 42),
}
VAES = {"wan": "wan2.1", "hunyuan": "hunyuan_video", "flux": "kl", "cog": "cogvideox"}


def shapes_for(model: str) -> dict[str, TensorInfo]:
    """A published model's tensors in ComfyUI's layout (shapes and bf16 bytes; no file)."""
    return MODELS[model]()


@dataclass(frozen=True)
class Published:
    """One published measurement: what ran, where, and what it took."""

    source: str
    model: str
    card: str
    width: int
    height: int
    frames: int
    steps: int
    cfg: bool  # classifier-free guidance (two forwards a step, batched)
    seconds: float
    per: str  # "step" (seconds per step) or "run" (the whole generation: text encode, steps, VAE decode)
    vae: str = ""
    note: str = ""


_XDIT_HY = "xDiT docs/performance/hunyuanvideo.md, Ulysses latency, 1 GPU (official HunyuanVideo repo; L20: diffusers)"
_LX_README = "LightX2V README, Performance Benchmarks (2025.12.01), Diffusers 1 GPU row"
_LX_BENCH = "LightX2V docs/EN/source/getting_started/benchmark_source.md, H200, Wan2.1 Official row"
_COG = "CogVideo README, model table: Inference Speed (Step = 50, FP/BF16)"
ROWS: tuple[Published, ...] = (
    Published(_XDIT_HY, "hunyuan-video", "h100-sxm", 1280, 720, 129, 50, False, 1904.08, "run", "hunyuan"),
    Published(_XDIT_HY, "hunyuan-video", "h20", 1280, 720, 129, 50, False, 6639.17, "run", "hunyuan"),
    Published(_XDIT_HY, "hunyuan-video", "l20", 1280, 720, 129, 50, False, 6043.88, "run", "hunyuan"),
    Published(_XDIT_HY, "hunyuan-video", "h100-sxm", 960, 960, 129, 50, False, 1735.01, "run", "hunyuan"),
    Published(_XDIT_HY, "hunyuan-video", "h20", 960, 960, 129, 50, False, 6621.46, "run", "hunyuan"),
    Published(_XDIT_HY, "hunyuan-video", "l20", 960, 960, 129, 50, False, 6039.08, "run", "hunyuan"),
    Published("xDiT docs/performance/flux.md, 1 GPU, PyTorch column", "flux.1-dev", "h100-sxm", 1024, 1024, 1, 28,
              False, 6.71, "run", "flux"),
    Published(_LX_README + " (H100)", "wan2.1-i2v-14b", "h100-sxm", 832, 480, 81, 40, True, 9.77, "step"),
    Published(_LX_README + " (RTX 4090D)", "wan2.1-i2v-14b", "rtx4090d", 832, 480, 81, 40, True, 30.50, "step",
              note="14B bf16 is more than 24 GB: offloaded"),
    Published(_LX_BENCH + " (480P)", "wan2.1-i2v-14b", "h200", 832, 480, 81, 40, True, 366.0, "run", "wan"),
    Published(_LX_BENCH + " (720P)", "wan2.1-i2v-14b", "h200", 1280, 720, 81, 40, True, 974.0, "run", "wan"),
    Published(_COG + ", CogVideoX-2B, A100", "cogvideox-2b", "a100-80gb", 720, 480, 49, 50, True, 90.0, "run", "cog"),
    Published(_COG + ", CogVideoX-2B, H100", "cogvideox-2b", "h100-sxm", 720, 480, 49, 50, True, 45.0, "run", "cog"),
    Published(_COG + ", CogVideoX-5B, A100", "cogvideox-5b", "a100-80gb", 720, 480, 49, 50, True, 180.0, "run", "cog"),
    Published(_COG + ", CogVideoX-5B, H100", "cogvideox-5b", "h100-sxm", 720, 480, 49, 50, True, 90.0, "run", "cog"),
    Published(_COG + ", CogVideoX1.5-5B, A100", "cogvideox1.5-5b", "a100-80gb", 1360, 768, 81, 50, True, 1000.0, "run",
              "cog"),
    Published(_COG + ", CogVideoX1.5-5B, H100", "cogvideox1.5-5b", "h100-sxm", 1360, 768, 81, 50, True, 550.0, "run",
              "cog"),
    Published("Wan2.1 README, highlights: 5-second 480P on an RTX 4090 in about 4 minutes (--offload_model True "
              "--t5_cpu)", "wan2.1-t2v-1.3b", "rtx4090", 832, 480, 81, 50, True, 240.0, "run", "wan"),
)


def predict_row(row: Published, preset: str = "auto") -> dict[str, float]:
    """The prediction for `row` on its card: seconds per step, per run, and predicted / measured."""
    import math

    from ..config import OffloadConfig
    from .cards import MEMORY_EFFICIENCY, get_card
    from .header_costs import Tokens, diffusion_analysis, vae_decode_cost
    from .model_kinds import describe
    from .prediction import _profile_on_card, predict_profile

    card = get_card(row.card)
    desc = describe(shapes_for(row.model))
    fam = desc.family_spec
    assert fam is not None, row.model
    tokens = fam.image_tokens(row.width, row.height, row.frames)
    if row.model.startswith("cogvideox1.5"):  # CogVideoX 1.5 patches two latent frames together
        lat = fam.latent_frames(row.frames)
        tokens = tokens // lat * math.ceil(lat / 2)
    analysis = diffusion_analysis(desc, Tokens(tokens, fam.text_tokens, 2 if row.cfg else 1))
    profile = _profile_on_card(analysis, card)
    profile.names, profile.sizes = [b.name for b in desc.blocks], [b.nbytes for b in desc.blocks]
    profile.rest_bytes = desc.rest_bytes
    pred = predict_profile(profile, OffloadConfig.from_preset(preset, device="sim"))
    step_s = pred.step_ms / 1e3
    run_s = step_s * row.steps
    decode_s = 0.0
    if row.vae:
        cost = vae_decode_cost(VAES[row.vae], row.width, row.height, row.frames)
        decode_s = cost.flops / (card.tflops * 1e12 * card.matmul_efficiency) + cost.nbytes / (
            card.mem_gbps * 1e9 * MEMORY_EFFICIENCY)
        run_s += decode_s
    predicted = step_s if row.per == "step" else run_s
    return {"step_s": step_s, "decode_s": decode_s, "predicted_s": predicted, "ratio": predicted / row.seconds,
            "tokens": float(tokens), "resident_step_s": pred.resident_step_ms / 1e3}
