"""One forward of a model priced from its file's header: per block, its matmuls (2 x tokens x weight elements, the
tokens each weight sees: image, text or one per sample), its attention (a fused kernel's 4 x queries x keys x width)
and its elementwise traffic; the activation peak; and the text encoder's and VAE decode's costs.

The result is a `meta_costs.MetaAnalysis`, the same card-independent form the meta-device run gives, so a card
prices it the same way (`MetaAnalysis.unit_ms`). Used by the workflow plan, which must answer in seconds from
headers alone; `tests/test_workflow_plan.py` holds its FLOPs against `torch.utils.flop_counter` on diffusers
models.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from .meta_costs import MetaAnalysis
from .model_files import TensorInfo
from .model_kinds import Block, ModelDesc

ACT_BYTES = 2  # bf16/fp16 activations
# elementwise traffic per token and block, in activations of the model width / of the MLP width: norms, modulation,
# residuals, RoPE, gates (about 24 reads + writes of the width) and the MLP's activation function (4 of its width)
_MEM_PER_WIDTH, _MEM_PER_FFN = 24, 4
# live activations at a block's peak per token: the MLP's hidden (two copies around the activation function) and
# about six of the model width (residual, normed input, q/k/v, attention output); held against the meta-device run
_PEAK_PER_FFN, _PEAK_PER_WIDTH = 2, 6

_ONCE = re.compile(r"(^|\.)(mod|modulation|img_mod|txt_mod|adaLN_modulation|adaln\w*|scale_shift_table|"
                   r"norm1\.linear|norm1_context\.linear|norm\.linear|norm_out\.linear|time\w*|vector_in|guidance\w*)"
                   r"(\.|$)")
_TEXT_SIDE = re.compile(r"(txt|context|add_[qkv]_proj|to_add_out|audio|cross_attn\.(k|v|k_img|v_img)\b|"
                        r"attn2\.to_(k|v)\b)")


@dataclass
class Tokens:
    image: int  # image/video tokens per sample
    text: int  # text tokens per sample
    batch: int = 1  # samples per forward (2 when cond and uncond run together)


def _stream(name: str, kind: str) -> str:
    """Which tokens a block's weight sees: once (per sample), text, image, or all (image + text)."""
    if _ONCE.search(name):
        return "once"
    if kind == "text":
        return "text"
    if kind in ("single",):
        return "all"
    if kind in ("joint", "self+cross") and _TEXT_SIDE.search(name):
        return "text"
    return "image"


def _block_ops(block: Block, tok: Tokens, width: int) -> tuple[list[tuple[str, float, float]], int]:
    """(ops, activation peak bytes) of one block for `tok`."""
    n = {"image": tok.image, "text": tok.text, "all": tok.image + tok.text, "once": 1}
    mm_flops = mm_bytes = 0.0
    ffn = width
    for name, info in block.tensors.items():
        if info.scale:  # a quantized layer's scales: read by its matmul, no FLOPs of their own
            mm_bytes += info.nbytes
            continue
        if len(info.shape) < 2 or not name.endswith("weight"):
            continue
        stream = _stream(name, block.kind)
        elems = math.prod(info.shape)
        mm_flops += 2.0 * n[stream] * tok.batch * elems
        mm_bytes += info.nbytes + ACT_BYTES * n[stream] * tok.batch * (info.shape[0] + info.shape[1])
        if stream in ("image", "all") and len(info.shape) == 2:
            ffn = max(ffn, info.shape[0], info.shape[1])
    q = {"self+cross": tok.image, "joint": tok.image + tok.text, "single": tok.image + tok.text,
         "text": tok.text, "image": tok.image, "self": tok.image}.get(block.kind, tok.image)
    attn = 4.0 * tok.batch * q * q * width
    if block.kind == "self+cross":
        attn += 4.0 * tok.batch * tok.image * tok.text * width
    ops = [("mm", mm_flops, mm_bytes), ("attn", attn, 4.0 * ACT_BYTES * tok.batch * q * width)]
    ops.append(("mem", 0.0, float(ACT_BYTES * tok.batch * q * (_MEM_PER_WIDTH * width + _MEM_PER_FFN * ffn))))
    peak = ACT_BYTES * tok.batch * q * (_PEAK_PER_FFN * ffn + _PEAK_PER_WIDTH * width)
    return ops, int(peak)


