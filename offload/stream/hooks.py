"""Where the engine's hooks sit on a model, and how they reach the streamer without keeping it alive: the root
module's pre/post hooks (a pass), each unit's pre/post hooks (prepended, so hooks a user registered earlier see the
unit's device weights), a pre-hook on each unit's children (models that call a block's layers, never the block),
a pre-hook on modules outside the blocks (they bring the placement in), a block's own `.compile()`, and the other
methods a unit or its children may be entered through (offload/stream/method_entry.py).
`ModelStreamer` decides what each hook does; this module only puts them on the model and takes them off.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch.nn as nn

from .compile_support import ChildHook, InFlag, compile_block_forward, register_hook_class, restore_compile
from .method_entry import UnitHook, unwrap_unit_methods, wrap_unit_methods


@register_hook_class  # dynamo calls it eagerly, never traces the engine (offload/stream/compile_support.py)
class WeakHook:
    """A hook (or callback) calling a streamer method through a weak reference (no model -> engine -> model cycle)."""

    __slots__ = ("_ref", "_fn", "_index")

    def __init__(self, streamer: Any, fn: Any, index: int | None = None) -> None:
        self._ref = weakref.ref(streamer)
        self._fn = fn
        self._index = index

    def __call__(self, *args: Any) -> Any:
        s = self._ref()
        if s is None:
            return None
        return self._fn(s, *args) if self._index is None else self._fn(s, self._index, *args)



class ModelHooks:
    """The engine's hooks on one model: installed once at setup, removed at detach."""

    def __init__(self) -> None:
        self.handles: list[Any] = []
        self.compile_overrides: list[nn.Module] = []
        self.methods: list[tuple[nn.Module, str]] = []

    def install(self, streamer: Any, model: nn.Module, units: list[nn.Module], in_flags: list[InFlag],
                rest_layout: Any) -> None:
        """Hooks calling `streamer`'s methods (weakly) on the model, on each unit module and its children, and on
        the modules outside the blocks that `rest_layout` lists."""
        cls = type(streamer)
        add = self.handles.append
        add(model.register_forward_pre_hook(WeakHook(streamer, cls._root_pre), prepend=True))
        add(model.register_forward_hook(WeakHook(streamer, cls._root_post), always_call=True))
        for index, module in enumerate(units):
            # prepend: hooks the user registered earlier must already see the unit's device weights
            pre, post = WeakHook(streamer, cls._pre, index), WeakHook(streamer, cls._post, index)
            flag = in_flags[index]
            add(module.register_forward_pre_hook(UnitHook(flag, pre, True), prepend=True))
            add(module.register_forward_hook(UnitHook(flag, post, False), always_call=True))
            self.methods += wrap_unit_methods(module, flag, pre, post)  # encode(), decode(), forward_gen(), ...
            # Some models never call the block container itself (ComfyUI's UNet iterates a
            # TimestepEmbedSequential and calls its layers): the first child to run brings the unit in.
            for child in module.children():
                add(child.register_forward_pre_hook(
                    ChildHook(in_flags[index], WeakHook(streamer, cls._child_pre, index)), prepend=True))
            if compile_block_forward(module):
                self.compile_overrides.append(module)
        # A module outside the blocks called on its own before any block (generate() entering T5's or Whisper's
        # encoder, whose embedding runs first) must not compute on the host copy: it brings the placement in.
        rest = {id(m): m for e in rest_layout.entries for m, _, _ in e.locations if m is not model}
        for sub in rest.values():
            add(sub.register_forward_pre_hook(WeakHook(streamer, cls._rest_pre), prepend=True))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        unwrap_unit_methods(self.methods)
        restore_compile(self.compile_overrides)
        self.compile_overrides.clear()

    def ids(self) -> set[int]:
        """The ids of the hooks installed (a deepcopy of the model leaves them out)."""
        return {h.id for h in self.handles}
