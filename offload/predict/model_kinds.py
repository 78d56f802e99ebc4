"""What a model file is, from its tensor names and shapes alone (as ComfyUI's `comfy/model_detection.py` and
`comfy/sd.py` tell families apart): its role (diffusion model, text encoder, VAE, LoRA), family, repeated blocks
(the engine's transfer units) with each block's tensors and stored bytes, and the facts its costs need (hidden
size, how its latent maps to tokens, which attention each block list runs, the frame-count rule).

`describe(infos)` gives a `ModelDesc`; `header_costs.py` prices one forward of it at a latent size.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from .model_files import TensorInfo

# the prefixes a diffusion model's keys carry in ComfyUI files and checkpoints (stripped before detection)
_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "model.", "transformer.", "net.")


@dataclass(frozen=True)
class Family:
    """How a family's latent becomes tokens and which attention its block lists run.

    attention per block list: "self+cross" (self-attention over the image tokens, cross-attention to the text:
    Wan, LTX), "joint" (one attention over image + text tokens, separate image and text weights: MMDiT double
    blocks), "single" (image + text tokens through the same weights: Flux single blocks, CogVideoX), "text" (over
    the text tokens only: refiners), "image" (over the image tokens only), "unet" (a UNet level schedule)."""

    name: str
    lists: tuple[tuple[str, str], ...]  # (block list prefix, attention kind)
    spatial: int = 8  # pixels per latent pixel (the VAE's factor)
    patch: int = 2  # latent pixels per token side
    temporal: int = 0  # frames per latent frame for video (0: an image model); the frame rule is temporal*k + 1
    text_tokens: int = 512
    label: str = ""

    @property
    def video(self) -> bool:
        return self.temporal > 0

    def latent_frames(self, frames: int) -> int:
        return (max(1, frames) - 1) // self.temporal + 1 if self.video else 1

    def image_tokens(self, width: int, height: int, frames: int = 1) -> int:
        side = self.spatial * self.patch
        return self.latent_frames(frames) * math.ceil(height / side) * math.ceil(width / side)

    def frame_rule(self, frames: int) -> str | None:
        """None when `frames` fits the family's rule, else what to use instead."""
        if not self.video or frames <= 1 or (frames - 1) % self.temporal == 0:
            return None
        k = (frames - 1) // self.temporal
        return (f"{self.label or self.name} takes {self.temporal}k+1 frames; {frames} is not one of them "
                f"(use {self.temporal * k + 1} or {self.temporal * (k + 1) + 1})")


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("wan", (("blocks", "self+cross"),), 8, 2, 4, 512, "Wan 2.x"),
    Family("wan2.2_5b", (("blocks", "self+cross"),), 16, 2, 4, 512, "Wan 2.2 TI2V 5B"),
    Family("hunyuan_video", (("txt_in.individual_token_refiner.blocks", "text"), ("double_blocks", "joint"),
                             ("single_blocks", "single")), 8, 2, 4, 256, "HunyuanVideo"),
    Family("hunyuan_video_1.5", (("txt_in.individual_token_refiner.blocks", "text"), ("double_blocks", "joint")),
           16, 1, 4, 1000, "HunyuanVideo 1.5"),
    Family("flux", (("double_blocks", "joint"), ("single_blocks", "single")), 8, 2, 0, 512, "Flux.1"),
    Family("chroma", (("double_blocks", "joint"), ("single_blocks", "single")), 8, 2, 0, 512, "Chroma"),
    Family("flux2", (("double_blocks", "joint"), ("single_blocks", "single")), 16, 1, 0, 512, "Flux.2"),
    Family("qwen_image", (("transformer_blocks", "joint"),), 8, 2, 0, 256, "Qwen-Image"),
    Family("ltxv", (("transformer_blocks", "self+cross"),), 32, 1, 8, 128, "LTX-Video"),
    Family("ltxav", (("transformer_blocks", "self+cross"),), 32, 1, 8, 1024, "LTX-2"),
    Family("cogvideox", (("blocks", "single"),), 8, 2, 4, 226, "CogVideoX"),
    Family("lumina2", (("noise_refiner", "image"), ("context_refiner", "text"), ("layers", "single")), 8, 2, 0,
           256, "Lumina 2"),
    Family("z_image", (("noise_refiner", "image"), ("context_refiner", "text"), ("layers", "single")), 8, 2, 0,
           512, "Z-Image"),
    Family("sd3", (("joint_blocks", "joint"),), 8, 2, 0, 333, "SD3.x"),
    Family("unet", (("input_blocks", "unet"), ("middle_block", "unet"), ("output_blocks", "unet")), 8, 1, 0, 77,
           "SD 1.x / SDXL UNet"),
)}


@dataclass
class Block:
    name: str
    nbytes: int
    tensors: dict[str, TensorInfo]  # relative to the block
    kind: str  # its list's attention kind


