"""Patches written into weights and taken out again: a forced load's baking (how ComfyUI 0.3.x saves), the backups
a plain clone of the same model leaves, and weight hooks on weights outside the offloaded root (patched as ComfyUI
patches them)."""
from __future__ import annotations

import logging
from typing import Any, Dict

import torch

import comfy.hooks
import comfy.model_management
import comfy.model_patcher
import comfy.utils

from . import patches
from .common import log_once
from .registry import Managed


def bake(patcher: Any, st: Managed, prefix: str) -> None:
    """Write the patches into the host weights (a forced load), keeping the originals to restore."""
    st.handle.unload()  # every weight on its host master
    with torch.no_grad():
        for key in patcher.patches:
            if not key.startswith(prefix):
                continue
            weight = comfy.utils.get_attr(patcher.model, key)
            value = patches.patched_weight(patcher.model, key, patcher.patches, weight.device)
            st.baked[key] = (weight, weight.detach().clone())  # the engine keeps parameter identity
            weight.data.copy_(value)


def restore_baked(st: Managed) -> None:
    """Undo a forced load's baking: the host weights are the originals again."""
    if not st.baked:
        return
    st.handle.unload()
    with torch.no_grad():
        for weight, original in st.baked.values():
            weight.data.copy_(original)
    st.baked.clear()


def restore_shared_backups(patcher: Any) -> None:
    """Put back weights a plain clone of the same model baked a patch into: ComfyUI's clones share one backup dict,
    and ComfyUI's own unpatch restores it before another clone uses the model; the offload patcher does the same
    (the engine then takes its parameters back at the next pass)."""
    backup = getattr(patcher, "backup", None)
    if not backup:
        return
    for key, bk in list(backup.items()):
        if bk.inplace_update:
            comfy.utils.copy_to_param(patcher.model, key, bk.weight)
        else:
            comfy.utils.set_attr_param(patcher.model, key, bk.weight)
    backup.clear()
    for m in patcher.model.modules():
        m.__dict__.pop("comfy_patched_weights", None)


def patch_hooks_outside(patcher: Any, hooks: Any, combined: Dict[str, list]) -> None:
    """Weight hooks on weights outside the offloaded root (ComfyUI keeps those on the device): patched in place, with
    ComfyUI's backups, exactly as ComfyUI patches them on a plain model."""
    counter = None
    counter_cls = getattr(comfy.model_patcher, "MemoryCounter", None)
    max_speed = getattr(getattr(comfy.hooks, "EnumHookMode", None), "MaxSpeed", None)
    if max_speed is not None and getattr(patcher, "hook_mode", None) == max_speed:
        if counter_cls is None:
            log_once("no-memory-counter", "Layer Offload: comfy.model_patcher.MemoryCounter is not in this ComfyUI; "
                     "weight hooks outside the offloaded blocks are patched without caching.", level=logging.INFO)
        else:
            counter = counter_cls(initial=comfy.model_management.get_free_memory(patcher.load_device),
                                  minimum=comfy.model_management.minimum_inference_memory() * 2)
    originals = patcher.get_key_patches()
    keys = set(patcher.model_state_dict().keys())
    for key in combined:
        if key in keys:
            patcher.patch_hook_weight_to_device(hooks=hooks, combined_patches=combined, key=key,
                                                original_weights=originals, memory_counter=counter)
