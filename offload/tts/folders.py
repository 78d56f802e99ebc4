"""TTS model folders on disk, read as untrusted input: the walk that finds them under models/tts/ (links followed
once each, a depth limit, so a link loop cannot stop ComfyUI from starting), config.json read as small JSON, and
the weight files checked by the engine's header validator (`store/header_check.py`) before transformers sees them.
"""
from __future__ import annotations

import logging
import os
import stat
from pathlib import Path
from typing import Callable

from ..model.fp8 import FP8_DTYPES
from ..store.header_check import CorruptFileError, read_json_file, read_json_object, safetensors_tensors

log = logging.getLogger(__name__)

AUDIO_TOKENIZER_DIR = "audio_tokenizer"
MAX_WALK_DEPTH = 8  # models/tts/<vendor>/<model>/... deeper than this is not a model folder
MAX_WALK_ENTRIES = 100_000  # directory entries looked at in one walk (a huge tree is listed in part, not forever)


class TTSModelError(ValueError):
    """A TTS model folder that cannot be loaded as it is: says what is wrong and what to do."""


def find_model_folders(base: str | os.PathLike, listed: Callable[[str], bool] = lambda p: True) -> list[str]:
    """Folders under `base` that hold a config.json (and that `listed(path)` takes), relative to `base` with '/'.
    A model folder's subfolders are part of it (its codec in audio_tokenizer/) and not walked. Links to folders are
    followed, each real folder at most once (a visited set of (device, inode)), at most `MAX_WALK_DEPTH` deep."""
    found: list[str] = []
    seen: set[tuple[int, int]] = set()
    budget = [MAX_WALK_ENTRIES]

    def walk(folder: str, depth: int) -> None:
        try:
            st = os.stat(folder)
        except OSError:
            return
        if not stat.S_ISDIR(st.st_mode) or (st.st_dev, st.st_ino) in seen:
            return
        seen.add((st.st_dev, st.st_ino))
        try:
            with os.scandir(folder) as it:
                entries = []
                for entry in it:
                    budget[0] -= 1
                    if budget[0] < 0:
                        log.warning("%s: more than %d entries under the TTS folder; the rest is not listed", base,
                                    MAX_WALK_ENTRIES)
                        break
                    entries.append(entry.name)
        except OSError:
            return
        if "config.json" in entries:
            if listed(folder):
                found.append(os.path.relpath(folder, base).replace(os.sep, "/"))
            return
        if depth >= MAX_WALK_DEPTH:
            return
        for name in sorted(entries):
            if not name.startswith("."):
                walk(os.path.join(folder, name), depth + 1)

    walk(os.fspath(base), 0)
    return sorted(set(found))


def model_type_of(folder: str | os.PathLike) -> str | None:
    """config.json's model_type, or None when the folder has no readable config (a FIFO, a huge file, not JSON)."""
    try:
        config = read_json_file(Path(folder) / "config.json", "config.json")
    except CorruptFileError:
        return None
    value = config.get("model_type") if isinstance(config, dict) else None
    return value if isinstance(value, str) else None


def read_config(path: Path) -> dict:
    """config.json of a model folder (a clear error when it is missing, half-written or not a small JSON file)."""
    config_path = path / "config.json"
    if not os.path.lexists(config_path):
        raise TTSModelError(f"{path}: no config.json; a TTS model folder is what transformers' save_pretrained writes "
                            f"(config.json, model.safetensors or shards, the tokenizer and processor files)")
    try:
        return read_json_object(config_path, "config.json")
    except CorruptFileError as e:
        raise TTSModelError(f"{e}; the file looks half-written or is not a model config") from None


def weight_files(folder: Path) -> list[Path]:
    """model.safetensors, or the shards model.safetensors.index.json names (all present, plain names)."""
    single = folder / "model.safetensors"
    if os.path.lexists(single):
        return [single]
    index = folder / "model.safetensors.index.json"
    if os.path.lexists(index):
        try:
            weight_map = read_json_object(index, "shard index").get("weight_map")
        except CorruptFileError as e:
            raise TTSModelError(f"{e}; the download looks incomplete") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TTSModelError(f"{index}: unreadable shard index (no weight_map of file names); the download looks "
                                f"incomplete")
        names = sorted(set(weight_map.values()))
        bad = [n for n in names if not n or n.startswith(".") or os.path.basename(n) != n or "\\" in n]
        if bad:
            raise TTSModelError(f"{index}: the shard name {bad[0][:200]!r} is not a plain file name in the folder")
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise TTSModelError(f"{folder}: shard(s) {missing[:3]} named in model.safetensors.index.json are missing; "
                                f"the download looks incomplete")
        return [folder / n for n in names]
    return []


def check_weights(path: Path, files: list[Path]) -> int:
    """Validate every safetensors header (regular file, size cap, dtypes, shapes, spans); the number of float8
    tensors."""
    if not files:
        raise TTSModelError(f"{path}: no model.safetensors (or model.safetensors.index.json with its shards); the "
                            f"download looks incomplete")
    fp8 = 0
    for f in files:
        try:
            tensors = safetensors_tensors(f)
        except CorruptFileError as e:
            raise TTSModelError(f"{path}: {e}; the download looks incomplete") from None
        fp8 += sum(1 for t in tensors.values() if t.dtype in FP8_DTYPES.values())
    return fp8


def check_codec_folder(path: Path, model_type: str, model: str, repo: str) -> None:
    """The codec a model needs, in `<folder>/audio_tokenizer/` (whatever id the processor config names)."""
    codec = path / AUDIO_TOKENIZER_DIR
    where = (f"{model} needs its audio codec ({repo}, a separate repository) in {codec}/: put that repository's "
             f"config.json and model.safetensors there")
    if not codec.is_dir():
        raise TTSModelError(f"{path}: no {AUDIO_TOKENIZER_DIR}/ folder. {where}")
    config = read_config(codec)
    if config.get("model_type") != model_type:
        raise TTSModelError(f"{codec}: config.json says model_type {config.get('model_type')!r}, not "
                            f"{model_type!r}. {where}")
    check_weights(codec, weight_files(codec))


def has_tokenizer_files(path: Path) -> bool:
    return any((path / n).is_file() for n in ("tokenizer.json", "vocab.json", "tokenizer.model"))
