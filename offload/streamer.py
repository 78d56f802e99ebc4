"""Per-unit forward hooks and the device slot ring: the hot path of the engine.

Before a streamed unit runs, the compute stream waits (GPU-side) for its copy and its parameters are swapped
to views of the slot; after it runs, they are swapped back to the host master and the slot is handed to the
prefetch worker for the next streamed unit. Resident units live in their own device buffer. Nothing is ever
copied device-to-host: the host buffer is the truth and a slot is just reused.

Ownership runs one way: the model keeps its engine alive (through the handle stored on it), and the hooks and
the streamer refer back to the model and to the pass listener only weakly, so dropping a model frees its host
and device memory at once, with or without the cycle collector.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator, Protocol

import torch
import torch.nn as nn

from .backends.base import Backend
from .layout import Binding
from .metrics import BlockReport, MetricsCollector
from .pass_lock import PassLock, module_call_frame
from .prefetch import PrefetchWorker
from .planner import bounce_buffers
from .staging import StagedModel, StagedUnit, StagingBuffer, file_keys_holding, make_ram_source
from .storage import BounceReader, DiskSource, HostSource, resolve

log = logging.getLogger(__name__)


class DeviceMemoryError(ValueError):
    """Even the smallest plan (one slot) does not fit: names the unit and its size."""


class PassListener(Protocol):
    """Told when a pass over the model starts and ends (the safe points for the budget and planner)."""

    def before_pass(self) -> None: ...

    def after_pass(self) -> None: ...


_UNCHANGED = object()


def _unalias_walk(obj: Any, storage_ptr: int) -> Any:
    if isinstance(obj, torch.Tensor):
        if obj.numel() and obj.untyped_storage().data_ptr() == storage_ptr:
            return obj.clone()
        return _UNCHANGED
    if isinstance(obj, (tuple, list)):
        items = [_unalias_walk(o, storage_ptr) for o in obj]
        if all(i is _UNCHANGED for i in items):
            return _UNCHANGED
        new = [o if i is _UNCHANGED else i for o, i in zip(obj, items)]
        return type(obj)(*new) if hasattr(obj, "_fields") else type(obj)(new)
    if isinstance(obj, dict):
        items = {k: _unalias_walk(v, storage_ptr) for k, v in obj.items()}
        if all(i is _UNCHANGED for i in items.values()):
            return _UNCHANGED
        new = copy.copy(obj)  # keeps dict subclasses (model-output classes) intact
        for k, v in items.items():
            if v is not _UNCHANGED:
                new[k] = v
        return new
    return _UNCHANGED


def _unalias(output: Any, storage_ptr: int) -> Any:
    """An output that views the slot (a unit returning its own weight) is cloned: the slot is about to be reused."""
    result = _unalias_walk(output, storage_ptr)
    return None if result is _UNCHANGED else result


class _StreamedBackwardGuard(torch.autograd.Function):
    """Identity in forward; backward refuses: autograd saved views of a slot that later units overwrote."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, name: str) -> torch.Tensor:  # type: ignore[override]
        ctx.unit_name = name
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        raise RuntimeError(
            f"backward through the streamed unit {ctx.unit_name!r} is not supported: its weights lived in a "
            f"device slot that later units reused, so the gradients would be wrong. Run offloaded models under "
            f"torch.no_grad()/torch.inference_mode(), or keep the layers you train resident (units=...)")


def _guard_backward(obj: Any, name: str) -> Any:
    """Route every grad-requiring output tensor through the guard (so backward raises instead of lying)."""
    if isinstance(obj, torch.Tensor):
        return _StreamedBackwardGuard.apply(obj, name) if obj.requires_grad else obj
    if isinstance(obj, (tuple, list)):
        items = [_guard_backward(o, name) for o in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, dict):
        new = copy.copy(obj)
        for k, v in obj.items():
            new[k] = _guard_backward(v, name)
        return new
    return obj


class _WeakHook:
    """A hook (or callback) calling a streamer method through a weak reference (no model -> engine -> model cycle)."""

    __slots__ = ("_ref", "_fn", "_index")

    def __init__(self, streamer: "ModelStreamer", fn: Any, index: int | None = None) -> None:
        self._ref = weakref.ref(streamer)
        self._fn = fn
        self._index = index

    def __call__(self, *args: Any) -> Any:
        s = self._ref()
        if s is None:
            return None
        return self._fn(s, *args) if self._index is None else self._fn(s, self._index, *args)


