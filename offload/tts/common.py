"""What every text-to-speech family shares: the interface a family implements, requests and results, folder checks,
offline loading, fp8, which blocks stream, speaker scripts, progress and the KV estimate (audio in and out: audio.py).

A family (one module per model: vibevoice.py, higgs_audio_v2.py, dia.py, csm.py) is a `TTSFamily` subclass that says
what to load (`model_class`, `load_processor`), which blocks stream (`stream_units`) and how to generate (`speak`).
Everything else (checking a folder, offline loading, dtypes, fp8, the KV estimate) is here, so the next model is a
new file, not a new branch in the nodes. Plain PyTorch + transformers, no ComfyUI.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn as nn

from ..model.fp8 import FP8_DTYPES, adopt_fp8_checkpoint, quantize_linears
from .folders import (AUDIO_TOKENIZER_DIR, TTSModelError, check_codec_folder, check_weights,  # noqa: F401
                      has_tokenizer_files, read_config, weight_files)

log = logging.getLogger(__name__)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_CHOICES = ("default", *DTYPES, *FP8_DTYPES)
_SPEAKER_LINE = re.compile(r"^\s*speaker\s*(\d+)\s*[:：]\s*(.*)$", re.IGNORECASE)


# ----------------------------------------------------------------------------------------------------------------
# requests and results
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class Voice:
    """A reference voice as the user gave it: a float waveform ([C, T], [T] or [B, C, T]) at `sample_rate`."""

    waveform: torch.Tensor
    sample_rate: int


@dataclass
class TTSRequest:
    """One generation: the text, the seed, optional voices, and the sampling settings (None: the model's own default
    from its generation_config.json)."""

    text: str
    seed: int = 0
    max_new_tokens: int = 512
    voices: dict[str, Voice] = field(default_factory=dict)  # speaker "1".."4" -> reference
    voice_text: str = ""  # what voice 1 says (Higgs, Dia and CSM prompt with it)
    cfg_scale: float | None = None
    diffusion_steps: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None


@dataclass
class TTSResult:
    """The speech: float32 [channels, T] at `sample_rate`, and the tokens generate() returned (for comparisons)."""

    audio: torch.Tensor
    sample_rate: int
    tokens: list[torch.Tensor] = field(default_factory=list)


# ----------------------------------------------------------------------------------------------------------------
# transformers and folders
# ----------------------------------------------------------------------------------------------------------------


def transformers_version() -> tuple[int, int]:
    import transformers

    return tuple(int(x) for x in re.findall(r"\d+", transformers.__version__)[:2])  # type: ignore[return-value]


@dataclass
class FolderInfo:
    """What `check_folder` found: the layout, the weight files, and whether they hold float8 weights."""

    path: Path
    layout: str  # "transformers"
    weight_files: list[Path]
    fp8_keys: int
    model_type: str = ""


@contextlib.contextmanager
def offline() -> Iterator[None]:
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


def torch_dtype_for(dtype: str) -> Any:
    """The from_pretrained dtype for the loader's `dtype` choice ("auto": the checkpoint's)."""
    if dtype not in DTYPE_CHOICES:
        raise TTSModelError(f"unknown dtype {dtype!r}; valid: {', '.join(DTYPE_CHOICES)}")
    return DTYPES.get(dtype, torch.bfloat16 if dtype in FP8_DTYPES else "auto")


def own_memory(module: nn.Module) -> None:
    """Parameters and buffers off the file's memory map and aligned (CPU kernels' results depend on alignment)."""
    for p in list(module.parameters()) + list(module.buffers()):
        p.data = p.data.clone()


def _file_errors() -> tuple[type[BaseException], ...]:
    """The safetensors library's own error (not an OSError or ValueError), where it is installed."""
    try:
        from safetensors import SafetensorError
    except ImportError:
        return ()
    return (SafetensorError,)


def adopt_fp8(model: nn.Module, info: FolderInfo) -> int:
    """Float8 weights saved with their scale tensors, kept as stored."""
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


def module_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))


def split_blocks(module: nn.Module, path: str, target: int, minimum: int) -> list[str]:
    """Sub-blocks of `module` no larger than `target` (and at least `minimum`, else they stay resident)."""
    size = module_bytes(module)
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
        units += split_blocks(child, f"{path}.{name}", target, minimum)
    return units


def layer_units(model: nn.Module, path: str) -> list[str]:
    """`path.0`, `path.1`, ... for the ModuleList at `path` (a decoder's layers)."""
    layers = model.get_submodule(path)
    return [f"{path}.{i}" for i in range(len(layers))]


