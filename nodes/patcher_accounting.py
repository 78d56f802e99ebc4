"""What ComfyUI's memory manager reads and writes of an offload patcher besides its methods: the load accounting
(where this ComfyUI keeps it), the tensors outside the offloaded root (ComfyUI's to place), and what a load tells the
budget (this model works now; its VRAM Budget node applies again)."""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch

import comfy.model_management

from .registry import Managed


def accounting(p: Any) -> Any:
    """Where this ComfyUI keeps a patcher's load accounting: `_memory_measurements` (0.12 to about 0.21) or the
    model (before 0.12, and again since)."""
    return getattr(p, "_memory_measurements", None) or p.model


def set_loaded(p: Any, loaded: int, lowvram: bool, patch_counter: int, uuid: Any,
               device: Optional[torch.device]) -> None:
    """Write what ComfyUI reads after a load or unload: bytes loaded, lowvram, the patches applied, the device."""
    acc = accounting(p)
    acc.model_loaded_weight_memory = loaded
    acc.model_lowvram = lowvram
    acc.lowvram_patch_counter = patch_counter
    acc.current_weight_patches_uuid = uuid
    acc.model_offload_buffer_memory = 0
    if device is not None:
        try:
            if hasattr(type(p), "model_device"):
                p.model_device = device
            else:
                p.model.device = device
        except AttributeError:  # a transformers model's `device` is a read-only property (from its weights)
            pass


def move_own_tensors(module: torch.nn.Module, device: Any) -> None:
    """Move a module's own parameters and buffers (not its children: those may be the engine's)."""
    for name, p in module._parameters.items():
        if p is not None and p.device != torch.device(device):
            p.data = p.data.to(device)
    for name, b in module._buffers.items():
        if b is not None and b.device != torch.device(device):
            module._buffers[name] = b.to(device)


def outside_modules(patcher: Any, root: torch.nn.Module) -> List[Tuple[str, torch.nn.Module]]:
    """Modules of the patcher's model that hold tensors but are outside the offloaded root."""
    inside = {id(m) for m in root.modules()}
    out = []
    for name, m in patcher.model.named_modules():
        if id(m) in inside:
            continue
        if any(True for _ in m.parameters(recurse=False)) or any(True for _ in m.buffers(recurse=False)):
            out.append((name, m))
    return out


def outside_device_bytes(patcher: Any, root: torch.nn.Module) -> int:
    """Device bytes of the tensors outside the offloaded root (0 when the model loads on the CPU)."""
    load = patcher.load_device
    if comfy.model_management.is_device_cpu(load):
        return 0
    total = 0
    for _, m in outside_modules(patcher, root):
        for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False)):
            if t.device == load:
                total += t.nelement() * t.element_size()
    return total


def mark_active(patcher: Any, st: Managed) -> None:
    """ComfyUI loads this model for a node's work: it leads its priority in the budget (idle models of the same
    priority give it their bytes now, least recently used first), and it carries its patcher's `fast_disk`."""
    st.fast_disk = bool(getattr(patcher, "fast_disk", False))  # host_memory: releases RAM first under pressure
    mark = getattr(st.handle, "mark_active", None)
    if callable(mark):
        mark()


def reassert_budget(st: Managed) -> None:
    """A model wired to a VRAM Budget node re-applies that budget when it loads (the latest loaded wins)."""
    apply = getattr(st.budget, "apply", None)
    if callable(apply):
        apply()
