"""Units entered through a method other than `forward`: Mimi's quantizer through `.encode()` / `.decode()` (Moshi's
generate, CSM's audio output), ComfyUI 0.33's WAN Animate blocks through `forward_gen` / `forward_pose` /
`kv_from_input` (which read the block's own `modulation` before any child runs). Forward hooks never see those
calls, so the unit would compute on its host master (a device mismatch on a GPU).

`wrap_unit_methods` puts a `MethodEntry` on the unit and on each of its children, in the instance's `__dict__`, for
the public methods their own classes define (not torch's, not a library base class's, not a setter or loader) that
may compute with the unit's weights (`method_reads.MethodReads`: a helper that touches no weight stays plain): when
the unit is not in, the call brings it in exactly as a forward would (the unit's pre-hook), and lets it go after (its
forward hook); the unit's own forward hooks inside the call do nothing (`InFlag.nested`), so a method that calls
`forward` stays one entry. While the unit is in, the wrapper only calls through. `unwrap_unit_methods` takes them
off (detach).

A `MethodEntry` is the bound method to whoever looks at it: `inspect.signature`, `inspect.ismethod`, `__name__`,
`__qualname__`, `__doc__`, `__module__`, `__wrapped__` (as the function has it), `__self__` (the module),
`__func__` (the class's own function), `==` and `hash` with the plain bound method, `repr`, `functools.partial`,
`weakref.WeakMethod`, pickling (`getattr(module, name)`, as a bound method pickles) and `copy.deepcopy` (a plain
bound method of the module's copy, an ordinary module). Only `type()` tells it apart.
"""
from __future__ import annotations

import copy
import types
from typing import Any

import torch.nn as nn

from .compile_support import InFlag, register_hook_class
from .method_reads import MethodReads

# library base classes whose methods are not a block's compute (loading, adapters, generation, casting ops)
_BASE_MODULES = ("torch.", "transformers.modeling_utils", "transformers.generation", "transformers.integrations",
                 "diffusers.models.modeling_utils", "diffusers.loaders", "peft.", "accelerate.", "comfy.ops")
_NOT_COMPUTE = ("set_", "get_", "load_", "save_", "register_", "enable_", "disable_", "fuse", "unfuse", "init",
                "reset", "tie_", "resize_", "prune", "extra_repr", "from_", "to_", "train", "eval", "compile")
_MODULE_NAMES = frozenset(dir(nn.Module))
# what a bound method reads from its function (the wrapper's own class would answer some of them otherwise)
_FROM_FUNCTION = frozenset({"__doc__", "__module__", "__name__", "__qualname__", "__annotations__", "__wrapped__",
                            "__dict__", "__defaults__", "__kwdefaults__", "__code__", "__globals__", "__closure__",
                            "__type_params__", "__text_signature__", "__signature__"})
_get = object.__getattribute__


def entry_methods(module: nn.Module) -> list[str]:
    """The public methods of `module`'s own classes that may compute with its weights, by name (which of them do is
    `MethodReads`')."""
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
    # `module.<name>(...)` that brings its unit in first when it is not (the unit's pre-hook) and lets it go after
    # (the unit's forward hook); to everything else the plain bound method (see the module docstring). No class
    # docstring: `__doc__` is the function's.

    __slots__ = ("_s", "__weakref__")

    def __new__(cls, fn: Any, module: Any, *engine: Any) -> Any:
        if engine:
            return object.__new__(cls)
        # `type(bound)(func, obj)`, as weakref.WeakMethod rebuilds a method: the method as the module has it now
        plain = types.MethodType(fn, module)
        current = getattr(module, getattr(fn, "__name__", ""), None)
        return current if current is not plain and current == plain else plain

    def __init__(self, fn: Any, module: nn.Module, unit: nn.Module | None = None, flag: InFlag | None = None,
                 pre: Any = None, post: Any = None) -> None:
        if unit is not None:  # (the two-argument form returned an existing object from __new__)
            # WeakHooks to the streamer in pre/post: no model -> engine -> model cycle
            object.__setattr__(self, "_s", (fn, module, unit, flag, pre, post))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fn, module, unit, flag, pre, post = _get(self, "_s")
        if flag.on:
            return fn(module, *args, **kwargs)
        pre(unit, args)
        flag.by_method += 1
        try:
            output = fn(module, *args, **kwargs)
        except BaseException:
            flag.by_method -= 1
            flag.nested = 0
            post(unit, args, None)  # the unit goes back (and a pass lock taken outside a pass with it)
            raise
        flag.by_method -= 1
        replaced = post(unit, args, output)
        return output if replaced is None else replaced

    def __getattribute__(self, name: str) -> Any:
        if name in _FROM_FUNCTION:
            return getattr(_get(self, "_s")[0], name)
        if name == "__func__":
            return _get(self, "_s")[0]
        if name == "__self__":
            return _get(self, "_s")[1]
        if name == "__class__":
            return types.MethodType  # isinstance(m, types.MethodType), inspect.ismethod, inspect.signature
        return _get(self, name)

    def __getattr__(self, name: str) -> Any:  # a bound method reads any other attribute from its function
        return getattr(_get(self, "_s")[0], name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"'method' object has no attribute {name!r}")

    def __eq__(self, other: Any) -> Any:
        if type(other) is types.MethodType or type(other) is MethodEntry:
            fn, module = _get(self, "_s")[:2]
            return other.__self__ is module and other.__func__ == fn
        return NotImplemented

    def __hash__(self) -> int:
        fn, module = _get(self, "_s")[:2]
        return hash(types.MethodType(fn, module))

    def __repr__(self) -> str:
        fn, module = _get(self, "_s")[:2]
        return repr(types.MethodType(fn, module))

    def __reduce_ex__(self, protocol: Any) -> Any:  # pickled as the plain bound method is
        fn, module = _get(self, "_s")[:2]
        return getattr, (module, fn.__name__)

    def __reduce__(self) -> Any:
        return self.__reduce_ex__(2)

    def __deepcopy__(self, memo: dict) -> Any:  # as copy.deepcopy copies a bound method
        fn, module = _get(self, "_s")[:2]
        return types.MethodType(fn, copy.deepcopy(module, memo))

    def __dir__(self) -> list[str]:
        fn, module = _get(self, "_s")[:2]
        return dir(types.MethodType(fn, module))


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
    """`MethodEntry` wrappers on `unit` and its children, for the methods that may compute with the unit's weights;
    returns what was wrapped (for `unwrap_unit_methods`)."""
    reads = MethodReads()
    wrapped = []
    for module in (unit, *unit.children()):
        for name in entry_methods(module):
            if not reads.reads(module, name):
                continue  # a helper that touches no weight stays the plain bound method
            fn = getattr(type(module), name)
            module.__dict__[name] = MethodEntry(fn, module, unit, flag, pre, post)
            wrapped.append((module, name))
    return wrapped


def unwrap_unit_methods(wrapped: list[tuple[nn.Module, str]]) -> None:
    for module, name in wrapped:
        if type(module.__dict__.get(name)) is MethodEntry:
            del module.__dict__[name]
    wrapped.clear()
