"""CSM (Sesame's Conversational Speech Model, transformers `csm`): a Llama backbone that predicts the first Mimi
codebook of each frame, a small depth decoder for the others, and the Mimi codec, 24 kHz.

- Folder: transformers' save_pretrained of `CsmForConditionalGeneration` (the Mimi codec's weights are part of that
  checkpoint, as in `sesame/csm-1b`) with its processor files. A checkpoint without them takes a Mimi codec from
  `audio_tokenizer/` (`kyutai/mimi`).
- Streams: every backbone and depth-decoder layer, and the codec's blocks of comparable size.
- Text: one turn per `Speaker N:` line (speaker id N-1); a text without speaker lines is speaker 0's one turn. CSM
  speaks the last turn of a conversation whose earlier turns carry their audio, so a dialogue is spoken turn by turn,
  each turn with the turns before it (and the voices) as context. A voice (`voice_N`, with `voice_text` for voice 1)
  is a context turn of that speaker.
- Generation: transformers' own `generate` (temperature, top-k, top-p, for the backbone and the depth decoder); the
  backbone's KV cache is paged in the engine's KVPager when one is given. The depth decoder's cache (at most one
  frame of codebooks) stays transformers' own: its `generate` builds a fresh one for every frame.
"""
from __future__ import annotations

import contextlib
import copy
import logging
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

from .audio import finite_audio, mono
from .common import (AUDIO_TOKENIZER_DIR, FolderInfo, TTSFamily, TTSModelError, TTSRequest, TTSResult,
                     check_codec_folder, codec_dtype, codec_units, kv_bytes_per_token, layer_units, module_bytes,
                     prompt_length, require_text, sampling_overrides, speaker_lines, to_device, token_streamer,
                     weight_files)

log = logging.getLogger(__name__)

CODEC_REPO = "kyutai/mimi"
MAX_SPEAKERS = 4


