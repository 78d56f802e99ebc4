"""VibeVoice (transformers >= 5.23) for offloaded text-to-speech: loading, which blocks stream, voices, generation.

Plain PyTorch + transformers, no ComfyUI: the nodes (nodes/tts.py) and scripts use the same code.

- `check_folder()` tells a transformers-layout folder from the original Microsoft release layout and from a
  missing, half-written or truncated one, with a message saying what is wrong and what to do.
- `load()` reads a folder with the hub offline, in the dtype asked for; `fp8_e4m3fn` stores the backbone's linear
  weights as float8 with per-channel scales (`offload.model.fp8`), and float8 checkpoints with scale tensors load as stored.
- `stream_units()` lists the blocks worth streaming: every decoder layer, and the diffusion head's and the speech
  tokenizers' blocks of comparable size; smaller parts stay resident.
- `generate()` seeds right before generating (the model draws its diffusion noise from the global RNG), passes
  the pack's DPM-Solver++ scheduler (no diffusers needed), gives both of VibeVoice's KV caches to a KVPager when one
  is given, reports every token to a callback (progress, cancel), and guides only the speech diffusion with
  `cfg_scale`, as Microsoft's release does (transformers' extra token-level CFG pass, which keeps a third KV cache
  outside any budget, is left out).
"""
from __future__ import annotations

import contextlib
import logging
import types
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn as nn

from .audio import mono, resample
from .common import (FolderInfo, TTSFamily, TTSModelError, TTSRequest, TTSResult, Voice, kv_bytes_per_token,
                     prompt_length, speaker_lines, split_blocks, module_bytes)
from .scheduler import make_vibevoice_scheduler

__all__ = ["FAMILY", "TTSModelError", "FolderInfo", "check_folder", "load", "stream_units", "generate", "parse_script",
           "build_conversation", "voice_from_audio", "resample", "require_transformers", "SAMPLE_RATE", "HOP",
           "MAX_SPEAKERS"]

log = logging.getLogger(__name__)

MIN_TRANSFORMERS = (5, 23)
SAMPLE_RATE = 24000
HOP = 3200  # samples per speech token
MAX_SPEAKERS = 4


