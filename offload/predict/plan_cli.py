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
import importlib.util
import json
import logging
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .model_inputs import TEXT_TOKENS, VIDEO_FAMILIES, InputSize, make_inputs  # noqa: F401 (names it offered)
from .plan_inputs import (CorruptFileError, ModelBoundsError, check_model_size, int_in,  # noqa: F401 (parse_bytes:
                          parse_bytes, read_config)  # used outside)

log = logging.getLogger(__name__)

GIB = 1 << 30
_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "model.", "transformer.")
# HunyuanVideo's block lists in the order diffusers registers them (the token refiner's blocks come first)
_HUNYUAN_LISTS = ("txt_in.individual_token_refiner.blocks", "double_blocks", "single_blocks")


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
    """The header of a .safetensors file (names, dtypes, shapes as computed with, bytes as stored, quantized
    formats), read without its data through `store.storage.SafetensorsFile` (its checks apply)."""
    from .model_files import ST_NAMES, read_safetensors_infos

    return {name: {"dtype": ST_NAMES.get(info.dtype, info.dtype), "shape": list(info.shape), "nbytes": info.nbytes,
                   "quant": info.quant}
            for name, info in read_safetensors_infos(Path(path)).items()}


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
        nbytes = align(info["nbytes"])  # as stored: a quantized weight's payload and its scales
        for li, lst in enumerate(lists):
            m = re.match(re.escape(lst) + r"\.(\d+)\.", name)
            if m:
                blocks[(li, int(m.group(1)))] = blocks.get((li, int(m.group(1))), 0) + nbytes
                break
        else:
            rest += nbytes
    return [blocks[k] for k in sorted(blocks)], rest


def _file_dtype(keys: dict[str, Any]) -> str:
    counts: dict[str, int] = {}
    for info in keys.values():
        if len(info["shape"]) == 2:
            kind = info.get("quant") or info["dtype"]  # a quantized layer counts as its format (ComfyUI's name)
            counts[kind] = counts.get(kind, 0) + math.prod(info["shape"])
    top = max(counts, key=counts.get) if counts else "BF16"
    return {"F16": "fp16", "F32": "fp32", "F8_E4M3": "fp8_e4m3fn", "F8_E5M2": "fp8_e5m2", "BF16": "bf16"}.get(top, top)


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
    config = read_config(path)  # a small regular JSON file only (CorruptFileError, a ValueError, otherwise)
    dtype = {"float16": "fp16", "float32": "fp32"}.get(str(config.get("torch_dtype") or config.get("dtype")), "bf16")
    if "_class_name" in config:
        cls = config["_class_name"]
        family = {"WanTransformer3DModel": "wan", "FluxTransformer2DModel": "flux",
                  "QwenImageTransformer2DModel": "qwen_image", "HunyuanVideoTransformer3DModel": "hunyuan_video",
                  "HunyuanVideo15Transformer3DModel": "hunyuan_video_1.5",
                  "SD3Transformer2DModel": "sd3", "CogVideoXTransformer3DModel": "cogvideox",
                  "LTXVideoTransformer3DModel": "ltx_video"}.get(cls, "diffusers")
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
    spec = spec_from_comfy_file(p) if p.suffix == ".safetensors" else spec_from_config(p)
    check_model_size(spec.config, spec.source)  # a model larger than any released one is refused before it is built
    return spec


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


