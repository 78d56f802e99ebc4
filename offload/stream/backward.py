"""Backward through streamed units: each unit's weights come back to a slot in reverse order while autograd runs.

Autograd saves the tensors a unit's ops need for backward, and while a streamed unit computes its weights are
views of a ring slot that later units overwrite. While a streamed unit computes with grad enabled, a
`saved_tensors_hooks` pair is active: a saved tensor that views the unit's slot (a weight, `weight.t()`, any view of
it) is saved as a small `_SlotView` (unit, byte offset, shape, strides, dtype) instead, never as the slot's memory.
Every other tensor goes to the hook that was active before ours (torch.utils.checkpoint's), or is saved as is.

In backward, `BackwardStreamer.enter(unit)` brings the unit's bytes into a slot and binds its parameters there:
it runs when the grads of the unit's outputs are ready (a pre-hook on their grad_fn nodes), when autograd
unpacks one of its `_SlotView`s, or when a checkpointed unit re-runs its forward inside backward. The unit holds its
slot until backward enters another unit: autograd runs nodes in reverse creation order, so by then every node of
the units after it in the forward has run. The prefetch worker follows the reversed forward order, so the next
units are copying while the current one computes. Frozen weights stay read-only host masters; nothing is copied
device-to-host. Parameters that are not part of a streamed unit's layout never enter a slot and get their gradients
as usual: LoRA adapters added after offloading, and the trainable parameters a block held when it was offloaded
(`trainable_in_blocks`: peft's LoRA layers added before offloading, a norm left trainable while the base weights are
frozen). Those are staged with the weights outside the blocks, so they live on the device for the whole run, count
in the device bytes every plan holds (`rest_bytes`), and the optimizer updates them in place there; detach() gives
them back as ordinary parameters with their trained values.

A streamed weight that requires grad (full fine-tuning of a streamed block) is refused with `TrainableWeightError`
naming the parameter. A weight made trainable after offloading (it was frozen when the model was offloaded) is a
training setup: that is refused before the forward computes anything. A weight that required grad all along is
usually inference code that forgot torch.no_grad() on a model whose parameters require grad (any nn.Module's
default): its forward runs and gives exact values, and a backward is refused at its start, before any gradient is
computed for the model's parameters.
"""
from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

from ..model.layout import is_subclass_tensor

log = logging.getLogger(__name__)


class TrainableWeightError(RuntimeError):
    """A streamed weight requires grad: backward through streamed units trains only parameters on the device."""


def in_backward() -> bool:
    """Whether this thread runs inside an autograd graph task (a backward node, a re-forward of a checkpoint)."""
    return torch._C._current_graph_task_id() != -1


def trainable_streamed_weight(units: list[Any], streamed: list[int]) -> tuple[int, nn.Module, str, bool] | None:
    """A (unit, module, attribute, made trainable after offloading) of a streamed unit whose weight requires grad,
    preferring one that was frozen when the model was offloaded; None when every streamed weight is frozen."""
    first = None
    for i in streamed:
        for entry in units[i].staged.layout.entries:
            t = entry.own()
            if t is not None and t.requires_grad:
                module, attr, _ = entry.locations[0]
                if not entry.requires_grad:
                    return i, module, attr, True
                if first is None:
                    first = (i, module, attr, False)
    return first


def trainable_weight_error(model: nn.Module | None, unit_name: str, module: nn.Module, attr: str) -> TrainableWeightError:
    name = f"{unit_name}.?.{attr}"
    if model is not None:
        for path, m in model.named_modules():
            if m is module:
                name = f"{path}.{attr}" if path else attr
                break
    return TrainableWeightError(
        f"the streamed weight {name!r} requires grad: backward through streamed blocks computes gradients for "
        f"parameters kept on the device but never for streamed base weights (full fine-tuning of a streamed block "
        f"is not supported). Parameters on the device are adapters added after offloading, and the trainable "
        f"parameters the blocks held when the model was offloaded with gradients enabled and its base weights frozen "
        f"(peft's get_peft_model, a norm left trainable). Freeze it (requires_grad_(False)) before offloading, run "
        f"inference under torch.no_grad(), or keep its block resident")


