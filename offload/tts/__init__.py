"""Text-to-speech models streamed by the engine: one module per model family behind one small interface
(`common.TTSFamily`: what to load, which blocks stream, how to generate).

`family_for(folder)` reads a model folder's config.json and returns the family that loads it; `FAMILIES` maps each
supported transformers `model_type` to its module. Adding a model is a new module and one line here.

Layer: an application of the engine, above the entry points; imports model/ (fp8), store/ (the file reader) and
generate/ (the paged KV cache); only the ComfyUI nodes import it.
Used from outside: `family_for`, `FAMILIES`, `model_type_of`, `config_readable`, `find_model_folders`,
`common.TTSFamily`, `common.check_codec_folder`.
"""
from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

# model_type (config.json) -> module in this package
FAMILIES = {
    "vibevoice": "vibevoice",
    "higgs_audio_v2": "higgs_audio_v2",
    "dia": "dia",
    "csm": "csm",
}


def model_type_of(folder: str | os.PathLike) -> str | None:
    """config.json's model_type, or None when the folder has no readable config."""
    from .folders import model_type_of as read_model_type

    return read_model_type(folder)


def config_readable(folder: str | os.PathLike) -> bool:
    """Whether the folder's config.json is a small, regular, valid JSON file."""
    from ..store.header_check import CorruptFileError, read_json_file

    try:
        read_json_file(Path(folder) / "config.json", "config.json")
    except CorruptFileError:
        return False
    return True


def find_model_folders(base: str | os.PathLike, listed: Any = None) -> list[str]:
    """TTS model folders under `base` (a bounded walk: links followed once each, a depth limit); see folders.py."""
    from .folders import find_model_folders as walk

    return walk(base, listed) if listed is not None else walk(base)


def family(model_type: str) -> Any:
    """The TTSFamily for a model_type (KeyError for an unknown one)."""
    return importlib.import_module(f"{__name__}.{FAMILIES[model_type]}").FAMILY


def family_for(folder: str | os.PathLike) -> Any:
    """The family that loads `folder`; a clear TTSModelError for a missing, unreadable or unsupported folder."""
    from .common import TTSModelError, read_config

    path = Path(folder)
    if not path.is_dir():
        raise TTSModelError(f"{path}: no such model folder")
    model_type = read_config(path).get("model_type")
    if model_type not in FAMILIES:
        raise TTSModelError(f"{path}: config.json says model_type {model_type!r}; the TTS loader takes "
                            f"{', '.join(repr(t) for t in FAMILIES)} (VibeVoice, Higgs Audio v2, Dia, CSM)")
    return family(model_type)
