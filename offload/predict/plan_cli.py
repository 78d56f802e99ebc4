"""`python -m offload plan`: will a model fit a card, and how slow will it run, before anything is downloaded.

The model is described by a local file: a diffusers or transformers `config.json` (or the folder holding it), or a
ComfyUI model file (`.safetensors`) whose header alone is read: its family is detected from the tensor names (as
ComfyUI's own `comfy/model_detection.py` does: Wan, Flux, HunyuanVideo 1.0 / 1.5, Qwen-Image, SD3) and mapped to the
diffusers config of that family; block sizes then come from the file itself (as they would stream). The model is
built on the meta device (no weights), one forward runs there at the input size asked for, and `offload.predict`
gives, per preset, the plan, the memory it takes and the predicted step time on the named card.

    python -m offload plan wan2.1_t2v_14B_bf16.safetensors --frames 81 --height 480 --width 832 --card rtx4090
    python -m offload plan path/to/transformer/config.json --height 1024 --width 1024 --card rtx3060-12gb --ram 32GB
    python -m offload plan Qwen2.5-7B/config.json --tokens 1 --card rtx4070-12gb
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import re
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger(__name__)

GIB = 1 << 30
TEXT_TOKENS = 512  # text-encoder tokens a diffusion model is conditioned on (T5 / umT5 / Qwen2.5-VL padding)
_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "model.", "transformer.")
# HunyuanVideo's block lists in the order diffusers registers them (the token refiner's blocks come first)
_HUNYUAN_LISTS = ("txt_in.individual_token_refiner.blocks", "double_blocks", "single_blocks")
_DTYPES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4, "I16": 2,
           "I8": 1, "U8": 1, "BOOL": 1}


@dataclass
class ModelSpec:
    """What the command knows about a model: how to build it on the meta device and how to make its inputs."""

    family: str  # wan, flux, qwen_image, hunyuan_video, hunyuan_video_1.5, sd3, transformers, diffusers
    class_name: str  # the diffusers / transformers class
    config: dict[str, Any]
    source: str  # the file it was read from
    dtype: str = "bf16"
    block_bytes: list[int] | None = None  # from a model file: each block's bytes as stored (None: from the model)
    rest_bytes: int | None = None
    notes: list[str] = field(default_factory=list)


# ------------------------------------------------------------------------------------------------ reading a file
def read_safetensors_header(path: Path) -> dict[str, dict[str, Any]]:
    """The header of a .safetensors file (names, dtypes, shapes, offsets), read without its data."""
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path} is not a safetensors file (shorter than its 8-byte header length)")
        (length,) = struct.unpack("<Q", raw)
        if length <= 0 or length > 200 << 20:
            raise ValueError(f"{path} is not a safetensors file (header length {length})")
        header = json.loads(fh.read(length))
    header.pop("__metadata__", None)
    return header


def _strip(keys: dict[str, Any]) -> dict[str, Any]:
    for prefix in _PREFIXES:
        if any(k.startswith(prefix + "blocks.") or k.startswith(prefix + "double_blocks.") or
               k.startswith(prefix + "transformer_blocks.") or k.startswith(prefix + "joint_blocks.") for k in keys):
            return {k[len(prefix):]: v for k, v in keys.items() if k.startswith(prefix)}
    return keys


def _count(keys: dict[str, Any], prefix: str) -> int:
    found = {int(m.group(1)) for k in keys if (m := re.match(re.escape(prefix) + r"(\d+)\.", k))}
    return max(found) + 1 if found else 0


def _shape(keys: dict[str, Any], name: str) -> list[int]:
    if name not in keys:
        raise ValueError(f"expected tensor {name!r} in the model file")
    return list(keys[name]["shape"])


def _block_bytes(keys: dict[str, Any], lists: tuple[str, ...]) -> tuple[list[int], int]:
    """Bytes of each block as stored (512-byte aligned per tensor, as the engine lays a unit out) and of the rest."""
    from ..model.layout import align

    blocks: dict[tuple[int, int], int] = {}
    rest = 0
    for name, info in keys.items():
        nbytes = _DTYPES.get(info["dtype"], 2) * math.prod(info["shape"])
        for li, lst in enumerate(lists):
            m = re.match(re.escape(lst) + r"\.(\d+)\.", name)
            if m:
                blocks[(li, int(m.group(1)))] = blocks.get((li, int(m.group(1))), 0) + align(nbytes)
                break
        else:
            rest += align(nbytes)
    return [blocks[k] for k in sorted(blocks)], rest


def _file_dtype(keys: dict[str, Any]) -> str:
    counts: dict[str, int] = {}
    for info in keys.values():
        if len(info["shape"]) == 2:
            counts[info["dtype"]] = counts.get(info["dtype"], 0) + math.prod(info["shape"])
    top = max(counts, key=counts.get) if counts else "BF16"
    return {"F16": "fp16", "F32": "fp32", "F8_E4M3": "fp8_e4m3fn", "F8_E5M2": "fp8_e5m2"}.get(top, "bf16")


def spec_from_comfy_file(path: Path) -> ModelSpec:
    """Detect the family of a ComfyUI diffusion model file from its tensor names and map it to a diffusers config."""
    keys = _strip(read_safetensors_header(path))
    dtype = _file_dtype(keys)

    def spec(family: str, cls: str, config: dict[str, Any], lists: tuple[str, ...]) -> ModelSpec:
        blocks, rest = _block_bytes(keys, lists)
        return ModelSpec(family, cls, config, str(path), dtype, blocks, rest)

    if "head.modulation" in keys and "patch_embedding.weight" in keys:  # Wan 2.1 / 2.2
        dim = _shape(keys, "head.modulation")[-1]
        config = dict(num_attention_heads=dim // 128, attention_head_dim=128,
                      in_channels=_shape(keys, "patch_embedding.weight")[1],
                      out_channels=_shape(keys, "head.head.weight")[0] // 4,
                      text_dim=_shape(keys, "text_embedding.0.weight")[1],
                      freq_dim=_shape(keys, "time_embedding.0.weight")[1],
                      ffn_dim=_shape(keys, "blocks.0.ffn.0.weight")[0], num_layers=_count(keys, "blocks."),
                      cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, patch_size=(1, 2, 2))
        if "img_emb.proj.0.bias" in keys:  # image-to-video: CLIP image tokens and their own cross-attention
            config.update(image_dim=_shape(keys, "img_emb.proj.1.weight")[1], added_kv_proj_dim=dim)
        return spec("wan", "WanTransformer3DModel", config, ("blocks",))
    if "txt_in.individual_token_refiner.blocks.0.norm1.weight" in keys:  # HunyuanVideo 1.0 / 1.5
        in_w = _shape(keys, "img_in.proj.weight")
        hidden = in_w[0]
        if "cond_type_embedding.weight" in keys:
            config = dict(in_channels=in_w[1], out_channels=_shape(keys, "final_layer.linear.weight")[0],
                          num_attention_heads=hidden // 128, attention_head_dim=128,
                          num_layers=_count(keys, "double_blocks."),
                          text_embed_dim=_shape(keys, "txt_in.input_embedder.weight")[1])
            if "vision_in.proj.0.weight" in keys:
                config["image_embed_dim"] = _shape(keys, "vision_in.proj.0.weight")[0]
            config["num_refiner_layers"] = _count(keys, "txt_in.individual_token_refiner.blocks.")
            return spec("hunyuan_video_1.5", "HunyuanVideo15Transformer3DModel", config, _HUNYUAN_LISTS[:2])
        config = dict(in_channels=in_w[1], out_channels=16, num_attention_heads=hidden // 128, attention_head_dim=128,
                      num_layers=_count(keys, "double_blocks."), num_single_layers=_count(keys, "single_blocks."),
                      text_embed_dim=_shape(keys, "txt_in.input_embedder.weight")[1],
                      guidance_embeds=any(k.startswith("guidance_in.") for k in keys),
                      num_refiner_layers=_count(keys, "txt_in.individual_token_refiner.blocks."))
        return spec("hunyuan_video", "HunyuanVideoTransformer3DModel", config, _HUNYUAN_LISTS)
    if "double_blocks.0.img_attn.qkv.weight" in keys and "img_in.weight" in keys:  # Flux.1
        hidden, in_ch = _shape(keys, "img_in.weight")
        config = dict(in_channels=in_ch, num_layers=_count(keys, "double_blocks."),
                      num_single_layers=_count(keys, "single_blocks."), attention_head_dim=128,
                      num_attention_heads=hidden // 128, joint_attention_dim=_shape(keys, "txt_in.weight")[1],
                      pooled_projection_dim=_shape(keys, "vector_in.in_layer.weight")[1],
                      guidance_embeds="guidance_in.in_layer.weight" in keys)
        return spec("flux", "FluxTransformer2DModel", config, ("double_blocks", "single_blocks"))
    if "txt_norm.weight" in keys and "transformer_blocks.0.img_mod.1.weight" in keys:  # Qwen-Image
        hidden, in_ch = _shape(keys, "img_in.weight")
        config = dict(in_channels=in_ch, out_channels=_shape(keys, "proj_out.weight")[0] // 4,
                      num_layers=_count(keys, "transformer_blocks."), attention_head_dim=128,
                      num_attention_heads=hidden // 128, joint_attention_dim=_shape(keys, "txt_norm.weight")[0])
        return spec("qwen_image", "QwenImageTransformer2DModel", config, ("transformer_blocks",))
    if "joint_blocks.0.x_block.attn.qkv.weight" in keys:  # SD3 / SD3.5 (MMDiT)
        hidden = _shape(keys, "x_embedder.proj.weight")[0]
        depth = _count(keys, "joint_blocks.")
        config = dict(num_layers=depth, attention_head_dim=64, num_attention_heads=hidden // 64,
                      caption_projection_dim=hidden, in_channels=_shape(keys, "x_embedder.proj.weight")[1],
                      joint_attention_dim=_shape(keys, "context_embedder.weight")[1],
                      pooled_projection_dim=_shape(keys, "y_embedder.mlp.0.weight")[1],
                      pos_embed_max_size=int(math.isqrt(_shape(keys, "pos_embed")[1])) if "pos_embed" in keys else 96,
                      dual_attention_layers=tuple(i for i in range(depth)
                                                  if f"joint_blocks.{i}.x_block.attn2.qkv.weight" in keys),
                      qk_norm="rms_norm" if "joint_blocks.0.x_block.attn.ln_q.weight" in keys else None)
        return spec("sd3", "SD3Transformer2DModel", config, ("joint_blocks",))
    raise ValueError(f"{path}: not a model family this command knows from its tensor names (Wan 2.x, Flux.1, "
                     f"HunyuanVideo 1.0/1.5, Qwen-Image, SD3); give the diffusers config.json of the model instead")


def spec_from_config(path: Path) -> ModelSpec:
    """A diffusers (`_class_name`) or transformers (`architectures` / `model_type`) config.json."""
    if path.is_dir():
        path = path / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {path} as a config.json: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: a config.json holds a JSON object")
    dtype = {"float16": "fp16", "float32": "fp32"}.get(str(config.get("torch_dtype") or config.get("dtype")), "bf16")
    if "_class_name" in config:
        cls = config["_class_name"]
        family = {"WanTransformer3DModel": "wan", "FluxTransformer2DModel": "flux",
                  "QwenImageTransformer2DModel": "qwen_image", "HunyuanVideoTransformer3DModel": "hunyuan_video",
                  "HunyuanVideo15Transformer3DModel": "hunyuan_video_1.5",
                  "SD3Transformer2DModel": "sd3"}.get(cls, "diffusers")
        clean = {k: v for k, v in config.items() if not k.startswith("_")}
        return ModelSpec(family, cls, clean, str(path), dtype)
    if "model_type" in config or "architectures" in config:
        arch = (config.get("architectures") or ["AutoModelForCausalLM"])[0]
        return ModelSpec("transformers", arch, config, str(path), dtype)
    raise ValueError(f"{path}: neither a diffusers config (no _class_name) nor a transformers config (no model_type)")


def load_spec(path: str | Path) -> ModelSpec:
    """A ModelSpec from a config.json, a folder holding one, or a ComfyUI .safetensors model file."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"{p} does not exist; give a config.json, a model folder or a .safetensors file")
    if p.suffix == ".safetensors":
        return spec_from_comfy_file(p)
    return spec_from_config(p)


