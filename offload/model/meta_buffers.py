"""Non-persistent buffers of a model built on the meta device: made the way the model itself makes them.

A model built under `torch.device("meta")` (or an init that puts buffers there too) has every tensor on the meta
device. Its parameters and persistent buffers are in `state_dict()`, so its safetensors file holds them and staging
reads them from there. Non-persistent buffers (`register_buffer(..., persistent=False)`, `nn.Buffer(...,
persistent=False)`: rotary `inv_freq`, Wan's `freqs_cos`, CLIP's integer `position_ids`, PixArt's sin-cos
`pos_embed`, precomputed masks) are in no checkpoint: they are computed when the module is constructed.
`materialize_non_persistent_buffers` recomputes them on the CPU before staging, module by module, by the first of
these that works:

1. the model library's own init for that module: the nearest transformers `PreTrainedModel` above it runs its
   `_init_weights` on a stand-in of the module whose parameters stay on the meta device and whose missing buffers
   are NaN-filled CPU tensors (what `from_pretrained` does for the same buffers); every value must be written;
2. the nearest library model at or above the module (a diffusers `ConfigMixin` model, rebuilt with
   `from_config(self.config)`; a transformers `PreTrainedModel`, rebuilt from its `config`) constructed again with
   its parameters on the meta device and its buffers real (what diffusers' `from_pretrained` does under
   `init_empty_weights()`), and the buffer taken from the same place in it: the arguments come from the config the
   library kept, not from attributes that may hold derived values (`PatchEmbed.height` is the patched height);
3. the module's own constructor, re-run on the CPU with the arguments recovered from its `config` mapping (diffusers'
   `register_to_config`) or its attributes (an argument of the same name, or `_name`; otherwise its default).

The new buffers must have the meta ones' shapes; values are cast to the meta buffer's dtype (a model cast with
`.to(dtype)` casts its buffers too). A buffer no way can make is a ValueError naming it; nothing is ever expected from
the file for a non-persistent buffer. Rebuilding never moves the global random number generator.

`materialize_tensor_attributes` does the same for plain tensor attributes that are neither parameters nor buffers
(Lumina2's rotary `freqs_cis` list, QwenImage's `pos_freqs` / `neg_freqs`, the tables of a scheduler object a
module keeps, as ConsistencyDecoderVAE does): on the meta device they would pass staging and fail in the forward
("Cannot copy out of meta tensor"), so they are rebuilt by ways 2 and 3, or refused up front naming the attribute.
An attribute weight_norm / spectral_norm recompute before every forward is left alone.

`tie_meta_weights` ties again the weights a model declares tied (transformers' `tie_weights()`, as
`from_pretrained` does after loading), and those the file's metadata records as saved once
(`safetensors.torch.save_model` writes `{removed: kept}`; a plain module tied by assignment, accelerate's
`ModelForTestTiedWeights`): `accelerate.init_empty_weights()` replaces every parameter registered while it is active
by a new object, which unties them, and a checkpoint holds a tied weight once.
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import logging
from collections.abc import Mapping
from typing import Any, Iterator

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


def tie_meta_weights(model: nn.Module, file: Any = None) -> bool:
    """Tie again the weights a meta init untied (see the module docstring): the model's own `tie_weights()` when
    some parameter is still on the meta device, then the ties `safetensors.torch.save_model` recorded in `file`'s
    metadata (`{removed name: kept name}`: a tied weight saved once, as accelerate's and plain torch models tie by
    assignment); True when something was tied. Nothing is read or computed: tied parameters become one object."""
    if not any(p.is_meta for p in model.parameters()):
        return False
    tied = False
    tie = getattr(model, "tie_weights", None)
    if callable(tie):
        try:
            tie()
            tied = True
        except Exception as exc:  # noqa: BLE001 - a model whose tying needs real weights: matched as it is
            log.debug("%s.tie_weights() on the meta device failed (%s); weights matched as they are",
                      type(model).__name__, exc)
    return _tie_saved_aliases(model, file) or tied


def _saved_aliases(file: Any) -> dict[str, str]:
    """`{removed: kept}` from a safetensors file's `__metadata__` (what `save_model` writes for shared tensors), as
    the file's reader validated it (never a second, unchecked read of the header)."""
    meta = getattr(file, "metadata", None)
    tensors = getattr(file, "tensors", None)
    if not isinstance(meta, dict) or not isinstance(tensors, dict):
        return {}
    return {k: v for k, v in meta.items() if isinstance(k, str) and isinstance(v, str) and k not in tensors
            and v in tensors}


