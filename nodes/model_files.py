"""The file behind a model another node loaded, so Offload Model / CLIP / Any get the disk tier too.

A model from ComfyUI's own loaders (Load Diffusion Model, Load Checkpoint, Load CLIP, DualCLIPLoader, ...) or another
pack's carries no path; without one the engine has no disk tier for it and cannot give RAM back. The pack learns it
three ways, tried in order:

- **Recorded at load** (feature-detected wrappers, installed once): `comfy.utils.load_torch_file` notes which file
  each tensor it hands out came from, and comfy.sd's state-dict loaders, through which ComfyUI's loaders and most
  packs' build their models (`load_diffusion_model_state_dict`, `load_state_dict_guess_config`,
  `load_text_encoder_state_dicts`), put the files of the tensors they were given on the module they return (the
  patcher's model; a CLIP's `cond_stage_model`).
- **Mapped**: weights that still view the file they were read from (GGUF loaders keep their tensors memory-mapped
  from the .gguf file) name it in the process's memory map (`/proc/self/maps`, Linux).
- **Matched** where nothing was recorded (a pack that reads files its own way, a model loaded before the pack): the
  safetensors files `load_torch_file` read lately, then those in ComfyUI's model folders for the kind of model, by
  header (the model's block tensors found by name and shape, names compared without leading parts the file lacks)
  and then by bytes (two tensors read from the file and compared, an exact dtype cast allowed).

The engine checks each block against the file again before it streams one from it (a block the file does not hold
as the model holds it stays in RAM). A model whose blocks come from several files (a CLIP of CLIP-L + T5) takes the
file holding most of its bytes; where no file is found the report says why (`FileFound.reason`).
"""
from __future__ import annotations

import bisect
import collections
import functools
import logging
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch

from .common import log_once

log = logging.getLogger("layer_offload")

FILES_ATTR = "_layer_offload_files"  # on a model module: the files its loader read, most bytes first
WRAPPED_ATTR = "_layer_offload_records"
SAFETENSORS = (".safetensors", ".sft")
STREAMABLE = SAFETENSORS + (".gguf",)  # the files the engine's disk tier reads (and packed folders)
FOLDERS = {"model": ("diffusion_models", "unet", "checkpoints"),
           "clip": ("text_encoders", "clip", "checkpoints")}
FOLDERS_ANY = ("diffusion_models", "unet", "checkpoints", "text_encoders", "clip", "tts")
RECENT = 32  # files load_torch_file read lately, tried first by the matcher

_lock = threading.RLock()  # re-entrant: a tensor freed while the tables are read runs _forget in the same thread
_tensor_files: Dict[int, Tuple[Any, str]] = {}  # id(tensor) -> (weakref to it, the file it came from)
_recent: "collections.OrderedDict[str, None]" = collections.OrderedDict()
Header = Dict[str, Tuple[Tuple[int, ...], str]]  # key -> (shape, dtype name)
_headers: Dict[Tuple[str, int, int], Optional[Tuple[Header, Dict[str, Optional[str]]]]] = {}


@dataclass
class FileFound:
    """The file Offload Model / CLIP / Any give the engine (`disk_path`), or None and why."""

    path: Optional[str]
    reason: str = ""  # why there is no file, or which blocks the file leaves out; "" when it holds them all
    how: str = ""  # "recorded", "mapped" or "matched"


# recording -------------------------------------------------------------------------------------------------------
def _forget(key: int, ref: Any) -> None:
    with _lock:
        if _tensor_files.get(key, (None,))[0] is ref:
            del _tensor_files[key]


def _record(path: Any, loaded: Any) -> None:
    """Note the file of every tensor of a state dict load_torch_file returned."""
    if not isinstance(path, (str, os.PathLike)):
        return
    sd = loaded[0] if isinstance(loaded, tuple) and loaded else loaded
    if not isinstance(sd, dict):
        return
    path = os.path.abspath(os.fspath(path))
    with _lock:
        if path.lower().endswith(SAFETENSORS):
            _recent.pop(path, None)
            _recent[path] = None
            while len(_recent) > RECENT:
                _recent.popitem(last=False)
        for t in sd.values():
            if isinstance(t, torch.Tensor):
                try:
                    ref = weakref.ref(t, functools.partial(_forget, id(t)))
                except TypeError:
                    continue
                _tensor_files[id(t)] = (ref, path)


