"""Find the repeated blocks of any nn.Module: they become the transfer units; everything else stays resident."""
from __future__ import annotations

import logging
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
    `_no_split_modules`); known block-list names; a size/uniformity heuristic; finally the top-level
    children (with a warning). A model with no submodules at all is refused with a clear error.
    """
    if explicit:
        units = []
        for path in explicit:
            try:
                units.append(Unit(path, model.get_submodule(path)))
            except AttributeError as exc:
                raise ValueError(f"unit {path!r} is not a submodule of {type(model).__name__}: {exc}") from None
        names = [u.name for u in units]
        for a in names:
            for b in names:
                if a != b and b.startswith(a + "."):
                    raise ValueError(f"units overlap: {b!r} is inside {a!r}")
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate unit paths in {names}")
        return units

    total = _param_bytes(model)
    for finder in (_by_class_hint, _by_known_names):
        found = finder(model)
        if len(found) >= 2:
            return [Unit(n, m) for n, m in found]
    found = _by_heuristic(model, total)
    if len(found) >= 2:
        return [Unit(n, m) for n, m in found]

    children = [(n, m) for n, m in model.named_children() if _param_bytes(m) > 0]
    if len(children) >= 2:
        log.warning("%s has no repeated blocks; streaming its %d top-level children as units instead",
                    type(model).__name__, len(children))
        return [Unit(n, m) for n, m in children]
    raise ValueError(
        f"{type(model).__name__} has no repeated blocks and fewer than two submodules holding weights, so "
        f"there is nothing to stream block by block; run it without offloading or pass units=[...] explicitly")


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