def _tie_saved_aliases(model: nn.Module, file: Any) -> bool:
    aliases = _saved_aliases(file) if file is not None else {}
    if not aliases:
        return False
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = []
    for removed, kept in aliases.items():
        ours, theirs = params.get(removed), params.get(kept)
        if ours is None or theirs is None or ours is theirs or not ours.is_meta:
            continue
        if ours.shape != theirs.shape or ours.dtype != theirs.dtype:
            continue
        owner, _, attr = removed.rpartition(".")
        model.get_submodule(owner)._parameters[attr] = theirs
        tied.append(removed)
    if tied:
        log.info("tied %d weight(s) the file saved once again to their twin: %s", len(tied), ", ".join(tied[:4]))
    return bool(tied)


def materialize_non_persistent_buffers(model: nn.Module) -> list[str]:
    """Recompute every non-persistent buffer of `model` still on the meta device on the CPU (see the module
    docstring); returns their names. Raises ValueError for one that cannot be recomputed."""
    todo = meta_non_persistent_buffers(model)
    if not todo:
        return []
    owners = _library_owners(model)
    rebuilt = _Rebuilt(model)
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
                values = _by_rebuilt_model(rebuilt, path, mod, wanted, why)
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


def _fresh_module(mod: nn.Module, why: list[str]) -> nn.Module | None:
    """A fresh `type(mod)` built on the CPU with the arguments recovered from `mod` (see the module docstring)."""
    cls = type(mod)
    try:
        params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    except (TypeError, ValueError) as exc:
        why.append(f"{cls.__name__}'s constructor has no signature ({exc})")
        return None
    if any(p.kind == p.POSITIONAL_ONLY for p in params):
        why.append(f"{cls.__name__} takes positional-only arguments")
        return None
    attrs = vars(mod)
    config = attrs.get("config") if isinstance(attrs.get("config"), Mapping) else None  # diffusers' FrozenDict
    kwargs: dict[str, Any] = {}
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if config is not None and p.name in config:
            kwargs[p.name] = config[p.name]
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
        with _quiet_construction():
            return cls(**kwargs)
    except Exception as exc:  # noqa: BLE001
        why.append(f"{cls.__name__}(...) failed on the CPU: {exc}")
        return None


def _by_constructor(mod: nn.Module, names: list[str], why: list[str]) -> dict | None:
    """Construct a fresh `type(mod)` on the CPU with arguments recovered from `mod` and take its buffers."""
    fresh = _fresh_module(mod, why)
    if fresh is None:
        return None
    return _buffers_from(fresh, mod, names, why, f"a fresh {type(mod).__name__}")


def _buffers_from(fresh: nn.Module, mod: nn.Module, names: list[str], why: list[str], what: str) -> dict | None:
    values = {}
    for n in names:
        value = fresh._buffers.get(n)
        meta = mod._buffers[n]
        if value is None or value.is_meta or tuple(value.shape) != tuple(meta.shape):
            why.append(f"{what} has no {n!r} of shape {tuple(meta.shape)}")
            return None
        values[n] = value.to(meta.dtype)
    return values


