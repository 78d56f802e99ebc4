"""Per-unit forward hooks and the device slot ring: the hot path of the engine.

Before a streamed unit runs, the compute stream waits (GPU-side) for its copy and its parameters are swapped
to views of the slot; after it runs, they are swapped back to the host master and the slot is handed to the
prefetch worker for the next streamed unit. Resident units live in their own device buffer. Nothing is ever
copied device-to-host: the host buffer is the truth and a slot is just reused.
"""
from __future__ import annotations

import copy
import functools
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn

from .backends.base import Backend
from .blocks import Unit
from .metrics import MetricsCollector
from .prefetch import PrefetchWorker
from .staging import Binding, StagingBuffer, plan_layout, unit_tensors
from .storage import BounceReader, DiskSource, PageableSource, SafetensorsFile, resolve

log = logging.getLogger(__name__)


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


def _unalias(output: Any, storage_ptr: int) -> Any:
    """An output that views the slot (a unit returning its own weight) is cloned: the slot is about to be reused."""
    result = _unalias_walk(output, storage_ptr)
    return None if result is _UNCHANGED else result


class DeviceMemoryError(ValueError):
    """Even the smallest plan (one slot) does not fit: names the unit and its size."""


@dataclass
class UnitState:
    """One unit's host master, its current tier and its device-side bindings."""

    index: int
    name: str
    module: nn.Module
    staging: StagingBuffer
    nbytes: int
    resident_buf: torch.Tensor | None = None
    slot_bindings: dict[int, Binding] = field(default_factory=dict)
    source: Any = None  # where the prefetch copy reads from (host buffer, or a disk reader)
    mark: int = 0  # version of the tensors bound between forwards, when last seen
    device_newer: bool = False  # a resident copy was written in place: the host master must catch up

    @property
    def host_tier(self) -> str:
        if getattr(self.source, "tier", None) == "disk":
            return "disk"
        return "pinned" if self.staging.pinned else "pageable"

    @property
    def tier(self) -> str:
        return "vram" if self.resident_buf is not None else self.host_tier


