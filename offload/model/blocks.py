"""Find the repeated blocks of any nn.Module: they become the transfer units; everything else stays resident."""
from __future__ import annotations

import functools
import inspect
import logging
import re
from dataclasses import dataclass

import torch.nn as nn

log = logging.getLogger(__name__)

KNOWN_BLOCK_LISTS = ("blocks", "layers", "double_blocks", "single_blocks", "transformer_blocks",
                     "single_transformer_blocks", "joint_blocks", "h", "layer", "block", "resblocks",
                     "input_blocks", "output_blocks", "down_blocks", "up_blocks")


@dataclass
class Unit:
    """One transfer unit: a module whose weights move to the device together."""

    name: str
    module: nn.Module


def _param_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))


def _outermost(named: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """Drop entries nested inside another entry."""
    keep: list[tuple[str, nn.Module]] = []
    for name, mod in sorted(named, key=lambda item: item[0].count(".")):
        if not any(name == k or name.startswith(k + ".") for k, _ in keep if k):
            keep.append((name, mod))
    order = {name: i for i, (name, _) in enumerate(named)}
    return sorted(keep, key=lambda item: order[item[0]])


def _by_class_hint(model: nn.Module) -> list[tuple[str, nn.Module]]:
    names: set[str] = set()
    for attr in ("_repeated_blocks", "_no_split_modules"):
        for m in model.modules():
            hint = getattr(m, attr, None)
            if isinstance(hint, (list, tuple, set)):
                names.update(str(h) for h in hint)
    if not names:
        return []
    found = [(n, m) for n, m in model.named_modules() if n and type(m).__name__ in names]
    found = _outermost(found)
    return found if len(found) >= 2 else []


def _by_known_names(model: nn.Module) -> list[tuple[str, nn.Module]]:
    lists = [(n, m) for n, m in model.named_modules()
             if isinstance(m, (nn.ModuleList, nn.Sequential)) and n.split(".")[-1] in KNOWN_BLOCK_LISTS
             and len(m) >= 2]
    units: list[tuple[str, nn.Module]] = []
    for name, lst in _outermost(lists):
        units.extend((f"{name}.{i}", child) for i, child in lst.named_children())
    return [(n, m) for n, m in units if _param_bytes(m) > 0]


def _by_heuristic(model: nn.Module, total: int) -> list[tuple[str, nn.Module]]:
    """Lists of >= 2 same-class children holding a large share of the weights."""
    candidates = []
    for name, m in model.named_modules():
        if not isinstance(m, (nn.ModuleList, nn.Sequential)) or len(m) < 2:
            continue
        children = list(m.children())
        classes = {type(c) for c in children}
        size = _param_bytes(m)
        if len(classes) == 1 and size >= 0.25 * total and size > 0:
            candidates.append((name, m))
    units: list[tuple[str, nn.Module]] = []
    for name, lst in _outermost(candidates):
        units.extend((f"{name}.{i}" if name else i, child) for i, child in lst.named_children())
    return [(n, m) for n, m in units if _param_bytes(m) > 0]


def find_units(model: nn.Module, explicit: list[str] | None = None) -> list[Unit]:
    """The transfer units of `model`, in registration (expected execution) order.

    Order of precedence: an explicit list of module paths; library hints (`_repeated_blocks`,
    `_no_split_modules`); known block-list names; a size/uniformity heuristic; finally the children of the model,
    or of the single child wrapping all of it (with a warning). A model with no submodules at all is refused with a
    clear error. A unit whose weights an enclosing module reads without calling it (`x @ self.linear.weight.t()`)
    is never entered, so the nearest such enclosing module becomes the unit instead (see `_merge_read_units`).
    """
    return _merge_read_units(model, _find_units(model, explicit))


def _find_units(model: nn.Module, explicit: list[str] | None) -> list[Unit]:
    if explicit:
        units = []
        for path in explicit:
            try:
                units.append(Unit(path, model.get_submodule(path)))
            except AttributeError as exc:
                raise ValueError(f"unit {path!r} is not a submodule of {type(model).__name__}: {exc}") from None
        names = [u.name for u in units]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate unit paths in {names}")
        known = set(names)
        for b in names:  # a unit inside another: one of its enclosing paths is a unit too
            parts = b.split(".")
            for n in range(1, len(parts)):
                a = ".".join(parts[:n])
                if a in known:
                    raise ValueError(f"units overlap: {b!r} is inside {a!r}")
        return units

    total = _param_bytes(model)
    for finder in (_by_class_hint, _by_known_names):
        found = finder(model)
        if len(found) >= 2:
            return [Unit(n, m) for n, m in found]
    found = _by_heuristic(model, total)
    if len(found) >= 2:
        return [Unit(n, m) for n, m in found]

    prefix, holder = "", model
    children = [(n, m) for n, m in holder.named_children() if _param_bytes(m) > 0]
    while len(children) == 1:  # a wrapper around the real model (accelerate's NestedModelForTest): look inside
        name, holder = children[0]
        prefix += name + "."
        children = [(n, m) for n, m in holder.named_children() if _param_bytes(m) > 0]
    if len(children) >= 2:
        where = f"the children of {prefix[:-1]!r}" if prefix else "its top-level children"
        log.warning("%s has no repeated blocks; streaming %s (%d) as units instead", type(model).__name__, where,
                    len(children))
        return [Unit(prefix + n, m) for n, m in children]
    raise ValueError(
        f"{type(model).__name__} has no repeated blocks and fewer than two submodules holding weights, so "
        f"there is nothing to stream block by block; run it without offloading or pass units=[...] explicitly")


# Methods that run outside a forward (setup, conversion, saving): a weight they read is no compute read.
_NOT_FORWARD = re.compile(r"^_*(init|fuse|unfuse|tie|load|save|state_dict|from_|set_|enable|disable|reset|"
                          r"extra_repr|convert|register|__)")
# Attributes of a tensor that read no bytes: `self.linear.weight.dtype` is not a compute read.
_METADATA = re.compile(r"dtype|device|shape|size|ndim|dim|requires_grad|is_\w+|numel|element_size|nbytes|itemsize|"
                       r"data_ptr|stride")


_CHAIN = re.compile(r"\bself((?:\s*\.\s*\w+|\s*\[\s*\d+\s*\])+)")


@functools.lru_cache(maxsize=None)
def _self_chains(cls: type) -> dict[str, tuple[tuple[str, ...], ...]]:
    """Every attribute chain `self.a[0].b.c` in the methods of `cls` that may run inside a forward (its bases' too,
    nn.Module's excluded), as name tuples (`("a", "0", "b", "c")`), by first name: parsed once per class."""
    chains: dict[str, dict[tuple[str, ...], None]] = {}  # insertion-ordered sets: the first read in source order
    for klass in cls.__mro__:
        if klass in (nn.Module, object) or not issubclass(klass, nn.Module):
            continue
        for name, fn in vars(klass).items():
            if _NOT_FORWARD.match(name) and name != "__call__":
                continue
            fn = getattr(fn, "__func__", fn)
            if not inspect.isfunction(fn):
                continue
            try:
                source = inspect.getsource(fn)
            except (OSError, TypeError):
                continue
            for match in _CHAIN.finditer(source):
                parts = tuple(re.findall(r"\w+", match.group(1)))
                if len(parts) >= 2:
                    chains.setdefault(parts[0], {})[parts] = None
    return {k: tuple(v) for k, v in chains.items()}


def _read_tensor(unit: nn.Module, chain: tuple[str, ...]) -> str | None:
    """The name of the tensor of `unit` an attribute chain (`weight`, `sub.bias`) names and reads (not only its
    `.dtype` or `.shape`), if it names one."""
    obj, names = unit, []
    for i, name in enumerate(chain):
        names.append(name)
        if name in obj._parameters or name in obj._buffers:
            after = chain[i + 1] if i + 1 < len(chain) else ""
            return None if _METADATA.fullmatch(after) else ".".join(names)
        sub = obj._modules.get(name)
        if sub is None:
            return None
        obj = sub
    return None


def _reader_of(model: nn.Module, unit: Unit) -> tuple[str, str] | None:
    """(path of the nearest module enclosing `unit` whose code reads one of its tensors as `self.<path>.<tensor>`,
    the tensor's name), or None."""
    parts = unit.name.split(".")
    for depth in range(len(parts) - 1, -1, -1):
        path = ".".join(parts[:depth])
        try:
            holder = model.get_submodule(path) if path else model
        except AttributeError:
            continue
        if isinstance(holder, (nn.ModuleList, nn.Sequential, nn.ModuleDict)) and type(holder).__module__.startswith(
                "torch."):
            continue  # torch's containers only call their children
        relative = tuple(parts[depth:])
        for chain in _self_chains(type(holder)).get(relative[0], ()):
            if len(chain) > len(relative) and chain[:len(relative)] == relative:
                name = _read_tensor(unit.module, chain[len(relative):])
                if name is not None:
                    return path, f"{unit.name}.{name}"
    return None


def _merge_read_units(model: nn.Module, units: list[Unit]) -> list[Unit]:
    """A unit whose tensor an enclosing module reads without calling the unit (`nn.MultiheadAttention` reads
    `out_proj.weight`; accelerate's `ModuleWithUnusedSubModules` reads `linear.weight`) would never be entered, so
    its host master would be read by the compute: the nearest enclosing module that reads it becomes the unit (every
    unit inside it merges into it); when that is the model itself, the unit stays resident with the rest."""
    units = list(units)
    merged: list[str] = []  # one log line for all of them
    i = 0
    while i < len(units):
        unit = units[i]
        found = _reader_of(model, unit)
        if found is None:
            i += 1
            continue
        path, tensor = found
        if not path:
            del units[i]
            merged.append(f"{type(model).__name__} reads {tensor} without calling {unit.name}: that block stays "
                          f"resident with the weights outside the blocks")
            continue
        inside = [u for u in units if u.name.startswith(path + ".")]
        i = units.index(inside[0])
        units = [u for u in units if u not in inside]
        units.insert(i, Unit(path, model.get_submodule(path)))  # looked at again: its own parent may read it
        merged.append(f"{path} reads {tensor} without calling {unit.name}: {path!r} streams as one unit instead of "
                      f"{', '.join(repr(u.name) for u in inside)}")
    if merged:
        log.warning("%s%s", merged[0], f" (and {len(merged) - 1} more like it)" if len(merged) > 1 else "")
    if not units:
        raise ValueError(f"{type(model).__name__} reads the weights of every block without calling the block, so "
                         f"no block can be streamed; pass units=[...] naming modules whose forward uses their weights")
    return units


def expert_units(model: nn.Module) -> list[str]:
    """Module names of every mixture-of-experts expert kept as its own module (children of a ModuleList named
    `experts`), for `offload_module(..., units=expert_units(model))`: experts then stream one by one and are loaded
    on demand when the router picks them. Empty when the experts are fused into one tensor per layer (then the unit
    is the layer, all experts together)."""
    names: list[str] = []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "experts" and isinstance(module, nn.ModuleList) and len(module) > 1:
            names.extend(f"{name}.{i}" for i in range(len(module)))
    return names
