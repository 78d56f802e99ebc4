"""Offload Model / Offload CLIP / Offload Any: put models another node loaded under the engine."""
from __future__ import annotations

import copy
import logging
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

import comfy.model_management
import comfy.utils
from comfy.model_patcher import ModelPatcher
from comfy_api.latest import io

from ..offload import offload_module
from . import dynamic, model_files, patches, status
from .comfy_patcher import add_report_wrapper, as_offload_patcher
from .common import (ANY, CATEGORY, devices_input, engine_device, host_compression_input, host_compression_override,
                     io_type, log_once, make_config, optional_inputs, preset_input, resolve_budget, resolve_devices)
from .registry import Managed, detach_managed, register, state_of, track_patcher

log = logging.getLogger("layer_offload")


def _progress_bar(total: int) -> Callable[[int, int], None]:
    """A ComfyUI progress bar for model setup (staging every unit on the host takes a moment)."""
    try:
        pbar = comfy.utils.ProgressBar(total)
    except Exception:  # noqa: BLE001 - no progress hook outside a prompt; setup must not fail for a UI nicety
        return lambda i, n: None

    def update(i: int, n: int) -> None:
        try:
            pbar.update_absolute(i, n)
        except Exception:  # noqa: BLE001 - a UI nicety
            pass

    return update


def _evict_from_comfy(patcher: Any) -> None:
    """Unload any ComfyUI-loaded copy sharing these weights, so the engine stages host-resident tensors."""
    mm = comfy.model_management
    for lm in list(getattr(mm, "current_loaded_models", [])):
        other = getattr(lm, "model", None)
        if other is None or not other.is_clone(patcher):
            continue
        try:
            lm.model_unload()
        finally:
            if lm in mm.current_loaded_models:
                mm.current_loaded_models.remove(lm)


def _move_to_host(root: torch.nn.Module) -> None:
    for t in list(root.parameters()) + list(root.buffers()):
        if t.device.type != "cpu":
            root.to("cpu")
            return


def _flattens(t: torch.Tensor) -> bool:
    """A tensor subclass that describes its inner tensors (ComfyUI 0.33's QuantizedTensor layouts)."""
    return type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__")


def _holds_quantized_weights(model: torch.nn.Module) -> bool:
    """Whether a model holds quantized weights: GGUF (ComfyUI-GGUF's or the built-in GGMLTensor) or a quantized
    tensor type ComfyUI loads itself (QuantizedTensor)."""
    return any(patches.is_gguf(p) or _flattens(p) for p in model.parameters())