@dataclass(frozen=True)
class _SlotView:
    """A saved tensor that viewed a unit's slot: enough to view the same bytes in whichever slot holds them later."""

    unit: int
    byte_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class _SubclassView:
    """A saved tensor subclass whose inner tensors view the slot (rebuilt by `__tensor_unflatten__`)."""

    cls: Any
    ctx: Any
    inner: dict[str, Any]
    size: tuple[int, ...]
    stride: tuple[int, ...]


class _Outer:
    """What the saved-tensor hook active before ours packed (torch.utils.checkpoint's holder)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def _match(t: torch.Tensor, unit: int, ptr: int, base: int) -> Any:
    if is_subclass_tensor(t):
        names, ctx = t.__tensor_flatten__()
        inner = {n: _match(getattr(t, n), unit, ptr, base) for n in names}
        if all(v is None for v in inner.values()):
            return None
        inner = {n: getattr(t, n) if v is None else v for n, v in inner.items()}
        return _SubclassView(type(t), ctx, inner, tuple(t.size()), tuple(t.stride()))
    try:
        if t.untyped_storage().data_ptr() != ptr or not t.numel():
            return None
    except (RuntimeError, NotImplementedError):  # a tensor without storage (a wrapper subclass that does not flatten)
        return None
    return _SlotView(unit, t.storage_offset() * t.element_size() - base, tuple(t.size()), tuple(t.stride()), t.dtype)


class _SavedHooks:
    """The pack / unpack pair active while one streamed unit computes; composes with the hook active before it."""

    def __init__(self, loader: "BackwardStreamer", unit: int, slot: torch.Tensor) -> None:
        self._loader = weakref.ref(loader)
        self._unit = unit
        self._ptr = slot.untyped_storage().data_ptr()
        self._base = slot.storage_offset() * slot.element_size()
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self._outer = top

    def pack(self, t: torch.Tensor) -> Any:
        found = _match(t, self._unit, self._ptr, self._base)
        if found is not None:
            return found
        if self._outer is not None:
            return _Outer(self._outer[0](t))
        return t

    def unpack(self, packed: Any) -> Any:
        if isinstance(packed, _Outer):
            return self._outer[1](packed.value)
        if isinstance(packed, (_SlotView, _SubclassView)):
            loader = self._loader()
            if loader is None:
                raise RuntimeError("backward through an offloaded model after its engine was detached")
            return loader.unpack(packed)
        return packed

    def push(self) -> None:
        torch._C._autograd._push_saved_tensors_default_hooks(self.pack, self.unpack)

    def pop(self) -> None:
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is not None and getattr(top[0], "__self__", None) is self:
            torch._C._autograd._pop_saved_tensors_default_hooks()
        else:  # someone pushed on top of ours and never popped: leave the stack alone rather than pop theirs
            log.warning("saved-tensor hooks of an offloaded unit were not on top when it finished; left in place")


class _RefuseHook:
    """Pre-hook on the grad_fn of an output that depends on a streamed weight requiring grad: backward is refused."""

    __slots__ = ("_error",)

    def __init__(self, error: TrainableWeightError) -> None:
        self._error = error

    def __call__(self, grad_outputs: Any) -> None:
        raise TrainableWeightError(str(self._error))


def refuse_backward(output: Any, error: TrainableWeightError) -> None:
    """Backward through `output` raises `error` before its first node runs."""
    found: dict[int, Any] = {}
    _grad_fns(output, found)
    for fn in found.values():
        fn.register_prehook(_RefuseHook(error))


class _EnterHook:
    """Pre-hook on a grad_fn node of a unit's output: the unit's backward starts when that node runs."""

    __slots__ = ("_ref", "_unit")

    def __init__(self, loader: "BackwardStreamer", unit: int) -> None:
        self._ref = weakref.ref(loader)
        self._unit = unit

    def __call__(self, grad_outputs: Any) -> None:
        loader = self._ref()
        if loader is not None:
            loader.enter(self._unit)
        return None


def _grad_fns(obj: Any, found: dict[int, Any]) -> None:
    if isinstance(obj, torch.Tensor):
        fn = obj.grad_fn
        if fn is not None:
            found.setdefault(id(fn), fn)
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            _grad_fns(o, found)
    elif isinstance(obj, dict):
        for o in obj.values():
            _grad_fns(o, found)


@dataclass
class _Held:
    """The streamed unit whose weights sit in a slot during backward."""

    index: int
    slot: int
    copy: Any
    ready: Any
    start: Any


class BackwardStreamer:
    """Brings streamed units back into slots, in reverse order, while autograd runs backward through them.

    Owned by `ModelStreamer`; refers to its parts (units, placement, worker, backend, metrics), and back to the
    streamer only through the weak callables it is given."""

    def __init__(self, units: list[Any], placement: Any, worker: Any, backend: Any, metrics: Any,
                 fetch: Callable[[int], tuple[int, Any, Any]], ensure_loaded: Callable[[], None],
                 ended: Callable[[], None] | None = None,
                 releasing: Callable[[int, int], None] | None = None) -> None:
        self.units = units
        self.placement = placement
        self.worker = worker
        self.backend = backend
        self.metrics = metrics
        self._fetch = fetch
        self._ensure_loaded = ensure_loaded
        self._ended = ended  # told when a backward that streamed units is over (the budget measures training)
        self._releasing = releasing  # told (unit, slot) before a held unit's slot goes back, while it is bound there
        self.held: _Held | None = None
        self.session: int | None = None  # the graph task whose end closes the session
        self.sessions = 0  # backward passes that brought streamed units in
        self.armed = False  # this forward left outputs whose backward streams units
        self.last_order: list[int] = []  # streamed units in the order the last forward ran them
        self._recompute: list[tuple[int, _SavedHooks | None]] = []  # units re-running their forward in backward
        self.detached = False

    # forward side -------------------------------------------------------------------------
    def hooks_for(self, index: int, slot: int) -> _SavedHooks | None:
        """Push the saved-tensor hooks for a streamed unit computing in `slot` (None without grad)."""
        if not torch.is_grad_enabled():
            return None
        hooks = _SavedHooks(self, index, self.placement.slots[slot])
        hooks.push()
        return hooks

    def arm(self, index: int, output: Any) -> None:
        """The unit's backward begins when the grads of its outputs are ready: hook their grad_fn nodes."""
        if not torch.is_grad_enabled():
            return
        found: dict[int, Any] = {}
        _grad_fns(output, found)
        for fn in found.values():
            fn.register_prehook(_EnterHook(self, index))
        if found:
            self.armed = True

    def before_forward(self) -> None:
        """A forward starts: close a session a failed backward left open; prefetch in forward order again."""
        if self.held is not None or self.session is not None:
            self.close()
        self.worker.forward_order()
        self.armed = False

    def after_forward(self, order: list[int]) -> None:
        """The forward ended: when backward will stream units, the worker starts on them in reverse order now."""
        self.last_order = list(order)
        if self.armed:
            self.worker.reverse_order(self.last_order)

    # backward side ------------------------------------------------------------------------
    def enter(self, index: int) -> None:
        """Backward reached unit `index`: its weights in a slot, its parameters bound there, until the next unit."""
        held = self.held
        if held is not None and held.index == index:
            return
        if self.detached:
            raise RuntimeError("backward through an offloaded model whose engine was detached after the forward: "
                               "run the forward again after detach() (the model is an ordinary module now)")
        if not in_backward():
            return  # only backward brings units in; a view unpacked outside one is copied (see `unpack`)
        self._open()
        if held is not None:
            self._release()
        u = self.units[index]
        if u.resident_buf is not None:
            return
        if not self.placement.loaded:
            self._ensure_loaded()
        slot, copy, ready = self._fetch(index)
        start = self.backend.record()
        self.placement.binding(u, slot).apply()
        self.held = _Held(index, slot, copy, ready, start)

    def unpack(self, packed: Any) -> torch.Tensor:
        """A saved view of a unit's slot, over the bytes of that unit wherever they are now."""
        if isinstance(packed, _SubclassView):
            inner = {n: self.unpack(v) if isinstance(v, (_SlotView, _SubclassView)) else v
                     for n, v in packed.inner.items()}
            return packed.cls.__tensor_unflatten__(inner, packed.ctx, packed.size, packed.stride)
        if self.detached:
            self.enter(packed.unit)  # raises
        u = self.units[packed.unit]
        if u.resident_buf is not None:
            return self._view(u.resident_buf, packed)
        if not in_backward():  # read outside backward (inspecting grad_fn._saved_*): a copy, no slot kept
            slot, _, _ = self._fetch(packed.unit)
            try:
                return self._view(self.placement.slots[slot], packed).clone()
            finally:
                self.worker.release(slot, self.backend.record())
        self.enter(packed.unit)
        return self._view(self.placement.slots[self.held.slot], packed)

    @staticmethod
    def _view(buf: torch.Tensor, p: _SlotView) -> torch.Tensor:
        item = torch.empty((), dtype=p.dtype).element_size()
        offset = buf.storage_offset() * buf.element_size() + p.byte_offset
        out = torch.empty(0, dtype=p.dtype, device=buf.device)
        with torch.no_grad():
            out.set_(buf.untyped_storage(), offset // item, p.size, p.stride)
        return out

    def recompute_pre(self, index: int, whole_unit: bool) -> None:
        """A unit's forward re-runs inside backward (activation checkpointing): its weights come in first."""
        u = self.units[index]
        if u.resident_buf is not None:
            self._recompute.append((index, None))
            return
        self.enter(index)
        hooks = None
        if whole_unit and self.held is not None and self.held.index == index:
            hooks = self.hooks_for(index, self.held.slot)
        if whole_unit:
            self._recompute.append((index, hooks))

    def recompute_post(self, index: int, output: Any) -> Any:
        """The re-run forward of `index` ended: its hooks off; outputs viewing the slot cloned."""
        from .outputs import unalias

        for k in range(len(self._recompute) - 1, -1, -1):
            if self._recompute[k][0] == index:
                _, hooks = self._recompute.pop(k)
                if hooks is not None:
                    hooks.pop()
                break
        held = self.held
        replaced = None
        if held is not None and held.index == index:
            replaced = unalias(output, self.placement.slot_ptrs[held.slot])
        self.arm(index, output if replaced is None else replaced)
        return replaced

    def _open(self) -> None:
        if self.session is not None:
            return
        self.session = torch._C._current_graph_task_id()
        self.sessions += 1
        if not self.worker.reversed and self.last_order:
            self.worker.reverse_order(self.last_order)
        weak = weakref.ref(self)

        def done() -> None:
            loader = weak()
            if loader is not None:
                loader.close(finished=True)

        torch.autograd.Variable._execution_engine.queue_callback(done)

    def _release(self) -> None:
        held, self.held = self.held, None
        u = self.units[held.index]
        try:
            if self._releasing is not None:
                self._releasing(held.index, held.slot)
        finally:
            u.master.host_binding.apply()
            end = self.backend.record()
            self.worker.release(held.slot, end)
            self.metrics.add(held.index, held.copy, held.ready, held.start, end, u.nbytes, backward=True)

    def close(self, finished: bool = False) -> None:
        """Backward ended (`finished`: autograd's end-of-backward callback), or a forward or a plan change comes
        while one is open (a backward that raised): the held slot back to the ring, prefetch in forward order."""
        if self.held is not None:
            self._release()
        self.session = None
        self._recompute.clear()
        self.worker.forward_order()
        if finished and self._ended is not None:
            self._ended()

    @property
    def busy(self) -> bool:
        return self.held is not None