def files_of_tensors(tensors: Iterable[Any]) -> List[str]:
    """The files recorded for these tensors, most bytes first."""
    nbytes: Dict[str, int] = collections.Counter()
    with _lock:
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            entry = _tensor_files.get(id(t))
            if entry is not None and entry[0]() is t:
                nbytes[entry[1]] += t.nelement() * t.element_size()
    return [p for p, _ in sorted(nbytes.items(), key=lambda kv: -kv[1])]


def tag(module: Any, files: List[str]) -> None:
    """Put the files a loader read on the module it built (kept by clones and private copies: same __dict__ values)."""
    if isinstance(module, torch.nn.Module) and files:
        module.__dict__[FILES_ATTR] = tuple(files)


def _tensors_of(state_dicts: Any) -> List[Any]:
    out: List[Any] = []
    for sd in state_dicts if isinstance(state_dicts, (list, tuple)) else [state_dicts]:
        if isinstance(sd, dict):
            out.extend(sd.values())
    return out


def _tag_result(result: Any, files: List[str]) -> None:
    """Tag what a comfy.sd loader returned: a patcher (its model), a CLIP (its cond_stage_model), or a tuple of them."""
    for item in result if isinstance(result, (list, tuple)) else [result]:
        if item is None:
            continue
        clip_model = getattr(item, "cond_stage_model", None)
        if isinstance(clip_model, torch.nn.Module):
            tag(clip_model, files)
        elif isinstance(getattr(item, "model", None), torch.nn.Module):
            tag(item.model, files)


def _wrap_loader(fn: Callable[..., Any], arg: str) -> Callable[..., Any]:
    """A comfy.sd state-dict loader that tags the model it builds with the files of the tensors it was given."""

    @functools.wraps(fn)
    def load_and_tag(*args: Any, **kwargs: Any) -> Any:
        given = args[0] if args else kwargs.get(arg)
        files = files_of_tensors(_tensors_of(given)) if given is not None else []
        out = fn(*args, **kwargs)
        if files:
            try:
                _tag_result(out, files)
            except Exception as e:  # noqa: BLE001 - a loader's result must reach the user whatever the pack makes of it
                log.debug("Layer Offload: could not note the file of a loaded model: %s", e)
        return out

    setattr(load_and_tag, WRAPPED_ATTR, fn)
    return load_and_tag