@dataclass
class ModelDesc:
    """A model file as the plan sees it."""

    role: str  # diffusion | text_encoder | vae | lora | unknown
    family: str
    blocks: list[Block]
    rest: dict[str, TensorInfo]
    hidden: int = 0
    family_spec: Family | None = None
    text_tokens: int = 0  # text encoders: tokens per prompt
    vae: str = ""  # vae kind (see header_costs.VAE_KINDS)
    dtype: str = "bf16"
    notes: list[str] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.blocks) + self.rest_bytes

    @property
    def rest_bytes(self) -> int:
        return sum(t.nbytes for t in self.rest.values())

    def to_dict(self) -> dict[str, object]:
        return {"role": self.role, "family": self.family, "label": self.family_spec.label if self.family_spec else
                self.family, "blocks": len(self.blocks), "bytes": self.nbytes, "dtype": self.dtype,
                "hidden": self.hidden}


def strip_prefix(infos: dict[str, TensorInfo]) -> dict[str, TensorInfo]:
    """The diffusion model's keys without the prefix a checkpoint or ComfyUI file gives them."""
    for prefix in _PREFIXES:
        inner = {k[len(prefix):]: v for k, v in infos.items() if k.startswith(prefix)}
        if inner and any(re.match(r"(blocks|double_blocks|transformer_blocks|joint_blocks|layers|input_blocks)\.\d",
                                  k) for k in inner):
            return inner
    return infos


def _has(keys: dict[str, TensorInfo], *names: str) -> bool:
    return all(n in keys for n in names)


def diffusion_family(keys: dict[str, TensorInfo]) -> str | None:
    """The diffusion family of stripped keys, by the tensors comfy/model_detection.py keys on; None if none."""
    if "head.modulation" in keys and "patch_embedding.weight" in keys:
        return "wan2.2_5b" if keys["patch_embedding.weight"].shape[1] == 48 else "wan"
    if "txt_in.individual_token_refiner.blocks.0.norm1.weight" in keys:
        return "hunyuan_video_1.5" if "cond_type_embedding.weight" in keys else "hunyuan_video"
    if any(k.startswith("double_blocks.0.img_attn.norm.key_norm.") for k in keys):
        if "double_stream_modulation_img.lin.weight" in keys:
            return "flux2"
        if any(k.startswith("distilled_guidance_layer.") for k in keys):
            return "chroma"
        return "flux"
    if "txt_norm.weight" in keys and "transformer_blocks.0.img_mod.1.weight" in keys:
        return "qwen_image"
    if "adaln_single.emb.timestep_embedder.linear_1.bias" in keys:
        return "ltxav" if "audio_adaln_single.linear.weight" in keys else "ltxv"
    if "blocks.0.norm1.linear.weight" in keys:
        return "cogvideox"
    if "cap_embedder.1.weight" in keys and any(k.startswith("noise_refiner.0.") for k in keys):
        return "z_image" if keys["cap_embedder.1.weight"].shape[0] == 3840 else "lumina2"
    if "joint_blocks.0.x_block.attn.qkv.weight" in keys:
        return "sd3"
    if "input_blocks.0.0.weight" in keys and any(k.startswith("middle_block.") for k in keys):
        return "unet"
    return None


def _blocks(keys: dict[str, TensorInfo], lists: tuple[tuple[str, str], ...]) -> tuple[list[Block], dict]:
    found: dict[tuple[int, int], Block] = {}
    rest: dict[str, TensorInfo] = {}
    for name, info in keys.items():
        for li, (lst, kind) in enumerate(lists):
            m = re.match(re.escape(lst) + r"\.(\d+)\.(.*)$", name)
            if m is None and lst == "middle_block" and name.startswith("middle_block."):
                m = re.match(r"middle_block\.()(.*)$", name)
            if m:
                key = (li, int(m.group(1) or 0))
                block = found.setdefault(key, Block(f"{lst}.{m.group(1) or 0}".rstrip("."), 0, {}, kind))
                block.tensors[m.group(2)] = info
                block.nbytes += info.nbytes
                break
        else:
            rest[name] = info
    return [found[k] for k in sorted(found)], rest


def _generic_blocks(keys: dict[str, TensorInfo]) -> tuple[list[Block], dict[str, TensorInfo], str]:
    """The repeated list holding the most bytes (`x.layers.N.`, `encoder.block.N.`): any model's transfer units."""
    totals: dict[str, int] = {}
    for name, info in keys.items():
        m = re.match(r"(.*?(?:layers|block|blocks|layer|h))\.(\d+)\.", name)
        if m:
            totals[m.group(1)] = totals.get(m.group(1), 0) + info.nbytes
    if not totals:
        return [], dict(keys), ""
    best = max(totals, key=totals.__getitem__)
    blocks, rest = _blocks(keys, ((best, "self"),))
    return blocks, rest, best


