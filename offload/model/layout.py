"""How a unit's tensors map onto one flat byte buffer, and how to rebind them to any such buffer.

A unit's parameters and buffers (and the inner tensors of tensor subclasses, through `__tensor_flatten__`) are
laid out at 512-byte aligned offsets, so one copy moves the whole unit and the same layout, applied to a device
slot, gives the device-side views. Bytes move as stored: float8 weights and their scale tensors are never upcast.
A layout keeps no reference to the tensors it describes (only to their modules), so planning a whole model
holds no weight alive.
"""
from __future__ import annotations

import copy
import functools
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

ALIGN = 512


def align(n: int) -> int:
    """Round a byte count up to the layout alignment."""
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
    meta: bool = False  # its bytes must come from a file: on the meta device when planned, or a persistent buffer
    # of a model being loaded from its file (staging.persistent_buffers_from_file)

    @property
    def row_major(self) -> bool:
        """Its bytes lie in row-major order, as a safetensors file stores them (strides kept only on size-1 dims,
        such as a channels_last 1x1 conv weight, do not move a byte)."""
        return self.stride is None or all(n == 1 or st == rm for n, st, rm in
                                          zip(self.shape, self.stride, row_major_strides(self.shape)))

    def restride(self, flat: torch.Tensor) -> torch.Tensor:
        """`flat` (a row-major tensor of this leaf's shape, a file's view) with this leaf's strides."""
        return flat if self.stride is None else flat.as_strided(self.shape, self.stride)


@dataclass
class Entry:
    """One distinct tensor of the unit and every (module, name) that refers to it."""

    locations: list[tuple[nn.Module, str, str]]  # (module, attribute, "param" | "buffer")
    recipe: Any  # int (leaf index) or (cls, ctx, {name: recipe}, outer_size, outer_stride)
    plain_param: bool  # a plain nn.Parameter: swapped with `.data =` so its identity never changes
    requires_grad: bool
    device: torch.device
    original: torch.Tensor | None = None  # subclass tensors keep their identity: inner tensors are re-pointed
    param: nn.Parameter | None = None  # the engine's own Parameter object for a plain parameter (set when staged)
    # the last replacement found to hold other bytes: not compared again (a device-to-host read) while it stays
    foreign: Any = field(default=None, repr=False, compare=False)

    def current(self) -> torch.Tensor | None:
        """The tensor the module holds under this entry now."""
        module, attr, kind = self.locations[0]
        return (module._parameters if kind == "param" else module._buffers).get(attr)

    def own(self) -> torch.Tensor | None:
        """The engine's own tensor for this entry (a foreign replacement in the module is not the engine's to touch)."""
        return self.param if self.param is not None else self.current()

    def reclaim(self) -> bool:
        """Whether the module still uses the engine's parameter; a replacement holding the same bytes (ComfyUI
        restoring a backup as a new Parameter) is swapped back for the engine's own. False: another owner's tensor
        with other bytes sits there now (a plain clone baked a patch into it)."""
        ours = self.param
        current = self.current()
        if ours is None or current is ours:
            return True
        if current is None or current.shape != ours.shape or current.dtype != ours.dtype:
            return False
        if self.foreign is not None and self.foreign() is current:
            return False
        same = current.data_ptr() == ours.data_ptr()
        if not same:
            with torch.no_grad():
                same = torch.equal(current.detach().to(ours.device), ours.detach())
        if same:
            for module, attr, _ in self.locations:
                module._parameters[attr] = ours
        else:
            self.foreign = weakref.ref(current)
        return same


def _plain(t: torch.Tensor) -> torch.Tensor:
    plain = t.detach()
    return plain if type(plain) is torch.Tensor else plain.as_subclass(torch.Tensor)


