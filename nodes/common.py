"""Shared pieces of the ComfyUI nodes: preset choices, tooltips, device choice, the registry of managed models."""
from __future__ import annotations

import logging
import threading
import weakref
from typing import Any, Dict, List, Optional

from ..offload import PRESETS, OffloadConfig, VramBudget, default_budget

log = logging.getLogger("layer_offload")

CATEGORY = "Layer Offload"
BUDGET_TYPE = "OFFLOAD_BUDGET"
PRESET_CHOICES: List[str] = ["auto", "high_end", "mid_range", "consumer", "budget"]
# Keep the dropdown in the documented order, but never offer a name the engine does not know.
PRESET_CHOICES = [p for p in PRESET_CHOICES if p in PRESETS] + [p for p in PRESETS if p not in PRESET_CHOICES]
WEIGHT_DTYPES_FALLBACK: List[str] = ["default", "fp8_e4m3fn", "fp8_e4m3fn_fast", "fp8_e5m2"]


class AnyType(str):
    """A ComfyUI type string that matches every other type (validation compares with `!=`)."""

    def __ne__(self, other: object) -> bool:
        return False

    def __hash__(self) -> int:
        return str.__hash__(self)


ANY = AnyType("*")

TIP_PRESET = ("How much of the model stays in VRAM: auto measures free VRAM; high_end keeps nearly all resident; "
              "mid_range about two thirds; consumer about a third; budget streams every block through a small slot ring.")
TIP_BUDGET = ("Optional link from a VRAM Budget node: the process-wide device budget shared by every offloaded model. "
              "Unlinked: the current process-wide budget is used.")
TIP_PRIORITY = ("Higher priority models keep more resident blocks when several offloaded models share the budget.")


def preset_input() -> tuple:
    """The preset dropdown, identical on every node."""
    return (PRESET_CHOICES, {"default": "auto", "tooltip": TIP_PRESET})


def optional_inputs() -> Dict[str, tuple]:
    """The optional `budget` link and `priority` shared by every offload node."""
    return {
        "budget": (BUDGET_TYPE, {"tooltip": TIP_BUDGET}),
        "priority": ("INT", {"default": 0, "min": -100, "max": 100, "step": 1, "tooltip": TIP_PRIORITY}),
    }


_logged_once: set = set()
_log_lock = threading.Lock()


def log_once(key: str, msg: str, *args: Any, level: int = logging.WARNING) -> None:
    """Log a fallback or limitation once per process, not once per prompt."""
    with _log_lock:
        if key in _logged_once:
            return
        _logged_once.add(key)
    log.log(level, msg, *args)


def engine_device() -> Optional[str]:
    """The engine device matching ComfyUI's torch device: 'cuda:N', 'sim' for --cpu, None when unsupported."""
    import comfy.model_management as mm

    dev = mm.get_torch_device()
    dev_type = getattr(dev, "type", str(dev))
    if dev_type == "cuda":
        return "cuda" if dev.index is None else "cuda:{}".format(dev.index)  # the engine resolves "cuda"
    if dev_type == "cpu":
        return "sim"
    log_once("device-" + dev_type, "Layer Offload: device type %r is not supported by the engine; "
             "models are left as ComfyUI loaded them (no offloading).", dev_type)
    return None


def make_config(preset: str, device: str) -> OffloadConfig:
    """OffloadConfig for a node's preset on the given engine device (ValueError names the valid presets)."""
    return OffloadConfig.from_preset(preset, device=device)


def resolve_budget(budget: Any) -> VramBudget:
    """The VramBudget a node should use: its linked OFFLOAD_BUDGET, else the process-wide one."""
    if budget is None:
        return default_budget()
    spec_apply = getattr(budget, "apply", None)
    if callable(spec_apply):
        return spec_apply()
    if isinstance(budget, VramBudget):
        return budget
    raise ValueError("budget must come from a VRAM Budget node, got {!r}".format(type(budget).__name__))


STATE_ATTR = "_layer_offload"


class Managed:
    """One model the pack offloaded (stored on the offloaded nn.Module itself, so it lives and dies with it)."""

    def __init__(self, name: str, handle: Any, preset: str, priority: int, device: str, kind: str,
                 config: Any = None, budget: Any = None) -> None:
        self.name = name
        self.handle = handle
        self.preset = preset
        self.priority = priority
        self.device = device
        self.kind = kind
        self.config = config
        self.budget = budget  # what the node was given (a BudgetSpec or None)
        self.handle_budget: Any = None  # the VramBudget the handle was attached to
        self.root_ref: Any = None  # weakref to the offloaded module
        self.patchers = 0  # live offload patchers using it; at zero the handle is detached (frees host RAM)
        self.cast_flags: List[Any] = []  # (module, its own comfy_cast_weights before offloading, or None)


_registry: "List[weakref.ReferenceType]" = []
_registry_lock = threading.Lock()


def register(root: Any, managed: Managed) -> None:
    """Attach `managed` to its root module and list it (weakly) for reports and the web panel."""
    managed.root_ref = weakref.ref(root)
    object.__setattr__(root, STATE_ATTR, managed)
    with _registry_lock:
        _registry[:] = [r for r in _registry if r() is not None and r() is not root]
        _registry.append(weakref.ref(root))


def unregister(root: Any) -> None:
    """Forget a root module whose handle was detached."""
    if STATE_ATTR in getattr(root, "__dict__", {}):
        object.__delattr__(root, STATE_ATTR)
    with _registry_lock:
        _registry[:] = [r for r in _registry if r() is not None and r() is not root]


def state_of(root: Any) -> Optional[Managed]:
    """The Managed record of an offloaded root module, or None."""
    if root is None:
        return None
    return getattr(root, "__dict__", {}).get(STATE_ATTR)


def managed_models() -> List[Managed]:
    """Every managed model still alive, oldest first."""
    with _registry_lock:
        roots = [r() for r in _registry]
    return [m for m in (state_of(r) for r in roots if r is not None) if m is not None]


def track_patcher(patcher: Any, managed: Managed) -> None:
    """Count a live patcher of a managed model; when the last one is gone the engine lets the model go.

    The budget holds every handle (and so its model) strongly: without this, each re-run of a loader would
    keep the previous model in host RAM for the life of the process.
    """
    with _registry_lock:
        managed.patchers += 1
    weakref.finalize(patcher, _release_patcher, managed)


def _release_patcher(managed: Managed) -> None:
    with _registry_lock:
        managed.patchers -= 1
        last = managed.patchers <= 0
    if last:
        detach_managed(managed)


def detach_managed(managed: Managed) -> None:
    """Hand a model back: engine hooks removed, ordinary tensors, ComfyUI's cast flags as they were."""
    root = managed.root_ref() if managed.root_ref is not None else None
    try:
        managed.handle.detach()
    except Exception as e:  # noqa: BLE001 - also runs from a finalizer, which must not raise
        log.warning("Layer Offload: detaching %s failed: %s", managed.name, e)
    for module, flag in managed.cast_flags:
        if flag is None:
            module.__dict__.pop("comfy_cast_weights", None)
        else:
            module.comfy_cast_weights = flag
    managed.cast_flags = []
    if root is not None and state_of(root) is managed:
        unregister(root)
