"""Offload TTS Loader / Offload TTS Generate: a transformers text-to-speech model (VibeVoice, Higgs Audio v2, Dia,
CSM) from models/tts/, streamed under the pack's budget, joined to ComfyUI's memory manager, AUDIO out.

The model-side work (loading, which blocks stream, voices, generation) is one module per family in offload/tts/
behind one interface (`offload.tts.common.TTSFamily`); this module is the ComfyUI face and holds no per-model branch:
the `tts` model folder, the nodes, ComfyUI's memory manager, progress, cancel and the report.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Dict, List, Optional, Tuple

import torch

import comfy.model_management
import comfy.utils
import folder_paths
from comfy_api.latest import io

from ..offload.tts import (FAMILIES, config_readable, family as family_of_type, family_for, find_model_folders,
                           model_type_of)
from ..offload.tts.common import TTSRequest, Voice
from .apply import attach_engine
from .comfy_patcher import OffloadModelPatcher
from .common import CATEGORY, engine_device, io_type, log_once, optional_inputs, preset_input
from .registry import Managed, track_patcher
from . import status

log = logging.getLogger("layer_offload")

TTS_FOLDER = "tts"
TTS_TYPE = "TTS_MODEL"
DTYPE_CHOICES = ["default", "bf16", "fp16", "fp32", "fp8_e4m3fn"]  # the V1 choices (the loader takes fp8_e5m2 too)
MAX_VOICES = 4
KV_CHOICES = ["auto", "off", "on"]
PAGE_TOKENS = 64


def register_tts_folder() -> None:
    """Make models/tts/ a ComfyUI model folder, appending to what extra_model_paths.yaml may already list under tts."""
    default = os.path.join(folder_paths.models_dir, TTS_FOLDER)
    try:
        known = folder_paths.get_folder_paths(TTS_FOLDER)
    except (KeyError, AttributeError):
        known = None
    if known is not None and default in known:
        return
    try:
        folder_paths.add_model_folder_path(TTS_FOLDER, default)
    except (KeyError, TypeError):  # the pip-installable fork registers a new folder name with its default path
        folder_paths.add_model_folder_path(TTS_FOLDER)


def _listed(path: str) -> bool:
    """A folder the loader lists: its config.json names a supported model type, or cannot be read (so loading it
    says what is wrong); folders of other model types are left out (logged once)."""
    model_type = model_type_of(path)  # a small JSON file only (no FIFO, no 20 GB "config.json" is read)
    if model_type in FAMILIES or not config_readable(path):
        return True  # unreadable or half-written: listed, and loading it is a clear error
    log_once("tts-type-" + path, "Layer Offload: %s is a %r model folder; the TTS loader takes %s", path, model_type,
             ", ".join(FAMILIES), level=logging.INFO)
    return False


def model_folders() -> List[str]:
    """Every TTS model folder (one holding a config.json of a supported model type) under the tts folders, as paths
    relative to them."""
    names: List[str] = []
    try:
        bases = folder_paths.get_folder_paths(TTS_FOLDER)
    except (KeyError, AttributeError):
        bases = []
    for base in bases:
        if not os.path.isdir(base):
            continue
        # links followed once each, a depth limit: a link loop under models/tts cannot stop ComfyUI from starting
        names.extend(find_model_folders(base, _listed))
    return sorted(set(names))


def model_folder_path(name: str) -> str:
    """The full path of a tts model folder by its listed name (a clear error naming what exists otherwise)."""
    for base in folder_paths.get_folder_paths(TTS_FOLDER):
        path = os.path.normpath(os.path.join(base, name))
        if os.path.commonpath([os.path.abspath(base), os.path.abspath(path)]) != os.path.abspath(base):
            continue  # never leave the model folders
        if os.path.isdir(path):
            return path
    found = model_folders()
    raise ValueError("no TTS model folder {!r} under models/tts/; found: {}".format(
        name, ", ".join(found) if found else "none (put a VibeVoice, Higgs Audio v2, Dia or CSM folder, with its config.json, in models/tts/)"))


class TTSModel:
    """What the loader hands the generate node: the offload patcher over the model, its processor, its settings."""

    def __init__(self, name: str, patcher: Any, processor: Any, managed: Optional[Managed], dtype: str,
                 kv_offload: str, family: Any = None) -> None:
        self.name = name
        self.family = family if family is not None else family_of_type("vibevoice")
        self.patcher = patcher
        self.processor = processor
        self.managed = managed
        self.dtype = dtype
        self.kv_offload = kv_offload

    @property
    def model(self) -> torch.nn.Module:
        return self.patcher.model

    def __repr__(self) -> str:
        return "TTSModel({}, {}, dtype={}, kv_offload={})".format(self.name, self.family.name, self.dtype,
                                                               self.kv_offload)


def _kv_pager(tts: TTSModel, request: TTSRequest) -> Any:
    """The model's KV pager (None with kv_offload off or no offloading); `auto` offloads only when the caches would
    not fit the model's free share of the budget (the family estimates their size)."""
    st = tts.managed
    if st is None or tts.kv_offload == "off":
        return None
    handle = st.handle
    if tts.kv_offload == "on":
        return handle.kv_pager(PAGE_TOKENS, offload=True)
    estimate = tts.family.kv_estimate(tts.model, tts.processor, request)
    budget = handle.budget
    free = int(budget.total_bytes or 0) - handle.planned_device_bytes()
    offload = estimate > free
    if offload:
        log.info("Layer Offload: %s: the KV caches could reach %.1f MB, more than the %.1f MB left of the budget; "
                 "pages beyond it live in host memory", tts.name, estimate / 2 ** 20, max(0, free) / 2 ** 20)
    return handle.kv_pager(PAGE_TOKENS, offload=offload)