@dataclass
class TensorLayout:
    """How a unit's tensors map onto a flat buffer, and how to rebuild them from any such buffer."""

    leaves: list[Leaf]
    entries: list[Entry]
    nbytes: int

    @property
    def plain(self) -> bool:
        """Every entry is one plain tensor whose bytes are row-major (how a safetensors file stores them)."""
        return all(isinstance(e.recipe, int) for e in self.entries) and all(l.row_major for l in self.leaves)

    @functools.cached_property
    def param_entries(self) -> list[Entry]:
        """The entries of plain parameters, in layout order (the order of a binding's `data_swaps`)."""
        return [e for e in self.entries if e.plain_param]

    def version(self) -> int:
        """Sum of the version counters of the tensors bound now: changes whenever one is written in place."""
        total = 0
        for entry in self.entries:
            t = entry.own()
            if t is None or t.is_inference():  # inference tensors have no version counter
                continue
            try:
                total += t._version
            except RuntimeError:  # a Parameter over an inference tensor made elsewhere: nothing to track either
                continue
        return total

    def reclaim(self) -> bool:
        """Every plain parameter back to the engine's own object where it holds the same bytes; False when another
        owner's tensor with other bytes is in use (the unit must not be streamed over it)."""
        ok = True
        for entry in self.entries:  # the common case first: the module holds the engine's own object
            ours = entry.param
            if ours is None:
                continue
            module, attr, kind = entry.locations[0]
            if kind == "param" and module._parameters.get(attr) is ours:
                continue
            ok = entry.reclaim() and ok
        return ok

    def adopt_params(self) -> None:
        """Remember the Parameter objects the modules hold now as the engine's own (right after staging)."""
        for entry in self.entries:
            if entry.plain_param:
                entry.param = entry.current()

    def sources(self) -> Iterator[torch.Tensor]:
        """The leaves' current tensors, read from the modules in layout order (nothing is kept between calls)."""
        for entry in self.entries:
            yield from _walk_leaves(entry.original if entry.original is not None else entry.current(), entry.recipe)

    def leaf_views(self, buf: torch.Tensor) -> list[torch.Tensor]:
        views = []
        for leaf in self.leaves:
            raw = buf[leaf.offset:leaf.offset + leaf.nbytes].view(leaf.dtype)
            views.append(raw.as_strided(leaf.shape, leaf.stride) if leaf.stride is not None else raw.view(leaf.shape))
        return views

    def build(self, buf: torch.Tensor, master: bool = False) -> "Binding":
        """Tensors viewing `buf`, ready to be swapped into the unit's modules.

        With `master`, tensor subclasses are not rebuilt: the original objects get their inner tensors
        re-pointed at `buf`, so the module keeps the very objects it had between forwards.
        """
        return self.bind(self.leaf_views(buf), buf, master)

    def bind(self, views: list[torch.Tensor], buf: torch.Tensor | None, master: bool = False) -> "Binding":
        """Like `build`, from per-leaf tensors (a file's mmap views for the disk tier)."""
        data_swaps: list[tuple[nn.Parameter, torch.Tensor]] = []
        dict_sets: list[tuple[dict, str, torch.Tensor]] = []
        for entry in self.entries:
            if master and entry.original is not None:
                repoint(entry.original, entry.recipe, views.__getitem__)
                for module, attr, kind in entry.locations:
                    dict_sets.append((module._parameters if kind == "param" else module._buffers, attr,
                                      entry.original))
                continue
            value = _assemble(entry.recipe, views.__getitem__)
            if entry.plain_param:
                data_swaps.append((entry.own(), value))
                continue
            value_p = nn.Parameter(value, requires_grad=entry.requires_grad) if any(
                kind == "param" for _, _, kind in entry.locations) else None
            if not master and value_p is None and isinstance(entry.recipe, int):
                value = own_version_alias(value)  # a device copy's buffer: a write to it is told apart (buffer_writes)
            for module, attr, kind in entry.locations:
                if kind == "param":
                    dict_sets.append((module._parameters, attr, value_p))
                else:
                    dict_sets.append((module._buffers, attr, value))
        return Binding(buf, data_swaps, dict_sets)

    def rebind_fresh(self, views: list[torch.Tensor]) -> None:
        """Give meta or inference-mode parameters new objects over `views` (they cannot take `.data`)."""
        for entry in self.entries:
            current = entry.current() if entry.plain_param else None
            if current is not None and (current.is_meta or current.is_inference()):
                param = fresh_param(current, views[entry.recipe], entry.requires_grad)
                for mod, name, k in entry.locations:
                    (mod._parameters if k == "param" else mod._buffers)[name] = param

    def restore(self, leaf: Callable[[int, torch.device], torch.Tensor]) -> None:
        """Give every tensor back as an ordinary tensor made by `leaf(i, device)` (an independent copy)."""
        for entry in self.entries:
            on_device = functools.partial(_leaf_on, leaf, entry.device)
            if entry.original is not None:
                repoint(entry.original, entry.recipe, on_device)
                for module, attr, kind in entry.locations:
                    (module._parameters if kind == "param" else module._buffers)[attr] = entry.original
                continue
            value = _assemble(entry.recipe, on_device)
            if entry.plain_param:
                entry.own().data = value
                continue
            param = nn.Parameter(value, requires_grad=entry.requires_grad) if any(
                k == "param" for _, _, k in entry.locations) else None
            for module, attr, kind in entry.locations:
                if kind == "param":
                    module._parameters[attr] = param
                else:
                    module._buffers[attr] = value


