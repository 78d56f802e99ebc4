"""Higgs Audio v2 (Boson AI, transformers `higgs_audio_v2`): a Llama-3 decoder with a second (audio) FFN per layer
over 8 delayed codebooks of its own audio tokenizer, 24 kHz.

- Folder: transformers' save_pretrained of `HiggsAudioV2ForConditionalGeneration` with its tokenizer, processor files
  and chat template, and the Higgs audio tokenizer (`bosonai/higgs-audio-v2-tokenizer`, a separate repository the
  processor config names) in `audio_tokenizer/`; nothing is downloaded.
- Streams: every decoder layer (attention, text FFN and audio FFN), and the audio tokenizer's blocks of comparable
  size.
- Text: plain text, or `[SPEAKER0] ... [SPEAKER1] ...` lines; `Speaker N:` lines become those tags (one speaker:
  plain text). A voice (`voice_1`) is a zero-shot voice prompt: a user turn with its transcript (`voice_text`) and an
  assistant turn with the audio, as transformers documents.
- torchaudio: transformers' audio tokenizer module imports it for one call (resampling a voice to HuBERT's 16 kHz).
  Where torchaudio cannot be imported (no wheel for the installed torch), that module is given a stand-in whose
  `functional.resample` is the pack's band-limited sinc resampler (the same Hann-windowed sinc as torchaudio's
  default); anything else it would ask of torchaudio raises a clear error naming the package.
- Generation: transformers' own `generate` (temperature, top-k, top-p; greedy or sampled as the generation config
  says); the KV cache is paged in the engine's KVPager when one is given.
"""
from __future__ import annotations

import builtins
import contextlib
import importlib
import importlib.util
import logging
import sys
import threading
import types
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

from ..store.header_check import CorruptFileError, read_json_object
from .audio import finite_audio, mono, resample
from .common import (AUDIO_TOKENIZER_DIR, FolderInfo, TTSFamily, TTSModelError, TTSRequest, TTSResult,
                     check_codec_folder, codec_units, kv_bytes_per_token, layer_units, module_bytes, prompt_length,
                     require_text, sampling_overrides, speaker_lines, to_device, token_streamer)

log = logging.getLogger(__name__)

CODEC_REPO = "bosonai/higgs-audio-v2-tokenizer"
TOKENIZER_MODULE = "transformers.models.higgs_audio_v2_tokenizer.modeling_higgs_audio_v2_tokenizer"
SYSTEM_PROMPT = "Generate audio following instruction."
SCENE = "Audio is recorded from a quiet room."
MAX_SPEAKERS = 4
_PROCESSOR_KEYS = ("audio_token", "audio_bos_token", "audio_eos_token", "audio_delay_token", "audio_stream_bos_id",
                   "audio_stream_eos_id")
_import_lock = threading.Lock()