# rebuilding the nearest library model ---------------------------------------------------------------------------
@contextlib.contextmanager
def _quiet_construction() -> Iterator[None]:
    """Construct on the CPU without grad and without moving the caller's random number generator."""
    with torch.random.fork_rng(devices=[]), torch.device("cpu"), torch.no_grad():
        yield


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """While active, every parameter a constructor registers goes to the meta device at once, buffers stay real
    (accelerate's `init_empty_weights()`, without needing accelerate): a rebuild costs the buffers, not the model."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        value = module._parameters.get(name)
        if value is not None and type(value) is nn.Parameter and not value.is_meta:
            module._parameters[name] = nn.Parameter(value.detach().to("meta"), requires_grad=value.requires_grad)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def _rebuild(model: nn.Module) -> nn.Module | None:
    """`model` constructed again from the config its library kept (parameters on meta, buffers real), or None when
    it is no library model."""
    cls = type(model)
    config = getattr(model, "config", None)
    if config is None:
        return None
    with _quiet_construction(), _parameters_on_meta():
        if isinstance(config, Mapping) and callable(getattr(cls, "from_config", None)) and \
                getattr(cls, "config_name", None):
            accepted = set(inspect.signature(cls.__init__).parameters)
            kwargs = {k: v for k, v in config.items() if k in accepted or k.startswith("_")}
            return cls.from_config(kwargs)  # diffusers ConfigMixin (register_to_config kept the arguments)
        if getattr(cls, "config_class", None) is not None and not isinstance(config, Mapping):
            return cls(copy.deepcopy(config))  # transformers PreTrainedModel
    return None


class _Rebuilt:
    """The library models above meta modules, each rebuilt once (by path), on demand."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._fresh: dict[str, nn.Module | None] = {}
        self._errors: dict[str, str] = {}

    def ancestors(self, path: str) -> Iterator[tuple[str, nn.Module]]:
        """(path, module) of `path` itself and of every module above it, nearest first."""
        parts = path.split(".") if path else []
        for n in range(len(parts), -1, -1):
            at = ".".join(parts[:n])
            try:
                yield at, (self.model.get_submodule(at) if at else self.model)
            except AttributeError:
                continue

    def counterpart(self, path: str, why: list[str]) -> tuple[nn.Module, str] | None:
        """The module at `path` in a fresh build of the nearest library model above it, and that model's name."""
        for at, owner in self.ancestors(path):
            if getattr(owner, "config", None) is None:
                continue
            if at not in self._fresh:
                try:
                    self._fresh[at] = _rebuild(owner)
                except Exception as exc:  # noqa: BLE001 - any failure means "not this way"
                    self._fresh[at] = None
                    self._errors[at] = f"rebuilding {type(owner).__name__} from its config failed: {exc}"
            fresh = self._fresh[at]
            if fresh is None:
                if at in self._errors:
                    why.append(self._errors[at])
                continue
            relative = path[len(at) + 1:] if at else path
            try:
                return (fresh.get_submodule(relative) if relative else fresh), type(owner).__name__
            except AttributeError:
                why.append(f"a rebuilt {type(owner).__name__} has no module {relative!r}")
                continue
        return None


def _by_rebuilt_model(rebuilt: _Rebuilt, path: str, mod: nn.Module, names: list[str], why: list[str]) -> dict | None:
    found = rebuilt.counterpart(path, why)
    if found is None:
        return None
    fresh, owner = found
    if type(fresh) is not type(mod):
        why.append(f"a rebuilt {owner} holds a {type(fresh).__name__} where the model holds a {type(mod).__name__}")
        return None
    return _buffers_from(fresh, mod, names, why, f"a rebuilt {owner}")


# tensor attributes ----------------------------------------------------------------------------------------------
_MODULE_STATE = {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "training"}


def _object_state(value: Any) -> dict | None:
    """The attributes of a plain object a module keeps (a diffusers scheduler holding its tables), else None."""
    if isinstance(value, (nn.Module, type)) or callable(value) or not hasattr(value, "__dict__"):
        return None
    return vars(value)


