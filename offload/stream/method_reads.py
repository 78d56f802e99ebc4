"""Which methods of a unit's modules may compute with the unit's weights: `method_entry.wrap_unit_methods` wraps
only those, so a helper that touches no weight stays the plain bound method it was (diffusers' Attention
`prepare_attention_mask` / `head_to_batch_dim`, which read `self.heads`; a method deriving a shape or a mask from the
config).

A method is read from its bytecode (`dis`), with the methods, properties and nested functions it reaches through
`self`, for what it takes from `self`:

- `self.<int, string, config ...>`, a child holding no tensor (dropout, an activation): no weight;
- `self.helper(...)`, `self.prop`: as `helper` / the property's getter;
- anything else is taken as computing with the weights: a parameter or buffer, a plain tensor attribute, a child
  holding tensors (called or not: a child's call outside a pass would bring the unit in and leave it in), `self`
  passed on or called, `super()`, a method of torch's `nn.Module` (`parameters()`, `state_dict()`), an attribute made
  at run time, or bytecode this reading does not know. Unsure means wrapped: a wrapper is always correct (and looks
  like the plain bound method), only not always needed.
"""
from __future__ import annotations

import dis
import enum
import inspect
import types
from typing import Any

import torch
import torch.nn as nn

_ATTR_OPS = ("LOAD_ATTR", "LOAD_METHOD")
_PLAIN = (int, float, complex, bool, str, bytes, type(None), range, slice, enum.Enum, torch.dtype, torch.device,
          torch.Size, torch.memory_format, torch.layout, types.BuiltinFunctionType, types.FunctionType, type)
_MISSING = object()


def _module_holds_tensors(module: nn.Module) -> bool:
    """Whether `module` or a module inside it holds a parameter, a buffer or a plain tensor attribute."""
    for sub in module.modules():
        if any(p is not None for p in sub._parameters.values()) or any(b is not None for b in sub._buffers.values()):
            return True
        if any(isinstance(v, torch.Tensor) for v in vars(sub).values()):
            return True
    return False


def _holds_weights(value: Any, depth: int = 3) -> bool:
    """Whether a plain attribute's value holds a tensor or a module with tensors (through containers, bound
    methods, partials and the attributes of plain objects such as configs, `depth` levels down)."""
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, nn.Module):
        return _module_holds_tensors(value)
    if isinstance(value, _PLAIN) or depth <= 0:
        return False
    if isinstance(value, types.MethodType):
        return _holds_weights(value.__self__, depth - 1)
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(_holds_weights(v, depth - 1) for v in value)
    if isinstance(value, dict):
        return any(_holds_weights(v, depth - 1) for v in value.values())
    inner = getattr(value, "__dict__", None)
    if isinstance(inner, dict):
        return any(_holds_weights(v, depth - 1) for v in list(inner.values()))
    return False


class MethodReads:
    """Answers `reads(module, name)` for the modules of one unit (remembering each answer)."""

    def __init__(self) -> None:
        self._memo: dict[tuple[int, str], bool] = {}

    def reads(self, module: nn.Module, name: str) -> bool:
        """Whether calling `module.<name>` may compute with the unit's weights."""
        key = (id(module), name)
        if key in self._memo:
            return self._memo[key]
        self._memo[key] = False  # a method reached again through a cycle adds nothing to what the cycle reads
        static = inspect.getattr_static(type(module), name, _MISSING)
        if isinstance(static, property):
            result = static.fget is None or self._function(module, static.fget)
        elif isinstance(static, types.FunctionType):
            result = self._function(module, static)
        else:
            result = True
        self._memo[key] = result
        return result

    def _function(self, module: nn.Module, fn: Any) -> bool:
        try:
            fn = inspect.unwrap(fn)  # decorators made with functools.wraps (torch.no_grad(), deprecations)
        except ValueError:
            return True
        code = getattr(fn, "__code__", None)
        if not isinstance(fn, types.FunctionType) or code is None or code.co_argcount < 1:
            return True
        if fn.__module__ is not None and fn.__module__.startswith("torch."):
            return True  # nn.Module's own methods hand out the module's tensors (parameters(), state_dict(), ...)
        return self._code(module, code, code.co_varnames[0], top=True)

    def _code(self, module: nn.Module, code: types.CodeType, me: str, top: bool) -> bool:
        if "__class__" in code.co_freevars:
            return True  # zero-argument super(): the parent's method on self, unseen here
        cell = me in code.co_cellvars or not top  # `me` lives in a cell: LOAD_DEREF reads it, LOAD_FAST builds closures
        instrs = list(dis.get_instructions(code))
        for i, ins in enumerate(instrs):
            op = ins.opname
            if op == "LOAD_SUPER_ATTR" or (op in ("LOAD_GLOBAL", "LOAD_NAME") and ins.argval == "super"):
                return True
            if op.startswith("LOAD_FAST") or op in ("LOAD_DEREF", "LOAD_CLOSURE"):
                names = ins.argval if isinstance(ins.argval, tuple) else (ins.argval,)
                if me not in names:
                    continue
                if (op == "LOAD_DEREF") != cell:
                    continue  # a closure being built: the nested code is read below
                if names[-1] != me or names.count(me) > 1:
                    return True  # self below another value on the stack: passed on
                if self._use(module, instrs, i + 1):
                    return True
            elif op.startswith(("STORE_FAST", "STORE_DEREF", "DELETE_FAST", "DELETE_DEREF")):
                stored = ins.argval if isinstance(ins.argval, tuple) else (ins.argval,)
                if me in stored:
                    return True
        for const in code.co_consts:
            if isinstance(const, types.CodeType) and me in const.co_freevars and self._code(module, const, me, False):
                return True
        return False

    def _use(self, module: nn.Module, instrs: list[dis.Instruction], j: int) -> bool:
        """What the instruction after a load of `self` does with it."""
        if j >= len(instrs):
            return True
        nxt = instrs[j]
        if nxt.opname in _ATTR_OPS:
            return self._attribute(module, nxt.argval)
        if nxt.opname in ("STORE_ATTR", "DELETE_ATTR"):
            return any(nxt.argval in module.__dict__.get(k, {}) for k in ("_parameters", "_buffers", "_modules"))
        return True

    def _attribute(self, module: nn.Module, attr: str) -> bool:
        """Whether `self.<attr>`, however used, may reach the weights."""
        own = module.__dict__
        for kind in ("_parameters", "_buffers"):
            if attr in own.get(kind, {}):
                return own[kind][attr] is not None
        if attr in own.get("_modules", {}):
            child = own["_modules"][attr]
            return child is not None and _module_holds_tensors(child)
        if attr in own:
            return _holds_weights(own[attr])
        static = inspect.getattr_static(type(module), attr, _MISSING)
        if static is _MISSING:
            return True  # made at run time, or nn.Module.__getattr__: not known here
        if isinstance(static, (staticmethod, classmethod)):
            return False  # never sees self
        if isinstance(static, (property, types.FunctionType)):
            return self.reads(module, attr)
        if hasattr(type(static), "__get__"):
            return True  # another descriptor: what it returns is not known here
        return _holds_weights(static)
