"""Non-persistent buffers of a model built on the meta device: made the way the model itself makes them.

A model built under `torch.device("meta")` (or an init that puts buffers there too) has every tensor on the meta
device. Its parameters and persistent buffers are in `state_dict()`, so its safetensors file holds them and staging
reads them from there. Non-persistent buffers (`register_buffer(..., persistent=False)`, `nn.Buffer(...,
persistent=False)`: rotary `inv_freq`, Wan's `freqs_cos`, precomputed masks) are in no checkpoint: they are computed
when the module is constructed. `materialize_non_persistent_buffers` recomputes them on the CPU before staging,
module by module, by the first of these that works:

1. the model library's own init for that module: the nearest transformers `PreTrainedModel` above it runs its
   `_init_weights` on a stand-in of the module whose parameters stay on the meta device and whose missing buffers
   are NaN-filled CPU tensors (what `from_pretrained` does for the same buffers); every value must be written;
2. the module's own constructor, re-run on the CPU with the arguments recovered from the module's attributes
   (an argument of the same name, or `_name`; otherwise its default); the new buffers must have the meta ones' shapes.

Values are cast to the meta buffer's dtype (a model cast with `.to(dtype)` casts its buffers too). A buffer neither
way can make is a ValueError naming it; nothing is ever expected from the file for a non-persistent buffer.

`tie_meta_weights` ties again the weights a model declares tied (transformers' `tie_weights()`, as
`from_pretrained` does after loading): `accelerate.init_empty_weights()` replaces every parameter registered while
it is active by a new object, which unties `lm_head.weight` from the embeddings, and a checkpoint holds a tied
weight once.
"""
from __future__ import annotations

import copy
import inspect
import logging
from typing import Any

import torch
import torch.nn as nn

log = logging.getLogger(__name__)


def meta_non_persistent_buffers(model: nn.Module) -> dict[str, tuple[nn.Module, list[str]]]:
    """`{module path: (module, [buffer names])}` of the non-persistent buffers still on the meta device."""
    found: dict[str, tuple[nn.Module, list[str]]] = {}
    for path, mod in model.named_modules():
        names = [n for n, b in mod._buffers.items()
                 if b is not None and b.is_meta and n in mod._non_persistent_buffers_set]
        if names:
            found[path] = (mod, names)
    return found


def tie_meta_weights(model: nn.Module) -> bool:
    """Call the model's own `tie_weights()` when some parameter is still on the meta device (see the module
    docstring); True when it was called. Nothing is read or computed: tied parameters become one object."""
    tie = getattr(model, "tie_weights", None)
    if not callable(tie) or not any(p.is_meta for p in model.parameters()):
        return False
    try:
        tie()
    except Exception as exc:  # noqa: BLE001 - a model whose tying needs real weights: matched as it is
        log.debug("%s.tie_weights() on the meta device failed (%s); weights matched as they are",
                  type(model).__name__, exc)
        return False
    return True


def materialize_non_persistent_buffers(model: nn.Module) -> list[str]:
    """Recompute every non-persistent buffer of `model` still on the meta device on the CPU (see the module
    docstring); returns their names. Raises ValueError for one that cannot be recomputed."""
    todo = meta_non_persistent_buffers(model)
    if not todo:
        return []
    owners = _library_owners(model)
    made: dict[int, torch.Tensor] = {}  # a meta buffer shared by several modules is computed once
    olds: list[torch.Tensor] = []  # kept until the end, so no id in `made` is reused by another tensor
    done: list[str] = []
    for path, (mod, names) in todo.items():
        wanted = [n for n in names if id(mod._buffers[n]) not in made]
        values: dict[str, torch.Tensor] | None = {}
        why: list[str] = []
        if wanted:
            owner = _nearest_owner(path, owners)
            values = _by_library_init(owner, mod, wanted, why) if owner is not None else None
            if values is None:
                values = _by_constructor(mod, wanted, why)
            if values is None:
                qualified = [f"{path}.{n}" if path else n for n in wanted]
                raise ValueError(
                    f"{qualified[0]}: a non-persistent buffer (in no checkpoint) is on the meta device and could not "
                    f"be recomputed ({'; '.join(why)}). Build the model so that its buffers are real (e.g. "
                    f"accelerate.init_empty_weights(include_buffers=False)), or move them off the meta device")
        for n in names:
            old = mod._buffers[n]
            new = made[id(old)] if id(old) in made else values[n]
            made[id(old)] = new
            olds.append(old)
            _replace(mod, n, old, new)
            done.append(f"{path}.{n}" if path else n)
    log.info("recomputed %d non-persistent buffer(s) on the meta device (no checkpoint holds them): %s",
             len(done), ", ".join(done[:4]) + (", ..." if len(done) > 4 else ""))
    return done


