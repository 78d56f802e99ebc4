"""What a streamed unit's output may hold: views of its slot, cloned before the slot is reused. (Tensors autograd
saves for backward are handled by offload/stream/backward.py: a view of the slot is saved as a handle, not as
memory.)"""
from __future__ import annotations

import copy
from typing import Any

import torch

_UNCHANGED = object()


def _unalias_walk(obj: Any, storage_ptr: int) -> Any:
    if isinstance(obj, torch.Tensor):
        if obj.numel() and obj.untyped_storage().data_ptr() == storage_ptr:
            return obj.clone()
        return _UNCHANGED
    if isinstance(obj, (tuple, list)):
        items = [_unalias_walk(o, storage_ptr) for o in obj]
        if all(i is _UNCHANGED for i in items):
            return _UNCHANGED
        new = [o if i is _UNCHANGED else i for o, i in zip(obj, items)]
        return type(obj)(*new) if hasattr(obj, "_fields") else type(obj)(new)
    if isinstance(obj, dict):
        items = {k: _unalias_walk(v, storage_ptr) for k, v in obj.items()}
        if all(i is _UNCHANGED for i in items.values()):
            return _UNCHANGED
        new = copy.copy(obj)  # keeps dict subclasses (model-output classes) intact
        for k, v in items.items():
            if v is not _UNCHANGED:
                new[k] = v
        return new
    return _UNCHANGED


def unalias(output: Any, storage_ptr: int) -> Any:
    """An output that views the slot (a unit returning its own weight) is cloned: the slot is about to be reused."""
    result = _unalias_walk(output, storage_ptr)
    return None if result is _UNCHANGED else result