# `param.data = value` through torch's own setter: `nn.Parameter.data` may be the engine's watching descriptor
# (offload/stream/data_watch.py), which a swap of the engine's own must not go through
_set_data = torch._C.TensorBase.data.__set__


def own_version_alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor over `t`'s very memory (storage, offset, shape, strides) with a version counter of its own: a view
    shares its base's counter, so an in-place write to one buffer of a unit would bump every leaf of the unit."""
    with torch.no_grad():
        return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(),
                                                                   t.shape, t.stride())


def fresh_param(like: torch.Tensor, view: torch.Tensor, requires_grad: bool) -> nn.Parameter:
    """A new parameter over `view` standing in for `like`: a tensor subclass that does not flatten (ComfyUI-GGUF's
    GGMLTensor: quantized bytes with `tensor_type` / `tensor_shape` attributes) keeps its class and attributes, so
    its layer still sees a quantized weight of its logical shape."""
    cls = type(like)
    if cls in (torch.Tensor, nn.Parameter) or not isinstance(like, torch.Tensor) or is_subclass_tensor(like):
        return nn.Parameter(view, requires_grad=requires_grad)
    fresh = view.as_subclass(cls)
    for key, value in like.__dict__.items():
        fresh.__dict__[key] = copy.copy(value) if isinstance(value, (list, dict, set)) else value
    fresh.requires_grad_(requires_grad and fresh.is_floating_point())
    fresh.__dict__["_is_param"] = True  # what nn.Parameter marks a subclass instance with (isinstance checks it)
    return fresh  # type: ignore[return-value]


# The recursive helpers are module-level on purpose: a recursive closure refers to itself through its cell, and
# that cycle would keep the buffer views it captured alive until the cycle collector runs.
def _walk_leaves(t: torch.Tensor, recipe: Any) -> Iterator[torch.Tensor]:
    if isinstance(recipe, int):
        yield _plain(t)
        return
    for name, r in recipe[2].items():
        yield from _walk_leaves(getattr(t, name), r)


