"""Units entered through a method other than `forward`: Mimi's quantizer through `.encode()` / `.decode()` (Moshi's
generate, CSM's audio output), ComfyUI 0.33's WAN Animate blocks through `forward_gen` / `forward_pose` /
`kv_from_input` (which read the block's own `modulation` before any child runs). Forward hooks never see those
calls, so the unit would compute on its host master (a device mismatch on a GPU).

`wrap_unit_methods` puts a `MethodEntry` on the unit and on each of its children, in the instance's `__dict__`, for
every public method their own classes define (not torch's, not a library base class's, not a setter or loader):
when the unit is not in, the call brings it in exactly as a forward would (the unit's pre-hook), and lets it go
after (its forward hook); the unit's own forward hooks inside the call do nothing (`InFlag.nested`). While the unit
is in, the wrapper only calls through. `unwrap_unit_methods` takes them off (detach); a deepcopy gets plain bound
methods of the copy.
"""
from __future__ import annotations

import types
from typing import Any

import torch.nn as nn

from .compile_support import InFlag, register_hook_class

# library base classes whose methods are not a block's compute (loading, adapters, generation, casting ops)
_BASE_MODULES = ("torch.", "transformers.modeling_utils", "transformers.generation", "transformers.integrations",
                 "diffusers.models.modeling_utils", "diffusers.loaders", "peft.", "accelerate.", "comfy.ops")
_NOT_COMPUTE = ("set_", "get_", "load_", "save_", "register_", "enable_", "disable_", "fuse", "unfuse", "init",
                "reset", "tie_", "resize_", "prune", "extra_repr", "from_", "to_", "train", "eval", "compile")
_MODULE_NAMES = frozenset(dir(nn.Module))


def entry_methods(module: nn.Module) -> list[str]:
    """The public methods of `module`'s own classes that may compute with its weights."""
    names: dict[str, None] = {}
    for cls in type(module).__mro__:
        if cls is nn.Module or cls is object or cls.__module__.startswith(_BASE_MODULES):
            continue
        for name, value in vars(cls).items():
            if (isinstance(value, types.FunctionType) and not name.startswith("_") and name != "forward"
                    and name not in _MODULE_NAMES and not name.startswith(_NOT_COMPUTE)):
                names[name] = None
    return [n for n in names if n not in module.__dict__]


@register_hook_class  # dynamo calls it eagerly, never traces the engine (offload/stream/compile_support.py)
class MethodEntry:
    """`module.<name>(...)` that brings its unit in first when it is not (the unit's pre-hook) and lets it go after
    (the unit's forward hook)."""

    __slots__ = ("_fn", "_module", "_unit", "_flag", "_pre", "_post")

    def __init__(self, fn: Any, module: nn.Module, unit: nn.Module, flag: InFlag, pre: Any, post: Any) -> None:
        self._fn = fn
        self._module = module
        self._unit = unit
        self._flag = flag
        self._pre = pre  # WeakHooks to the streamer: no model -> engine -> model cycle
        self._post = post

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        flag = self._flag
        if flag.on:
            return self._fn(self._module, *args, **kwargs)
        self._pre(self._unit, args)
        flag.by_method += 1
        try:
            output = self._fn(self._module, *args, **kwargs)
        except BaseException:
            flag.by_method -= 1
            flag.nested = 0
            self._post(self._unit, args, None)  # the unit goes back (and a pass lock taken outside a pass with it)
            raise
        flag.by_method -= 1
        replaced = self._post(self._unit, args, output)
        return output if replaced is None else replaced

    def __deepcopy__(self, memo: dict) -> Any:
        copy = memo.get(id(self._module))
        return types.MethodType(self._fn, copy) if copy is not None else self

    def __reduce__(self) -> Any:  # pickled as the plain bound method
        return getattr, (self._module, self._fn.__name__)


@register_hook_class
class UnitHook:
    """A unit's own forward pre/post hook, idle while a method call brought the unit in (`MethodEntry`)."""

    __slots__ = ("_flag", "_hook", "_is_pre")

    def __init__(self, flag: InFlag, hook: Any, is_pre: bool) -> None:
        self._flag = flag
        self._hook = hook
        self._is_pre = is_pre

    def __call__(self, *args: Any) -> Any:
        flag = self._flag
        if flag.by_method:
            if self._is_pre:
                flag.nested += 1
                return None
            if flag.nested:
                flag.nested -= 1
                return None
        return self._hook(*args)


def wrap_unit_methods(unit: nn.Module, flag: InFlag, pre: Any, post: Any) -> list[tuple[nn.Module, str]]:
    """`MethodEntry` wrappers on `unit` and its children; returns what was wrapped (for `unwrap_unit_methods`)."""
    wrapped = []
    for module in (unit, *unit.children()):
        for name in entry_methods(module):
            fn = getattr(type(module), name)
            module.__dict__[name] = MethodEntry(fn, module, unit, flag, pre, post)
            wrapped.append((module, name))
    return wrapped


def unwrap_unit_methods(wrapped: list[tuple[nn.Module, str]]) -> None:
    for module, name in wrapped:
        if isinstance(module.__dict__.get(name), MethodEntry):
            del module.__dict__[name]
    wrapped.clear()
