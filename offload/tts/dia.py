"""Dia (Nari Labs, transformers `dia`): a text encoder and an audio decoder over 9 delayed DAC codebooks, 44.1 kHz.

- Folder: transformers' save_pretrained of `DiaForConditionalGeneration` with its processor files, and Descript's
  DAC codec (`descript/dac_44khz`, a separate repository the processor config names) in `audio_tokenizer/`; nothing
  is downloaded.
- Streams: every encoder and decoder layer, and the codec's blocks of comparable size.
- Text: `[S1] ... [S2] ...` (two speakers); `Speaker 1:` / `Speaker 2:` lines are turned into those tags. A voice
  (`voice_1`) is Dia's audio prompt; its transcript (`voice_text`) goes before the text, as Dia expects.
- Generation: transformers' own `generate` (classifier-free guidance `cfg_scale`, temperature, top-k, top-p); the
  self- and cross-attention KV caches are paged in the engine's KVPager when one is given.
"""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

from .audio import finite_audio, mono
from .common import (AUDIO_TOKENIZER_DIR, FolderInfo, TTSFamily, TTSModelError, TTSRequest, TTSResult,
                     check_codec_folder, codec_units, kv_bytes_per_token, layer_units, module_bytes, require_text,
                     sampling_overrides, speaker_lines, to_device, token_streamer)

log = logging.getLogger(__name__)

CODEC_REPO = "descript/dac_44khz"