class CsmFamily(TTSFamily):
    """CSM 1B."""

    name = "CSM"
    model_type = "csm"
    module = "csm"
    class_name = "CsmForConditionalGeneration"
    min_transformers = (5, 0)
    max_speakers = MAX_SPEAKERS
    default_sample_rate = 24000

    def check_extra(self, path: Path, config: dict) -> None:
        if not self._checkpoint_has_codec(path):  # sesame/csm-1b holds its Mimi codec as codec_model.*
            check_codec_folder(path, "mimi", f"{self.name} (this checkpoint holds no codec_model.* weights)",
                               CODEC_REPO)

    @staticmethod
    def _checkpoint_has_codec(path: Path) -> bool:
        from ..store.header_check import safetensors_tensors

        return any(k.startswith("codec_model.") for f in weight_files(path) for k in safetensors_tensors(f))

    def load_processor(self, transformers: Any, info: FolderInfo) -> Any:
        processor = transformers.AutoProcessor.from_pretrained(str(info.path), local_files_only=True)
        if type(processor).__name__ != "CsmProcessor":
            raise TTSModelError(f"{info.path}: the processor files load as {type(processor).__name__}, not a "
                                f"CsmProcessor; processor_config.json is missing or from another model")
        if not processor.chat_template:
            raise TTSModelError(f"{info.path}: no chat template (chat_template.jinja); copy it from the CSM release")
        return processor

    def after_load(self, model: nn.Module, processor: Any, info: FolderInfo) -> None:
        if not self._checkpoint_has_codec(info.path):
            import transformers

            from .common import offline

            with offline():
                codec = transformers.MimiModel.from_pretrained(str(info.path / AUDIO_TOKENIZER_DIR),
                                                               local_files_only=True, dtype=codec_dtype(model))
            model.codec_model = codec.eval()

    def fp8_paths(self, model: nn.Module) -> list[str]:
        return ["backbone_model.layers", "depth_decoder.model.layers"]

    def stream_units(self, model: nn.Module) -> list[str]:
        """Every backbone and depth-decoder layer, then the codec's blocks of comparable size."""
        units = layer_units(model, "backbone_model.layers") + layer_units(model, "depth_decoder.model.layers")
        target = max(module_bytes(model.get_submodule(u)) for u in units)
        return units + codec_units(model, "codec_model", target)

    def sample_rate(self, model: nn.Module, processor: Any) -> int:
        return int(model.codec_model.config.sampling_rate)

    def kv_estimate(self, model: nn.Module, processor: Any, request: TTSRequest) -> int:
        dtype_bytes = next(model.backbone_model.parameters()).element_size()
        frame_rate = float(getattr(model.codec_model.config, "frame_rate", 12.5))
        voice_frames = sum(int(v.waveform.shape[-1] / max(1, v.sample_rate) * frame_rate) + 2
                           for v in request.voices.values())
        turns = len(csm_turns(request.text))
        tokens = prompt_length(processor, request.text) + voice_frames + turns * (int(request.max_new_tokens) + 8)
        return kv_bytes_per_token(model.config, dtype_bytes) * tokens

    def context(self, model: nn.Module, request: TTSRequest) -> list[dict]:
        """The voices as context turns (text, audio) of their speakers."""
        rate = self.sample_rate(model, None)
        turns = []
        for speaker in sorted(request.voices):
            text = request.voice_text.strip() if speaker == "1" else ""
            turns.append({"role": str(int(speaker) - 1), "content": [
                {"type": "text", "text": text}, {"type": "audio", "audio": mono(request.voices[speaker], rate)}]})
        return turns

    def inputs(self, model: nn.Module, processor: Any, conversation: list[dict]) -> dict:
        """The processor's inputs for a conversation whose last turn is to be spoken."""
        inputs = dict(processor.apply_chat_template(conversation, tokenize=True, return_dict=True,
                                                    return_tensors="pt"))
        if "input_values" in inputs:
            inputs["input_values"] = inputs["input_values"].to(codec_dtype(model.codec_model))
        return inputs

    def generate_kwargs(self, request: TTSRequest) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"max_new_tokens": int(request.max_new_tokens), "output_audio": True,
                                  "return_dict_in_generate": True}
        kwargs.update(sampling_overrides(request))
        kwargs.update(sampling_overrides(request, prefix="depth_decoder_"))
        return kwargs

    def speak(self, model: nn.Module, processor: Any, request: TTSRequest, device: torch.device | str = "cpu",
              pager: Any = None, on_token: Callable[[int], None] | None = None) -> TTSResult:
        from ..generate.kv_cache import paged_generation

        turns = csm_turns(request.text)
        conversation = self.context(model, request)
        pieces: list[torch.Tensor] = []
        tokens: list[torch.Tensor] = []
        done = 0
        torch.manual_seed(int(request.seed))
        for speaker, text in turns:
            turn = {"role": str(int(speaker) - 1), "content": [{"type": "text", "text": text}]}
            inputs = to_device(self.inputs(model, processor, conversation + [turn]), device)
            streamer = token_streamer(on_token, offset=done)
            # transformers' CSM writes depth_decoder_* settings into the depth decoder's generation config for good:
            # restored, so a later request without them gets the model's defaults again
            saved = copy.deepcopy(model.depth_decoder.generation_config)
            try:
                with contextlib.ExitStack() as stack:
                    if pager is not None:
                        stack.enter_context(paged_generation(model, pager))
                    out = model.generate(**inputs, **self.generate_kwargs(request), streamer=streamer)
            finally:
                model.depth_decoder.generation_config = saved
            done = streamer.count
            wave = out.audio[0] if out.audio else None
            if wave is None or wave.numel() == 0:
                log.info("CSM: no audio for the turn %r (it ended at once)", text[:40])
                continue
            wave = wave.detach().to(torch.float32).cpu()
            pieces.append(wave.reshape(-1))
            tokens.append(out.sequences.cpu())
            turn["content"].append({"type": "audio", "audio": wave.reshape(-1).numpy()})
            conversation.append(turn)
        audio = torch.cat(pieces) if pieces else None
        return TTSResult(finite_audio(audio, self.name), self.sample_rate(model, processor), tokens)


def csm_turns(text: str) -> list[tuple[str, str]]:
    """(speaker "1".., text) per turn: `Speaker N:` lines, or the whole text as speaker 1's (id 0) turn."""
    text = require_text(text)
    lines = speaker_lines(text, MAX_SPEAKERS, "CSM")
    return lines if lines is not None else [("1", " ".join(text.split()))]


FAMILY = CsmFamily()