def _unet_ops(desc: ModelDesc, tok: Tokens) -> tuple[list[list[tuple[str, float, float]]], int]:
    """A UNet's blocks at their levels' resolutions: convolutions at the level's pixels, attention over them."""
    pixels = tok.image  # the latent's pixels (patch 1)
    units, peak = [], 0
    for block in desc.blocks:
        in_output = block.name.startswith("output_blocks")
        flops = nbytes = attn = 0.0
        width = 0
        for name, info in block.tensors.items():
            if info.scale:
                nbytes += info.nbytes
                continue
            if not name.endswith("weight") or len(info.shape) < 2:
                continue
            elems = math.prod(info.shape)
            seen = tok.text if re.search(r"attn2\.to_(k|v)", name) else 1 if "emb_layers" in name else pixels
            flops += 2.0 * tok.batch * seen * elems
            nbytes += info.nbytes
            if name.endswith("attn1.to_q.weight"):
                width = info.shape[0]
                attn += 4.0 * tok.batch * pixels * pixels * width + 4.0 * tok.batch * pixels * tok.text * width
        ch = max((i.shape[0] for n, i in block.tensors.items() if len(i.shape) == 4), default=width)
        ops = [("mm", flops, nbytes + ACT_BYTES * tok.batch * pixels * ch * 4), ("attn", attn, 0.0),
               ("mem", 0.0, float(ACT_BYTES * tok.batch * pixels * ch * 16))]
        units.append(ops)
        peak = max(peak, ACT_BYTES * tok.batch * pixels * max(ch * 8, width * 16))
        if any(n.endswith("op.weight") for n in block.tensors) and not in_output:
            pixels = max(1, pixels // 4)
        if in_output and any(re.fullmatch(r"\d+\.conv\.weight", n) for n in block.tensors):
            pixels *= 4
    return units, int(peak)


def diffusion_analysis(desc: ModelDesc, tok: Tokens) -> MetaAnalysis:
    """One forward of a diffusion model at `tok`, card-independent."""
    if desc.family == "unet":
        units, peak = _unet_ops(desc, tok)
    else:
        units, peak = [], 0
        for block in desc.blocks:
            ops, p = _block_ops(block, tok, desc.hidden or 1)
            units.append(ops)
            peak = max(peak, p)
    rest_flops = rest_bytes = 0.0
    for name, info in desc.rest.items():
        if info.scale:
            rest_bytes += info.nbytes
        elif len(info.shape) >= 2:
            seen = 1 if _ONCE.search(name) else tok.text if re.search(r"(txt|text|context|cap)", name) else tok.image
            rest_flops += 2.0 * tok.batch * seen * math.prod(info.shape)
            rest_bytes += info.nbytes
    rest = [("mm", rest_flops, rest_bytes)]
    flops = [sum(f for _, f, _ in ops) for ops in units]
    return MetaAnalysis(units, rest, flops, peak + ACT_BYTES * tok.batch * tok.image * (desc.hidden or 1) * 2)


def encoder_analysis(desc: ModelDesc, tokens: int, prompts: int = 1) -> MetaAnalysis:
    """A text encoder over `prompts` prompts of `tokens` tokens: its blocks as self-attention over the tokens."""
    tok = Tokens(tokens, tokens, prompts)
    units, peak = [], 0
    for block in desc.blocks:
        b = Block(block.name, block.nbytes, block.tensors, "image")
        ops, p = _block_ops(b, tok, desc.hidden or 1)
        units.append(ops)
        peak = max(peak, p)
    rest_bytes = sum(i.nbytes for i in desc.rest.values())
    return MetaAnalysis(units, [("mem", 0.0, float(tokens * prompts * (desc.hidden or 1) * ACT_BYTES * 4))],
                        [sum(f for _, f, _ in ops) for ops in units], peak + min(rest_bytes, 0))


# VAE decode, per kind: FLOPs and device bytes moved per output pixel (per frame), from one decode of diffusers'
# own VAE classes on the meta device (torch.utils.flop_counter formulas; AutoencoderKL SD/Flux config,
# AutoencoderKLWan 2.1 and 2.2 configs, AutoencoderKLHunyuanVideo, AutoencoderKLLTXVideo, AutoencoderKLCogVideoX),
# and the memory ComfyUI itself reserves for a decode (comfy/sd.py VAE.__init__, memory_used_decode), in bytes per
# latent element of its formula's shape: fn(latent frames, latent h, latent w) -> bytes (bf16: x2).
VAE_KINDS: dict[str, tuple[float, float, object, int, int]] = {
    # kind: (FLOPs / output px, bytes / output px, ComfyUI's decode memory, spatial factor, temporal factor)
    "kl": (9.49e6, 33424, lambda f, h, w: 2178 * h * w * 64 * 2, 8, 0),
    "wan2.1": (8.71e6, 75557, lambda f, h, w: (2200 if f <= 4 else 7000) * h * w * 64 * 2, 8, 4),
    "wan2.2": (18.9e6, 66920, lambda f, h, w: 8000 * h * w * 256 * 2, 16, 4),
    "hunyuan_video": (18.1e6, 34849, lambda f, h, w: 2800 * min(8, (f - 1) * 4 + 1) * h * w * 64 * 2, 8, 4),
    "hunyuan_video_1.5": (18.1e6, 34849, lambda f, h, w: 3600 * 4 * h * w * 256 * 2, 16, 4),
    "ltx": (0.96e6, 5545, lambda f, h, w: 1200 * f * h * w * 512 * 2, 32, 8),
    "cogvideox": (18.9e6, 78223, lambda f, h, w: 2800 * max(2, (f - 1) * 4 + 1) * h * w * 64 * 2, 8, 4),
}


@dataclass
class DecodeCost:
    flops: float
    nbytes: float
    peak_bytes: int  # device memory the decode needs beside the VAE's weights
    tiled: bool
    kind: str


def vae_decode_cost(kind: str, width: int, height: int, frames: int, batch: int = 1, tiled: bool = False,
                    tile: int = 512, temporal: int = 64) -> DecodeCost:
    """The decode of a `frames` x `height` x `width` output (tiled: ComfyUI's VAEDecodeTiled, `tile` pixels square
    and `temporal` frames a tile, overlap recomputed: about a quarter more work)."""
    flops_px, bytes_px, mem_fn, spatial, temporal_f = VAE_KINDS.get(kind, VAE_KINDS["kl"])
    frames = max(1, frames) if temporal_f else 1
    px = width * height * frames * batch
    lf = (frames - 1) // temporal_f + 1 if temporal_f else 1
    if tiled:
        th, tw = min(height, tile) // spatial, min(width, tile) // spatial
        tf = min(lf, max(1, temporal // max(temporal_f, 1))) if temporal_f else 1
        peak = mem_fn(tf, max(1, th), max(1, tw))  # type: ignore[operator]
        return DecodeCost(flops_px * px * 1.25, bytes_px * px * 1.25, int(peak), True, kind)
    peak = mem_fn(lf, max(1, height // spatial), max(1, width // spatial)) * batch  # type: ignore[operator]
    return DecodeCost(flops_px * px, bytes_px * px, int(peak), False, kind)


def weights_2d(tensors: dict[str, TensorInfo]) -> int:
    """Elements of the matrices among `tensors` (what 2 x tokens x elements FLOPs are counted over)."""
    return sum(math.prod(i.shape) for i in tensors.values() if len(i.shape) >= 2 and not i.scale)