class DiaFamily(TTSFamily):
    """Dia 1.6B."""

    name = "Dia"
    model_type = "dia"
    module = "dia"
    class_name = "DiaForConditionalGeneration"
    min_transformers = (5, 0)
    max_speakers = 2
    default_sample_rate = 44100
    needs_tokenizer_files = False  # Dia's tokenizer is byte-level: tokenizer_config.json at most

    def check_extra(self, path: Path, config: dict) -> None:
        if not any((path / n).is_file() for n in ("preprocessor_config.json", "processor_config.json")):
            raise TTSModelError(f"{path}: no processor_config.json / preprocessor_config.json (Dia's feature "
                                f"extractor); copy the processor files of the Dia release into the folder")
        check_codec_folder(path, "dac", self.name, CODEC_REPO)

    def load_processor(self, transformers: Any, info: FolderInfo) -> Any:
        path = str(info.path)
        tokenizer = transformers.DiaTokenizer.from_pretrained(path, local_files_only=True) \
            if (info.path / "tokenizer_config.json").is_file() else transformers.DiaTokenizer()
        feature_extractor = transformers.DiaFeatureExtractor.from_pretrained(path, local_files_only=True)
        codec = transformers.DacModel.from_pretrained(str(info.path / AUDIO_TOKENIZER_DIR), local_files_only=True,
                                                      dtype=torch.float32).eval()
        return transformers.DiaProcessor(feature_extractor=feature_extractor, tokenizer=tokenizer,
                                         audio_tokenizer=codec)

    def after_load(self, model: nn.Module, processor: Any, info: FolderInfo) -> None:
        model.add_module("audio_tokenizer", processor.audio_tokenizer)  # the engine places (and streams) it too

    def fp8_paths(self, model: nn.Module) -> list[str]:
        return ["model.encoder.layers", "model.decoder.layers"]

    def stream_units(self, model: nn.Module) -> list[str]:
        """Every encoder and decoder layer, then the codec's blocks of comparable size."""
        units = layer_units(model, "model.encoder.layers") + layer_units(model, "model.decoder.layers")
        target = max(module_bytes(model.get_submodule(u)) for u in units)
        if isinstance(getattr(model, "audio_tokenizer", None), nn.Module):
            units += codec_units(model, "audio_tokenizer", target)
        return units

    def sample_rate(self, model: nn.Module, processor: Any) -> int:
        return int(processor.audio_tokenizer.config.sampling_rate)

    def audio_kwargs(self, model: nn.Module) -> dict[str, Any]:
        """The processor's audio settings from the model's own config (delay pattern and codebook token ids)."""
        dec = model.config.decoder_config
        return {"delay_pattern": list(model.config.delay_pattern), "bos_token_id": dec.bos_token_id,
                "pad_token_id": dec.pad_token_id, "eos_token_id": dec.eos_token_id}

    def kv_estimate(self, model: nn.Module, processor: Any, request: TTSRequest) -> int:
        dtype_bytes = next(model.model.decoder.parameters()).element_size()
        text_tokens = len(dia_text(request.text).encode("utf-8")) + len(request.voice_text.encode("utf-8")) + 1
        frames = int(request.max_new_tokens) + max(model.config.delay_pattern) + 1 + sum(
            v.waveform.shape[-1] * self.default_sample_rate // max(1, v.sample_rate) // 512 + 1
            for v in request.voices.values())
        dec = model.config.decoder_config
        self_attn = kv_bytes_per_token(dec, dtype_bytes) * frames
        cross_heads = dec.cross_num_key_value_heads
        cross = 2 * dec.num_hidden_layers * cross_heads * dec.cross_head_dim * dtype_bytes * text_tokens
        cfg = 2 if (request.cfg_scale is None or request.cfg_scale != 1.0) else 1
        return (self_attn + cross) * cfg

    def prepare(self, model: nn.Module, processor: Any, request: TTSRequest) -> tuple[dict, int | None]:
        """The processor's inputs for the request, and the audio prompt's length (None without a voice)."""
        text = dia_text(request.text)
        voice = request.voices.get("1")
        unused = sorted(k for k in request.voices if k != "1")
        if unused:
            log.info("Dia takes one audio prompt (voice_1): voice(s) %s unused", ", ".join(unused))
        audio = None
        if voice is not None:
            audio = mono(voice, self.sample_rate(model, processor))
            if request.voice_text.strip():
                text = dia_text(request.voice_text) + " " + text
            else:
                log.info("Dia: a voice without its transcript (voice_text) clones poorly; give what it says")
        kwargs = self.audio_kwargs(model)
        inputs = processor(text=[text], audio=audio, padding=True, return_tensors="pt", **kwargs)
        prompt_len = processor.get_audio_prompt_len(inputs["decoder_attention_mask"], **kwargs) if audio is not None \
            else None
        return dict(inputs), prompt_len

    def generate_kwargs(self, request: TTSRequest) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"max_new_tokens": int(request.max_new_tokens)}
        if request.cfg_scale is not None:
            kwargs["guidance_scale"] = float(request.cfg_scale)
        kwargs.update(sampling_overrides(request))
        return kwargs

    def speak(self, model: nn.Module, processor: Any, request: TTSRequest, device: torch.device | str = "cpu",
              pager: Any = None, on_token: Callable[[int], None] | None = None) -> TTSResult:
        inputs, prompt_len = self.prepare(model, processor, request)
        inputs = to_device(inputs, device)
        with contextlib.ExitStack() as stack:
            if pager is not None:
                stack.enter_context(paged_encoder_decoder_cache(model, pager))
            torch.manual_seed(int(request.seed))
            codes = model.generate(**inputs, **self.generate_kwargs(request), streamer=token_streamer(on_token))
        wave = processor.batch_decode(codes, audio_prompt_len=prompt_len, **self.audio_kwargs(model))[0]
        return TTSResult(finite_audio(wave, self.name), self.sample_rate(model, processor), [codes.cpu()])


def dia_text(text: str) -> str:
    """Dia's `[S1] ... [S2] ...` text from `Speaker 1/2:` lines; a text without any tag is speaker 1's."""
    text = require_text(text)
    lines = speaker_lines(text, 2, "Dia")
    if lines is not None:
        return " ".join(f"[S{s}] {t}" for s, t in lines)
    if "[S1]" in text or "[S2]" in text:
        return " ".join(text.split())
    return "[S1] " + " ".join(text.split())


def paged_encoder_decoder_cache(model: nn.Module, pager: Any) -> contextlib.AbstractContextManager[None]:
    """While inside, the cache `generate` makes is an EncoderDecoderCache of two caches in `pager` (self-attention
    keys and values grow a frame at a time; the cross-attention ones are written once from the encoder)."""
    from ..generate.kv_cache import paged_generation

    return paged_generation(model, pager)  # transformers' own EncoderDecoderCache, both halves paged


FAMILY = DiaFamily()
