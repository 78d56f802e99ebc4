"""DynamicVRAM (ComfyUI 0.12+ with comfy-aimdo, on by default on NVIDIA in current releases): the pack's modes.

- DynamicVRAM off, or a ComfyUI without it: every model is a plain ModelPatcher; nothing to do here.
- DynamicVRAM on: an offloaded model is never dynamic. Two memory managers must not own one weight, so before
  the engine adopts a model DynamicVRAM loaded, DynamicVRAM lets go of it: the model is unloaded from ComfyUI's
  memory manager, its pins are released through ComfyUI's own API (`unpin_all_weights`, which unpins through
  `comfy.pinned_memory`), its VBAR memory is freed (`partially_unload`), and the VBAR state on its modules and
  weights (`_v`, `_v_signature`, `*_lowvram_function`, `_pin`; since 0.33 also `_v_weight`, `_v_bias`, `_prefetch`,
  `_v_block`, `_pin_state`) is removed, so `ops.cast_bias_weight` never takes the VBAR path (or a stale prefetch)
  around the engine's slots and no `LowVramPatch` stacks on the pack's exact patch. A module's `_pins` stays: since
  0.23 ComfyUI's `unpin_all_weights` empties it, and nothing reads it without `_v`. A non-dynamic
  delegate is used where ComfyUI offers one (`get_non_dynamic_delegate`); otherwise the patcher's state moves
  into the plain offload patcher class (nodes/comfy_patcher.py).
- One card, both kinds: the other models of the workflow stay dynamic; the offloaded model reports its true
  `loaded_size()` and is freed like a classic model, so ComfyUI budgets the rest of the card for them.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

import comfy.model_management

from .common import log_once

log = logging.getLogger("layer_offload")

MODULE_VBAR_ATTRS = ("_v", "_v_signature", "weight_lowvram_function", "bias_lowvram_function", "pin_failed",
                     # 0.33+ (0.39's names too): the VBAR copy of a resident weight, a prefetch in flight, a block's
                     # VBAR span on its unit root and the model's pin state (which holds its pinned host buffers)
                     "_v_weight", "_v_bias", "_prefetch", "_v_block", "_v_block_faulted", "_pin_state")
TENSOR_VBAR_ATTRS = ("_v", "_v_signature", "_model_dtype")


def is_dynamic(patcher: Any) -> bool:
    """True for DynamicVRAM patchers (feature-detected: older ComfyUI has no is_dynamic at all)."""
    fn = getattr(patcher, "is_dynamic", None)
    try:
        return bool(fn()) if callable(fn) else False
    except Exception:  # noqa: BLE001 - a broken is_dynamic means: treat as not dynamic
        return False


def _legacy_unpin() -> Any:
    """`comfy.pinned_memory.unpin_memory` (0.12 to 0.22) or None: since 0.23 pins live in `module._pins` and are
    released by the dynamic patcher's own `unpin_all_weights`, and a module left with `_pins` but no `_v` never
    reads them."""
    try:
        import comfy.pinned_memory as pinned_memory  # 0.12+ only
    except Exception:  # noqa: BLE001 - an older ComfyUI has no module; a newer one may fail to import it on the CPU
        return None
    unpin = getattr(pinned_memory, "unpin_memory", None)
    if not callable(unpin):
        log_once("no-unpin-memory", "Layer Offload: comfy.pinned_memory.unpin_memory is not in this ComfyUI; "
                 "DynamicVRAM pins are released through the model patcher instead.", level=logging.INFO)
        return None
    return unpin


def strip_vbar_state(model: torch.nn.Module) -> int:
    """Remove DynamicVRAM's per-module and per-weight state (pins released through ComfyUI first); returns the
    number of modules that carried some."""
    unpin = _legacy_unpin()
    touched = 0
    for m in model.modules():
        carried = False
        if getattr(m, "_pin", None) is not None:
            carried = True
            if unpin is not None:
                try:
                    unpin(m)
                except Exception as e:  # noqa: BLE001 - a failed unpin must not block adoption
                    log.debug("Layer Offload: unpinning %s failed: %s", type(m).__name__, e)
            m.__dict__.pop("_pin", None)
        for attr in MODULE_VBAR_ATTRS:
            if attr in m.__dict__:
                del m.__dict__[attr]
                carried = True
        for p in list(m._parameters.values()) + list(m._buffers.values()):
            if p is None:
                continue
            for attr in TENSOR_VBAR_ATTRS:
                if attr in p.__dict__:
                    del p.__dict__[attr]
                    carried = True
        touched += carried
    vbars = getattr(model, "dynamic_vbars", None)
    if isinstance(vbars, dict) and vbars:
        vbars.clear()
        touched += 1
    return touched


def _release(patcher: Any) -> None:
    """Let DynamicVRAM give the model up: out of ComfyUI's loaded list, pins and VBAR memory freed."""
    mm = comfy.model_management
    for lm in list(getattr(mm, "current_loaded_models", [])):
        other = getattr(lm, "model", None)
        if other is not None and other.is_clone(patcher):
            try:
                lm.model_unload()
            except Exception as e:  # noqa: BLE001
                log.debug("Layer Offload: unloading the dynamic model failed: %s", e)
            if lm in mm.current_loaded_models:
                mm.current_loaded_models.remove(lm)
    for step in ("unpin_all_weights",):
        fn = getattr(patcher, step, None)
        if callable(fn):
            try:
                fn()
            except Exception as e:  # noqa: BLE001
                log.debug("Layer Offload: %s on the dynamic model failed: %s", step, e)
    if not mm.is_device_cpu(patcher.load_device):
        try:
            patcher.partially_unload(None, 1e32)
        except Exception as e:  # noqa: BLE001
            log.debug("Layer Offload: freeing the dynamic model's VBAR failed: %s", e)


def prepare(patcher: Any) -> Any:
    """A patcher the offload class can adopt: DynamicVRAM's hold on the model released, its state stripped."""
    if not is_dynamic(patcher):
        if strip_vbar_state(patcher.model):
            log_once("vbar-leftover", "Layer Offload: removed DynamicVRAM state left on a model before offloading it.",
                     level=logging.INFO)
        return patcher
    delegate = getattr(patcher, "get_non_dynamic_delegate", None)
    chosen = patcher
    if callable(delegate):
        try:
            d = delegate()
            if d is not None and not is_dynamic(d):
                chosen = d
        except Exception as e:  # noqa: BLE001 - fall back to adopting the dynamic patcher's state
            log.debug("Layer Offload: no non-dynamic delegate: %s", e)
    _release(patcher)
    strip_vbar_state(patcher.model)
    log_once("dynamic-adopt", "Layer Offload: a DynamicVRAM model is offloaded as a plain model; DynamicVRAM keeps "
             "managing the other models of the workflow.", level=logging.INFO)
    return chosen