def _assemble(recipe: Any, leaf: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """The tensor a recipe describes, from its leaves (a tensor subclass is rebuilt by `__tensor_unflatten__`)."""
    if isinstance(recipe, int):
        return leaf(recipe)
    cls, ctx, inner, outer_size, outer_stride = recipe
    return cls.__tensor_unflatten__({k: _assemble(r, leaf) for k, r in inner.items()}, ctx, outer_size, outer_stride)


def _leaf_on(leaf: Callable[[int, torch.device], torch.Tensor], device: torch.device, i: int) -> torch.Tensor:
    return leaf(i, device)


def repoint(obj: torch.Tensor, recipe: Any, leaf: Callable[[int], torch.Tensor]) -> None:
    """Point a tensor subclass's inner tensors at `leaf(i)` (recursively), keeping the object itself.

    The attributes `__tensor_flatten__` names need not be where the subclass's kernels read its tensors:
    comfy_kitchen's `QuantizedTensor` flattens its scales as `_param_scale` copies of `_params.scale`, which the
    kernels read. So the object also takes the state of one `__tensor_unflatten__` builds from the new inner
    tensors (its `__dict__` entries), and every kernel reads the scales that moved with the payload."""
    cls, ctx, inner, outer_size, outer_stride = recipe
    values: dict[str, torch.Tensor] = {}
    for name, r in inner.items():
        if isinstance(r, int):
            values[name] = leaf(r)
            setattr(obj, name, values[name])
        else:
            values[name] = getattr(obj, name)
            repoint(values[name], r, leaf)
    _take_state(obj, cls.__tensor_unflatten__(values, ctx, outer_size, outer_stride))


def _take_state(obj: torch.Tensor, fresh: Any) -> None:
    """`obj` takes the instance attributes of `fresh` (the same subclass rebuilt over new inner tensors) that differ."""
    state, new = getattr(obj, "__dict__", None), getattr(fresh, "__dict__", None)
    if type(fresh) is not type(obj) or state is None or not new:
        return
    for key, value in new.items():
        if state.get(key, _MISSING) is not value:
            state[key] = value


_MISSING = object()


@dataclass
class Binding:
    """A unit's tensors bound to one buffer (host master or a device slot); `apply` swaps them in."""

    buf: torch.Tensor | None
    data_swaps: list[tuple[nn.Parameter, torch.Tensor]]
    dict_sets: list[tuple[dict, str, torch.Tensor]]
    _ptrs: list[int] | None = field(default=None, repr=False, compare=False)

    def param_ptrs(self) -> list[int]:
        """Where each swapped parameter's data starts once applied (a parameter elsewhere had its `.data` replaced)."""
        if self._ptrs is None:
            self._ptrs = [value.data_ptr() if value.numel() else -1 for _, value in self.data_swaps]
        return self._ptrs

    def apply(self) -> None:
        for param, value in self.data_swaps:
            _set_data(param, value)
        for d, key, value in self.dict_sets:
            d[key] = value


def _flatten(t: torch.Tensor, leaves: list[Leaf], offset: list[int]) -> Any:
    if is_subclass_tensor(t):
        names, ctx = t.__tensor_flatten__()
        inner = {name: _flatten(getattr(t, name), leaves, offset) for name in names}
        return (type(t), ctx, inner, tuple(t.size()), tuple(t.stride()))
    plain = _plain(t)
    stride = None
    span = plain.numel()
    if (tuple(plain.stride()) != row_major_strides(plain.shape) and plain.numel() > 0
            and all(st > 0 or n == 1 for n, st in zip(plain.shape, plain.stride()))):
        # keep the original strides (kernels, and so outputs, can depend on them) over the memory they span; compared
        # exactly, not with is_contiguous(), which ignores size-1 dims: a channels_last 1x1 conv weight (C, C, 1, 1)
        # is "contiguous" too, yet a conv over an NCHW input picks its output's memory format from those strides
        stride = tuple(plain.stride())
        span = 1 + sum((n - 1) * st for n, st in zip(plain.shape, stride))
    nbytes = span * plain.element_size()
    leaves.append(Leaf(offset[0], nbytes, plain.dtype, tuple(plain.shape), stride, plain.is_meta))
    offset[0] = align(offset[0] + nbytes)
    return len(leaves) - 1


def row_major_strides(shape: tuple[int, ...] | torch.Size) -> tuple[int, ...]:
    """The strides of a row-major (torch.contiguous_format) tensor of `shape`, as `torch.empty(shape)` has them."""
    strides, step = [], 1
    for n in reversed(tuple(shape)):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


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


def plan_layout(tensors: list[tuple[nn.Module, str, str, torch.Tensor]], group_dtypes: bool = True) -> TensorLayout:
    """Lay out distinct tensors (a tensor met twice is laid out once, except a non-persistent buffer aliasing
    another: transformers' dynamic RoPE leaves `inv_freq` and `original_inv_freq` as one tensor after a reset, then
    re-registers `inv_freq` alone in a later forward; a shared leaf would carry the new value into both).

    With `group_dtypes` the leaves of one dtype lie together (dtypes in the order they first appear, tensors in their
    order within each): the codec then codes all of a unit's tensors of one dtype as one stream (`codec.py`), so its
    decode takes a constant number of device ops. Without it (a unit laid out as a packed folder stores it), the
    order given."""
    by_id: dict[int, Entry] = {}
    leaves: list[Leaf] = []
    offset = [0]
    entries: list[Entry] = []
    for sub, name, kind, t in tensors:
        entry = by_id.get(id(t))
        if entry is not None and kind == "buffer" and name in sub._non_persistent_buffers_set:
            entry = None
        if entry is None:
            recipe = _flatten(t, leaves, offset)
            plain_param = kind == "param" and not is_subclass_tensor(t)
            home = torch.device("cpu") if t.is_meta else t.device  # a meta weight comes home from disk to RAM
            entry = Entry([], recipe, plain_param, bool(t.requires_grad), home,
                          t if not isinstance(recipe, int) else None)
            by_id[id(t)] = entry
            entries.append(entry)
        entry.locations.append((sub, name, kind))
    if group_dtypes and len(leaves) > 1:
        offset[0] = group_by_dtype(leaves)
    return TensorLayout(leaves, entries, max(offset[0], ALIGN))


SMALL_LEAF = 4096  # bytes: a smaller tensor goes to the end of its dtype's run (the codec may keep that tail raw)


def group_by_dtype(leaves: list[Leaf]) -> int:
    """Place `leaves` again so that those of one dtype lie together (dtypes in the order they first appear; within
    each, tensors of at least SMALL_LEAF bytes first, then the smaller ones, each in their order), each at an aligned
    offset; returns the bytes they span."""
    rank: dict[torch.dtype, int] = {}
    for leaf in leaves:
        rank.setdefault(leaf.dtype, len(rank))
    end = 0
    for i in sorted(range(len(leaves)), key=lambda i: (rank[leaves[i].dtype], leaves[i].nbytes < SMALL_LEAF, i)):
        leaves[i].offset = end
        end = align(end + leaves[i].nbytes)
    return end