# ---------------------------------------------------------------------------------------------- the command
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `python -m offload plan`."""
    from .cards import CARDS
    from ..config import PRESETS

    parser.add_argument("model", help="a ComfyUI workflow .json (API or UI; its models' headers are read from "
                                      "--models-dir), a config.json (diffusers or transformers), a folder holding "
                                      "one, or a ComfyUI diffusion model .safetensors file (only its header is read)")
    parser.add_argument("--models-dir", action="append", default=None, help="a ComfyUI models folder (workflows; "
                                                                            "repeatable; default ./models)")
    parser.add_argument("--card", default="rtx4090", help=f"the GPU: {', '.join(CARDS)} (default rtx4090)")
    parser.add_argument("--vram", default=None, help="the card's memory, e.g. 16GB (overrides the named card's)")
    parser.add_argument("--tflops", type=float, default=None, help="dense bf16 tensor TFLOP/s (fp32 accumulate) "
                                                                   "of a card not in the table")
    parser.add_argument("--mem-gbps", type=float, default=None, help="its memory bandwidth, GB/s")
    parser.add_argument("--h2d-gbps", type=float, default=None, help="its pinned host-to-device copy speed, GB/s")
    parser.add_argument("--arch", default=None, choices=["ampere", "ada", "hopper", "blackwell", "blackwell-dc"],
                        help="its architecture (sets the attention kernel's efficiency)")
    parser.add_argument("--attention", default=None, choices=["sdpa", "fa2", "fa3"],
                        help="the attention kernel (default sdpa: PyTorch's, as ComfyUI uses)")
    parser.add_argument("--ram", default=None, help="host RAM the model may use, e.g. 32GB (default: not limited)")
    parser.add_argument("--frames", type=int_in("--frames", 1, 10_001), default=81,
                        help="video frames (video models; default 81; checked against the model's rule: 4k+1 Wan / "
                             "HunyuanVideo / CogVideoX, 8k+1 LTX-Video)")
    parser.add_argument("--height", type=int_in("--height", 16, 32_768), default=None,
                        help="image/video height in pixels (default 1024; video 480)")
    parser.add_argument("--width", type=int_in("--width", 16, 32_768), default=None,
                        help="width in pixels (default 1024; video 832)")
    parser.add_argument("--tokens", type=int_in("--tokens", 1, 1 << 20), default=None,
                        help="tokens per forward (language models; default 1: one decode step)")
    parser.add_argument("--text-tokens", type=int_in("--text-tokens", 1, 1 << 16), default=TEXT_TOKENS,
                        help=f"text-encoder tokens a diffusion model sees (default {TEXT_TOKENS})")
    parser.add_argument("--batch", type=int_in("--batch", 1, 256), default=1,
                        help="samples per forward (before CFG doubles it)")
    parser.add_argument("--cfg", type=float, default=None, help="classifier-free guidance scale: other than 1, each "
                                                                "step runs cond and uncond as one batch of two")
    parser.add_argument("--steps", type=int_in("--steps", 1, 100_000), default=None,
                        help="also print the time of this many sampling steps (steps, not forwards: --cfg doubles "
                             "the batch)")
    parser.add_argument("--presets", default=",".join(PRESETS), help="comma-separated presets (default: all)")
    parser.add_argument("--disk", action="store_true", help="the model file may serve blocks RAM cannot hold "
                                                            "(the disk tier; presets that allow it)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    from .workflow_cli import add_workflow_arguments

    add_workflow_arguments(parser)


def card_from_args(args: argparse.Namespace) -> Any:
    """The card named by --card, with --vram / --tflops / --mem-gbps / --h2d-gbps / --arch / --attention applied."""
    from dataclasses import replace

    from .cards import get_card

    card = get_card(args.card)
    given = {k: v for k, v in (("tflops", getattr(args, "tflops", None)), ("mem_gbps", getattr(args, "mem_gbps", None)),
                               ("h2d_gbps", getattr(args, "h2d_gbps", None)), ("arch", getattr(args, "arch", None)),
                               ("attention", getattr(args, "attention", None))) if v is not None}
    if args.vram:
        given["vram_bytes"] = parse_bytes(args.vram)
    if given:
        label = ", ".join(f"{k}={args.vram if k == 'vram_bytes' else v}" for k, v in given.items())
        card = replace(card, name=f"{card.name} ({label})", **given)
    return card


def _quiet_build(spec: ModelSpec) -> Any:
    """build_meta_model without the libraries' warnings (diffusers' float32-modules notice, deprecations): the
    command's output is the table."""
    import importlib
    import warnings

    levels = []
    for name in ("diffusers", "transformers"):
        try:  # imported first: importing a library sets its loggers' level
            importlib.import_module(name)
        except ImportError:
            continue
        lib_log = logging.getLogger(name)
        levels.append((lib_log, lib_log.level))
        lib_log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return build_meta_model(spec)
    finally:
        for lib_log, level in levels:
            lib_log.setLevel(level)