def _replace(mod: nn.Module, name: str, old: torch.Tensor, new: torch.Tensor) -> None:
    """Swap the buffer, and any plain attribute of the module that aliased the meta tensor."""
    mod._buffers[name] = new
    for key, value in list(vars(mod).items()):
        if value is old:
            mod.__dict__[key] = new


def _library_owners(model: nn.Module) -> dict[str, nn.Module]:
    """Modules (by path) that carry a model library's per-module init: transformers' `_init_weights`."""
    owners = {}
    for path, mod in model.named_modules():
        if callable(getattr(mod, "_init_weights", None)) and getattr(mod, "config", None) is not None:
            owners[path] = mod
    return owners


def _nearest_owner(path: str, owners: dict[str, nn.Module]) -> nn.Module | None:
    parts = path.split(".") if path else []
    for n in range(len(parts), -1, -1):
        owner = owners.get(".".join(parts[:n]))
        if owner is not None:
            return owner
    return None


def _by_library_init(owner: nn.Module, mod: nn.Module, names: list[str], why: list[str]) -> dict | None:
    """Run the owner's `_init_weights` on a stand-in of `mod` (its real tensors are never touched)."""
    if not all(mod._buffers[n].is_floating_point() for n in names):
        why.append("the library init cannot be checked on integer buffers")
        return None
    stand_in = copy.copy(mod)
    stand_in.__dict__["_parameters"] = {k: (None if p is None else nn.Parameter(torch.empty_like(p, device="meta"),
                                                                                  requires_grad=False))
                                        for k, p in mod._parameters.items()}
    stand_in.__dict__["_buffers"] = {k: (None if b is None else
                                         torch.full(b.shape, float("nan"), dtype=b.dtype) if k in names
                                         else torch.empty_like(b, device="meta"))
                                     for k, b in mod._buffers.items()}
    stand_in.__dict__["_modules"] = {}
    try:
        with torch.no_grad():
            owner._init_weights(stand_in)
    except Exception as exc:  # noqa: BLE001 - any failure means "not this way"
        why.append(f"{type(owner).__name__}._init_weights failed: {exc}")
        return None
    values = {n: stand_in._buffers[n] for n in names}
    unset = [n for n, v in values.items() if v is None or v.is_meta or torch.isnan(v).any()]
    if unset:
        why.append(f"{type(owner).__name__}._init_weights does not set {unset[0]!r}")
        return None
    return {n: v.to(mod._buffers[n].dtype) for n, v in values.items()}


def _by_constructor(mod: nn.Module, names: list[str], why: list[str]) -> dict | None:
    """Construct a fresh `type(mod)` on the CPU with arguments recovered from `mod`'s attributes."""
    cls = type(mod)
    try:
        params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    except (TypeError, ValueError) as exc:
        why.append(f"{cls.__name__}'s constructor has no signature ({exc})")
        return None
    attrs = vars(mod)
    kwargs: dict[str, Any] = {}
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        for attr in (p.name, "_" + p.name):
            value = attrs.get(attr)
            if attr in attrs and not isinstance(value, (torch.Tensor, nn.Module)):
                kwargs[p.name] = value
                break
        else:
            if p.default is p.empty:
                why.append(f"{cls.__name__}({p.name}=...) cannot be recovered from the module's attributes")
                return None
    try:
        with torch.device("cpu"), torch.no_grad():
            fresh = cls(**kwargs) if not any(p.kind == p.POSITIONAL_ONLY for p in params) else None
    except Exception as exc:  # noqa: BLE001
        why.append(f"{cls.__name__}(...) failed on the CPU: {exc}")
        return None
    if fresh is None:
        why.append(f"{cls.__name__} takes positional-only arguments")
        return None
    values = {}
    for n in names:
        value = fresh._buffers.get(n)
        meta = mod._buffers[n]
        if value is None or value.is_meta or tuple(value.shape) != tuple(meta.shape):
            why.append(f"a fresh {cls.__name__} has no {n!r} of shape {tuple(meta.shape)}")
            return None
        values[n] = value.to(meta.dtype)
    return values