class HiggsAudioV2Family(TTSFamily):
    """Higgs Audio v2 generation 3B base (5.8B parameters with the audio FFNs)."""

    name = "Higgs Audio v2"
    model_type = "higgs_audio_v2"
    module = "higgs_audio_v2"
    class_name = "HiggsAudioV2ForConditionalGeneration"
    min_transformers = (5, 0)
    max_speakers = MAX_SPEAKERS
    default_sample_rate = 24000

    def check_extra(self, path: Path, config: dict) -> None:
        check_codec_folder(path, "higgs_audio_v2_tokenizer", self.name, CODEC_REPO)
        if not any((path / n).is_file() for n in ("processor_config.json", "preprocessor_config.json")):
            raise TTSModelError(f"{path}: no processor_config.json; copy the processor files of the Higgs Audio v2 "
                                f"release into the folder")

    def load_processor(self, transformers: Any, info: FolderInfo) -> Any:
        path = info.path
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        feature_extractor = transformers.DacFeatureExtractor.from_pretrained(str(path), local_files_only=True)
        codec = audio_tokenizer_class().from_pretrained(str(path / AUDIO_TOKENIZER_DIR), local_files_only=True,
                                                        dtype=torch.float32).eval()
        settings = {}
        for name in ("processor_config.json", "preprocessor_config.json"):
            if (path / name).is_file():
                try:
                    settings = read_json_object(path / name, name)
                except CorruptFileError as e:
                    raise TTSModelError(f"{e}; the file looks half-written") from None
                break
        chat_template = settings.get("chat_template")
        if (path / "chat_template.jinja").is_file():
            chat_template = (path / "chat_template.jinja").read_text()
        chat_template = chat_template or getattr(tokenizer, "chat_template", None)
        if not chat_template:
            raise TTSModelError(f"{path}: no chat template (chat_template.jinja); copy it from the Higgs Audio v2 "
                                f"release")
        kwargs = {k: settings[k] for k in _PROCESSOR_KEYS if k in settings}
        return transformers.HiggsAudioV2Processor(feature_extractor, tokenizer, codec, chat_template=chat_template,
                                                  **kwargs)

    def after_load(self, model: nn.Module, processor: Any, info: FolderInfo) -> None:
        model.add_module("audio_tokenizer", processor.audio_tokenizer)  # the engine places (and streams) it too

    def fp8_paths(self, model: nn.Module) -> list[str]:
        return ["model.layers"]

    def stream_units(self, model: nn.Module) -> list[str]:
        """Every decoder layer, then the audio tokenizer's blocks of comparable size."""
        units = layer_units(model, "model.layers")
        target = max(module_bytes(model.get_submodule(u)) for u in units)
        if isinstance(getattr(model, "audio_tokenizer", None), nn.Module):
            units += codec_units(model, "audio_tokenizer", target)
        return units

    def sample_rate(self, model: nn.Module, processor: Any) -> int:
        return int(processor.audio_tokenizer.config.sample_rate)

    def kv_estimate(self, model: nn.Module, processor: Any, request: TTSRequest) -> int:
        dtype_bytes = next(model.model.layers.parameters()).element_size()
        rate = float(getattr(processor.audio_tokenizer.config, "frame_rate", 25))
        voice_frames = sum(int(v.waveform.shape[-1] / max(1, v.sample_rate) * rate) + 16
                           for v in request.voices.values())
        tokens = prompt_length(processor, request.text + request.voice_text) + 64 + voice_frames
        return kv_bytes_per_token(model.config, dtype_bytes) * (tokens + int(request.max_new_tokens))

    def conversation(self, model: nn.Module, processor: Any, request: TTSRequest) -> list[dict]:
        """The chat: system prompt, scene, the voice prompt (transcript, audio), the text to speak."""
        conv: list[dict] = [{"role": "system", "content": [{"type": "text", "text": SYSTEM_PROMPT}]},
                            {"role": "scene", "content": [{"type": "text", "text": SCENE}]}]
        voice = request.voices.get("1")
        unused = sorted(k for k in request.voices if k != "1")
        if unused:
            log.info("Higgs Audio v2 takes one voice prompt (voice_1): voice(s) %s unused", ", ".join(unused))
        if voice is not None:
            conv.append({"role": "user", "content": [{"type": "text", "text": request.voice_text.strip() or "..."}]})
            conv.append({"role": "assistant", "content": [
                {"type": "audio", "audio": mono(voice, self.sample_rate(model, processor))}]})
        conv.append({"role": "user", "content": [{"type": "text", "text": higgs_text(request.text)}]})
        return conv

    def inputs(self, model: nn.Module, processor: Any, request: TTSRequest) -> dict:
        return dict(processor.apply_chat_template(
            self.conversation(model, processor, request), add_generation_prompt=True, tokenize=True,
            return_dict=True, return_tensors="pt"))

    def generate_kwargs(self, request: TTSRequest) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"max_new_tokens": int(request.max_new_tokens)}
        kwargs.update(sampling_overrides(request))
        return kwargs

    def decode(self, model: nn.Module, processor: Any, codes: torch.Tensor) -> torch.Tensor | None:
        """The waveform of the generated frames (None when fewer frames than the delay pattern needs came out)."""
        bos = processor.audio_stream_bos_id
        starts = (codes == bos).all(-1).nonzero()
        if not len(starts) or codes.shape[1] - int(starts[-1, -1]) <= model.config.num_codebooks:
            return None
        return processor.decode(codes)

    def speak(self, model: nn.Module, processor: Any, request: TTSRequest, device: torch.device | str = "cpu",
              pager: Any = None, on_token: Callable[[int], None] | None = None) -> TTSResult:
        from ..generate.kv_cache import paged_generation

        inputs = to_device(self.inputs(model, processor, request), device)
        with contextlib.ExitStack() as stack:
            if pager is not None:
                stack.enter_context(paged_generation(model, pager))
            torch.manual_seed(int(request.seed))
            codes = model.generate(**inputs, **self.generate_kwargs(request), streamer=token_streamer(on_token))
        wave = self.decode(model, processor, codes)
        return TTSResult(finite_audio(wave, self.name), self.sample_rate(model, processor), [codes.cpu()])