class OffloadTTSLoader(io.ComfyNode):
    """Load a transformers TTS model (VibeVoice, Higgs Audio v2, Dia, CSM) from models/tts/ and stream its blocks under
    the pack's budget."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="OffloadTTSLoader", display_name="Offload TTS Loader", category=CATEGORY,
            description=("Load a text-to-speech model (VibeVoice, Higgs Audio v2, Dia or CSM) from models/tts/ (local "
                         "files only) and stream its blocks under the pack's VRAM budget, with optional fp8 weights "
                         "and a paged KV cache."),
            inputs=[io.Combo.Input("model_name", options=model_folders(), tooltip=(
                        "A model folder (holding config.json) under models/tts/, as transformers' save_pretrained "
                        "writes it: VibeVoice, Higgs Audio v2, Dia or CSM. Dia's DAC codec and Higgs' audio "
                        "tokenizer go in its audio_tokenizer/ subfolder.")),
                    preset_input(), *optional_inputs(),
                    io.Combo.Input("dtype", options=list(DTYPE_CHOICES), default="default", optional=True, tooltip=(
                        "Weight dtype: the checkpoint's (default), bf16, fp16, fp32, or fp8_e4m3fn (the backbone's "
                        "linear weights stored and streamed as float8 with per-channel scales: half the bytes).")),
                    io.Combo.Input("kv_offload", options=list(KV_CHOICES), default="auto", optional=True, tooltip=(
                        "Paged KV cache: auto keeps pages beyond the model's share of the VRAM budget in host memory "
                        "when long speech would not fit; on always pages and offloads; off uses transformers' own "
                        "cache (outside the budget)."))],
            outputs=[io_type(TTS_TYPE).Output(display_name="tts_model", tooltip=(
                "The TTS model; its decoder layers (and large blocks) stream from host RAM."))])

    @classmethod
    def execute(cls, model_name: str, preset: str, budget: Any = None, priority: int = 0, dtype: str = "default",
                kv_offload: str = "auto") -> io.NodeOutput:
        return io.NodeOutput(*cls.load(model_name, preset, budget, priority, dtype, kv_offload))

    @classmethod
    def load(cls, model_name: str, preset: str, budget: Any = None, priority: int = 0, dtype: str = "default",
             kv_offload: str = "auto") -> Tuple[TTSModel]:
        if kv_offload not in KV_CHOICES:
            raise ValueError("kv_offload must be one of {}, got {!r}".format(", ".join(KV_CHOICES), kv_offload))
        path = model_folder_path(model_name)
        family = family_for(path)  # TTSModelError (a ValueError) says what is wrong
        model, processor, _ = family.load(path, dtype)
        mm = comfy.model_management
        patcher = OffloadModelPatcher(model, load_device=mm.get_torch_device(), offload_device=mm.unet_offload_device())
        managed = None
        if engine_device() is not None:
            managed = attach_engine(model, preset, budget, priority, "tts:" + model_name, kind="tts",
                                    units=family.stream_units(model))
            if managed is not None:
                track_patcher(patcher, managed)
        return (TTSModel(model_name, patcher, processor, managed, dtype, kv_offload, family),)


def _setting(value: Any, kind: type) -> Any:
    """An optional sampling widget: 0 (or nothing) keeps the model's own default."""
    if value is None:
        return None
    value = kind(value)
    return None if value == 0 else value


