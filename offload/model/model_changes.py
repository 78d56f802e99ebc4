"""Changes to an offloaded model after offloading: refused at the call, or made to take effect; and `copy.deepcopy`.

The engine owns every tensor it laid out: the module holds views of a host master (or of a device copy), and each
pass swaps them. A change made through the module afterwards would be silently undone at the next pass, so:

- **Conversions** (`.to(dtype)`, `.half()`, `.bfloat16()`, `.cuda()`, `.to(memory_format=...)`, diffusers'
  `enable_layerwise_casting`: everything `nn.Module._apply` runs) are refused at the call while no pass runs,
  naming the tensor and `detach()`, before anything changed: each module of the model gets an `_apply` of its own
  that first runs the conversion on the engine's tensors one at a time (a conversion that changes nothing, like
  ComfyUI's `.to(offload_device)` of a host master, returns the tensor itself and passes). During a pass (a hook that
  casts weights for the forward, as layerwise casting set up before offloading does) conversions run as torch runs
  them: the engine binds its own tensors again when the unit finishes.
- **`param.data = tensor`** cannot be intercepted; it is found at the next pass start (`WriteWatch.reclaim`, the
  parameter no longer views the engine's bytes) and takes effect when the new data has the same shape and dtype:
  its values are copied into the host master (or the resident device copy) and the parameter views the engine's
  bytes again, as `load_state_dict` would write them. Another shape or dtype is `ModelChangedError`, naming detach().
- **`copy.deepcopy(model)`** (or of any module inside it) gives an ordinary model: every tensor the engine owns
  copied to the device it had before offloading (the values the model computes with now), no hooks, no handle.
  The original keeps streaming; the copy can be offloaded on its own.
"""
from __future__ import annotations

import copy
import weakref
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

from .layout import TensorLayout, _assemble, _walk_leaves


# what the streamer puts in a module's __dict__ (stream/ is above this layer: by name): a copy leaves them out
_ENGINE_ATTRS = ("_CompileForward", "MethodEntry")


class ModelChangedError(RuntimeError):
    """A change to an offloaded model that cannot reach the engine's copies (detach() first)."""