class ModelStreamer:
    """Stages a model's units on the host, installs the hooks and runs the slot ring."""

    def __init__(self, model: nn.Module, units: list[Unit], backend: Backend, pin_memory: bool,
                 profile: bool = False, on_forward_start: Callable[[], None] | None = None,
                 progress: Callable[[int, int], None] | None = None, prefetch: int = 2,
                 file: SafetensorsFile | None = None,
                 host_plan: Callable[[list[int]], dict[int, str]] | None = None) -> None:
        self.model = model
        self.backend = backend
        self.on_forward_start = on_forward_start
        self.on_forward_end: Callable[[], None] | None = None
        self.on_forward_begin: Callable[[], None] | None = None
        self._implicit_last: int | None = None
        self._lock = threading.RLock()
        self.units: list[UnitState] = []
        self._hooks: list[Any] = []
        self.active: tuple[int, int, Any, Any, Any] | None = None  # (unit, slot, copy, ready, start)
        self._resident_start: dict[int, Any] = {}
        self.slots: list[torch.Tensor] = []
        self._slot_ptrs: list[int] = []
        self.slot_bytes = 0
        self.depth = 0
        self._seen: list[int] = []
        self.order_learned = False
        self.loaded = False
        self.worker = PrefetchWorker(self._issue)
        self.metrics = MetricsCollector(backend, len(units), profile)
        self.peak_device_bytes = 0
        self.resident_set: set[int] = set()
        self._n_slots = 0  # slots the current plan asks for

        self.file = file
        self.reader: BounceReader | None = None
        paths: dict[int, str] = {}
        for path, mod in model.named_modules(remove_duplicate=False):
            paths.setdefault(id(mod), path)

        def key_of(sub: nn.Module, name: str) -> str:
            return f"{paths[id(sub)]}.{name}" if paths.get(id(sub)) else name

        # 1. plan every layout and check the file before touching the model (nothing half-attached on error)
        shared = self._shared_tensor_ids(model, units)
        planned = []
        in_units: set[tuple[int, str, str]] = set()
        for unit in units:
            tensors = [t for t in unit_tensors(unit.module) if id(t[3]) not in shared]
            in_units.update((id(sub), name, kind) for sub, name, kind, _ in tensors)
            planned.append(plan_layout(tensors) + (tensors,))
        rest = [(sub, name, kind, t) for sub, name, kind, t in unit_tensors(model)
                if (id(sub), name, kind) not in in_units]
        rest_layout, rest_sources = plan_layout(rest)
        sizes = [layout.nbytes for layout, _, _ in planned]
        tiers = host_plan(sizes) if host_plan is not None else {}
        keys: dict[int, list[str]] = {}
        for i, (layout, sources, _) in enumerate(planned):
            plain = all(isinstance(e.recipe, int) for e in layout.entries) and \
                all(leaf.stride is None for leaf in layout.leaves)  # the file stores tensors contiguous
            needs_file = tiers.get(i) == "disk" or any(src.is_meta for src in sources)
            if tiers.get(i) == "disk" and not (plain and file is not None):
                tiers[i] = "pageable"
            if needs_file and file is not None and plain:
                keys[i] = file.match([key_of(*e.locations[0][:2]) for e in layout.entries], sources)
                if tiers.get(i) == "disk" and not all(file.aligned(k) for k in keys[i]):
                    tiers[i] = "pageable"  # a misaligned tensor cannot be viewed in place: keep it in RAM
        rest_keys = None
        if file is not None and any(src.is_meta for src in rest_sources):
            rest_keys = file.match([key_of(*e.locations[0][:2]) for e in rest_layout.entries], rest_sources)

        # 2. stage: one host buffer per RAM unit, file views for disk units
        total = len(units) + 1
        disk = [i for i in range(len(units)) if tiers.get(i) == "disk"]
        if disk:
            self.reader = BounceReader(backend, max(sizes[i] for i in disk), prefetch + 2)
        for i, (unit, (layout, sources, _)) in enumerate(zip(units, planned)):
            tier = tiers.get(i)
            if tier == "disk":
                views = [file.view(k) for k in keys[i]]
                staging = StagingBuffer.from_file(layout, views)
                source: Any = DiskSource(file, layout, keys[i], self.reader)
            else:
                fill = (lambda j, k=keys.get(i): file.view(k[j])) if i in keys else None
                staging = StagingBuffer.create(layout, sources, backend.alloc_host,
                                               pin_memory and tier != "pageable", fill,
                                               # the simulated device needs no pinning: say it quietly there
                                               logging.WARNING if backend.supports_pinned_host else logging.INFO)
                source = staging.host
            self.units.append(UnitState(i, unit.name, unit.module, staging, staging.layout.nbytes, source=source))
            if progress:
                progress(i + 1, total)
        # Pageable units (planned so, or pinning refused) on a device with pinned memory go through a pinned
        # bounce buffer on the read-ahead thread: a copy straight from pageable memory would block the forward.
        pageable = [u for u in self.units if isinstance(u.source, torch.Tensor) and not u.staging.pinned]
        if pageable and backend.supports_pinned_host:
            if self.reader is None:
                self.reader = BounceReader(backend, max(u.nbytes for u in pageable), prefetch + 2)
            elif max(u.nbytes for u in pageable) > self.reader.bounce_bytes:
                self.reader.close()
                self.reader = BounceReader(backend, max(sizes), prefetch + 2)
                for u in self.units:
                    if isinstance(u.source, DiskSource):
                        u.source.reader = self.reader
            for u in pageable:
                u.source = PageableSource(u.staging.host, self.reader)
        # Non-block tensors: always resident; the host copy stays as the master for detach.
        fill = (lambda j: file.view(rest_keys[j])) if rest_keys else None
        self.rest = StagingBuffer.create(rest_layout, rest_sources, backend.alloc_host, False, fill)
        self.rest_buf: torch.Tensor | None = None
        self.rest_bytes = self.rest.layout.nbytes if rest else 0
        self.rest_mark = self.rest.layout.version()
        self.rest_device_newer = False
        for u in self.units:
            u.mark = u.staging.layout.version()
        if progress:
            progress(total, total)
        self._install_hooks()

    @staticmethod
    def _shared_tensor_ids(model: nn.Module, units: list[Unit]) -> set[int]:
        """Tensors used by more than one unit, or by a unit and the rest: kept resident with the rest."""
        owner: dict[int, int] = {}
        shared: set[int] = set()
        for i, unit in enumerate(units):
            for _, _, _, t in unit_tensors(unit.module):
                if owner.setdefault(id(t), i) != i:
                    shared.add(id(t))
        unit_mods = {id(m) for u in units for m in u.module.modules()}
        for sub in model.modules():
            if id(sub) in unit_mods:
                continue
            for t in list(sub._parameters.values()) + list(sub._buffers.values()):
                if t is not None and id(t) in owner:
                    shared.add(id(t))
        if shared:
            log.info("%d tensor(s) are shared between units or with the rest of the model; kept resident",
                     len(shared))
        return shared

    # hooks ----------------------------------------------------------------------
    def _install_hooks(self) -> None:
        self._hooks.append(self.model.register_forward_pre_hook(self._root_pre, prepend=True))
        self._hooks.append(self.model.register_forward_hook(self._root_post, always_call=True))
        for u in self.units:
            # prepend: hooks the user registered earlier must already see the unit's device weights
            self._hooks.append(u.module.register_forward_pre_hook(functools.partial(self._pre, u.index),
                                                                   prepend=True))
            self._hooks.append(u.module.register_forward_hook(functools.partial(self._post, u.index),
                                                              always_call=True))
            # Some models never call the block container itself (ComfyUI's UNet iterates a
            # TimestepEmbedSequential and calls its layers): the first child to run brings the unit in.
            for child in u.module.children():
                self._hooks.append(child.register_forward_pre_hook(functools.partial(self._child_pre, u.index),
                                                                   prepend=True))

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def _root_pre(self, module: nn.Module, args: Any) -> None:
        self.depth += 1
        if self.depth > 1:
            return
        self._implicit_last = None
        self._begin_pass()

    def _begin_pass(self) -> None:
        """A safe point before a forward: rebalance, notice in-place writes, learn the order, start prefetching."""
        if self.active is not None:
            self._finish_active()
        if self.on_forward_begin is not None:
            self.on_forward_begin()
        self.metrics.harvest()
        self._check_writes()
        if self.on_forward_start is not None:
            self.on_forward_start()
        self.ensure_loaded()
        if self._seen and not self.order_learned:
            self.order_learned = True
            self.worker.set_order(self._seen)
        self._seen = []
        self.metrics.forward_started()
        self.worker.fill()

    def _root_post(self, module: nn.Module, args: Any, output: Any) -> None:
        self.depth = max(0, self.depth - 1)
        if self.depth == 0:
            if self.active is not None:  # a unit raised: give its slot back
                self._finish_active()
            if self.on_forward_end is not None:
                self.on_forward_end()

    def _pre(self, index: int, module: nn.Module, args: Any) -> None:
        if self.depth == 0:
            # Units called without the root module (a text encoder entered through another method): a unit at
            # or before the last one seen starts a new pass, which gets the same safe point as a root forward.
            if self._implicit_last is None or index <= self._implicit_last:
                self._begin_pass()
            self._implicit_last = index
        if self.active is not None:
            self._finish_active()
        if not self.loaded:
            self.ensure_loaded()
        u = self.units[index]
        if u.resident_buf is not None:
            self._resident_start[index] = self.backend.record()
            return
        self._seen.append(index)
        slot, copy = self.worker.take(index)
        ready = self.backend.record()
        copy = resolve(copy)
        self.backend.wait(copy)
        start = self.backend.record()
        self._binding(u, slot).apply()
        self.active = (index, slot, copy, ready, start)

    def _child_pre(self, index: int, module: nn.Module, args: Any) -> None:
        active = self.active
        if (active is not None and active[0] == index) or self.units[index].resident_buf is not None:
            return
        self._pre(index, module, args)  # stays in until the next unit comes in or the forward ends

    def _post(self, index: int, module: nn.Module, args: Any, output: Any) -> Any:
        u = self.units[index]
        if u.resident_buf is not None:
            start = self._resident_start.pop(index, None)
            if start is not None:
                self.metrics.add(index, None, None, start, self.backend.record(), 0)
            return None
        if self.active is not None and self.active[0] == index:
            replaced = _unalias(output, self._slot_ptrs[self.active[1]])
            self._finish_active()
            if torch.is_grad_enabled():
                replaced = _guard_backward(output if replaced is None else replaced, u.name)
            return replaced
        return None

    def _finish_active(self) -> None:
        index, slot, copy, ready, start = self.active
        self.active = None
        u = self.units[index]
        u.staging.host_binding.apply()
        free = self.backend.record()
        self.metrics.add(index, copy, ready, start, free, u.nbytes)
        self.worker.release(slot, free)

    def _check_writes(self) -> None:
        """Notice weights written in place between forwards (load_state_dict, a merged patch).

        A streamed unit's host master changed: copies already queued for it are stale, so the lookahead is
        restarted. A resident unit's device copy changed: the host master catches up when it is evicted.
        """
        stale = False
        for u in self.units:
            v = u.staging.layout.version()
            if v != u.mark:
                u.mark = v
                if u.resident_buf is not None:
                    u.device_newer = True
                else:
                    stale = True
        v = self.rest.layout.version()
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
                u.mark = u.staging.layout.version()
                u.device_newer = u.resident_buf is not None
            self.rest_device_newer = self.rest_buf is not None
            self.rest_mark = self.rest.layout.version()
            if self.active is None:
                self.worker.restart()

    def _evict(self, u: UnitState) -> None:
        """Drop a resident unit's device copy (catching the host master up first if it was written)."""
        if u.device_newer:
            self._copy_back(u.staging, u.resident_buf, u.name)
            u.device_newer = False
        u.staging.host_binding.apply()
        self.backend.release(u.resident_buf)
        u.resident_buf = None
        u.mark = u.staging.layout.version()

    def _copy_back(self, staging: StagingBuffer, device_buf: torch.Tensor, name: str) -> None:
        # The only device-to-host copy in the engine, and only for bytes the user wrote on the device.
        if staging.host is None:
            log.warning("%s was changed in place on the device but its master is a read-only file; the change "
                        "is dropped when it leaves the device", name)
            return
        self.backend.synchronize()
        staging.host.copy_(device_buf)

    def _quiesce(self) -> None:
        """Wait for every queued read and copy: nothing in flight may touch memory about to change hands."""
        if self.reader is not None:
            self.reader.drain()
        self.backend.synchronize()

    def _binding(self, u: UnitState, slot: int) -> Binding:
        binding = u.slot_bindings.get(slot)
        if binding is None:
            with torch.inference_mode(False):  # views made under inference_mode could not serve autograd later
                binding = u.staging.layout.build(self.slots[slot])
            u.slot_bindings[slot] = binding
        return binding

    def _issue(self, unit: int, slot: int, after: Any) -> Any:
        u = self.units[unit]
        src = u.source
        if hasattr(src, "issue"):
            return src.issue(self.backend, self.slots[slot], after)
        return self.backend.copy_h2d(self.slots[slot][:u.nbytes], src, after)

    # plan ----------------------------------------------------------------------
    def streamed(self) -> list[int]:
        return [u.index for u in self.units if u.index not in self.resident_set]

    def device_bytes(self) -> int:
        """Device bytes this model holds now."""
        return ((self.rest_bytes if self.rest_buf is not None else 0)
                + sum(u.nbytes for u in self.units if u.resident_buf is not None)
                + len(self.slots) * self.slot_bytes)

    def planned_bytes(self, resident: set[int], n_slots: int) -> int:
        streamed = [u.nbytes for u in self.units if u.index not in resident]
        slot = max(streamed) if streamed else 0
        return self.rest_bytes + sum(self.units[i].nbytes for i in resident) + n_slots * slot

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
                self.rest_buf = self._to_device(self.rest)
                self.rest_mark = self.rest.layout.version()
            for i in sorted(self.resident_set):
                u = self.units[i]
                if u.resident_buf is None:
                    u.resident_buf = self._to_device(u.staging, u)
                    u.mark = u.staging.layout.version()
            if not self.slots and n_slots:
                self.slot_bytes = slot_bytes
                for _ in range(n_slots):
                    self.slots.append(self.backend.alloc(slot_bytes))
                self._slot_ptrs = [s.untyped_storage().data_ptr() for s in self.slots]  # read in every post hook
        except torch.OutOfMemoryError:
            self._free_slots()
            raise
        self.worker.configure(streamed, len(self.slots))
        self.order_learned = False  # the streamed set may have changed: learn the call order again
        self._seen = []
        self.loaded = True
        self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes())

    def _to_device(self, staging: StagingBuffer, unit: UnitState | None = None) -> torch.Tensor:
        nbytes = staging.layout.nbytes
        buf = self.backend.alloc(nbytes)
        src = unit.source if unit is not None else staging.host
        if hasattr(src, "issue"):
            event = resolve(src.issue(self.backend, buf, None))
        else:
            event = self.backend.copy_h2d(buf, src, None)
        self.backend.wait(event)
        staging.layout.build(buf).apply()
        return buf

    def _free_slots(self) -> None:
        for u in self.units:
            u.slot_bindings.clear()
        for s in self.slots:
            self.backend.release(s)
        self.slots = []
        self._slot_ptrs = []
        self.slot_bytes = 0
        self.worker.configure([], 0)

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
                    self._copy_back(self.rest, self.rest_buf, "non-block weights")
                    self.rest_device_newer = False
                self.rest.host_binding.apply()
                self.backend.release(self.rest_buf)
                self.rest_buf = None
            self.loaded = False
            self.resident_set = {u.index for u in self.units if u.resident_buf is not None}
            return before - self.device_bytes()

    def detach(self) -> None:
        """Remove the hooks and give every tensor back as an ordinary host tensor."""
        with self._lock:
            self.remove_hooks()
            self.unload()
            self.metrics.harvest(block=True)
            for u in self.units:
                u.staging.restore_ordinary()
                u.slot_bindings.clear()
            self.rest.restore_ordinary()
            self.units = []
            if self.reader is not None:
                self.reader.close()
                self.reader = None
            self.worker.configure([], 0)