class VibeVoiceFamily(TTSFamily):
    """VibeVoice 1.5B / 7B: a Qwen2 decoder, a diffusion head and two speech tokenizers in one checkpoint."""

    name = "VibeVoice"
    model_type = "vibevoice"
    module = "vibevoice"
    class_name = "VibeVoiceForConditionalGeneration"
    min_transformers = MIN_TRANSFORMERS
    max_speakers = MAX_SPEAKERS
    default_sample_rate = SAMPLE_RATE

    def check_layout(self, path: Path, config: dict) -> None:
        if "decoder_config" in config or "acoustic_tokenizer_config" in config:
            raise TTSModelError(
                f"{path}: this is the original Microsoft VibeVoice release layout. Convert it once to the transformers "
                f"layout with transformers' script (src/transformers/models/vibevoice/convert_vibevoice_to_hf.py in "
                f"the transformers repository), which also adds the tokenizer files that release lacks, and put the "
                f"converted folder under models/tts/")

    def check_extra(self, path: Path, config: dict) -> None:
        pass

    def load_processor(self, transformers: Any, info: FolderInfo) -> Any:
        processor = transformers.AutoProcessor.from_pretrained(str(info.path), local_files_only=True)
        if type(processor).__name__ != "VibeVoiceProcessor":
            raise TTSModelError(f"{info.path}: the processor files load as {type(processor).__name__}, not a "
                                f"VibeVoiceProcessor; processor_config.json is missing or from another model")
        return processor

    def fp8_paths(self, model: nn.Module) -> list[str]:
        return ["model.language_model.layers"]

    def stream_units(self, model: nn.Module) -> list[str]:
        """The decoder layers, then the diffusion head's and the speech tokenizers' blocks of comparable size (at
        least an eighth of a decoder layer; larger ones are split)."""
        inner = model.model
        layers = inner.language_model.layers
        units = [f"model.language_model.layers.{i}" for i in range(len(layers))]
        target = max(module_bytes(layer) for layer in layers)
        for name in ("diffusion_head", "audio_tower", "semantic_tokenizer_encoder"):
            part = getattr(inner, name, None)
            if isinstance(part, nn.Module):
                units += split_blocks(part, f"model.{name}", target, target // 8)
        return units

    def kv_estimate(self, model: nn.Module, processor: Any, request: TTSRequest) -> int:
        """Both caches (positive, and the CFG-negative one when cfg_scale != 1) over the prompt and the new tokens."""
        dtype_bytes = model.model.language_model.embed_tokens.weight.element_size()
        prompt = prompt_length(processor, request.text) + 64 + sum(
            mono(v, SAMPLE_RATE).shape[-1] // HOP + 1 for v in request.voices.values())
        cfg = request.cfg_scale if request.cfg_scale is not None else 1.3
        per_token = kv_bytes_per_token(model.config.text_config, dtype_bytes)
        return per_token * (prompt + int(request.max_new_tokens)) * (2 if cfg != 1.0 else 1)

    def speak(self, model: nn.Module, processor: Any, request: TTSRequest, device: torch.device | str = "cpu",
              pager: Any = None, on_token: Callable[[int], None] | None = None) -> TTSResult:
        voices = {k: mono(v, SAMPLE_RATE) for k, v in request.voices.items()}
        wave = generate(model, processor, request.text, voices=voices, seed=request.seed,
                        cfg_scale=1.3 if request.cfg_scale is None else request.cfg_scale,
                        diffusion_steps=10 if request.diffusion_steps is None else request.diffusion_steps,
                        max_new_tokens=request.max_new_tokens, device=device, pager=pager, on_token=on_token)
        return TTSResult(wave, SAMPLE_RATE)


FAMILY = VibeVoiceFamily()


def require_transformers() -> Any:
    """The transformers module, if it has native VibeVoice (>= 5.23); else a clear error naming the version."""
    return FAMILY.require_transformers()


def check_folder(folder: Any) -> FolderInfo:
    """Validate a model folder before loading anything (a clear TTSModelError otherwise)."""
    return FAMILY.check_folder(folder)


def load(folder: Any, dtype: str = "default") -> tuple[nn.Module, Any, FolderInfo]:
    """(model, processor, info) from a transformers-layout VibeVoice folder, on the CPU, eval mode."""
    return FAMILY.load(folder, dtype)


def stream_units(model: nn.Module) -> list[str]:
    """The module paths the engine streams (see VibeVoiceFamily.stream_units)."""
    return FAMILY.stream_units(model)


# ----------------------------------------------------------------------------------------------------------------
# voices and scripts
# ----------------------------------------------------------------------------------------------------------------


def voice_from_audio(waveform: torch.Tensor, sample_rate: int) -> Any:
    """A ComfyUI-style [B, C, T] (or [C, T] / [T]) waveform as the processor wants a voice: 1-D float32 numpy,
    mono (channels averaged), 24 kHz (resampled here: the processor takes any rate silently as 24 kHz)."""
    return mono(Voice(waveform, int(sample_rate)), SAMPLE_RATE)


def parse_script(text: str) -> list[tuple[str, str]]:
    """`Speaker N: ...` lines as (speaker, text), speakers 1..4; a text without speaker lines is Speaker 1's."""
    if not [ln for ln in text.splitlines() if ln.strip()]:
        raise ValueError("the text is empty: write one or more lines like 'Speaker 1: Hello there.'")
    lines = speaker_lines(text, MAX_SPEAKERS, "VibeVoice")
    if lines is None:
        return [("1", " ".join(ln.strip() for ln in text.splitlines() if ln.strip()))]
    return lines


def build_conversation(lines: Sequence[tuple[str, str]], voices: dict[str, Any] | None = None) -> list[dict]:
    """The processor's chat format: 0-based roles (as the original processor renumbers), a voice on each speaker's
    first turn."""
    voices = voices or {}
    seen: set[str] = set()
    conv = []
    for speaker, text in lines:
        role = str(int(speaker) - 1)
        content: list[dict] = [{"type": "text", "text": text}]
        if speaker not in seen and voices.get(speaker) is not None:
            content.append({"type": "audio", "audio": voices[speaker]})
        seen.add(speaker)
        conv.append({"role": role, "content": content})
    return conv


# ----------------------------------------------------------------------------------------------------------------
# generation
# ----------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _speech_cfg_only(model: nn.Module) -> Iterator[None]:
    """cfg_scale guides the speech diffusion only, as in Microsoft's release: transformers' generic token-level CFG
    logits processor (a third LM pass per token, with a cache of its own) is left out while generating."""
    from transformers import LogitsProcessorList
    from transformers.generation.logits_process import UnbatchedClassifierFreeGuidanceLogitsProcessor

    cls_method = type(model)._get_logits_processor

    def get_logits_processor(self: Any, *args: Any, **kwargs: Any) -> Any:
        procs = cls_method(self, *args, **kwargs)
        return LogitsProcessorList([p for p in procs if not isinstance(p, UnbatchedClassifierFreeGuidanceLogitsProcessor)])

    model._get_logits_processor = types.MethodType(get_logits_processor, model)
    try:
        yield
    finally:
        model.__dict__.pop("_get_logits_processor", None)


def _stopping(on_token: Callable[[int], None] | None) -> Any:
    from transformers import StoppingCriteria, StoppingCriteriaList

    class EveryToken(StoppingCriteria):
        """Called once per generated token: progress and cancel (the callback may raise to stop generating)."""

        def __init__(self) -> None:
            self.count = 0

        def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.BoolTensor:
            self.count += 1
            if on_token is not None:
                on_token(self.count)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    return StoppingCriteriaList([EveryToken()])


def generate(model: nn.Module, processor: Any, text: str, voices: dict[str, Any] | None = None, seed: int = 0,
             cfg_scale: float = 1.3, diffusion_steps: int = 10, max_new_tokens: int = 512,
             device: torch.device | str = "cpu", pager: Any = None,
             on_token: Callable[[int], None] | None = None) -> torch.Tensor:
    """Speak `text` (`Speaker N:` lines); returns a float32 [1, T] waveform at 24 kHz.

    `voices`: speaker ("1".."4") -> 1-D 24 kHz numpy voice reference. `pager`: an offload KVPager holding both KV
    caches under the model's budget (None: transformers' own caches). `on_token(n)` runs after every token.
    """
    from ..generate.kv_cache import paged_generation

    lines = parse_script(text)
    unknown = sorted(set(voices or {}) - {s for s, _ in lines})
    if unknown:
        log.info("voice(s) for speaker(s) %s not in the text: unused", ", ".join(unknown))
    conv = build_conversation(lines, voices)
    inputs = processor.apply_chat_template(conv, tokenize=True, return_dict=True, return_tensors="pt")
    inputs = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
    compute_dtype = next((p.dtype for p in model.model.language_model.embed_tokens.parameters()), torch.float32)
    if "input_values" in inputs:
        inputs["input_values"] = inputs["input_values"].to(compute_dtype)
    scheduler = make_vibevoice_scheduler(model.generation_config)
    with contextlib.ExitStack() as stack:
        stack.enter_context(_speech_cfg_only(model))
        if pager is not None:
            stack.enter_context(paged_generation(model, pager))
        torch.manual_seed(int(seed))  # the diffusion noise comes from the global RNG
        audio = model.generate(**inputs, max_new_tokens=int(max_new_tokens), num_diffusion_steps=int(diffusion_steps),
                               guidance_scale=float(cfg_scale), noise_scheduler=scheduler,
                               stopping_criteria=_stopping(on_token))
    wave = audio[0] if isinstance(audio, (list, tuple)) else getattr(audio, "audio", [None])[0]
    if wave is None:
        raise ValueError("the model produced no speech for this text (it ended before its first speech token); try "
                         "another seed or a longer text")
    return wave.to(torch.float32)