def _describe(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {t.dtype} on {t.device}"


class ModelChanges:
    """Guards one offloaded model's modules against conversions, and gives `copy.deepcopy` an ordinary copy."""

    def __init__(self, model: nn.Module, layouts: list[TensorLayout], in_pass: Callable[[], bool],
                 hook_ids: Callable[[], set[int]]) -> None:
        self._in_pass = in_pass  # the streamer's (through a weak reference: no model -> engine -> model cycle)
        self._hook_ids = hook_ids
        self.layouts = layouts
        self._paths = {id(m): p for p, m in model.named_modules(remove_duplicate=False)}
        self._owned: dict[int, list[tuple[str, str]]] = {}  # id(module) -> [(attr, kind)] the engine owns there
        for layout in layouts:
            for entry in layout.entries:
                for module, attr, kind in entry.locations:
                    self._owned.setdefault(id(module), []).append((attr, kind))
        self._modules: list[weakref.ref] = []
        self.checking = False  # a conversion of an enclosing module was checked already (its subtree included)
        me = weakref.ref(self)
        for module in model.modules():
            if "_apply" in module.__dict__ or "__deepcopy__" in module.__dict__:
                continue  # someone else's per-instance override: left alone
            module.__dict__["_apply"] = _GuardedApply(me, weakref.ref(module))
            module.__dict__["__deepcopy__"] = _OrdinaryDeepcopy(me, weakref.ref(module))
            self._modules.append(weakref.ref(module))

    def remove(self) -> None:
        """Take the per-module overrides off again (detach)."""
        for ref in self._modules:
            module = ref()
            if module is None:
                continue
            for key, cls in (("_apply", _GuardedApply), ("__deepcopy__", _OrdinaryDeepcopy)):
                if isinstance(module.__dict__.get(key), cls):
                    del module.__dict__[key]
        self._modules.clear()

    # conversions ----------------------------------------------------------------------------------
    def _owned_tensors(self, module: nn.Module, recurse: bool) -> Iterator[tuple[nn.Module, str, torch.Tensor]]:
        for sub in (module.modules() if recurse else (module,)):
            for attr, kind in self._owned.get(id(sub), ()):
                t = (sub._parameters if kind == "param" else sub._buffers).get(attr)
                if t is not None:
                    yield sub, attr, t

    def check_apply(self, module: nn.Module, fn: Callable[[torch.Tensor], Any], recurse: bool) -> None:
        """Raise ModelChangedError if `fn` would change a tensor the engine owns (nothing is changed here)."""
        if self._in_pass():
            return  # a hook casting weights for this forward: the engine binds its own tensors again afterwards
        with torch.no_grad():
            for sub, attr, t in self._owned_tensors(module, recurse):
                out = fn(t)
                if out is t or (isinstance(out, torch.Tensor) and out.dtype == t.dtype and out.device == t.device
                                and out.shape == t.shape and out.stride() == t.stride()
                                and out.data_ptr() == t.data_ptr()):
                    del out
                    continue
                path = self._paths.get(id(sub), "")
                name = f"{path}.{attr}" if path else attr
                new = _describe(out) if isinstance(out, torch.Tensor) else type(out).__name__
                raise ModelChangedError(
                    f"{name}: this conversion ({_describe(t)} -> {new}) would change a tensor of an offloaded model, "
                    f"which the offload engine owns; the streamed copies would not follow it. Make the change before "
                    f"offload_module(), or call handle.detach() first, change the model, then offload it again")

    # deepcopy ---------------------------------------------------------------------------------------
    def seed_memo(self, memo: dict[int, Any]) -> None:
        """Put an ordinary copy of every tensor the engine owns into a deepcopy memo (once per deepcopy)."""
        key = id(self)
        if memo.get(key) is self:
            return
        memo[key] = self
        keep = memo.setdefault(id(memo), [])
        for layout in self.layouts:
            for entry in layout.entries:
                for module, attr, kind in entry.locations:
                    current = (module._parameters if kind == "param" else module._buffers).get(attr)
                    if current is None or id(current) in memo:
                        continue
                    memo[id(current)] = _ordinary(current, entry, kind)
                    keep.append(current)

    def deepcopy_module(self, module: nn.Module, memo: dict[int, Any]) -> nn.Module:
        """An ordinary copy of `module` (see the module docstring)."""
        self.seed_memo(memo)
        cls = type(module)
        y = cls.__new__(cls)
        memo[id(module)] = y
        engine_hooks = self._hook_ids()
        state = {}
        for k, v in module.__dict__.items():
            if k == "_layer_offload_handle" or isinstance(v, (_GuardedApply, _OrdinaryDeepcopy)) or \
                    type(v).__name__ in _ENGINE_ATTRS:
                continue
            if k.endswith("_hooks") or k.endswith("_hooks_with_kwargs") or k.endswith("_hooks_always_called"):
                if isinstance(v, dict) and any(h in engine_hooks for h in v):
                    v = type(v)((h, fn) for h, fn in v.items() if h not in engine_hooks)
            state[k] = v
        state = copy.deepcopy(state, memo)
        if hasattr(y, "__setstate__"):
            y.__setstate__(state)
        else:
            y.__dict__.update(state)
        return y


def _ordinary(current: torch.Tensor, entry: Any, kind: str) -> torch.Tensor:
    """`current` (a view of a host master, a device copy or the file) as an independent tensor on the device the
    entry had before offloading."""
    with torch.no_grad():
        leaves = [leaf.detach().to(entry.device, copy=True) for leaf in _walk_leaves(current, entry.recipe)]
        value = leaves[0] if isinstance(entry.recipe, int) else _assemble(entry.recipe, leaves.__getitem__)
    if kind != "param":
        return value
    param = nn.Parameter(value, requires_grad=current.requires_grad)
    if current.grad is not None:
        param.grad = current.grad.detach().to(entry.device, copy=True)
    return param


class _GuardedApply:
    """A module's `_apply` (what `.to()`, `.half()`, `.cuda()` call) that refuses to change the engine's tensors."""

    def __init__(self, changes: weakref.ref, module: weakref.ref) -> None:
        self._changes = changes
        self._module = module

    def __call__(self, fn: Callable[[torch.Tensor], Any], recurse: bool = True) -> nn.Module:
        module = self._module()
        changes = self._changes()
        if changes is None or changes.checking:
            return type(module)._apply(module, fn, recurse)
        changes.check_apply(module, fn, recurse)
        changes.checking = recurse  # the children's own _apply need not check their tensors again
        try:
            return type(module)._apply(module, fn, recurse)
        finally:
            changes.checking = False


class _OrdinaryDeepcopy:
    """A module's `__deepcopy__`: an ordinary copy, not a second engine (see the module docstring)."""

    def __init__(self, changes: weakref.ref, module: weakref.ref) -> None:
        self._changes = changes
        self._module = module

    def __call__(self, memo: dict[int, Any]) -> nn.Module:
        module = self._module()
        changes = self._changes()
        if changes is None:  # the engine is gone: the plain copy of the module as it is
            cls = type(module)
            y = cls.__new__(cls)
            memo[id(module)] = y
            state = {k: v for k, v in module.__dict__.items()
                     if not isinstance(v, (_GuardedApply, _OrdinaryDeepcopy)) and type(v).__name__ not in _ENGINE_ATTRS}
            y.__dict__.update(copy.deepcopy(state, memo))
            return y
        return changes.deepcopy_module(module, memo)