def check_frames(family: str, frames: int) -> None:
    """A video family's frame count against its rule (4k+1 Wan / HunyuanVideo / CogVideoX, 8k+1 LTX-Video)."""
    from .model_kinds import FAMILIES

    fam = FAMILIES.get({"ltx_video": "ltxv"}.get(family, family))
    rule = fam.frame_rule(frames) if fam is not None else None
    if rule:
        raise ValueError(f"--frames {frames}: {rule}")


def run(args: argparse.Namespace, out: Callable[[str], None] = print) -> int:
    """Build the model on the meta device (or price a model file from its header), predict every preset on the card,
    print the table (or JSON)."""
    from ..config import PRESETS, OffloadConfig
    from .prediction import CONTEXT_BYTES, predict_configs, unit_sizes
    from .workflow_cli import is_workflow

    card = card_from_args(args)
    ram = parse_bytes(args.ram) if args.ram else None
    if is_workflow(args.model):
        from . import workflow_cli

        return workflow_cli.run(args, card, ram, out)
    if getattr(args, "fetch_headers", False):
        raise ValueError("--fetch-headers reads the headers of a workflow's missing models; give a workflow .json")
    presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    unknown = [p for p in presets if p not in PRESETS]
    if unknown:
        raise ValueError(f"unknown preset(s) {unknown}; valid presets: {', '.join(PRESETS)}")
    configs = {p: OffloadConfig.from_preset(p, device="sim") for p in presets}
    if ram is not None:  # the same presets without the compressed host form: what compression keeps off the disk
        configs.update({f"{p}:{_RAW}": OffloadConfig.from_preset(p, device="sim", host_compression="off")
                        for p in presets})
    guided = args.cfg is not None and abs(args.cfg - 1.0) > 1e-6
    batch = args.batch * (2 if guided else 1)
    try:
        spec = load_spec(args.model)
    except (CorruptFileError, ModelBoundsError):
        raise  # a crafted or corrupt file, a model no one released: refused, never planned another way
    except ValueError:
        if Path(args.model).suffix.lower() not in (".safetensors", ".gguf") or not Path(args.model).exists():
            raise
        spec = None  # a family the meta-device path cannot build: its header's costs instead
    lib = spec is not None and ("transformers" if spec.family == "transformers" else "diffusers")
    if lib and Path(args.model).suffix.lower() == ".safetensors" and importlib.util.find_spec(lib) is None:
        log.info("%s is not installed (ComfyUI's python): %s is priced from its header", lib, args.model)
        spec = None  # the library that builds it on the meta device is missing
    if spec is None:
        from .file_plan import predict_file

        fp = predict_file(args.model, args.width or 832, args.height or 480, args.frames, batch, card, configs,
                          ram, args.disk, args.text_tokens if args.text_tokens != TEXT_TOKENS else None)
        fam = fp.desc.family_spec
        desc_video = fam is not None and fam.video
        if desc_video:
            check_frames(fp.desc.family, args.frames)
        else:
            fp = predict_file(args.model, args.width or 1024, args.height or 1024, 1, batch, card, configs, ram,
                              args.disk, args.text_tokens if args.text_tokens != TEXT_TOKENS else None)
        preds, tokens, weights = fp.preds, fp.tokens, fp.desc.nbytes
        family, cls, dtype, source = fp.desc.family, (fam.label if fam else fp.desc.role), fp.desc.dtype, args.model
        described = (f"{args.frames} frames " if desc_video else "") + \
            f"{args.width or (832 if desc_video else 1024)}x{args.height or (480 if desc_video else 1024)}, " \
            f"batch {batch}"
    else:
        video = spec.family in VIDEO_FAMILIES
        if video:
            check_frames(spec.family, args.frames)
        size = InputSize(frames=args.frames if video else 1, height=args.height or (480 if video else 1024),
                         width=args.width or (832 if video else 1024), tokens=args.tokens,
                         text_tokens=args.text_tokens, batch=batch)
        try:  # the config is untrusted: a value of the wrong type fails inside diffusers / transformers
            model = _quiet_build(spec)
            fargs, fkwargs, tokens = make_inputs(spec, model, size)
        except Exception as exc:  # noqa: BLE001 - diffusers / transformers raise their own validation errors too
            raise ValueError(f"{spec.source}: {spec.class_name} cannot be built from this config "
                             f"({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''})") from None
        preds = predict_configs(model, fargs, fkwargs, configs, card, ram_bytes=ram, disk_tier=args.disk,
                                layout_bytes=(spec.block_bytes, spec.rest_bytes) if spec.block_bytes else None)
        if spec.block_bytes:
            weights = sum(spec.block_bytes) + (spec.rest_bytes or 0)
        else:
            from ..model.blocks import find_units

            sizes, rest = unit_sizes(model, find_units(model))
            weights = sum(sizes) + rest
        family, cls, dtype, source = spec.family, spec.class_name, spec.dtype, spec.source
        described = size.describe(spec.family)
    raw = {p[:-len(_RAW) - 1]: preds.pop(p) for p in list(preds) if p.endswith(":" + _RAW)}
    first = next(iter(preds.values()))
    need = weights + first.activation_bytes + CONTEXT_BYTES
    resident = {"fits": need <= card.vram_bytes, "needs_bytes": need, "weights_bytes": weights,
                "activation_bytes": first.activation_bytes, "context_bytes": CONTEXT_BYTES,
                "ms_per_step": first.resident_step_ms}
    if args.json:
        out(json.dumps({"model": source, "family": family, "class": cls, "dtype": dtype, "input": described,
                        "tokens": tokens, "batch": batch, "cfg": args.cfg, "card": card.to_dict(), "ram_bytes": ram,
                        "without_offloading": resident,
                        "presets": {p: pr.to_dict() for p, pr in preds.items()}}, indent=1))
        return 0
    out(f"{family} ({cls}, {dtype}) from {source}: {len(first.blocks)} blocks, {weights / GIB:.2f} GiB of weights; "
        f"input {described} ({tokens} tokens)")
    out(f"card {card.name}: {card.vram_bytes / GIB:.0f} GiB, {card.h2d_gbps:g} GB/s host-to-device, "
        f"{card.tflops:g} TFLOP/s; host RAM {'not limited' if ram is None else f'{ram / GIB:.0f} GiB'}. "
        f"PREDICTIONS (offload.predict), not measurements.")
    if guided:
        out(f"CFG {args.cfg:g}: each step runs cond and uncond as one batch of {batch} (as ComfyUI's sampler does)")
    out(f"without offloading: {'fits' if resident['fits'] else 'does NOT fit'} - needs {need / GIB:.2f} GiB "
        f"(weights {weights / GIB:.2f} + activations {first.activation_bytes / GIB:.2f} + CUDA context "
        f"{CONTEXT_BYTES / GIB:.2f}) of the card's {card.vram_bytes / GIB:.2f}; {first.resident_step_ms:.0f} ms/step"
        + ("" if resident["fits"] else "; the presets below stream what does not fit"))
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
    """One row per preset: fits, VRAM (plan + activations + CUDA context) / host / disk GiB, step time beside the
    resident one, what limits it; `steps` adds that many steps' time."""
    from .prediction import CONTEXT_BYTES

    head = ["preset", "fits", "VRAM GiB", "activations GiB", "host RAM GiB", "disk GiB", "ms/step",
            "resident ms/step", "vs resident", "limited by"]
    if steps:
        head.insert(9, f"{steps} steps")
    rows = []
    for name, p in preds.items():
        finite = math.isfinite(p.step_ms)
        block = p.limiting_block
        limit = (f"{p.limited_by} ({block.name})" if block is not None and finite else
                 (p.notes[0][:80] if p.notes else "-"))
        vram = p.device_bytes + p.activation_bytes + CONTEXT_BYTES
        row = [name, "yes" if p.fits and finite else "NO", f"{vram / GIB:.2f}", f"{p.activation_bytes / GIB:.2f}",
               f"{p.host_bytes / GIB:.2f}", f"{p.disk_bytes / GIB:.2f}", f"{p.step_ms:.0f}" if finite else "-",
               f"{p.resident_step_ms:.0f}", f"{p.slowdown:.2f}x" if finite else "-", limit]
        if steps:
            row.insert(9, f"{p.step_ms * steps / 1e3:.0f} s" if finite else "-")
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
    except (ValueError, OSError, OverflowError) as exc:  # CorruptFileError is a ValueError
        print(f"python -m offload plan: error: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
              file=sys.stderr)
        return 2
