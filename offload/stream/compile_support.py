"""torch.compile over offloaded models: dynamo runs the engine's hooks, and never reuses a graph traced without them.

The engine streams a unit from its forward pre-hook and gives the slot back in its forward hook. Two things go wrong
under `torch.compile` unless the process is prepared:

- dynamo skips guards on module hooks by default (`torch._dynamo.config.skip_nnmodule_hook_guards`): a graph traced
  for another instance of the same class without hooks (a plain pipeline compiled earlier, the other of Wan 2.2's two
  experts) is reused for the offloaded one, which then streams nothing and computes on its host masters;
- dynamo traces into the hooks themselves (locks, weak references, the prefetch worker), recompiling them per unit
  and failing in fake-tensor tracing on some models.

`prepare_dynamo()` fixes both, once per process, as soon as dynamo is in use and a model is offloaded (at offload
time, or at the start of the next pass when dynamo was imported later; torch._dynamo is never imported here): the
engine's hook objects are made opaque (a graph break at each, run eagerly with every frame they call, as
`torch._dynamo.disable` does, without its wrapper frame on the eager path), hooks become
part of what dynamo guards on (`skip_nnmodule_hook_guards = False`, process-wide), and code compiled before that
without hook guards is dropped (`torch._dynamo.reset_code_caches()`), so every compiled model recompiles once.
"""
from __future__ import annotations

import logging
import sys
import weakref
from typing import Any

log = logging.getLogger(__name__)

_hook_classes: list[type] = []  # the engine's hook callables (made opaque to dynamo once it is in use)
_prepared = False


class InFlag:
    """Whether a unit is in (its container's pre-hook ran): a plain flag, so dynamo can guard on it."""

    def __init__(self) -> None:
        self.on = False
        self.by_method = 0  # the unit was brought in by a method other than forward (offload/stream/hooks.py)
        self.nested = 0  # its own forward hooks running inside that method: they have nothing to do


class ChildHook:
    """A unit child's pre-hook: brings the unit in when its container is never called (ComfyUI's UNet calls the
    layers of a TimestepEmbedSequential). While the unit is in it only reads a flag, which dynamo traces and guards
    on instead of breaking the graph at every layer of a compiled block (`slow`: the engine's opaque hook)."""

    def __init__(self, flag: InFlag, slow: Any) -> None:
        self.flag = flag
        self.slow = slow  # refers to the streamer weakly: no model -> hook -> engine -> model cycle

    def __call__(self, module: Any, args: Any) -> Any:
        if self.flag.on:
            return None
        return self.slow(module, args)


class _CompileForward:
    """`unit.compile(...)` on an offloaded block (diffusers' `compile_repeated_blocks` calls it per block): compiles
    the block's forward instead of its whole call, so the engine's hooks run eagerly around the compiled graph and
    `fullgraph=True` works (torch's `Module.compile` would compile `_call_impl`, hooks included)."""

    def __init__(self, module: Any) -> None:
        self._module = weakref.ref(module)

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        import torch

        module = self._module()
        if module is not None:
            module.__dict__["forward"] = torch.compile(module.forward, *args, **kwargs)


def compile_block_forward(module: Any) -> bool:
    """Make `module.compile(...)` compile the block's forward only (`_CompileForward`); False where the module has
    a `compile` of its own on the instance already (left alone)."""
    if "compile" in module.__dict__:
        return False
    module.__dict__["compile"] = _CompileForward(module)
    return True


def restore_compile(modules: list[Any]) -> None:
    """Undo `compile_block_forward` (detach)."""
    for module in modules:
        if isinstance(module.__dict__.get("compile"), _CompileForward):
            del module.__dict__["compile"]


def register_hook_class(cls: type) -> type:
    """Mark a hook class whose instances dynamo must call eagerly, never trace (used as a decorator)."""
    _hook_classes.append(cls)
    if _prepared:
        _make_opaque(cls)
    return cls


def prepare_dynamo() -> bool:
    """Prepare dynamo for offloaded models (see the module docstring) if it is loaded; returns whether it is ready."""
    global _prepared
    if _prepared:
        for cls in _hook_classes:  # torch._dynamo.reset() clears per-code settings: set them again, cheaply
            code = getattr(cls.__dict__["__call__"], "__code__", None)
            if code is not None:
                _skip_frames(code)
        return True
    if "torch._dynamo" not in sys.modules:
        return False  # nothing compiled yet: the next pass looks again
    import torch._dynamo

    _prepared = True
    from . import devices  # its activation hooks run at unit boundaries too

    weak_call = getattr(devices, "_WeakCall", None)
    if weak_call is not None and weak_call not in _hook_classes:
        _hook_classes.append(weak_call)
    if torch._dynamo.config.skip_nnmodule_hook_guards:
        torch._dynamo.config.skip_nnmodule_hook_guards = False
        torch._dynamo.reset_code_caches()  # graphs traced without hook guards must not serve an offloaded model
        log.info("torch.compile: module hooks are guarded from now on (skip_nnmodule_hook_guards=False), so an "
                 "offloaded model never reuses a graph traced without its engine; code compiled earlier recompiles once")
    for cls in _hook_classes:
        _make_opaque(cls)
    return True


def _make_opaque(cls: type) -> None:
    """Dynamo graph-breaks at a call of `cls` and runs it eagerly, its callees too; the eager path is unchanged (no
    wrapper frame: `torch._dynamo.disable` would add one to every hook call)."""
    call: Any = cls.__dict__.get("__call__")
    if call is None or getattr(call, "_lo_opaque", False):
        return
    if _skip_frames(call.__code__):
        call._torchdynamo_disable = True  # inlining stops here (a graph break), as for torch.compiler.disable
        call._lo_opaque = True
        return
    import torch._dynamo  # a torch without per-code frame strategies: the wrapper, one more frame per hook call

    wrapped = torch._dynamo.disable(call)
    wrapped._lo_opaque = True
    cls.__call__ = wrapped


def _skip_frames(code: Any) -> bool:
    """Frames of `code`, and every frame they call, are never compiled by dynamo (run as they are); False where this
    torch has no per-code frame strategies."""
    global _skip_strategy
    if _skip_strategy is None:
        try:
            from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy

            _skip_strategy = (set_code_exec_strategy, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP))
        except (ImportError, AttributeError, TypeError):
            _skip_strategy = False
    if not _skip_strategy:
        return False
    set_strategy, strategy = _skip_strategy
    set_strategy(code, strategy)
    return True


_skip_strategy: Any = None