def codec_units(model: nn.Module, path: str, target: int) -> list[str]:
    """A codec's blocks of comparable size to a decoder layer (at least an eighth of `target`), leaving resident the
    block that holds the codec's first parameter: transformers' processors move inputs to `codec.device`, which is
    that parameter's device, so it must be the compute device."""
    codec = model.get_submodule(path)
    first = next(iter(codec.parameters()), None)
    units = split_blocks(codec, path, target, max(1, target // 8))
    if first is None:
        return units
    holding = {f"{path}.{name}".rsplit(".", 1)[0] for name, p in codec.named_parameters() if p is first}
    return [u for u in units if not any(h == u or h.startswith(u + ".") for h in holding)]


# ----------------------------------------------------------------------------------------------------------------
# voices and scripts
# ----------------------------------------------------------------------------------------------------------------


def speaker_lines(text: str, max_speakers: int, model: str) -> list[tuple[str, str]] | None:
    """`Speaker N: ...` lines as (speaker, text), or None when the text has no such line (the model's own format).

    Lines without a tag continue the turn before them.
    """
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not any(_SPEAKER_LINE.match(ln) for ln in lines):
        return None
    out: list[tuple[str, str]] = []
    for ln in lines:
        m = _SPEAKER_LINE.match(ln)
        if m:
            n = int(m.group(1))
            if not 1 <= n <= max_speakers:
                raise ValueError(f"speaker {n} in {ln.strip()!r}: {model} takes speakers 1 to {max_speakers}")
            if m.group(2).strip():
                out.append((str(n), m.group(2).strip()))
        elif out:
            out[-1] = (out[-1][0], out[-1][1] + " " + ln.strip())
        else:
            out.append(("1", ln.strip()))
    if not out:
        raise ValueError("no speech in the text: every 'Speaker N:' line is empty")
    return out


def require_text(text: str) -> str:
    if not text or not text.strip():
        raise ValueError("the text is empty: write what the model should say")
    return text.strip()


# ----------------------------------------------------------------------------------------------------------------
# generation helpers
# ----------------------------------------------------------------------------------------------------------------


def token_streamer(on_token: Callable[[int], None] | None, skip_first: bool = True, offset: int = 0) -> Any:
    """A transformers streamer that calls `on_token(n)` once per generated step (progress; it may raise to cancel).

    generate() first puts the prompt, then each new token: the first put is skipped when `skip_first`.
    """
    from transformers.generation.streamers import BaseStreamer

    class StepStreamer(BaseStreamer):
        def __init__(self) -> None:
            self.puts = 0
            self.count = offset

        def put(self, value: Any) -> None:
            self.puts += 1
            if skip_first and self.puts == 1:
                return
            self.count += 1
            if on_token is not None:
                on_token(self.count)

        def end(self) -> None:
            pass

    return StepStreamer()


def sampling_overrides(request: TTSRequest, prefix: str = "") -> dict[str, Any]:
    """generate() kwargs for the settings the request sets (the rest stay the model's generation_config defaults)."""
    out: dict[str, Any] = {}
    if request.temperature is not None:
        out[prefix + "temperature"] = float(request.temperature)
    if request.top_k is not None:
        out[prefix + "top_k"] = int(request.top_k)
    if request.top_p is not None:
        out[prefix + "top_p"] = float(request.top_p)
    return out


def kv_bytes_per_token(config: Any, dtype_bytes: int) -> int:
    """Keys and values of one token over every layer of a decoder config."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * heads * head_dim * dtype_bytes


def to_device(inputs: dict, device: torch.device | str) -> dict:
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}


# ----------------------------------------------------------------------------------------------------------------
# the interface
# ----------------------------------------------------------------------------------------------------------------


class TTSFamily:
    """One model family: what to load, which blocks stream, how to generate. Subclasses set the class attributes and
    implement `load_processor`, `stream_units`, `speak` (and may extend `check_extra`, `after_load`)."""

    name = ""  # shown to users: "Dia"
    model_type = ""  # config.json's model_type
    module = ""  # transformers.models.<module>
    class_name = ""  # the transformers class generate() lives on
    min_transformers: tuple[int, int] = (5, 23)
    max_speakers = 1
    default_sample_rate = 24000

    # -- transformers ------------------------------------------------------------------------------------------
    def require_transformers(self) -> Any:
        """The transformers module, if it ships this model type; else a clear error naming the version needed."""
        need = "{}.{}".format(*self.min_transformers)
        try:
            import transformers
        except ImportError:
            raise TTSModelError(f"{self.name} needs the transformers package (>= {need}): "
                                f"pip install \"transformers>={need}\"") from None
        import importlib.util

        try:
            shipped = importlib.util.find_spec(f"transformers.models.{self.module}") is not None
        except (ImportError, ValueError):
            shipped = False
        if not shipped or transformers_version() < self.min_transformers or \
                not hasattr(transformers, self.class_name):
            raise TTSModelError(f"{self.name} (model_type '{self.model_type}') needs transformers >= {need}, which "
                                f"ships it natively; this environment has transformers {transformers.__version__}: "
                                f"pip install \"transformers>={need}\" (the other TTS models keep working)")
        return transformers

    def available(self) -> str | None:
        """None when this environment can load the family, else why not (the error text)."""
        try:
            self.require_transformers()
        except TTSModelError as e:
            return str(e)
        return None

    # -- folders -------------------------------------------------------------------------------------------------
    def check_folder(self, folder: str | os.PathLike) -> FolderInfo:
        """Validate a model folder before loading anything (a clear TTSModelError otherwise)."""
        path = Path(folder)
        if not path.is_dir():
            raise TTSModelError(f"{path}: no such model folder")
        config = read_config(path)
        if config.get("model_type") != self.model_type:
            raise TTSModelError(f"{path}: config.json says model_type {config.get('model_type')!r}, not "
                                f"{self.model_type!r} ({self.name})")
        self.check_layout(path, config)
        files = weight_files(path)
        fp8 = check_weights(path, files)
        if not has_tokenizer_files(path) and self.needs_tokenizer_files:
            raise TTSModelError(f"{path}: no tokenizer files (tokenizer.json); copy the tokenizer files of the "
                                f"{self.name} release into the folder")
        self.check_extra(path, config)
        return FolderInfo(path, "transformers", files, fp8, self.model_type)

    needs_tokenizer_files = True

    def check_layout(self, path: Path, config: dict) -> None:
        """Refuse layouts other than transformers' (with what to do)."""

    def check_extra(self, path: Path, config: dict) -> None:
        """Family-specific files (a codec in audio_tokenizer/, ...)."""

    # -- loading -------------------------------------------------------------------------------------------------
    def load(self, folder: str | os.PathLike, dtype: str = "default") -> tuple[nn.Module, Any, FolderInfo]:
        """(model, processor, info) from a transformers-layout folder, on the CPU, eval mode.

        `dtype`: default (the checkpoint's) / bf16 / fp16 / fp32 / fp8_e4m3fn (the backbone's linear weights as float8
        with per-channel scales, the rest in bf16). Float8 weights saved with scale tensors are kept as stored.
        """
        transformers = self.require_transformers()
        info = self.check_folder(folder)
        torch_dtype = torch_dtype_for(dtype)
        try:
            with offline():
                model = getattr(transformers, self.class_name).from_pretrained(
                    str(info.path), local_files_only=True, dtype=torch_dtype)
                processor = self.load_processor(transformers, info)
        except TTSModelError:
            raise
        except (OSError, ValueError, RuntimeError, KeyError, TypeError, AttributeError, *_file_errors()) as e:
            raise TTSModelError(f"{info.path}: could not be loaded ({type(e).__name__}: "
                                f"{str(e).splitlines()[0] if str(e) else ''})") from None
        model.eval()
        own_memory(model)
        if info.fp8_keys:
            try:
                adopted = adopt_fp8(model, info)
            except (OSError, *_file_errors()) as e:
                raise TTSModelError(f"{info.path}: the float8 weights could not be read ({type(e).__name__}: "
                                    f"{str(e)[:200]})") from None
            log.info("%s: %d float8 linear layer(s) kept as stored with their scales", info.path.name, adopted)
        elif dtype in FP8_DTYPES:
            n = sum(quantize_linears(model.get_submodule(p), FP8_DTYPES[dtype], per_channel=True)
                    for p in self.fp8_paths(model))
            log.info("%s: %d backbone linear layer(s) stored as %s with per-channel scales", info.path.name, n, dtype)
        self.after_load(model, processor, info)
        return model, processor, info

    def load_processor(self, transformers: Any, info: FolderInfo) -> Any:
        raise NotImplementedError

    def after_load(self, model: nn.Module, processor: Any, info: FolderInfo) -> None:
        """Join a separately loaded codec to the model (so the engine places it), and the like."""

    def fp8_paths(self, model: nn.Module) -> list[str]:
        """The module lists whose linear layers become float8 with dtype fp8_e4m3fn (the backbone's layers)."""
        return []

    # -- streaming, generation -------------------------------------------------------------------------------------
    def stream_units(self, model: nn.Module) -> list[str]:
        raise NotImplementedError

    def sample_rate(self, model: nn.Module, processor: Any) -> int:
        return self.default_sample_rate

    def kv_estimate(self, model: nn.Module, processor: Any, request: TTSRequest) -> int:
        """An upper estimate of the KV cache bytes one request needs (decides `kv_offload=auto`)."""
        return 0

    def speak(self, model: nn.Module, processor: Any, request: TTSRequest, device: torch.device | str = "cpu",
              pager: Any = None, on_token: Callable[[int], None] | None = None) -> TTSResult:
        raise NotImplementedError


def codec_dtype(codec: nn.Module) -> torch.dtype:
    return next((p.dtype for p in codec.parameters() if p.is_floating_point()), torch.float32)


def prompt_length(processor: Any, text: str) -> int:
    """Tokens of `text` under the processor's tokenizer (for the KV estimate)."""
    tok = getattr(processor, "tokenizer", processor)
    try:
        return len(tok(text)["input_ids"])
    except Exception:  # noqa: BLE001 - an estimate only
        return len(text)


def sequence_of(lines: Sequence[tuple[str, str]]) -> str:
    return " ".join(t for _, t in lines)
