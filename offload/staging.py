"""Host staging: one flat buffer per unit, every tensor of the unit a view into it.

The unit's parameters and buffers (and the inner tensors of tensor subclasses, through
`__tensor_flatten__`) are laid out at 512-byte aligned offsets, so one copy moves the whole unit and the
same layout, applied to a device slot, gives the device-side views. Bytes move as stored: float8 weights and
their scale tensors are never upcast.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

log = logging.getLogger(__name__)

ALIGN = 512


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def is_subclass_tensor(t: torch.Tensor) -> bool:
    """A tensor subclass that describes its inner tensors (quantized weights and the like)."""
    return type(t) not in (torch.Tensor, nn.Parameter) and hasattr(t, "__tensor_flatten__") and \
        type(t).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__


@dataclass
class Leaf:
    """One plain tensor's place in the flat buffer."""

    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...] | None  # None: contiguous; else the original strides over a span of memory


@dataclass
class Entry:
    """One distinct tensor of the unit and every (module, name) that refers to it."""

    locations: list[tuple[nn.Module, str, str]]  # (module, attribute, "param" | "buffer")
    recipe: Any  # int (leaf index) or (cls, ctx, {name: recipe}, outer_size, outer_stride)
    plain_param: bool  # a plain nn.Parameter: swapped with `.data =` so its identity never changes
    requires_grad: bool
    device: torch.device
    original: torch.Tensor | None = None  # subclass tensors keep their identity: inner tensors are re-pointed


@dataclass
class TensorLayout:
    """How a unit's tensors map onto a flat buffer, and how to rebuild them from any such buffer."""

    leaves: list[Leaf]
    entries: list[Entry]
    nbytes: int

    def version(self) -> int:
        """Sum of the version counters of the tensors bound now: changes whenever one is written in place."""
        total = 0
        for entry in self.entries:
            module, attr, kind = entry.locations[0]
            t = (module._parameters if kind == "param" else module._buffers).get(attr)
            if t is not None and not t.is_inference():  # inference tensors have no version counter
                total += t._version
        return total

    def leaf_views(self, buf: torch.Tensor) -> list[torch.Tensor]:
        views = []
        for leaf in self.leaves:
            raw = buf[leaf.offset:leaf.offset + leaf.nbytes].view(leaf.dtype)
            if leaf.stride is not None:
                views.append(raw.as_strided(leaf.shape, leaf.stride))
            else:
                views.append(raw.view(leaf.shape))
        return views

    def build(self, buf: torch.Tensor, master: bool = False) -> "Binding":
        """Tensors viewing `buf`, ready to be swapped into the unit's modules.

        With `master`, tensor subclasses are not rebuilt: the original objects get their inner tensors
        re-pointed at `buf`, so the module keeps the very objects it had between forwards.
        """
        return self.bind(self.leaf_views(buf), buf, master)

    def bind(self, views: list[torch.Tensor], buf: torch.Tensor | None, master: bool = False) -> "Binding":
        """Like `build`, from per-leaf tensors (a file's mmap views for the disk tier)."""

        def make(recipe: Any) -> torch.Tensor:
            if isinstance(recipe, int):
                return views[recipe]
            cls, ctx, inner, outer_size, outer_stride = recipe
            return cls.__tensor_unflatten__({k: make(r) for k, r in inner.items()}, ctx, outer_size, outer_stride)

        data_swaps: list[tuple[nn.Parameter, torch.Tensor]] = []
        dict_sets: list[tuple[dict, str, torch.Tensor]] = []
        for entry in self.entries:
            if master and entry.original is not None:
                _repoint(entry.original, entry.recipe, views.__getitem__)
                for module, attr, kind in entry.locations:
                    dict_sets.append((module._parameters if kind == "param" else module._buffers, attr,
                                      entry.original))
                continue
            value = make(entry.recipe)
            if entry.plain_param:
                data_swaps.append((entry.locations[0][0]._parameters[entry.locations[0][1]], value))
                continue
            value_p = nn.Parameter(value, requires_grad=entry.requires_grad) if any(
                kind == "param" for _, _, kind in entry.locations) else None
            for module, attr, kind in entry.locations:
                if kind == "param":
                    dict_sets.append((module._parameters, attr, value_p))
                else:
                    dict_sets.append((module._buffers, attr, value))
        return Binding(buf, data_swaps, dict_sets)


