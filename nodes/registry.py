"""The models the pack manages: a record on each offloaded root module, listed weakly for reports and the panel."""
from __future__ import annotations

import logging
import threading
import weakref
from typing import Any, Callable, List, Optional, Tuple

import torch

log = logging.getLogger("layer_offload")

STATE_ATTR = "_layer_offload"


class Managed:
    """One model the pack offloaded (stored on the offloaded nn.Module itself, so it lives and dies with it)."""

    def __init__(self, name: str, handle: Any, preset: str, priority: int, device: str, kind: str,
                 config: Any = None, budget: Any = None, budget_of_handle: Any = None) -> None:
        self.name = name
        self.handle = handle
        self.preset = preset
        self.priority = priority
        self.device = device
        self.kind = kind
        self.config = config
        self.budget = budget  # what the node was given (a BudgetSpec or None)
        self.budget_of_handle = budget_of_handle  # the VramBudget the handle joined
        self.root_ref: Any = None  # weakref to the offloaded module
        self.patchers = 0  # live offload patchers using it; at zero the handle is detached (frees host RAM)
        self.on_release: List[Callable[[], None]] = []  # undo steps run when the model is handed back
        self.baked: dict = {}  # key -> (weight, original) while a forced load (saving) holds patched weights
        # offloads another patcher's private copy of this model the same way (set by nodes/apply.py): the patcher
        # class calls it for clone(force_deepcopy=True) without importing the module that made it
        self.reoffload: Optional[Callable[[Any, "Managed"], Any]] = None  # (patcher, this record)


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


def find_managed(name: str) -> Optional[Managed]:
    """The managed model with this report name (the panel addresses models by name)."""
    for m in managed_models():
        if m.name == name:
            return m
    return None


def managed_root(model: Any) -> Tuple[Optional[torch.nn.Module], str, Optional[Managed]]:
    """(root, key prefix, record) of the offloaded module inside a patcher's model: the diffusion model for
    MODEL, the whole module otherwise; (None, "", None) when nothing in it is offloaded."""
    if model is None:
        return None, "", None
    inner = getattr(model, "diffusion_model", None)
    if isinstance(inner, torch.nn.Module):
        st = state_of(inner)
        if st is not None:
            return inner, "diffusion_model.", st
    st = state_of(model)
    if st is not None:
        return model, "", st
    return None, "", None


def managed_of(obj: Any) -> Optional[Managed]:
    """The record behind a MODEL / CLIP / TTS_MODEL (a patcher, or an object holding one) or a raw module."""
    target = getattr(obj, "patcher", obj)
    inner = getattr(target, "model", target)
    _, _, st = managed_root(inner)
    return st if st is not None else state_of(inner)


def track_patcher(patcher: Any, managed: Managed) -> None:
    """Count a live patcher of a managed model; when the last one is gone the engine lets the model go."""
    if getattr(patcher, "_lo_tracked_for", None) is managed:
        return
    with _registry_lock:
        managed.patchers += 1
    patcher._lo_tracked_for = managed
    weakref.finalize(patcher, _release_patcher, managed)


def _release_patcher(managed: Managed) -> None:
    with _registry_lock:
        managed.patchers -= 1
        last = managed.patchers <= 0
    if last:
        detach_managed(managed)


def detach_managed(managed: Managed) -> None:
    """Hand a model back: engine hooks removed, ordinary tensors, every ComfyUI flag as it was."""
    root = managed.root_ref() if managed.root_ref is not None else None
    try:
        managed.handle.detach()
    except Exception as e:  # noqa: BLE001 - also runs from a finalizer, which must not raise
        log.warning("Layer Offload: detaching %s failed: %s", managed.name, e)
    undo, managed.on_release = managed.on_release, []
    for step in reversed(undo):
        try:
            step()
        except Exception as e:  # noqa: BLE001
            log.warning("Layer Offload: restoring %s failed: %s", managed.name, e)
    if root is not None and state_of(root) is managed:
        unregister(root)