def higgs_text(text: str) -> str:
    """Plain text, or `[SPEAKERk]` lines from `Speaker N:` lines (speaker N is SPEAKER{N-1}; one speaker: plain)."""
    text = require_text(text)
    lines = speaker_lines(text, MAX_SPEAKERS, "Higgs Audio v2")
    if lines is None:
        return text
    if len({s for s, _ in lines}) == 1:
        return " ".join(t for _, t in lines)
    return "\n".join(f"[SPEAKER{int(s) - 1}] {t}" for s, t in lines)


# ----------------------------------------------------------------------------------------------------------------
# the audio tokenizer class, with or without torchaudio
# ----------------------------------------------------------------------------------------------------------------


def _torchaudio_missing(what: str) -> TTSModelError:
    return TTSModelError(f"Higgs Audio v2's audio tokenizer needs torchaudio for {what}, which this Python cannot "
                         f"import: pip install torchaudio (a build matching your torch); the other TTS models keep "
                         f"working")


def torchaudio_stand_in() -> types.ModuleType:
    """What transformers' Higgs audio tokenizer uses of torchaudio (functional.resample), from the pack's resampler;
    any other name raises a clear error naming the package."""
    functional = types.ModuleType("torchaudio.functional")

    def resample_like_torchaudio(waveform: torch.Tensor, orig_freq: int, new_freq: int, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("resampling_method", "sinc_interp_hann") != "sinc_interp_hann" or \
                set(kwargs) - {"resampling_method", "lowpass_filter_width", "rolloff"}:
            raise _torchaudio_missing(f"resample({kwargs})")
        out = resample(waveform, int(orig_freq), int(new_freq), width=int(kwargs.get("lowpass_filter_width", 6)),
                       rolloff=float(kwargs.get("rolloff", 0.99)))
        return out.to(waveform.dtype)

    functional.resample = resample_like_torchaudio  # type: ignore[attr-defined]

    def missing(name: str) -> Any:
        raise _torchaudio_missing(f"torchaudio.{name}")

    functional.__getattr__ = lambda name: missing("functional." + name)  # type: ignore[attr-defined]
    module = types.ModuleType("torchaudio")
    module.functional = functional  # type: ignore[attr-defined]
    module.__getattr__ = missing  # type: ignore[attr-defined]
    return module


def _torchaudio_importable() -> bool:
    try:
        import torchaudio  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken install is as good as none here
        return False
    return True


def audio_tokenizer_class() -> type:
    """transformers' HiggsAudioV2TokenizerModel: imported as usual where torchaudio imports, else its module is
    executed once with the stand-in as its `torchaudio` (only that module sees it; sys.modules['torchaudio'] is
    never touched, so ComfyUI and other packs still see torchaudio as missing)."""
    module = sys.modules.get(TOKENIZER_MODULE)
    if module is not None and hasattr(module, "HiggsAudioV2TokenizerModel"):
        return module.HiggsAudioV2TokenizerModel
    if _torchaudio_importable():
        return importlib.import_module(TOKENIZER_MODULE).HiggsAudioV2TokenizerModel
    with _import_lock:
        module = sys.modules.get(TOKENIZER_MODULE)
        if module is not None and hasattr(module, "HiggsAudioV2TokenizerModel"):
            return module.HiggsAudioV2TokenizerModel
        spec = importlib.util.find_spec(TOKENIZER_MODULE)
        if spec is None or spec.loader is None:
            raise TTSModelError("this transformers has no Higgs Audio v2 audio tokenizer module "
                                f"({TOKENIZER_MODULE}); pip install \"transformers>=5.24\"")
        stand_in = torchaudio_stand_in()
        real_import = builtins.__import__

        def scoped_import(name: str, globals: Any = None, locals: Any = None, fromlist: Any = (),
                          level: int = 0) -> Any:
            if level == 0 and (name == "torchaudio" or name.startswith("torchaudio.")):
                return stand_in
            return real_import(name, globals, locals, fromlist, level)

        module = importlib.util.module_from_spec(spec)
        module.__dict__["__builtins__"] = dict(builtins.__dict__, __import__=scoped_import)
        sys.modules[TOKENIZER_MODULE] = module
        try:
            spec.loader.exec_module(module)
        except Exception:
            sys.modules.pop(TOKENIZER_MODULE, None)
            raise
        cls = module.HiggsAudioV2TokenizerModel
        # transformers names the class in place of a placeholder that raises; processors check against that name
        import transformers

        for parent in (transformers, sys.modules.get(TOKENIZER_MODULE.rsplit(".", 1)[0])):
            if parent is not None:
                setattr(parent, "HiggsAudioV2TokenizerModel", cls)
        log.info("Higgs Audio v2: torchaudio is not importable; its audio tokenizer resamples voices with the pack's "
                 "own resampler")
        return cls


FAMILY = HiggsAudioV2Family()
