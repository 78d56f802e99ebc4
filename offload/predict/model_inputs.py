"""One forward's inputs for a model the single-model command builds on the meta device: the input size (`InputSize`)
and, per family, the keyword arguments its diffusers / transformers forward takes (`make_inputs`), as meta tensors
or seeded random ones on a device."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TEXT_TOKENS = 512  # text-encoder tokens a diffusion model is conditioned on (T5 / umT5 / Qwen2.5-VL padding)
VIDEO_FAMILIES = ("wan", "hunyuan_video", "hunyuan_video_1.5", "cogvideox", "ltx_video")


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
        video = family in VIDEO_FAMILIES
        return (f"{self.frames} frames " if video else "") + f"{self.width}x{self.height}, batch {self.batch}"


def make_inputs(spec: Any, model: Any, size: InputSize, device: Any = "meta",
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
    if fam == "cogvideox":  # (B, latent frames, C, h, w) and 226 T5 tokens
        h, w = size.height // 8, size.width // 8
        kw = dict(hidden_states=meta(b, latent_f, cfg.in_channels, h, w),
                  encoder_hidden_states=meta(b, 226, cfg.text_embed_dim), timestep=step, return_dict=False)
        pt = cfg.patch_size_t or 1
        return (), kw, -(-latent_f // pt) * (h // cfg.patch_size) * (w // cfg.patch_size)
    if fam == "ltx_video":  # packed latent tokens (32x spatial, 8x temporal VAE) and 128 T5 tokens
        f, h, w = (size.frames - 1) // 8 + 1, size.height // 32, size.width // 32
        kw = dict(hidden_states=meta(b, f * h * w, cfg.in_channels),
                  encoder_hidden_states=meta(b, 128, cfg.caption_channels), timestep=step,
                  encoder_attention_mask=meta(b, 128, dtype=torch.long), num_frames=f, height=h, width=w,
                  return_dict=False)
        return (), kw, f * h * w
    raise ValueError(f"{spec.class_name}: this command does not know its inputs; use offload.predict() in Python "
                     f"with the model's own inputs (meta tensors)")
