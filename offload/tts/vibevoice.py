"""VibeVoice (transformers >= 5.23) for offloaded text-to-speech: loading, which blocks stream, voices, generation.

Plain PyTorch + transformers, no ComfyUI: the nodes (nodes/tts.py) and scripts use the same code.

- `check_folder()` tells a transformers-layout folder from the original Microsoft release layout and from a
  missing, half-written or truncated one, with a message saying what is wrong and what to do.
- `load()` reads a folder with the hub offline, in the dtype asked for; `fp8_e4m3fn` stores the backbone's linear
  weights as float8 with per-channel scales (`offload.fp8`), and float8 checkpoints with scale tensors load as stored.
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
import json
import logging
import math
import os
import re
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn as nn

from ..fp8 import FP8_DTYPES, adopt_fp8_checkpoint, quantize_linears
from ..storage import CorruptFileError, SafetensorsFile
from .scheduler import make_vibevoice_scheduler

log = logging.getLogger(__name__)

MIN_TRANSFORMERS = (5, 23)
SAMPLE_RATE = 24000
HOP = 3200  # samples per speech token
MAX_SPEAKERS = 4
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_SPEAKER_LINE = re.compile(r"^\s*speaker\s*(\d+)\s*[:：]\s*(.*)$", re.IGNORECASE)


class TTSModelError(ValueError):
    """A TTS model folder that cannot be loaded as it is: says what is wrong and what to do."""


def require_transformers() -> Any:
    """The transformers module, if it has native VibeVoice (>= 5.23); else a clear error naming the version."""
    try:
        import transformers
    except ImportError:
        raise TTSModelError("VibeVoice needs the transformers package (>= 5.23): pip install \"transformers>=5.23\"") \
            from None
    version = tuple(int(x) for x in re.findall(r"\d+", transformers.__version__)[:2])
    if version < MIN_TRANSFORMERS or not hasattr(transformers, "VibeVoiceForConditionalGeneration"):
        raise TTSModelError(f"VibeVoice needs transformers >= {MIN_TRANSFORMERS[0]}.{MIN_TRANSFORMERS[1]} (native "
                            f"VibeVoice support); this environment has {transformers.__version__}: "
                            f"pip install \"transformers>={MIN_TRANSFORMERS[0]}.{MIN_TRANSFORMERS[1]}\"")
    return transformers


# ----------------------------------------------------------------------------------------------------------------
# folders
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class FolderInfo:
    """What `check_folder` found: the layout, the weight files, and whether they hold float8 weights."""

    path: Path
    layout: str  # "transformers"
    weight_files: list[Path]
    fp8_keys: int


def _weight_files(folder: Path) -> list[Path]:
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise TTSModelError(f"{index}: unreadable shard index ({e}); the download looks incomplete") from None
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise TTSModelError(f"{folder}: shard(s) {missing[:3]} named in model.safetensors.index.json are missing; "
                                f"the download looks incomplete")
        return [folder / n for n in names]
    return []


def check_folder(folder: str | os.PathLike) -> FolderInfo:
    """Validate a model folder before loading anything (a clear TTSModelError otherwise)."""
    path = Path(folder)
    if not path.is_dir():
        raise TTSModelError(f"{path}: no such model folder")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise TTSModelError(f"{path}: no config.json; a VibeVoice folder holds config.json, model.safetensors (or "
                            f"shards), the tokenizer files and processor_config.json")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as e:
        raise TTSModelError(f"{config_path}: not valid JSON ({e}); the file looks half-written") from None
    if config.get("model_type") != "vibevoice":
        raise TTSModelError(f"{path}: config.json says model_type {config.get('model_type')!r}; only VibeVoice "
                            f"(model_type 'vibevoice') is supported")
    if "decoder_config" in config or "acoustic_tokenizer_config" in config:
        raise TTSModelError(
            f"{path}: this is the original Microsoft VibeVoice release layout. Convert it once to the transformers "
            f"layout with transformers' script (src/transformers/models/vibevoice/convert_vibevoice_to_hf.py in the "
            f"transformers repository), which also adds the tokenizer files that release lacks, and put the converted "
            f"folder under models/tts/")
    files = _weight_files(path)
    if not files:
        raise TTSModelError(f"{path}: no model.safetensors (or model.safetensors.index.json with its shards); the "
                            f"download looks incomplete")
    fp8 = 0
    for f in files:
        try:
            header = SafetensorsFile(f)  # validates the header against the file size (truncation)
        except CorruptFileError as e:
            raise TTSModelError(f"{path}: {e}; the download looks incomplete") from None
        try:
            fp8 += sum(1 for t in header.tensors.values() if t.dtype in FP8_DTYPES.values())
        finally:
            header.close()
    if not (path / "tokenizer.json").is_file() and not (path / "vocab.json").is_file():
        raise TTSModelError(f"{path}: no tokenizer files (tokenizer.json); copy the Qwen2.5 tokenizer files the model "
                            f"was trained with into the folder")
    return FolderInfo(path, "transformers", files, fp8)


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """Never reach for a hub while loading a local folder."""
    saved = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def load(folder: str | os.PathLike, dtype: str = "default") -> tuple[nn.Module, Any, FolderInfo]:
    """(model, processor, info) from a transformers-layout VibeVoice folder, on the CPU, eval mode.

    `dtype`: default (the checkpoint's) / bf16 / fp16 / fp32 / fp8_e4m3fn (the decoder's linear weights as float8 with
    per-channel scales, the rest in bf16). Float8 weights saved with scale tensors are kept as stored.
    """
    transformers = require_transformers()
    info = check_folder(folder)
    if dtype not in ("default", *DTYPES, *FP8_DTYPES):
        raise TTSModelError(f"unknown dtype {dtype!r}; valid: default, {', '.join(DTYPES)}, {', '.join(FP8_DTYPES)}")
    torch_dtype = DTYPES.get(dtype, torch.bfloat16 if dtype in FP8_DTYPES else "auto")
    try:
        with _offline():
            model = transformers.VibeVoiceForConditionalGeneration.from_pretrained(
                str(info.path), local_files_only=True, dtype=torch_dtype)
            processor = transformers.AutoProcessor.from_pretrained(str(info.path), local_files_only=True)
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        raise TTSModelError(f"{info.path}: could not be loaded ({type(e).__name__}: {str(e).splitlines()[0]})") from None
    if type(processor).__name__ != "VibeVoiceProcessor":
        raise TTSModelError(f"{info.path}: the processor files load as {type(processor).__name__}, not a "
                            f"VibeVoiceProcessor; processor_config.json is missing or from another model")
    model.eval()
    for p in list(model.parameters()) + list(model.buffers()):
        p.data = p.data.clone()  # off the file's memory map, and aligned (CPU kernels' results depend on alignment)
    if info.fp8_keys:
        adopted = _adopt_fp8(model, info)
        log.info("%s: %d float8 linear layer(s) kept as stored with their scales", info.path.name, adopted)
    elif dtype in FP8_DTYPES:
        n = quantize_linears(model.model.language_model.layers, FP8_DTYPES[dtype], per_channel=True)
        log.info("%s: %d decoder linear layer(s) stored as %s with per-channel scales", info.path.name, n, dtype)
    return model, processor, info


def _adopt_fp8(model: nn.Module, info: FolderInfo) -> int:
    from safetensors import safe_open

    count = 0
    for f in info.weight_files:
        state = {}
        with safe_open(str(f), framework="pt") as sf:
            for key in sf.keys():
                t = sf.get_slice(key)
                if t.get_dtype() in ("F8_E4M3", "F8_E5M2") or key.endswith(("scale", "weight_scale", "scale_weight")):
                    state[key] = sf.get_tensor(key)
        count += adopt_fp8_checkpoint(model, state)
    return count


# ----------------------------------------------------------------------------------------------------------------
# which blocks stream
# ----------------------------------------------------------------------------------------------------------------


def _bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))


def _split(module: nn.Module, path: str, target: int, minimum: int) -> list[str]:
    """Sub-blocks of `module` no larger than `target` (and at least `minimum`, else they stay resident)."""
    size = _bytes(module)
    if size < minimum:
        return []
    own = sum(t.numel() * t.element_size() for t in list(module.parameters(recurse=False)) +
              list(module.buffers(recurse=False)))
    if size <= target and not isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        return [path]
    if own > target:
        return []  # its own weights are too big for a slot and cannot be split: it stays resident
    units: list[str] = []
    for name, child in module.named_children():
        units += _split(child, f"{path}.{name}", target, minimum)
    return units


def stream_units(model: nn.Module) -> list[str]:
    """The module paths the engine streams: the decoder layers, then the diffusion head's and the speech tokenizers'
    blocks of comparable size (at least an eighth of a decoder layer; larger ones are split)."""
    inner = model.model
    layers = inner.language_model.layers
    units = [f"model.language_model.layers.{i}" for i in range(len(layers))]
    target = max(_bytes(layer) for layer in layers)
    for name in ("diffusion_head", "audio_tower", "semantic_tokenizer_encoder"):
        part = getattr(inner, name, None)
        if isinstance(part, nn.Module):
            units += _split(part, f"model.{name}", target, target // 8)
    return units


# ----------------------------------------------------------------------------------------------------------------
# voices and scripts
# ----------------------------------------------------------------------------------------------------------------


def resample(wave: torch.Tensor, orig: int, new: int, width: int = 6, rolloff: float = 0.99) -> torch.Tensor:
    """Band-limited resampling (Hann-windowed sinc, as torchaudio's default) of [..., T] float audio."""
    if orig == new:
        return wave
    g = math.gcd(int(orig), int(new))
    orig, new = int(orig) // g, int(new) // g
    base = min(orig, new) * rolloff
    radius = math.ceil(width * orig / base)
    idx = torch.arange(-radius, radius + orig, dtype=torch.float64)[None, None] / orig
    t = torch.arange(0, -new, -1, dtype=torch.float64)[:, None, None] / new + idx
    t = (t * base).clamp(-width, width)
    window = torch.cos(t * math.pi / width / 2) ** 2
    t = t * math.pi
    kernel = torch.where(t == 0, torch.tensor(1.0, dtype=torch.float64), t.sin() / t) * window * base / orig
    kernel = kernel.to(torch.float32)
    shape = wave.shape
    x = wave.reshape(-1, shape[-1]).to(torch.float32)
    length = x.shape[-1]
    x = torch.nn.functional.pad(x, (radius, radius + orig))
    y = torch.nn.functional.conv1d(x[:, None], kernel, stride=orig)
    y = y.transpose(1, 2).reshape(x.shape[0], -1)
    out_len = math.ceil(new * length / orig)
    return y[..., :out_len].reshape(*shape[:-1], out_len)


def voice_from_audio(waveform: torch.Tensor, sample_rate: int) -> Any:
    """A ComfyUI-style [B, C, T] (or [C, T] / [T]) waveform as the processor wants a voice: 1-D float32 numpy,
    mono (channels averaged), 24 kHz (resampled here: the processor takes any rate silently as 24 kHz)."""
    w = waveform.detach().to(torch.float32).cpu()
    while w.dim() > 2:
        w = w[0]
    if w.dim() == 2:
        w = w.mean(dim=0)
    if w.numel() == 0:
        raise ValueError("a voice reference holds no samples")
    return resample(w, int(sample_rate), SAMPLE_RATE).numpy()


def parse_script(text: str) -> list[tuple[str, str]]:
    """`Speaker N: ...` lines as (speaker, text), speakers 1..4; a text without speaker lines is Speaker 1's."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        raise ValueError("the text is empty: write one or more lines like 'Speaker 1: Hello there.'")
    out: list[tuple[str, str]] = []
    for ln in lines:
        m = _SPEAKER_LINE.match(ln)
        if m:
            n = int(m.group(1))
            if not 1 <= n <= MAX_SPEAKERS:
                raise ValueError(f"speaker {n} in {ln.strip()!r}: VibeVoice takes speakers 1 to {MAX_SPEAKERS}")
            if m.group(2).strip():
                out.append((str(n), m.group(2).strip()))
        elif out:
            out[-1] = (out[-1][0], out[-1][1] + " " + ln.strip())  # a continuation line
        else:
            out.append(("1", ln.strip()))
    if not out:
        raise ValueError("no speech in the text: every 'Speaker N:' line is empty")
    return out


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
    from ..kv_cache import paged_generation

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