class OffloadTTSGenerate(io.ComfyNode):
    """Text and optional voice references in, AUDIO out (at the model's sampling rate)."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        voices = [io.Audio.Input("voice_{}".format(i), optional=True, tooltip=(
                      "Speaker {}'s voice reference (any sample rate and channels: resampled to the model's rate, "
                      "mono). Higgs Audio v2 and Dia take voice_1 only (a voice prompt); CSM and VibeVoice one per "
                      "speaker.".format(i)))
                  for i in range(1, MAX_VOICES + 1)]
        return io.Schema(
            node_id="OffloadTTSGenerate", display_name="Offload TTS Generate", category=CATEGORY,
            description=("Speak a text with an offloaded TTS model; voice references clone the speakers' voices. "
                         "'Speaker N:' lines work for every model (Dia: [S1]/[S2], Higgs: [SPEAKERk] also)."),
            inputs=[io_type(TTS_TYPE).Input("tts_model", tooltip="From Offload TTS Loader."),
                    io.String.Input("text", multiline=True,
                                    default="Speaker 1: Hello, and welcome.\nSpeaker 2: Thanks!",
                                    tooltip=("One line per turn: 'Speaker N: text' (VibeVoice and CSM: N from 1 to 4, "
                                             "Dia 1 to 2), or the model's own format (Dia: [S1] ... [S2] ...; Higgs: "
                                             "plain text or [SPEAKER0] ... lines).")),
                    io.Int.Input("seed", default=0, min=0, max=0xffffffffffffffff,
                                 tooltip="The same seed gives the same audio."),
                    io.Float.Input("cfg_scale", default=1.3, min=1.0, max=10.0, step=0.05,
                                   tooltip=("Classifier-free guidance: VibeVoice's speech diffusion, Dia's tokens "
                                            "(Dia's own default is 3.0); Higgs and CSM do not use it.")),
                    io.Int.Input("diffusion_steps", default=10, min=1, max=100,
                                 tooltip="VibeVoice: diffusion steps per speech token (7.5 tokens a second)."),
                    io.Int.Input("max_new_tokens", default=1024, min=1, max=65536,
                                 tooltip=("Upper bound on generated tokens: audio frames (VibeVoice 7.5, Higgs 25, Dia "
                                          "86, CSM 12.5 a second; CSM: per turn).")),
                    *voices,
                    io.String.Input("voice_text", default="", multiline=True, optional=True, tooltip=(
                        "What voice_1 says (its transcript): Higgs Audio v2, Dia and CSM prompt with it; empty "
                        "without a transcript (cloning is weaker).")),
                    io.Float.Input("temperature", default=0.0, min=0.0, max=5.0, step=0.05, optional=True, tooltip=(
                        "Sampling temperature (Higgs, Dia, CSM); 0 keeps the model's own default.")),
                    io.Int.Input("top_k", default=0, min=0, max=100000, optional=True, tooltip=(
                        "Top-k sampling (Higgs, Dia, CSM); 0 keeps the model's own default.")),
                    io.Float.Input("top_p", default=0.0, min=0.0, max=1.0, step=0.01, optional=True, tooltip=(
                        "Top-p sampling (Higgs, Dia, CSM); 0 keeps the model's own default."))],
            outputs=[io.Audio.Output(tooltip="The speech at the model's sampling rate: {waveform [1, C, T], "
                                             "sample_rate}.")])

    @classmethod
    def execute(cls, tts_model: Any, text: str, seed: int, cfg_scale: float, diffusion_steps: int,
                max_new_tokens: int, **optional: Any) -> io.NodeOutput:
        return io.NodeOutput(*cls.generate(tts_model, text, seed, cfg_scale, diffusion_steps, max_new_tokens,
                                           **optional))

    @classmethod
    def generate(cls, tts_model: TTSModel, text: str, seed: int, cfg_scale: float, diffusion_steps: int,
                 max_new_tokens: int, voice_text: str = "", temperature: Optional[float] = None,
                 top_k: Optional[int] = None, top_p: Optional[float] = None,
                 **voice_inputs: Any) -> Tuple[Dict[str, Any]]:
        if not isinstance(tts_model, TTSModel):
            raise ValueError("tts_model must come from Offload TTS Loader, got {}".format(type(tts_model).__name__))
        voices = {}
        for key, audio in voice_inputs.items():
            if not key.startswith("voice_"):
                raise ValueError("unknown input {!r}".format(key))
            if audio is None:
                continue
            if not isinstance(audio, dict) or "waveform" not in audio or "sample_rate" not in audio:
                raise ValueError("{} must be AUDIO ({{'waveform', 'sample_rate'}}), got {}".format(key, type(audio)))
            if not isinstance(audio["waveform"], torch.Tensor) or audio["waveform"].numel() == 0:
                raise ValueError("{} holds no samples".format(key))
            voices[key[len("voice_"):]] = Voice(audio["waveform"], int(audio["sample_rate"]))
        request = TTSRequest(text=text, seed=int(seed), max_new_tokens=int(max_new_tokens), voices=voices,
                             voice_text=voice_text or "", cfg_scale=float(cfg_scale),
                             diffusion_steps=int(diffusion_steps), temperature=_setting(temperature, float),
                             top_k=_setting(top_k, int), top_p=_setting(top_p, float))
        mm = comfy.model_management
        mm.load_models_gpu([tts_model.patcher])
        device = torch.device("cpu") if engine_device() in (None, "sim") else tts_model.patcher.load_device
        pager = _kv_pager(tts_model, request)
        pbar = comfy.utils.ProgressBar(int(max_new_tokens))

        def on_token(n: int) -> None:
            mm.throw_exception_if_processing_interrupted()  # ComfyUI's cancel stops generation within a token
            pbar.update_absolute(min(n, int(max_new_tokens)), int(max_new_tokens))

        try:
            with torch.inference_mode():
                result = tts_model.family.speak(tts_model.model, tts_model.processor, request, device=device,
                                                pager=pager, on_token=on_token)
        finally:
            status.publish()
        wave = result.audio
        if not torch.isfinite(wave).all():
            raise ValueError("{} produced non-finite audio (NaN or inf); try another dtype (fp32) or seed".format(
                tts_model.family.name))
        return ({"waveform": wave.reshape(1, wave.shape[0], -1).cpu(), "sample_rate": int(result.sample_rate)},)