# ------------------------------------------------------------------------------------------ model and inputs
def build_meta_model(spec: ModelSpec) -> Any:
    """The model class of `spec` on the meta device, in its dtype (bf16 for a float8 file: it computes in bf16)."""
    import torch

    dtype = {"fp16": torch.float16, "fp32": torch.float32}.get(spec.dtype, torch.bfloat16)
    if spec.family == "transformers":
        import transformers

        config = transformers.AutoConfig.for_model(**{k: v for k, v in spec.config.items()
                                                      if k not in ("architectures", "transformers_version")})
        cls = getattr(transformers, spec.class_name, None) or transformers.AutoModelForCausalLM
        with torch.device("meta"):
            model = cls.from_config(config) if cls is transformers.AutoModelForCausalLM else cls(config)
        return model.to(dtype).eval()
    import diffusers

    cls = getattr(diffusers, spec.class_name, None)
    if cls is None:
        raise ValueError(f"diffusers {diffusers.__version__} has no {spec.class_name}")
    with torch.device("meta"):
        model = cls.from_config(spec.config)
    return model.to(dtype).eval()


@dataclass
class InputSize:
    """What one forward is run at: a video (frames), an image (height x width) or a token count."""

    frames: int = 1
    height: int = 1024
    width: int = 1024
    tokens: int | None = None
    text_tokens: int = TEXT_TOKENS
    batch: int = 1

    def describe(self, family: str) -> str:
        if family == "transformers":
            return f"{self.tokens or 1} token(s), batch {self.batch}"
        video = family in ("wan", "hunyuan_video", "hunyuan_video_1.5")
        return (f"{self.frames} frames " if video else "") + f"{self.width}x{self.height}, batch {self.batch}"


