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
engine's hook objects are made opaque (`torch._dynamo.disable`: a graph break at each, run eagerly), hooks become
part of what dynamo guards on (`skip_nnmodule_hook_guards = False`, process-wide), and code compiled before that
without hook guards is dropped (`torch._dynamo.reset_code_caches()`), so every compiled model recompiles once.
"""
from __future__ import annotations

import logging
import sys
from typing import Any

log = logging.getLogger(__name__)

_hook_classes: list[type] = []  # the engine's hook callables (made opaque to dynamo once it is in use)
_prepared = False


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
        return True
    if "torch._dynamo" not in sys.modules:
        return False  # nothing compiled yet: the next pass looks again
    import torch._dynamo

    _prepared = True
    from . import devices  # its activation hooks run at unit boundaries too

    weak_call = getattr(devices, "_WeakCall", None)
    if weak_call is not None and weak_call not in _hook_classes:
        _hook_classes.append(weak_call)
    for cls in _hook_classes:
        _make_opaque(cls)
    if torch._dynamo.config.skip_nnmodule_hook_guards:
        torch._dynamo.config.skip_nnmodule_hook_guards = False
        torch._dynamo.reset_code_caches()  # graphs traced without hook guards must not serve an offloaded model
        log.info("torch.compile: module hooks are guarded from now on (skip_nnmodule_hook_guards=False), so an "
                 "offloaded model never reuses a graph traced without its engine; code compiled earlier recompiles once")
    return True


def _make_opaque(cls: type) -> None:
    import torch._dynamo

    call: Any = cls.__dict__.get("__call__")
    if call is not None and not getattr(call, "_lo_opaque", False):
        wrapped = torch._dynamo.disable(call)
        wrapped._lo_opaque = True
        cls.__call__ = wrapped