@dataclass
class ActiveUnit:
    """The streamed unit computing now, in its slot."""

    index: int
    slot: int
    copy: Any  # event its copy completed on
    ready: Any  # compute stream reached the unit (before waiting for the copy)
    start: Any  # compute started (after the wait)
    holds_lock: bool = False  # entered outside a root pass: the unit holds the pass lock until it finishes


@dataclass
class UnitState:
    """One unit's device side: its resident copy or slot bindings, and what changed since it was placed."""

    staged: StagedUnit
    resident_buf: torch.Tensor | None = None
    slot_bindings: dict[int, Binding] = field(default_factory=dict)
    mark: int = 0  # version of the tensors bound between forwards, when last seen
    device_newer: bool = False  # a resident copy was written in place: the host master must catch up

    @property
    def index(self) -> int:
        return self.staged.index

    @property
    def nbytes(self) -> int:
        return self.staged.nbytes

    @property
    def master(self) -> StagingBuffer:
        return self.staged.master

    @property
    def tier(self) -> str:
        return "vram" if self.resident_buf is not None else self.staged.source.tier


class ModelStreamer:
    """Installs the hooks on a staged model and runs its slot ring and device memory."""

    def __init__(self, model: nn.Module, staged: StagedModel, backend: Backend, listener: PassListener,
                 pin_memory: bool, prefetch: int, profile: bool = False) -> None:
        self._model = weakref.ref(model)
        self.worker_prefetch = prefetch
        self.staged = staged
        self.backend = backend
        self._listener = weakref.ref(listener)
        self.pin_memory = pin_memory
        self.units = [UnitState(s, mark=s.layout.version()) for s in staged.units]
        self.sources = [s.source for s in staged.units]  # shared with the worker: a promoted unit's source swaps here
        self.rest_source = HostSource(staged.rest.host, False, backend)
        self.rest_buf: torch.Tensor | None = None
        self.rest_mark = staged.rest.layout.version()
        self.rest_device_newer = False
        self.worker = PrefetchWorker()
        self.metrics = MetricsCollector(backend, len(self.units), profile)
        self.slots: list[torch.Tensor] = []
        self._slot_ptrs: list[int] = []
        self.slot_bytes = 0
        self.resident_set: set[int] = set()
        self._n_slots = 0  # slots the current plan asks for
        self.loaded = False
        self.order_learned = False
        self.peak_device_bytes = 0
        self.active: ActiveUnit | None = None
        self._resident_start: dict[int, tuple[Any, bool]] = {}
        self._seen: list[int] = []
        # one pass at a time; device memory changes hands only under it (the lock refers back weakly, no cycle)
        self._lock = PassLock(_WeakHook(self, ModelStreamer._abandon_pass))
        self._root_calls = 0  # root-module forwards in progress on the owning thread (nested calls count)
        self._pass_owner: int | None = None
        self._last_unit_outside_root: int | None = None
        self._foreign: set[int] = set()  # units whose parameters another owner's tensors replace this pass
        self._hooks: list[Any] = []
        self._install_hooks(model)

    @property
    def rest_bytes(self) -> int:
        return self.staged.rest_bytes

    # hooks ----------------------------------------------------------------------
    def _install_hooks(self, model: nn.Module) -> None:
        cls = type(self)
        self._hooks.append(model.register_forward_pre_hook(_WeakHook(self, cls._root_pre), prepend=True))
        self._hooks.append(model.register_forward_hook(_WeakHook(self, cls._root_post), always_call=True))
        for u in self.units:
            module = u.staged.module
            # prepend: hooks the user registered earlier must already see the unit's device weights
            self._hooks.append(module.register_forward_pre_hook(_WeakHook(self, cls._pre, u.index), prepend=True))
            self._hooks.append(module.register_forward_hook(_WeakHook(self, cls._post, u.index), always_call=True))
            # Some models never call the block container itself (ComfyUI's UNet iterates a
            # TimestepEmbedSequential and calls its layers): the first child to run brings the unit in.
            for child in module.children():
                self._hooks.append(child.register_forward_pre_hook(_WeakHook(self, cls._child_pre, u.index),
                                                                   prepend=True))

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def is_busy(self) -> bool:
        """A pass (or a unit outside one) is running."""
        return self._root_calls > 0 or self.active is not None

    @contextlib.contextmanager
    def exclusive(self, blocking: bool = True) -> Iterator[bool]:
        """Hold the pass lock (no forward runs meanwhile); yields False when not blocking and a pass is running."""
        got = self._lock.acquire(blocking)
        try:
            yield got and not (self._root_calls > 0 and self._pass_owner != threading.get_ident())
        finally:
            if got:
                self._lock.release()

    def _root_pre(self, module: nn.Module, args: Any) -> None:
        self._lock.acquire(frame=module_call_frame())  # another thread's pass over this model finishes first
        self._pass_owner = threading.get_ident()
        self._root_calls += 1
        if self._root_calls == 1:
            self._last_unit_outside_root = None
            self._begin_pass()  # if this raises, _root_post (always called) ends the pass and releases

    def _root_post(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._root_calls == 0 or self._pass_owner != threading.get_ident():
            return  # an earlier pre-hook raised before ours ran: this pass never started
        try:
            self._root_calls -= 1
            if self._root_calls == 0:
                if self.active is not None:  # a unit raised: give its slot back
                    self._finish_active()
                listener = self._listener()
                if listener is not None:
                    listener.after_pass()
        finally:
            if self._root_calls == 0:
                self._pass_owner = None
            self._lock.release()

    def _abandon_pass(self, holder: int) -> None:
        """A forward cut short by a BaseException (KeyboardInterrupt) skipped torch's always-called hooks and left its
        pass open: close it as `_root_post` would have (its unit's weights back on the host, its slot to the ring).
        Called by the pass lock while it takes the lock over, so it must not use the lock itself."""
        model = self._model()
        log.warning("%s: a pass left open on thread %d (a forward cut short by Ctrl-C, or a block's layer called on "
                    "its own) is closed now", type(model).__name__ if model is not None else "model", holder)
        active, self.active = self.active, None
        if active is not None:
            self._unbind(active)  # no timing: the unit never finished
        self._resident_start.clear()
        self._root_calls = 0
        self._pass_owner = None
        self._last_unit_outside_root = None
        if not self.order_learned:
            self._seen = []  # a partial pass is not the model's order

    def _begin_pass(self) -> None:
        """A safe point before a forward: check sources and writes, rebalance, learn the order, start prefetching."""
        if self.active is not None:
            self._finish_active()
        self.staged.check_sources()
        self.metrics.harvest()
        self._reclaim()
        self._check_writes()
        listener = self._listener()
        if listener is not None:
            listener.before_pass()
        self.ensure_loaded()
        if self._seen and not self.order_learned:
            self.order_learned = True
            self.worker.set_order(self._seen)
        self._seen = []
        self.metrics.forward_started()
        self.worker.fill()

    def _reclaim(self) -> None:
        """Take back parameters that hold the engine's own bytes (ComfyUI restoring a backup wraps them in a new
        Parameter), and step aside for units whose parameters another owner replaced with other bytes (a plain clone
        of the same model that baked a LoRA in): those run as that owner set them up until it gives them back."""
        foreign = {u.index for u in self.units if not u.staged.layout.reclaim()}
        self.staged.rest.layout.reclaim()
        if foreign != self._foreign:
            if foreign:
                log.info("%d block(s) hold another patcher's weights this pass (a plain clone of the same model); they "
                         "run as it set them up until it gives them back", len(foreign))
            self._foreign = foreign
            self.worker.set_skip(foreign)  # restarts the lookahead without them

    def _enter_outside_root(self, index: int) -> None:
        """A unit called without the root module (a text encoder entered through another method): a unit at or
        before the last one seen starts a new pass, which gets the same safe point as a root forward."""
        if self._last_unit_outside_root is None or index <= self._last_unit_outside_root:
            self._begin_pass()
        self._last_unit_outside_root = index

    def _pre(self, index: int, module: nn.Module, args: Any) -> None:
        outside = self._root_calls == 0 or self._pass_owner != threading.get_ident()
        if outside:
            self._lock.acquire(frame=module_call_frame(caller_of_call=True))
        try:
            if outside:
                self._enter_outside_root(index)
            if self.active is not None:
                self._finish_active()
            if index in self._foreign:  # another owner's weights are in place: not ours to stream
                if outside:
                    self._lock.release()
                return
            if not self.loaded:
                self.ensure_loaded()
            u = self.units[index]
            if u.resident_buf is not None:
                self._resident_start[index] = (self.backend.record(), outside)
                return
            self._seen.append(index)
            slot, copy_event, ready = self._fetch(index)
            start = self.backend.record()
            self._binding(u, slot).apply()
            self.active = ActiveUnit(index, slot, copy_event, ready, start, outside)
        except BaseException:
            if outside:
                self._lock.release()
            raise

    def _fetch(self, index: int) -> tuple[int, Any, Any]:
        """The slot holding `index`'s bytes, once its copy is done; a failed copy is retried once into a fresh slot
        (a transient error is invisible), a second failure raises. No slot is ever lost to the ring."""
        for attempt in (1, 2):
            slot, copy_event = self.worker.take(index)
            try:
                ready = self.backend.record()
                copy_event = resolve(copy_event)
                self.backend.wait(copy_event)
                return slot, copy_event, ready
            except Exception as exc:
                self.worker.give_back(slot)  # the failed copy's slot is free again
                if attempt == 2:
                    raise
                log.warning("copying %s to the device failed (%s); trying once more", self.units[index].staged.name,
                            exc)
            except BaseException:
                self.worker.give_back(slot)
                raise
        raise AssertionError("unreachable")

    def _child_pre(self, index: int, module: nn.Module, args: Any) -> None:
        active = self.active
        if (active is not None and active.index == index) or self.units[index].resident_buf is not None:
            return
        self._pre(index, module, args)  # stays in until the next unit comes in or the forward ends

    def _post(self, index: int, module: nn.Module, args: Any, output: Any) -> Any:
        u = self.units[index]
        if u.resident_buf is not None:
            started = self._resident_start.pop(index, None)
            if started is not None:
                self.metrics.add(index, None, None, started[0], self.backend.record(), 0)
                if started[1]:
                    self._lock.release()
            return None
        active = self.active
        if active is not None and active.index == index:
            replaced = _unalias(output, self._slot_ptrs[active.slot])
            self._finish_active()
            if torch.is_grad_enabled():
                replaced = _guard_backward(output if replaced is None else replaced, u.staged.name)
            return replaced
        return None

    def _finish_active(self) -> None:
        active, self.active = self.active, None
        try:
            free = self._unbind(active)
            nbytes = self.units[active.index].nbytes
            self.metrics.add(active.index, active.copy, active.ready, active.start, free, nbytes)
        finally:
            if active.holds_lock:
                self._lock.release()

    def _unbind(self, active: ActiveUnit) -> Any:
        """The unit's parameters back on the host master, its slot back to the ring; returns the slot-free event."""
        self.units[active.index].master.host_binding.apply()
        free = self.backend.record()
        self.worker.release(active.slot, free)
        return free

    def _binding(self, u: UnitState, slot: int) -> Binding:
        binding = u.slot_bindings.get(slot)
        if binding is None:
            with torch.inference_mode(False):  # views made under inference_mode could not serve autograd later
                binding = u.staged.layout.build(self.slots[slot])
            u.slot_bindings[slot] = binding
        return binding

    # writes between forwards ------------------------------------------------------
    def _check_writes(self) -> None:
        """Notice weights written in place between forwards (load_state_dict, a merged patch).

        A streamed unit's host master changed: copies already queued for it are stale, so the lookahead is
        restarted. A disk-tier unit written in place leaves the disk tier (its bytes now differ from the file).
        A resident unit's device copy changed: the host master catches up when it is evicted.
        """
        stale = False
        for u in self.units:
            if u.index in self._foreign:
                continue
            v = u.staged.layout.version()
            if v != u.mark:
                u.mark = v
                if u.resident_buf is not None:
                    u.device_newer = True
                else:
                    if u.master.host is None:
                        self._promote_to_ram(u)
                    stale = True
        v = self.staged.rest.layout.version()
        if v != self.rest_mark:
            self.rest_mark = v
            self.rest_device_newer = self.rest_buf is not None
        if stale:
            log.debug("weights changed in place; restarting the lookahead")
            self.worker.restart()

    def refresh(self) -> None:
        """Weights were written in a way version counters miss (through `.data`): treat everything as changed."""
        with self._lock:
            for u in self.units:
                u.mark = u.staged.layout.version()
                if u.resident_buf is not None:
                    u.device_newer = True
                elif u.master.host is None and self._differs_from_file(u):
                    self._promote_to_ram(u)
            self.rest_device_newer = self.rest_buf is not None
            self.rest_mark = self.staged.rest.layout.version()
            if self.active is None:
                self.worker.restart()

    def _differs_from_file(self, u: UnitState) -> bool:
        """Whether a disk-tier unit's views hold other bytes than its file (a write through `.data`)."""
        master = u.master
        master.file.check_unchanged()  # reading the map of a truncated file would be fatal
        for entry, key in zip(master.layout.entries, master.keys):  # disk layouts are plain: one leaf per entry
            t = entry.current()
            if t is None or not torch.equal(t.detach().reshape(-1).view(torch.uint8),
                                            master.file.read_tensor(key).reshape(-1).view(torch.uint8)):
                return True
        return False

    def _promote_to_ram(self, u: UnitState, device_copy: torch.Tensor | None = None) -> None:
        """A disk-tier unit whose bytes were written in place gets a RAM master (from the written views, or from
        its device copy) and streams from RAM from now on: pread would return the file's, not the written, bytes."""
        old = u.master
        layout = old.layout
        host, pinned = self.backend.alloc_host(layout.nbytes, self.pin_memory)
        with torch.no_grad():
            if device_copy is not None:
                self.backend.synchronize()
                host.copy_(device_copy)
            else:
                old.file.check_unchanged()
                for view, entry in zip(layout.leaf_views(host), layout.entries):
                    view.copy_(entry.current().detach())
        binding = layout.build(host, master=True)
        master = StagingBuffer(layout, host, pinned, binding)
        if u.resident_buf is None:
            binding.apply()
        u.staged.master = master
        u.staged.source = self.sources[u.index] = make_ram_source(master, self.backend, self.staged.reader)
        u.mark = layout.version()
        log.info("%s was written in place; it streams from RAM from now on instead of %s", u.staged.name,
                 old.file.path if old.file is not None else "its file")

    # device memory -------------------------------------------------------------------
    def streamed(self) -> list[int]:
        return [u.index for u in self.units if u.index not in self.resident_set]

    def device_bytes(self) -> int:
        """Device bytes this model holds now."""
        return ((self.rest_bytes if self.rest_buf is not None else 0)
                + sum(u.nbytes for u in self.units if u.resident_buf is not None)
                + len(self.slots) * self.slot_bytes)

    def set_plan(self, resident: set[int], n_slots: int) -> None:
        """Adopt a resident set and slot count (at a safe point); takes effect now if loaded, else on load."""
        with self._lock:
            n_streamed = len(self.units) - len(resident)
            n_slots = min(n_slots, n_streamed) if n_streamed else 0
            if n_streamed and n_slots < 1:
                n_slots = 1
            changed = resident != self.resident_set or n_slots != self._n_slots
            self.resident_set = set(resident)
            self._n_slots = n_slots
            if changed and self.loaded:
                self._apply()

    def ensure_loaded(self) -> None:
        with self._lock:
            if not self.loaded:
                self._apply()

    def _apply(self) -> None:
        """Make device memory match the plan: rest, resident units, slot ring."""
        with torch.inference_mode(False), torch.no_grad():
            self._apply_plan()

    def _quiesce(self) -> None:
        """Wait for every queued read and copy: nothing in flight may touch memory about to change hands."""
        if self.staged.reader is not None:
            self.staged.reader.drain()
        self.backend.synchronize()

    def _apply_plan(self) -> None:
        if self.active is not None:
            self._finish_active()
        self._quiesce()  # nothing in flight may touch memory we are about to free
        streamed = self.streamed()
        slot_bytes = max((self.units[i].nbytes for i in streamed), default=0)
        n_slots = self._n_slots if streamed else 0
        # release first, so what we allocate next fits
        for u in self.units:
            if u.resident_buf is not None and u.index not in self.resident_set:
                self._evict(u)
        if len(self.slots) != n_slots or self.slot_bytes != slot_bytes:
            self._free_slots()
        try:
            if self.rest_buf is None and self.rest_bytes:
                self.rest_buf = self._to_device(self.rest_source, self.staged.rest)
                self.rest_mark = self.staged.rest.layout.version()
            for i in sorted(self.resident_set):
                u = self.units[i]
                if u.resident_buf is None:
                    u.resident_buf = self._to_device(self.sources[i], u.master)
                    u.mark = u.staged.layout.version()
            if not self.slots and n_slots:
                self.slot_bytes = slot_bytes
                for _ in range(n_slots):
                    self.slots.append(self.backend.alloc(slot_bytes))
                self._slot_ptrs = [s.untyped_storage().data_ptr() for s in self.slots]  # read in every post hook
        except torch.OutOfMemoryError:
            self._free_slots()
            raise
        self.worker.configure(streamed, self.slots, self.sources)
        self.order_learned = False  # the streamed set may have changed: learn the call order again
        self._seen = []
        self.loaded = True
        self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes())

    def _to_device(self, source: Any, master: StagingBuffer) -> torch.Tensor:
        buf = self.backend.alloc(master.layout.nbytes)
        try:
            self.backend.wait(resolve(source.issue(buf, None)))
        except BaseException:
            self.backend.release(buf)
            raise
        master.layout.build(buf).apply()
        return buf

    def _evict(self, u: UnitState) -> None:
        """Drop a resident unit's device copy (catching the host master up first if it was written)."""
        if u.device_newer:
            self._copy_back(u)
            u.device_newer = False
        u.master.host_binding.apply()
        self.backend.release(u.resident_buf)
        u.resident_buf = None
        u.mark = u.staged.layout.version()

    def _copy_back(self, u: UnitState) -> None:
        # The only device-to-host copy in the engine, and only for bytes the user wrote on the device.
        if u.master.host is None:
            self._promote_to_ram(u, device_copy=u.resident_buf)
            return
        self.backend.synchronize()
        u.master.host.copy_(u.resident_buf)

    def _free_slots(self) -> None:
        for u in self.units:
            u.slot_bindings.clear()
        for s in self.slots:
            self.backend.release(s)
        self.slots = []
        self._slot_ptrs = []
        self.slot_bytes = 0
        self.worker.configure([], [], self.sources)

    def unload(self, nbytes: int | None = None) -> int:
        """Free at least `nbytes` device bytes (None: everything); the next forward re-acquires what it may."""
        with self._lock:
            before = self.device_bytes()
            if self.active is not None:
                self._finish_active()
            self._quiesce()
            target = 0 if nbytes is None else max(0, before - int(nbytes))
            # demote resident units (last first), then the ring, then the rest
            for u in sorted((u for u in self.units if u.resident_buf is not None), key=lambda u: -u.index):
                if self.device_bytes() <= target:
                    break
                self._evict(u)
            if self.device_bytes() > target:
                self._free_slots()
            if self.device_bytes() > target and self.rest_buf is not None:
                if self.rest_device_newer:
                    self.backend.synchronize()
                    self.staged.rest.host.copy_(self.rest_buf)
                    self.rest_device_newer = False
                self.staged.rest.host_binding.apply()
                self.backend.release(self.rest_buf)
                self.rest_buf = None
            self.loaded = False
            self.resident_set = {u.index for u in self.units if u.resident_buf is not None}
            return before - self.device_bytes()

    # host memory -----------------------------------------------------------------------
    def host_memory(self) -> dict[str, int]:
        """Host bytes this model holds: in RAM (blocks and non-block weights), of which pinned, and on disk."""
        ram = pinned = disk = 0
        for u in self.units:
            if u.master.host is None:
                disk += u.nbytes
            else:
                ram += u.nbytes
                pinned += u.nbytes if u.master.pinned else 0
        ram += self.staged.rest.layout.nbytes
        reader = self.staged.reader
        if reader is not None:
            ram += reader.bounce_bytes * reader.count
            pinned += reader.bounce_bytes * reader.count if reader.pinned else 0
        return {"ram": ram, "pinned": pinned, "disk": disk}

    def release_host_memory(self, nbytes: int) -> int:
        """Free at least `nbytes` of host RAM by moving blocks to the disk tier, where the model's file holds their
        exact bytes (checked); returns the bytes freed, net of any bounce buffers the disk tier needed (0 without a
        file). Waits for a running pass to end."""
        staged = self.staged
        file = staged.file
        if file is None or nbytes <= 0:
            return 0
        with self._lock:
            candidates = [u for u in reversed(self.units) if u.master.host is not None and u.staged.layout.plain]
            biggest = max((x.nbytes for x in self.units), default=0)
            reader = staged.reader
            if reader is None or reader.bounce_bytes < biggest:  # the disk tier would need new bounce buffers
                extra = biggest * bounce_buffers(self.worker_prefetch) - (0 if reader is None else
                                                                          reader.bounce_bytes * reader.count)
                if sum(u.nbytes for u in candidates) <= extra:
                    return 0  # moving every block could not even pay for the bounce buffers
            freed = cost = 0
            for u in candidates:
                if freed - cost >= nbytes:
                    break
                keys = file_keys_holding(file, u.staged.layout, staged.key_of)
                if keys is None or not all(file.aligned(k) for k in keys):
                    continue
                self._quiesce()  # no read or copy may still use the RAM master about to go
                if staged.reader is None or staged.reader.bounce_bytes < u.nbytes:
                    cost += self._replace_reader(biggest)
                u.staged.master = StagingBuffer.on_disk(u.staged.layout, file, keys, apply=u.resident_buf is None)
                u.staged.source = self.sources[u.index] = DiskSource(file, keys, u.staged.layout.leaves, u.nbytes,
                                                                      staged.reader)
                u.mark = u.staged.layout.version()
                freed += u.nbytes
            if freed:
                self.worker.restart()  # copies queued from the old masters are replaced by reads of the file
                log.info("moved %.1f MB of blocks to the disk tier (%s) to give RAM back", freed / 2 ** 20, file.path)
            return max(0, freed - cost)

    def _replace_reader(self, bounce_bytes: int) -> int:
        """A read-ahead thread with bounce buffers of `bounce_bytes`; returns the host bytes it added."""
        staged = self.staged
        old = staged.reader
        before = 0 if old is None else old.bounce_bytes * old.count
        if old is not None:
            old.close()
        staged.reader = BounceReader(self.backend, bounce_bytes, bounce_buffers(self.worker_prefetch))
        for src in self.sources:  # sources bound to the old reader move to the new one
            if hasattr(src, "reader"):
                src.reader = staged.reader
        return staged.reader.bounce_bytes * staged.reader.count - before

    # reporting -----------------------------------------------------------------------
    def block_reports(self) -> list[BlockReport]:
        """Per-unit figures since the last reset (waits for the timing events recorded so far)."""
        m = self.metrics
        with m.lock:
            m._harvest(block=True)
            return [BlockReport(u.staged.name, u.tier, u.nbytes, m.h2d_ms[u.index], m.compute_ms[u.index],
                                m.stall_ms[u.index], m.calls[u.index], m.bytes_streamed[u.index],
                                self.sources[u.index].reads) for u in self.units]

    # detach ----------------------------------------------------------------------------
    def detach(self) -> None:
        """Remove the hooks and give every tensor back as an ordinary host tensor."""
        with self._lock:
            if any(u.master.host is None for u in self.units):
                self.staged.check_sources()  # refuse before touching anything: the file no longer has the weights
            self._check_writes()  # disk units written in place take their written bytes along
            self.remove_hooks()
            self.unload()
            self.metrics.harvest(block=True)
            self.worker.configure([], [], [])
            for i, u in enumerate(self.units):
                u.master.restore_ordinary()
                # drop every reference to the unit's host buffer now, so detaching peaks at one unit, not two models
                u.slot_bindings.clear()
                u.staged.master = u.staged.source = self.sources[i] = None
            self.staged.rest.restore_ordinary()
            self.units = []
            self.sources = []
            self.staged.close()