def _has_meta(value: Any, depth: int = 0) -> bool:
    if isinstance(value, torch.Tensor):
        return value.is_meta
    if depth > 2:
        return False
    if isinstance(value, (list, tuple)):
        return any(_has_meta(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return any(_has_meta(v, depth + 1) for v in value.values())
    state = _object_state(value)
    return state is not None and any(_has_meta(v, depth + 1) for v in state.values())


def _same_structure(a: Any, b: Any) -> bool:
    """Whether `b` can stand in for the meta value `a`: tensors of the same shapes, in the same containers (an
    object of the same type with no meta tensor left)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and not b.is_meta and tuple(a.shape) == tuple(b.shape)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same_structure(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_structure(a[k], b[k]) for k in a)
    if _object_state(a) is not None:
        return type(a) is type(b) and not _has_meta(b)
    return True


def _cast_like(meta: Any, value: Any) -> Any:
    if isinstance(meta, torch.Tensor):
        return value.to(meta.dtype)
    if isinstance(meta, (list, tuple)):
        return type(meta)(_cast_like(m, v) for m, v in zip(meta, value))
    if isinstance(meta, dict):
        return {k: _cast_like(meta[k], value[k]) for k in meta}
    return value  # an object: the rebuilt one, as its constructor made it


def meta_tensor_attributes(model: nn.Module) -> dict[str, tuple[nn.Module, list[str]]]:
    """`{module path: (module, [attribute names])}` of plain attributes (not parameters or buffers) holding a tensor
    on the meta device, alone or in a list, tuple or dict."""
    found: dict[str, tuple[nn.Module, list[str]]] = {}
    for path, mod in model.named_modules():
        # weight_norm / spectral_norm recompute their attribute from parameters before every forward
        hooked = {getattr(h, "name", None) for h in mod._forward_pre_hooks.values()
                  if callable(getattr(h, "compute_weight", None))}
        names = [k for k, v in vars(mod).items() if k not in _MODULE_STATE and k not in hooked and _has_meta(v)]
        if names:
            found[path] = (mod, names)
    return found


def materialize_tensor_attributes(model: nn.Module) -> list[str]:
    """Recompute every plain tensor attribute of `model` still on the meta device (see the module docstring);
    returns their names. Raises ValueError naming one that cannot be recomputed."""
    if not any(t.is_meta for t in list(model.parameters()) + list(model.buffers())):
        return []  # not built on the meta device: nothing to look for
    todo = meta_tensor_attributes(model)
    if not todo:
        return []
    rebuilt = _Rebuilt(model)
    done: list[str] = []
    for path, (mod, names) in todo.items():
        why: list[str] = []
        found = rebuilt.counterpart(path, why)
        fresh = found[0] if found is not None and type(found[0]) is type(mod) else None
        if fresh is None or not all(_same_structure(vars(mod)[n], vars(fresh).get(n)) for n in names):
            fresh = _fresh_module(mod, why)
        for n in names:
            qualified = f"{path}.{n}" if path else n
            value = vars(fresh).get(n) if fresh is not None else None
            if fresh is None or not _same_structure(vars(mod)[n], value):
                if fresh is not None:
                    why.append(f"a fresh {type(mod).__name__} has no {n!r} of the same shape")
                raise ValueError(
                    f"{qualified}: a tensor attribute (neither a parameter nor a buffer, so in no checkpoint) is on "
                    f"the meta device and could not be recomputed ({'; '.join(why) or 'no way to rebuild it'}); the "
                    f"forward would fail with 'Cannot copy out of meta tensor'. Build the model with real tensors "
                    f"(accelerate.init_empty_weights(include_buffers=False) keeps them real), or set {qualified} "
                    f"before offloading")
            mod.__dict__[n] = _cast_like(vars(mod)[n], value)
            done.append(qualified)
    log.info("recomputed %d tensor attribute(s) on the meta device (no checkpoint holds them): %s", len(done),
             ", ".join(done[:4]) + (", ..." if len(done) > 4 else ""))
    return done