def _private_tensor(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A new tensor object over the same storage: same class, same attributes (GGUF patches not carried over)."""
    if t is None:
        return None
    cls = type(t)
    if _flattens(t):  # a new outer object over the same inner tensors; the engine re-points only the new one's
        names, ctx = t.__tensor_flatten__()
        fresh = cls.__tensor_unflatten__({n: getattr(t, n) for n in names}, ctx, t.size(), t.stride())
        if getattr(t, "_is_param", False):
            fresh._is_param = True
        return fresh
    fresh = t.as_subclass(torch.Tensor) if cls is torch.nn.Parameter else t.as_subclass(torch.Tensor).as_subclass(cls)
    if cls is torch.nn.Parameter:
        return torch.nn.Parameter(fresh, requires_grad=t.requires_grad)
    for key, value in t.__dict__.items():
        fresh.__dict__[key] = list(value) if isinstance(value, list) else value
    if patches.is_gguf(fresh):
        fresh.__dict__["patches"] = []  # a LoRA another branch has loaded on the original is not ours
    return fresh


def private_model(model: torch.nn.Module, originals: Optional[Dict[str, Any]] = None) -> torch.nn.Module:
    """A structural copy of `model`: new module objects and new parameter objects over the same storage.

    The engine stages the copy (its bytes go into the engine's host buffers and the copy's parameters are rebound to
    them); the original module, which the loader's cached output holds, is never changed, so other branches of the
    graph that use the loader's model keep working in any order. Used for quantized models another node loaded
    (GGUF, whose weights are memory-mapped from the file, and ComfyUI's own QuantizedTensor layouts, memory-mapped
    from the safetensors file by the ComfyUI versions that have them): the copy costs no second copy in RAM.
    `originals` (key -> tensor or object): what another loaded clone of the model replaced (ComfyUI's backups of
    weights it baked a patch into, of object patches): the copy gets the originals.
    """
    memo: Dict[int, torch.nn.Module] = {}

    def copy_module(m: torch.nn.Module) -> torch.nn.Module:
        done = memo.get(id(m))
        if done is not None:
            return done
        new = copy.copy(m)  # a new __dict__ holding the same values
        memo[id(m)] = new
        for key, value in list(new.__dict__.items()):
            if key.startswith("_") and isinstance(value, dict):  # torch's own dicts: hooks, parameters, modules
                new.__dict__[key] = copy.copy(value)
        new._parameters = {k: _private_tensor(v) for k, v in m._parameters.items()}
        new._buffers = dict(m._buffers)
        new._modules = {k: (copy_module(c) if c is not None else None) for k, c in m._modules.items()}
        return new

    out = copy_module(model)
    for key, value in (originals or {}).items():
        owner_name, _, attr = key.rpartition(".")
        owner = out.get_submodule(owner_name) if owner_name else out
        if attr in owner._parameters and isinstance(value, torch.Tensor):
            owner._parameters[attr] = _private_tensor(value)
        elif attr in owner._buffers:
            owner._buffers[attr] = value
        elif attr in owner._modules:
            owner._modules[attr] = value
        else:
            object.__setattr__(owner, attr, value)
    return out


def _clone_backups(patcher: Any) -> Dict[str, Any]:
    """The originals of whatever another loaded clone of this model has patched in place (ComfyUI's backups of
    baked weights, weight hooks and object patches), by key; the private copy starts from them."""
    originals: Dict[str, Any] = {}
    for key, bk in (getattr(patcher, "hook_backup", None) or {}).items():
        originals[key] = bk[0] if isinstance(bk, tuple) else bk
    for key, bk in (getattr(patcher, "backup", None) or {}).items():
        originals[key] = getattr(bk, "weight", bk)
    for key, obj in (getattr(patcher, "object_patches_backup", None) or {}).items():
        originals[key] = obj
    return originals


def attach_engine(root: torch.nn.Module, preset: str, budget: Any, priority: int, name: str, kind: str,
                  disk_path: Optional[str] = None, units: Optional[List[str]] = None,
                  devices: Any = None, host_compression: Any = None) -> Optional[Managed]:
    """Offload `root` with the engine (or reuse/refresh an existing handle); None when the device is unsupported.

    `disk_path`: the file the weights came from; blocks it holds byte for byte may stream from it when host RAM
    runs short (others stay in RAM). `devices`: the node's `devices` text (see `common.resolve_devices`).
    """
    device = engine_device()
    if device is None:
        return None
    overrides: Dict[str, Any] = {}
    if disk_path:
        overrides.update(disk_path=disk_path, disk_optional=True)
    overrides.update(host_compression_override(host_compression))
    cfg = make_config(preset, device, resolve_devices(devices, device), **overrides)
    vbudget = resolve_budget(budget)
    existing = state_of(root)
    if existing is not None:
        if existing.config == cfg and existing.budget_of_handle is vbudget and existing.handle.attached:
            if existing.handle.priority != priority:
                existing.handle.set_priority(priority)
            existing.priority = priority
            existing.budget = budget
            return existing
        detach_managed(existing)
    _move_to_host(root)
    n_units = max(1, sum(1 for _ in root.children()))
    progress = _progress_bar(n_units)
    t0 = time.perf_counter()
    handle = offload_module(root, cfg, name=name, priority=priority, budget=vbudget, units=units, progress=progress)
    progress(n_units, n_units)
    managed = Managed(name=name, handle=handle, preset=preset, priority=priority, device=device, kind=kind,
                      config=cfg, budget=budget, budget_of_handle=vbudget)
    managed.reoffload = _reoffload
    patches.set_cast_flags(root, managed)
    register(root, managed)
    log.info("Layer Offload: %s (%s) set up on %s with preset %s in %.2fs", name, kind, device, preset,
             time.perf_counter() - t0)
    return managed


def offload_patcher(patcher: ModelPatcher, preset: str, budget: Any = None, priority: int = 0,
                    name: Optional[str] = None, kind: str = "model", disk_path: Optional[str] = None,
                    shared: bool = True, devices: Any = None, host_compression: Any = None) -> ModelPatcher:
    """An offload patcher for `patcher`'s model, whose root module the engine streams.

    `shared`: the model came from another node (whose cached output keeps using it); False for a model the caller
    loaded itself (the Offload Loaders).
    """
    if engine_device() is None:
        return patcher
    resolve_devices(devices)  # a bad devices text is an error before anything changes
    patcher = dynamic.prepare(patcher)
    fresh = not getattr(type(patcher), "_lo_offload", False)
    private = shared and fresh and isinstance(patcher.model, torch.nn.Module) and \
        _holds_quantized_weights(patcher.model)
    if fresh and not private:
        _evict_from_comfy(patcher)
    n = as_offload_patcher(patcher)
    if private:  # the loader's cached model stays as it is (see private_model)
        n.model = private_model(n.model, _clone_backups(n))
        # the backups belong to the clones of the loader's model; the copy has none (and nothing baked)
        for attr in ("backup", "hook_backup", "object_patches_backup"):
            if isinstance(getattr(n, attr, None), dict):
                setattr(n, attr, type(getattr(n, attr))())
        log_once("quantized-private", "Layer Offload: a quantized (GGUF or QuantizedTensor) model is offloaded as its "
                 "own copy of the module tree (the quantized bytes are staged as stored); the loader's model is left "
                 "unchanged.", level=logging.INFO)
    model = n.model
    inner = getattr(model, "diffusion_model", None)
    root = inner if kind == "model" and isinstance(inner, torch.nn.Module) else model
    if name is None:
        name = "{}:{}".format(kind, type(root).__name__)
    found = model_files.find_file(model, root, kind) if shared and disk_path is None else None
    managed = attach_engine(root, preset, budget, priority, name, kind, disk_path=found.path if found else disk_path,
                            devices=devices, host_compression=host_compression)
    note_file(managed, found)
    if managed is not None:
        track_patcher(n, managed)
        add_report_wrapper(n, status.publish)
    return n


def note_file(managed: Optional[Managed], found: Optional[model_files.FileFound]) -> None:
    """Say which file a model from another node streams from when RAM runs short, or in its report why none."""
    if managed is None or found is None:
        return
    if found.path:
        log.info("Layer Offload: %s: blocks may stream from %s when RAM runs short (the file %s)", managed.name,
                 found.path, "its loader read" if found.how == "recorded" else "whose tensors match the model's")
    if found.reason:
        managed.handle.notice("disk_file", found.reason)
        log_once("disk-file:" + managed.name, "Layer Offload: %s: %s", managed.name, found.reason,
                 level=logging.INFO)


def _reoffload(patcher: ModelPatcher, src: Managed) -> ModelPatcher:
    """Offload a patcher's private copy of a managed model (clone(force_deepcopy=True)) as `src` is now."""
    return offload_patcher(patcher, src.preset, src.budget, src.priority, kind=src.kind, shared=False,
                           disk_path=getattr(src.config, "disk_path", None),
                           host_compression=getattr(src.config, "host_compression", None))


def offload_clip(clip: Any, preset: str, budget: Any = None, priority: int = 0, name: Optional[str] = None,
                 devices: Any = None, host_compression: Any = None) -> Any:
    """A clone of a CLIP object whose text encoder the engine streams."""
    if engine_device() is None:
        return clip
    out = clip.clone()
    inner = type(getattr(out, "cond_stage_model", None)).__name__
    same = getattr(out, "cond_stage_model", None) is out.patcher.model
    out.patcher = offload_patcher(out.patcher, preset, budget, priority, name or "clip:{}".format(inner), kind="clip",
                                  devices=devices, host_compression=host_compression)
    if same and out.cond_stage_model is not out.patcher.model:  # a private copy: the clone encodes with the copy
        out.cond_stage_model = out.patcher.model
    return out


def _find_modules(obj: Any, depth: int, seen: set, found: List[Tuple[str, Any]], path: str) -> None:
    """Collect the outermost nn.Modules and ModelPatchers reachable through attributes, items and values."""
    if obj is None or id(obj) in seen or depth < 0:
        return
    if isinstance(obj, (str, bytes, int, float, bool, torch.Tensor, type)):
        return
    seen.add(id(obj))
    if isinstance(obj, ModelPatcher) or isinstance(obj, torch.nn.Module):
        found.append((path or type(obj).__name__, obj))
        return
    if depth == 0:
        return
    if isinstance(obj, dict):
        items = list(obj.items())
    elif isinstance(obj, (list, tuple, set)):
        items = list(enumerate(obj))
    else:
        d = getattr(obj, "__dict__", None)
        if not isinstance(d, dict):
            return
        items = list(d.items())
    for k, v in items:
        if isinstance(k, str) and k.startswith("__"):
            continue
        _find_modules(v, depth - 1, seen, found, "{}.{}".format(path, k) if path else str(k))


def offload_anything(anything: Any, preset: str, budget: Any = None, priority: int = 0,
                     max_depth: int = 4, devices: Any = None, host_compression: Any = None) -> Any:
    """Offload every nn.Module found inside an arbitrary object (in place); return the object."""
    if engine_device() is None:
        return anything
    resolve_devices(devices)  # a bad devices text is an error before anything changes
    if isinstance(anything, ModelPatcher):
        return offload_patcher(anything, preset, budget, priority, kind="model", devices=devices,
                               host_compression=host_compression)
    if hasattr(anything, "patcher") and hasattr(anything, "cond_stage_model") and hasattr(anything, "clone"):
        return offload_clip(anything, preset, budget, priority, devices=devices, host_compression=host_compression)
    found: List[Tuple[str, Any]] = []
    _find_modules(anything, max_depth, set(), found, "")
    if not found:
        log_once("any-nothing-" + type(anything).__name__, "Layer Offload: Offload Any found no nn.Module inside "
                 "a %s; passing it through unchanged.", type(anything).__name__)
        return anything
    for path, obj in found:
        if isinstance(obj, ModelPatcher):
            patched = offload_patcher(obj, preset, budget, priority, name="any:" + path, kind="model",
                                      devices=devices, host_compression=host_compression)
            _replace_in_place(anything, path, obj, patched)
            continue
        if not any(True for _ in obj.parameters()):
            continue
        found = model_files.find_file(obj, obj, "any")
        note_file(attach_engine(obj, preset, budget, priority, "any:" + path, kind="module", disk_path=found.path,
                                devices=devices, host_compression=host_compression), found)
    return anything


def _replace_in_place(container: Any, path: str, old: Any, new: Any) -> None:
    """Swap a patcher found at `path` for its offload clone (best effort; a failure keeps the original)."""
    parts = path.split(".")
    parent = container
    try:
        for p in parts[:-1]:
            parent = parent[int(p)] if isinstance(parent, (list, tuple)) else (
                parent[p] if isinstance(parent, dict) else getattr(parent, p))
        last = parts[-1]
        if isinstance(parent, dict):
            parent[last] = new
        elif isinstance(parent, list):
            parent[int(last)] = new
        else:
            setattr(parent, last, new)
    except (AttributeError, KeyError, IndexError, ValueError, TypeError):
        log_once("any-replace", "Layer Offload: could not put an offloaded patcher back at %s; the original is kept.",
                 path)


class OffloadModel(io.ComfyNode):
    """MODEL -> MODEL: stream a diffusion model loaded by any other node (GGUF loaders included)."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="OffloadModel", display_name="Offload Model", category=CATEGORY,
            description="Stream a MODEL block by block from host RAM under the pack's VRAM budget.",
            inputs=[io.Model.Input("model", tooltip="The diffusion model to stream (from any loader)."),
                    preset_input(), *optional_inputs(), devices_input(), host_compression_input()],
            outputs=[io.Model.Output(tooltip="The same model; its blocks now stream from host RAM.")])

    @classmethod
    def execute(cls, model: Any, preset: str, budget: Any = None, priority: int = 0,
                devices: str = "", host_compression: str = "preset") -> io.NodeOutput:
        return io.NodeOutput(*cls.apply(model, preset, budget, priority, devices, host_compression))

    @classmethod
    def apply(cls, model: Any, preset: str, budget: Any = None, priority: int = 0, devices: str = "",
              host_compression: str = "preset") -> Tuple[Any]:
        """The node's work, as a tuple of its outputs."""
        return (offload_patcher(model, preset, budget, priority, kind="model", devices=devices,
                                host_compression=host_compression),)


class OffloadCLIP(io.ComfyNode):
    """CLIP -> CLIP: stream a text encoder loaded by any other node."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="OffloadCLIP", display_name="Offload CLIP", category=CATEGORY,
            description="Stream a CLIP text encoder block by block from host RAM under the pack's VRAM budget.",
            inputs=[io.Clip.Input("clip", tooltip="The text encoder to stream (from any loader)."),
                    preset_input(), *optional_inputs(), devices_input(), host_compression_input()],
            outputs=[io.Clip.Output(tooltip="The same CLIP; its encoder blocks now stream from host RAM.")])

    @classmethod
    def execute(cls, clip: Any, preset: str, budget: Any = None, priority: int = 0,
                devices: str = "", host_compression: str = "preset") -> io.NodeOutput:
        return io.NodeOutput(*cls.apply(clip, preset, budget, priority, devices, host_compression))

    @classmethod
    def apply(cls, clip: Any, preset: str, budget: Any = None, priority: int = 0, devices: str = "",
              host_compression: str = "preset") -> Tuple[Any]:
        """The node's work, as a tuple of its outputs."""
        return (offload_clip(clip, preset, budget, priority, devices=devices, host_compression=host_compression),)


class OffloadAny(io.ComfyNode):
    """* -> *: stream every nn.Module inside any object (other packs' TTS or custom model types)."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="OffloadAny", display_name="Offload Any", category=CATEGORY,
            description=("Find every torch nn.Module inside the input (attributes walked a few levels deep) and stream "
                         "it; use it for model objects of other packs."),
            inputs=[io.AnyType.Input("anything", tooltip="Any object: its nn.Modules (found a few attribute levels "
                                                         "deep) are offloaded in place."),
                    preset_input(), *optional_inputs(), devices_input(), host_compression_input()],
            outputs=[io_type(ANY).Output(display_name="anything",
                                         tooltip="The same object, its modules now streamed.")])

    @classmethod
    def execute(cls, anything: Any, preset: str, budget: Any = None, priority: int = 0,
                devices: str = "", host_compression: str = "preset") -> io.NodeOutput:
        return io.NodeOutput(*cls.apply(anything, preset, budget, priority, devices, host_compression))

    @classmethod
    def apply(cls, anything: Any, preset: str, budget: Any = None, priority: int = 0,
              devices: str = "", host_compression: str = "preset") -> Tuple[Any]:
        """The node's work, as a tuple of its outputs."""
        return (offload_anything(anything, preset, budget, priority, devices=devices,
                                 host_compression=host_compression),)
