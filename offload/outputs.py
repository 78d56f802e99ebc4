"""What a streamed unit's output may hold: views of its slot (cloned before the slot is reused), and a guard
on tensors that need grad (backward through streamed weights is refused instead of computing on reused slots)."""
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


class _StreamedBackwardGuard(torch.autograd.Function):
    """Identity in forward; backward refuses: autograd saved views of a slot that later units overwrote."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, name: str) -> torch.Tensor:  # type: ignore[override]
        ctx.unit_name = name
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        raise RuntimeError(
            f"backward through the streamed unit {ctx.unit_name!r} is not supported: its weights lived in a "
            f"device slot that later units reused, so the gradients would be wrong. Run offloaded models under "
            f"torch.no_grad()/torch.inference_mode(), or keep the layers you train resident (units=...)")


def guard_backward(obj: Any, name: str) -> Any:
    """Route every grad-requiring output tensor through the guard (so backward raises instead of lying)."""
    if isinstance(obj, torch.Tensor):
        return _StreamedBackwardGuard.apply(obj, name) if obj.requires_grad else obj
    if isinstance(obj, (tuple, list)):
        items = [guard_backward(o, name) for o in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, dict):
        new = copy.copy(obj)
        for k, v in obj.items():
            new[k] = guard_backward(v, name)
        return new
    return obj