def _hidden(blocks: list[Block], keys: dict[str, TensorInfo]) -> int:
    """The model width: the commonest input width of the blocks' matrices."""
    counts: dict[int, int] = {}
    for block in blocks[:2] or [Block("", 0, keys, "")]:
        for info in block.tensors.values():
            if len(info.shape) == 2 and not info.scale:  # a quantized layer's scales are no matrix
                counts[info.shape[1]] = counts.get(info.shape[1], 0) + 1
    return max(counts, key=counts.__getitem__) if counts else 0


_TEXT_ENCODERS = (  # (a key that tells it, family, tokens per prompt as ComfyUI's tokenizer pads / a typical prompt)
    ("encoder.block.0.layer.0.SelfAttention.q.weight", "t5", 512),
    ("text_model.encoder.layers.0.self_attn.q_proj.weight", "clip", 77),
    ("model.layers.0.self_attn.q_proj.weight", "llm", 256),
    ("layers.0.self_attn.q_proj.weight", "llm", 256),
    ("model.language_model.layers.0.self_attn.q_proj.weight", "llm", 256),
)


def vae_kind(keys: dict[str, TensorInfo]) -> str | None:
    """The VAE kind, by the keys comfy/sd.py's VAE.__init__ tells them apart with; None if not a VAE."""
    if "decoder.middle.0.residual.0.gamma" in keys:
        return "wan2.2" if "decoder.upsamples.0.upsamples.0.residual.2.weight" in keys else "wan2.1"
    if "decoder.up_blocks.0.res_blocks.0.conv1.conv.weight" in keys or any(
            k.startswith("decoder.up_blocks.") and "res_blocks" in k for k in keys):
        return "ltx"
    if "decoder.conv_in.conv.weight" in keys:
        shape = keys["decoder.conv_in.conv.weight"].shape
        if "decoder.mid_block.resnets.0.norm1.norm_layer.weight" in keys:
            return "cogvideox"
        return "hunyuan_video_1.5" if shape[1] == 32 else "hunyuan_video"
    if "decoder.conv_in.weight" in keys or "decoder.up_blocks.0.resnets.0.norm1.weight" in keys:
        return "kl"
    return None


def describe(infos: dict[str, TensorInfo], hint: str = "") -> ModelDesc:
    """What a model file is (see the module doc); `hint` is the folder it came from ("vae", "loras", ...)."""
    from .model_files import file_dtype

    dtype = file_dtype(infos)
    if hint == "loras" or any(".lora_up." in k or ".lora_A." in k or ".lora_down." in k for k in list(infos)[:200]):
        return ModelDesc("lora", "lora", [], dict(infos), dtype=dtype)
    keys = strip_prefix(infos)
    family = diffusion_family(keys)
    if family is not None:
        spec = FAMILIES[family]
        blocks, rest = _blocks(keys, spec.lists)
        return ModelDesc("diffusion", family, blocks, rest, _hidden(blocks, keys), spec, dtype=dtype)
    vkeys = {k[len("vae."):] if k.startswith("vae.") else k[len("first_stage_model."):]
             if k.startswith("first_stage_model.") else k: v for k, v in infos.items()}
    kind = vae_kind(vkeys)
    if kind is not None:
        return ModelDesc("vae", kind, [], dict(infos), vae=kind, dtype=dtype)
    for key, fam, tokens in _TEXT_ENCODERS:
        if any(k.endswith(key) for k in infos):
            blocks, rest, _ = _generic_blocks(infos)
            return ModelDesc("text_encoder", fam, blocks, rest, _hidden(blocks, infos), text_tokens=tokens,
                             dtype=dtype)
    blocks, rest, _ = _generic_blocks(infos)
    return ModelDesc("unknown", "unknown", blocks, rest, _hidden(blocks, infos), dtype=dtype,
                     notes=["not a model family the plan knows from its tensor names: costed as a generic stack of "
                            "blocks"])


def split_checkpoint(infos: dict[str, TensorInfo]) -> dict[str, dict[str, TensorInfo]]:
    """A checkpoint's parts: the diffusion model, text encoder(s) and VAE by their key prefixes (ComfyUI's
    checkpoint layout: model.diffusion_model., cond_stage_model. / conditioner. / text_encoders., first_stage_model.
    / vae.)."""
    parts: dict[str, dict[str, TensorInfo]] = {"diffusion": {}, "text_encoder": {}, "vae": {}}
    for name, info in infos.items():
        if name.startswith(("first_stage_model.", "vae.")):
            parts["vae"][name] = info
        elif name.startswith(("cond_stage_model.", "conditioner.", "text_encoders.")):
            parts["text_encoder"][name] = info
        else:
            parts["diffusion"][name] = info
    return {k: v for k, v in parts.items() if v}