def _wrap_reader(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def load_torch_file_and_record(ckpt: Any, *args: Any, **kwargs: Any) -> Any:
        out = fn(ckpt, *args, **kwargs)
        try:
            _record(ckpt, out)
        except Exception as e:  # noqa: BLE001 - never fail ComfyUI's load
            log.debug("Layer Offload: could not note the file %s: %s", ckpt, e)
        return out

    setattr(load_torch_file_and_record, WRAPPED_ATTR, fn)
    return load_torch_file_and_record


LOADERS = (("load_diffusion_model_state_dict", "sd"), ("load_state_dict_guess_config", "sd"),
           ("load_text_encoder_state_dicts", "state_dicts"))


def install() -> None:
    """Record the files ComfyUI's loaders read (idempotent; each missing name: one INFO line, matching still works)."""
    import comfy.sd
    import comfy.utils

    reader = getattr(comfy.utils, "load_torch_file", None)
    if callable(reader):
        if not hasattr(reader, WRAPPED_ATTR):
            comfy.utils.load_torch_file = _wrap_reader(reader)
    else:
        log_once("no-load-torch-file", "Layer Offload: comfy.utils.load_torch_file is not in this ComfyUI: the files "
                 "of models other nodes load are found by matching their tensors only.", level=logging.INFO)
    for name, arg in LOADERS:
        fn = getattr(comfy.sd, name, None)
        if callable(fn):
            if not hasattr(fn, WRAPPED_ATTR):
                setattr(comfy.sd, name, _wrap_loader(fn, arg))
        else:
            log_once("no-" + name, "Layer Offload: comfy.sd.%s is not in this ComfyUI: models it would build are "
                     "matched to their files by their tensors.", name, level=logging.INFO)


def uninstall() -> None:
    """Put ComfyUI's functions back (tests)."""
    import comfy.sd
    import comfy.utils

    for module, name in [(comfy.utils, "load_torch_file")] + [(comfy.sd, n) for n, _ in LOADERS]:
        inner = getattr(getattr(module, name, None), WRAPPED_ATTR, None)
        if inner is not None:
            setattr(module, name, inner)


# matching --------------------------------------------------------------------------------------------------------
def _header(path: str) -> Optional[Tuple[Header, Dict[str, Optional[str]]]]:
    """(key -> (shape, dtype name), every dotted tail of the keys -> the one key ending so, None where several do) of
    a safetensors file, cached by path, size and mtime; None if unreadable."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    key = (path, st.st_size, st.st_mtime_ns)
    with _lock:
        if key in _headers:
            return _headers[key]
    try:
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            head = {k: (tuple(f.get_slice(k).get_shape()), str(f.get_slice(k).get_dtype())) for k in f.keys()}
        tails: Dict[str, Optional[str]] = {}
        for k in head:
            parts = k.split(".")
            for i in range(len(parts)):
                tail = ".".join(parts[i:])
                tails[tail] = k if tails.get(tail, k) == k else None
        out: Optional[Tuple[Header, Dict[str, Optional[str]]]] = (head, tails)
    except Exception as e:  # noqa: BLE001 - an unreadable or foreign file is not the model's
        log.debug("Layer Offload: %s is not a readable safetensors file: %s", path, e)
        out = None
    with _lock:
        _headers[key] = out
    return out


def _tails(name: str) -> List[str]:
    """The model's name, then without each leading part before the block's container (`x.y.blocks.3.w`:
    `y.blocks.3.w`, `blocks.3.w`); [] for a tensor outside the blocks (no index in its name)."""
    parts = name.split(".")
    first = next((i for i, p in enumerate(parts) if p.isdigit()), None)
    if first is None or first == 0:
        return []
    return [".".join(parts[j:]) for j in range(first)]


def _block_tensors(root: torch.nn.Module) -> List[Tuple[str, torch.Tensor]]:
    """The root's plain block tensors by name (quantized subclasses and empty tensors left out)."""
    out = []
    for name, t in root.state_dict(keep_vars=True).items():
        if type(t) in (torch.Tensor, torch.nn.Parameter) and t.numel() and not t.is_meta and _tails(name):
            out.append((name, t))
    return out


def _matches(path: str, tensors: List[Tuple[str, torch.Tensor]]) -> List[Tuple[str, torch.Tensor, str]]:
    """(name, tensor, file key) of the tensors the file holds by name and shape."""
    read = _header(path)
    if not read:
        return []
    head, tails = read
    found = []
    for name, t in tensors:
        for tail in _tails(name):
            key = tails.get(tail)
            if key is not None and head[key][0] == tuple(t.shape):
                found.append((name, t, key))
                break
    return found


def _same_values(path: str, pairs: List[Tuple[str, torch.Tensor, str]]) -> bool:
    """Whether the file holds these tensors' values: bytes equal, or equal after an exact cast to the model's dtype."""
    try:
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            for _, t, key in pairs:
                stored = f.get_tensor(key)
                have = t.detach()
                if have.device.type != "cpu":
                    have = have.cpu()
                if stored.dtype != have.dtype:
                    stored = stored.to(have.dtype)
                if not torch.equal(stored.reshape(-1).view(torch.uint8), have.reshape(-1).view(torch.uint8)):
                    return False
        return True
    except Exception as e:  # noqa: BLE001 - unreadable: not the model's file
        log.debug("Layer Offload: could not compare %s with the model: %s", path, e)
        return False


def _probes(found: List[Tuple[str, torch.Tensor, str]]) -> List[Tuple[str, torch.Tensor, str]]:
    """Two tensors to compare: the largest, and one of the last block found."""
    if not found:
        return []
    largest = max(found, key=lambda f: f[1].numel())
    return [largest] if found[-1] is largest else [largest, found[-1]]


def _folder_files(kinds: Iterable[str]) -> List[str]:
    """The safetensors files of ComfyUI's model folders of these kinds."""
    import folder_paths

    out: List[str] = []
    for kind in kinds:
        try:
            names = folder_paths.get_filename_list(kind)
        except Exception:  # noqa: BLE001 - a kind this ComfyUI does not have
            continue
        for n in names:
            if not n.lower().endswith(SAFETENSORS):
                continue
            try:
                p = folder_paths.get_full_path(kind, n)
            except Exception:  # noqa: BLE001
                p = None
            if p and os.path.abspath(p) not in out:
                out.append(os.path.abspath(p))
    return out


def _nbytes(found: List[Tuple[str, torch.Tensor, str]]) -> int:
    return sum(t.nelement() * t.element_size() for _, t, _ in found)


def _recorded(model: Any, root: torch.nn.Module) -> Tuple[str, ...]:
    for m in (root, model):
        files = getattr(m, "__dict__", {}).get(FILES_ATTR)
        if files:
            return tuple(files)
    return ()


def _not_streamable(path: str) -> str:
    kind = os.path.splitext(path)[1] or "(no extension)"
    return ("its file {} is a {} file: the disk tier streams from .safetensors and .gguf files (and packed folders), "
            "so its blocks stay in RAM and no RAM is given back".format(path, kind))


def mapped_files(tensors: Iterable[torch.Tensor]) -> List[str]:
    """The files these tensors' bytes are memory-mapped from, most bytes first (`/proc/self/maps`; [] elsewhere)."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            lines = f.readlines()
    except OSError:
        return []
    spans = []
    for line in lines:
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].startswith("/") and not parts[5].rstrip().endswith("(deleted)"):
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            spans.append((lo, hi, parts[5].rstrip("\n")))
    spans.sort()
    starts = [lo for lo, _, _ in spans]
    nbytes: Dict[str, int] = collections.Counter()
    for t in tensors:
        try:
            ptr = t.data_ptr()
        except Exception:  # noqa: BLE001 - a tensor without storage (a wrapper subclass)
            continue
        i = bisect.bisect_right(starts, ptr) - 1
        if i >= 0 and ptr < spans[i][1]:
            nbytes[spans[i][2]] += t.nelement() * t.element_size()
    return [p for p, _ in sorted(nbytes.items(), key=lambda kv: -kv[1])]


def find_file(model: Any, root: torch.nn.Module, kind: str) -> FileFound:
    """The safetensors file holding `root`'s blocks (`model`: the module a loader built, which carries the recorded
    files), recorded at load or matched among recently read files and ComfyUI's model folders; or why none."""
    tensors = _block_tensors(root)
    recorded = [p for p in _recorded(model, root) if os.path.isfile(p)]
    if recorded:
        streamable = [p for p in recorded if p.lower().endswith(STREAMABLE)]
        if not streamable:
            return FileFound(None, _not_streamable(recorded[0]))
        scored = sorted(((_nbytes(_matches(p, tensors)) if p.lower().endswith(SAFETENSORS) else 1, p)
                         for p in streamable), reverse=True)  # a GGUF file is taken as recorded (the engine checks)
        best, path = scored[0]
        if best > 0 or not tensors:
            others = [p for p in recorded if p != path]
            note = ("blocks held in {} stay in RAM: the disk tier streams one file per model".format(", ".join(others))
                    if others else "")
            return FileFound(path, note, "recorded")
        return FileFound(None, "its file {} holds its blocks under other names than the model (ComfyUI converted "
                               "them when it loaded the file), so its blocks stay in RAM".format(path))
    mapped = [p for p in mapped_files(t for _, t in root.named_parameters()) if p.lower().endswith(STREAMABLE)]
    if mapped:
        return FileFound(mapped[0], "", "mapped")
    if any(hasattr(t, "tensor_type") and hasattr(t, "tensor_shape") for t in root.parameters()):
        return FileFound(None, "GGUF weights no longer mapped from their .gguf file (copied by their loader): the file "
                               "cannot be told, so its blocks stay in RAM and no RAM is given back")
    if not tensors:
        return FileFound(None, "no block tensor to look for in a file (quantized or empty blocks)")
    folders = FOLDERS.get(kind, FOLDERS_ANY)
    with _lock:
        recent = list(reversed(_recent))
    candidates = recent + [p for p in _folder_files(folders) if p not in recent]
    scored = sorted(((_nbytes(found), -i, p, found) for i, p in enumerate(candidates)
                     for found in [_matches(p, tensors)] if found), key=lambda s: s[:2], reverse=True)
    for _, _, path, found in scored:
        if _same_values(path, _probes(found)):
            return FileFound(path, "", "matched")
    return FileFound(None, "no file among the {} safetensors file(s) read lately or in ComfyUI's model folders ({}) "
                           "holds its blocks (checked by name, shape and bytes), so its blocks stay in RAM and no RAM "
                           "is given back".format(len(candidates), ", ".join(folders)))