def _repoint(obj: torch.Tensor, recipe: Any, leaf: Callable[[int], torch.Tensor]) -> None:
    """Point a tensor subclass's inner tensors at `leaf(i)` (recursively), keeping the object itself."""
    _, _, inner, _, _ = recipe
    for name, r in inner.items():
        if isinstance(r, int):
            setattr(obj, name, leaf(r))
        else:
            _repoint(getattr(obj, name), r, leaf)


@dataclass
class Binding:
    """A unit's tensors bound to one buffer (host master or a device slot); `apply` swaps them in."""

    buf: torch.Tensor | None
    data_swaps: list[tuple[nn.Parameter, torch.Tensor]]
    dict_sets: list[tuple[dict, str, torch.Tensor]]

    def apply(self) -> None:
        for param, value in self.data_swaps:
            param.data = value
        for d, key, value in self.dict_sets:
            d[key] = value


def _flatten(t: torch.Tensor, leaves: list[Leaf], sources: list[torch.Tensor], offset: list[int]) -> Any:
    if is_subclass_tensor(t):
        names, ctx = t.__tensor_flatten__()
        inner = {name: _flatten(getattr(t, name), leaves, sources, offset) for name in names}
        return (type(t), ctx, inner, tuple(t.size()), tuple(t.stride()))
    plain = t.detach()
    if type(plain) is not torch.Tensor:
        plain = plain.as_subclass(torch.Tensor)
    stride = None
    span = plain.numel()
    if not plain.is_contiguous() and plain.numel() > 0 and all(st > 0 for st in plain.stride()):
        # keep the original strides (kernels, and so outputs, can depend on them) over the memory they span
        stride = tuple(plain.stride())
        span = 1 + sum((n - 1) * st for n, st in zip(plain.shape, stride))
    nbytes = span * plain.element_size()
    leaves.append(Leaf(offset[0], nbytes, plain.dtype, tuple(plain.shape), stride))
    sources.append(plain)
    offset[0] = _align(offset[0] + nbytes)
    return len(leaves) - 1


def unit_tensors(module: nn.Module) -> list[tuple[nn.Module, str, str, torch.Tensor]]:
    """Every (owner module, name, kind, tensor) under `module`, parameters first."""
    found = []
    for sub in module.modules():
        for name, p in sub._parameters.items():
            if p is not None:
                found.append((sub, name, "param", p))
        for name, b in sub._buffers.items():
            if b is not None:
                found.append((sub, name, "buffer", b))
    return found


def plan_layout(tensors: list[tuple[nn.Module, str, str, torch.Tensor]]) -> tuple[TensorLayout, list[torch.Tensor]]:
    """Lay out distinct tensors (a tensor met twice is laid out once); returns the source tensors too."""
    by_id: dict[int, Entry] = {}
    leaves: list[Leaf] = []
    sources: list[torch.Tensor] = []
    offset = [0]
    entries: list[Entry] = []
    for sub, name, kind, t in tensors:
        entry = by_id.get(id(t))
        if entry is None:
            recipe = _flatten(t, leaves, sources, offset)
            plain_param = kind == "param" and not is_subclass_tensor(t)
            home = torch.device("cpu") if t.is_meta else t.device  # a meta weight comes home from disk to RAM
            entry = Entry([], recipe, plain_param, bool(t.requires_grad), home,
                          t if not isinstance(recipe, int) else None)
            by_id[id(t)] = entry
            entries.append(entry)
        entry.locations.append((sub, name, kind))
    layout = TensorLayout(leaves, entries, max(offset[0], ALIGN))
    return layout, sources


class PinFallbackNotice:
    """Says once per process that pinning was refused and pageable memory is used instead."""

    said = False

    @classmethod
    def say(cls, reason: str, level: int = logging.WARNING) -> None:
        if not cls.said:
            cls.said = True
            log.log(level, "pinned host memory unavailable (%s); staging in pageable memory instead "
                    "(copies are slower and cannot fully overlap compute)", reason)