def make_inputs(spec: ModelSpec, model: Any, size: InputSize, device: Any = "meta",
                seed: int = 0) -> tuple[tuple, dict[str, Any], int]:
    """(args, kwargs, image/video tokens) of one forward of `model` at `size`: meta tensors, or seeded random ones on
    `device` (masks all ones, ids zero) for a real run."""
    import torch

    dt = next(iter(model.parameters())).dtype
    b, t_txt = size.batch, size.text_tokens
    cfg = model.config
    gen = torch.Generator().manual_seed(seed)

    def meta(*shape: int, dtype: Any = dt) -> torch.Tensor:
        if str(device) == "meta":
            return torch.empty(*shape, device="meta", dtype=dtype)
        if dtype == torch.long:
            return torch.ones(*shape, dtype=dtype, device=device)
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    step = meta(b, dtype=torch.float32)
    if str(device) != "meta":
        step = torch.full((b,), 500.0, device=device)
    latent_f = (size.frames - 1) // 4 + 1
    fam = spec.family
    if fam == "transformers":
        tokens = size.tokens or 1
        ids = meta(b, tokens, dtype=torch.long) if str(device) == "meta" else torch.zeros(b, tokens, dtype=torch.long,
                                                                                           device=device)
        return (), {"input_ids": ids, "use_cache": False}, tokens
    if fam == "wan":
        h, w = size.height // 8, size.width // 8
        kw = dict(hidden_states=meta(b, cfg.in_channels, latent_f, h, w), timestep=step,
                  encoder_hidden_states=meta(b, t_txt, cfg.text_dim), return_dict=False)
        if cfg.image_dim:
            kw["encoder_hidden_states_image"] = meta(b, 257, cfg.image_dim)
        return (), kw, latent_f * (h // 2) * (w // 2)
    if fam == "flux":
        h, w = size.height // 16, size.width // 16
        kw = dict(hidden_states=meta(b, h * w, cfg.in_channels), encoder_hidden_states=meta(b, t_txt,
                  cfg.joint_attention_dim), pooled_projections=meta(b, cfg.pooled_projection_dim), timestep=step,
                  img_ids=meta(h * w, 3, dtype=torch.float32), txt_ids=meta(t_txt, 3, dtype=torch.float32),
                  return_dict=False)
        if cfg.guidance_embeds:
            kw["guidance"] = step
        return (), kw, h * w
    if fam == "qwen_image":
        h, w = size.height // 16, size.width // 16
        kw = dict(hidden_states=meta(b, h * w, cfg.in_channels),
                  encoder_hidden_states=meta(b, t_txt, cfg.joint_attention_dim),
                  encoder_hidden_states_mask=meta(b, t_txt, dtype=torch.long), timestep=step,
                  img_shapes=[[(1, h, w)]] * b, return_dict=False)
        return (), kw, h * w
    if fam == "hunyuan_video":
        h, w = size.height // 8, size.width // 8
        kw = dict(hidden_states=meta(b, cfg.in_channels, latent_f, h, w), timestep=step,
                  encoder_hidden_states=meta(b, t_txt, cfg.text_embed_dim),
                  encoder_attention_mask=meta(b, t_txt, dtype=torch.long),
                  pooled_projections=meta(b, cfg.pooled_projection_dim), return_dict=False)
        if cfg.guidance_embeds:
            kw["guidance"] = step
        return (), kw, latent_f * (h // 2) * (w // 2)
    if fam == "hunyuan_video_1.5":
        h, w = size.height // 16, size.width // 16
        kw = dict(hidden_states=meta(b, cfg.in_channels, latent_f, h, w), timestep=step,
                  encoder_hidden_states=meta(b, t_txt, cfg.text_embed_dim),
                  encoder_attention_mask=meta(b, t_txt, dtype=torch.long),
                  encoder_hidden_states_2=meta(b, 256, cfg.text_embed_2_dim),
                  encoder_attention_mask_2=meta(b, 256, dtype=torch.long),
                  image_embeds=meta(b, 729, cfg.image_embed_dim), return_dict=False)
        return (), kw, latent_f * h * w
    if fam == "sd3":
        h, w = size.height // 8, size.width // 8
        kw = dict(hidden_states=meta(b, cfg.in_channels, h, w), encoder_hidden_states=meta(b, 333,
                  cfg.joint_attention_dim), pooled_projections=meta(b, cfg.pooled_projection_dim), timestep=step,
                  return_dict=False)
        return (), kw, (h // 2) * (w // 2)
    raise ValueError(f"{spec.class_name}: this command does not know its inputs; use offload.predict() in Python "
                     f"with the model's own inputs (meta tensors)")


# ---------------------------------------------------------------------------------------------- the command
_SIZE = re.compile(r"^\s*([0-9.]+)\s*(gib|gb|g|mib|mb|m)?\s*$", re.I)


def parse_bytes(text: str) -> int:
    """'32GB', '32 GiB', '12g', '512MB' -> bytes (GB and GiB both mean 2**30 here, as a card's '12 GB' does)."""
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"{text!r} is not a size; write e.g. 32GB or 512MB")
    unit = (m.group(2) or "gb").lower()
    return int(float(m.group(1)) * (GIB if unit.startswith("g") else 1 << 20))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `python -m offload plan`."""
    from .cards import CARDS
    from ..config import PRESETS

    parser.add_argument("model", help="a config.json (diffusers or transformers), a folder holding one, or a ComfyUI "
                                      "diffusion model .safetensors file (only its header is read)")
    parser.add_argument("--card", default="rtx4090", help=f"the GPU: {', '.join(CARDS)} (default rtx4090)")
    parser.add_argument("--vram", default=None, help="override the card's memory, e.g. 16GB")
    parser.add_argument("--ram", default=None, help="host RAM the model may use, e.g. 32GB (default: not limited)")
    parser.add_argument("--frames", type=int, default=81, help="video frames (video models; default 81)")
    parser.add_argument("--height", type=int, default=None, help="image/video height in pixels (default 1024; "
                                                                  "video 480)")
    parser.add_argument("--width", type=int, default=None, help="width in pixels (default 1024; video 832)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per forward (language models; default 1: "
                                                                  "one decode step)")
    parser.add_argument("--text-tokens", type=int, default=TEXT_TOKENS, help="text-encoder tokens a diffusion "
                                                                              f"model sees (default {TEXT_TOKENS})")
    parser.add_argument("--batch", type=int, default=1, help="batch (2 for classifier-free guidance in one batch)")
    parser.add_argument("--steps", type=int, default=None, help="also print the time of this many sampling steps")
    parser.add_argument("--presets", default=",".join(PRESETS), help="comma-separated presets (default: all)")
    parser.add_argument("--disk", action="store_true", help="the model file may serve blocks RAM cannot hold "
                                                            "(the disk tier; presets that allow it)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace, out: Callable[[str], None] = print) -> int:
    """Build the model on the meta device, predict every preset on the card, print the table (or JSON)."""
    from dataclasses import replace

    from .cards import get_card
    from ..config import PRESETS, OffloadConfig
    from .prediction import predict_configs

    spec = load_spec(args.model)
    video = spec.family in ("wan", "hunyuan_video", "hunyuan_video_1.5")
    size = InputSize(frames=args.frames if video else 1, height=args.height or (480 if video else 1024),
                     width=args.width or (832 if video else 1024), tokens=args.tokens, text_tokens=args.text_tokens,
                     batch=args.batch)
    card = get_card(args.card)
    if args.vram:
        card = replace(card, name=f"{card.name} at {args.vram}", vram_bytes=parse_bytes(args.vram))
    presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    unknown = [p for p in presets if p not in PRESETS]
    if unknown:
        raise ValueError(f"unknown preset(s) {unknown}; valid presets: {', '.join(PRESETS)}")
    ram = parse_bytes(args.ram) if args.ram else None
    model = build_meta_model(spec)
    fargs, fkwargs, tokens = make_inputs(spec, model, size)
    configs = {p: OffloadConfig.from_preset(p, device="sim") for p in presets}
    if ram is not None:  # the same presets without the compressed host form: what compression keeps off the disk
        configs.update({f"{p}:{_RAW}": OffloadConfig.from_preset(p, device="sim", host_compression="off")
                        for p in presets})
    preds = predict_configs(model, fargs, fkwargs, configs, card, ram_bytes=ram, disk_tier=args.disk,
                            layout_bytes=(spec.block_bytes, spec.rest_bytes) if spec.block_bytes else None)
    raw = {p[:-len(_RAW) - 1]: preds.pop(p) for p in list(preds) if p.endswith(":" + _RAW)}
    if args.json:
        out(json.dumps({"model": spec.source, "family": spec.family, "class": spec.class_name, "dtype": spec.dtype,
                        "input": size.describe(spec.family), "tokens": tokens, "card": card.to_dict(),
                        "ram_bytes": ram, "presets": {p: pr.to_dict() for p, pr in preds.items()}}, indent=1))
        return 0
    weights = sum(b.bytes for b in next(iter(preds.values())).blocks)
    out(f"{spec.family} ({spec.class_name}, {spec.dtype}) from {spec.source}: {len(next(iter(preds.values())).blocks)}"
        f" blocks, {weights / GIB:.2f} GiB of blocks; input {size.describe(spec.family)} ({tokens} tokens)")
    out(f"card {card.name}: {card.vram_bytes / GIB:.0f} GiB, {card.h2d_gbps:g} GB/s host-to-device, "
        f"{card.tflops:g} TFLOP/s; host RAM {'not limited' if ram is None else f'{ram / GIB:.0f} GiB'}. "
        f"PREDICTIONS (offload.predict), not measurements.")
    out(format_table(preds, args.steps))
    for line in compression_lines(preds, raw):
        out(line)
    return 0


_RAW = "host_compression=off"


def compression_lines(preds: dict[str, Any], raw: dict[str, Any]) -> list[str]:
    """Per preset, what holding blocks compressed in RAM (host_compression, default auto) keeps out of the disk tier
    and off the RAM ceiling, against the same preset with host_compression="off"."""
    lines = []
    for name, p in preds.items():
        if not p.compressed_blocks:
            continue
        off = raw.get(name)
        kept = f"; off: {off.disk_bytes / GIB:.2f} GiB on disk" if off is not None else ""
        if off is not None and not math.isfinite(off.step_ms):
            kept = "; off: no plan fits the RAM"
        lines.append(f"{name}: {p.compressed_blocks} block(s) held compressed in RAM "
                     f"({p.compressed_bytes / GIB:.2f} GiB saved), {p.disk_bytes / GIB:.2f} GiB on disk{kept}")
    return lines


def format_table(preds: dict[str, Any], steps: int | None = None) -> str:
    """One row per preset: fits, device / host / disk GiB, step time, slowdown, what limits it."""
    head = ["preset", "fits", "VRAM GiB", "activations GiB", "host RAM GiB", "disk GiB", "ms/step", "vs resident",
            "limited by"]
    if steps:
        head.insert(8, f"{steps} steps")
    rows = []
    for name, p in preds.items():
        finite = math.isfinite(p.step_ms)
        block = p.limiting_block
        limit = (f"{p.limited_by} ({block.name})" if block is not None and finite else
                 (p.notes[0][:80] if p.notes else "-"))
        row = [name, "yes" if p.fits else "NO", f"{p.device_bytes / GIB:.2f}", f"{p.activation_bytes / GIB:.2f}",
               f"{p.host_bytes / GIB:.2f}", f"{p.disk_bytes / GIB:.2f}", f"{p.step_ms:.0f}" if finite else "-",
               f"{p.slowdown:.2f}x" if finite else "-", limit]
        if steps:
            row.insert(8, f"{p.step_ms * steps / 1e3:.0f} s" if finite else "-")
        rows.append(row)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(v.ljust(w) for v, w in zip(r, widths)) + " |" for r in rows]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """`python -m offload plan`: bad input is a message naming what to change, exit code 2."""
    try:
        return run(args)
    except ValueError as exc:
        print(f"python -m offload plan: error: {exc}", file=sys.stderr)
        return 2