@dataclass
class StagingBuffer:
    """A unit's host master: one flat buffer (pinned where allowed) that all its tensors view."""

    layout: TensorLayout
    host: torch.Tensor | None
    pinned: bool
    host_binding: Binding

    master_views: list[torch.Tensor] | None = None  # disk tier: per-leaf views of the file's mmap

    @staticmethod
    def _unmeta(layout: TensorLayout, views: list[torch.Tensor]) -> None:
        """Meta or inference-mode parameters cannot take `.data` from our buffers: give them new objects."""
        for entry in layout.entries:
            module, attr, kind = entry.locations[0]
            current = module._parameters[attr] if entry.plain_param else None
            if current is not None and (current.is_meta or current.is_inference()):
                param = nn.Parameter(views[entry.recipe], requires_grad=entry.requires_grad)
                for mod, name, k in entry.locations:
                    (mod._parameters if k == "param" else mod._buffers)[name] = param

    @classmethod
    def create(cls, layout: TensorLayout, sources: list[torch.Tensor],
               alloc_host: Callable[[int, bool], tuple[torch.Tensor, bool]], pin: bool,
               fill_meta: Callable[[int], torch.Tensor] | None = None,
               notice_level: int = logging.WARNING) -> "StagingBuffer":
        """Copy the tensors into one host buffer and point their modules at views of it.

        `fill_meta(i)` supplies leaf i when the module holds only a meta tensor (weights still on disk).
        """
        host, pinned = alloc_host(layout.nbytes, pin)
        if pin and not pinned:
            PinFallbackNotice.say("the allocator refused or this torch has no accelerator", notice_level)
        views = layout.leaf_views(host)
        with torch.no_grad():
            for i, (view, src) in enumerate(zip(views, sources)):
                if src.is_meta:
                    if fill_meta is None:
                        raise ValueError(f"a {tuple(src.shape)} {src.dtype} tensor is on the meta device and no "
                                         f"disk_path was given to read it from")
                    src = fill_meta(i)
                view.copy_(src)
        cls._unmeta(layout, views)
        binding = layout.build(host, master=True)
        binding.apply()  # the originals are now unreferenced by the module: their storage is released
        return cls(layout, host, pinned, binding)

    @classmethod
    def from_file(cls, layout: TensorLayout, views: list[torch.Tensor]) -> "StagingBuffer":
        """A disk-tier master: the module views the file's mmap; no RAM copy is made."""
        cls._unmeta(layout, views)
        binding = layout.bind(views, None, master=True)
        binding.apply()
        return cls(layout, None, False, binding, views)

    def restore_ordinary(self) -> None:
        """Give every tensor back as an ordinary, independent tensor on its original device."""
        layout = self.layout
        views = self.master_views if self.host is None else layout.leaf_views(self.host)

        def make(recipe: Any, device: torch.device) -> torch.Tensor:
            if isinstance(recipe, int):
                return views[recipe].to(device=device, copy=True)
            cls_, ctx, inner, outer_size, outer_stride = recipe
            return cls_.__tensor_unflatten__({k: make(r, device) for k, r in inner.items()}, ctx, outer_size,
                                             outer_stride)

        for entry in layout.entries:
            if entry.original is not None:
                _repoint(entry.original, entry.recipe, lambda i: views[i].to(device=entry.device, copy=True))
                for module, attr, kind in entry.locations:
                    (module._parameters if kind == "param" else module._buffers)[attr] = entry.original
                continue
            value = make(entry.recipe, entry.device)
            if entry.plain_param:
                module, attr, _ = entry.locations[0]
                module._parameters[attr].data = value
                continue
            param = nn.Parameter(value, requires_grad=entry.requires_grad) if any(
                k == "param" for _, _, k in entry.locations) else None
            for module, attr, kind in entry.locations:
                if kind == "param":
                    module._parameters[attr] = param
                else:
                    module._buffers[attr] = value
