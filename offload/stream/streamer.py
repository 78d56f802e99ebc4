"""The pass over an offloaded model and the per-unit hooks that run it: the hot path of the engine.

Before a streamed unit runs, the compute stream waits (GPU-side) for its copy and its parameters are swapped
to views of the slot; after it runs, they are swapped back to the host master and the slot is handed to the
prefetch worker for the next streamed unit. Resident units live in their own device buffer. Nothing is ever
copied device-to-host: the host buffer is the truth and a slot is just reused.

`ModelStreamer` owns the pass (its lock, the hooks, the learned call order) and composes the parts that act at
its safe points: `DevicePlacement` (resident set, slot ring, device bytes), `HostTiers` (RAM and disk masters)
and `WriteWatch` (weights written in place, parameters another owner replaced). Backward through streamed units
(training adapters on an offloaded base) is `BackwardStreamer` (offload/stream/backward.py): the hooks here hand it the
unit's slot while it computes with grad, and route a forward that re-runs inside backward (checkpointing) to it.

Ownership runs one way: the model keeps its engine alive (through the handle stored on it), and the hooks and
the streamer refer back to the model and to the pass listener only weakly, so dropping a model frees its host
and device memory at once, with or without the cycle collector.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Iterator, Protocol

import torch
import torch.nn as nn

from ..backends.base import Backend
from ..model.model_changes import ModelChanges
from ..plan.planner import DeviceMemoryError  # noqa: F401  (raised through the streamer: importable from here as before)
from ..report.metrics import MetricsCollector
from ..store.staging import StagedModel
from .backward import (BackwardStreamer, TrainableWeightError, in_backward, refuse_backward, trainable_streamed_weight,
                       trainable_weight_error)
from .buffer_writes import ModelBufferWrites
from .compile_support import InFlag, prepare_dynamo
from .hooks import ModelHooks, WeakHook
from .host_tiers import HostTiers
from .outputs import unalias
from .pass_lock import PassLock, module_call_frame
from . import restage
from .placement import DevicePlacement, UnitState
from .prefetch import PrefetchWorker, fetch_copied
from .write_watch import WriteWatch

log = logging.getLogger(__name__)


class PassListener(Protocol):
    """Told when a pass over the model starts and ends (the safe points for the budget and planner)."""

    def before_pass(self) -> None: ...

    def after_pass(self) -> None: ...


@dataclass
class ActiveUnit:
    """The streamed unit computing now, in its slot."""

    index: int
    slot: int
    copy: Any  # event its copy completed on
    ready: Any  # compute stream reached the unit (before waiting for the copy)
    start: Any  # compute started (after the wait)
    holds_lock: bool = False  # entered outside a root pass: the unit holds the pass lock until it finishes
    hooks: Any = None  # the saved-tensor hooks pushed while it computes with grad (offload/stream/backward.py)
    buffers: Any = None  # its buffers as bound before it ran (offload/stream/buffer_writes.py); None: it has none


class ModelStreamer:
    """Installs the hooks on a staged model and runs its passes; placement, host tiers and writes are its parts."""

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
        self.background: Any = None  # units encoded after setup (HostPlan.encode_later, background_encode.py)
        self.worker = PrefetchWorker()
        self.host = HostTiers(staged, self.units, self.sources, backend, self.worker, pin_memory, prefetch)
        self.placement = DevicePlacement(staged, self.units, self.sources, backend, self.worker,
                                         self.host.promote_to_ram)
        self.writes = WriteWatch(staged, self.units, self.placement, self.host, self.worker)
        # buffers a unit writes during its own forward (running stats, step counters) reach the host master
        self.buffers = ModelBufferWrites(staged, self.units, self.placement, self.host, self.worker, backend)
        self.metrics = MetricsCollector(backend, len(self.units), profile)
        self.backward = BackwardStreamer(self.units, self.placement, self.worker, backend, self.metrics,
                                         WeakHook(self, ModelStreamer._fetch),
                                         WeakHook(self, ModelStreamer.ensure_loaded),
                                         WeakHook(self, ModelStreamer._after_backward),
                                         WeakHook(self, ModelStreamer._backward_releasing))
        self.order_learned = False
        self.active: ActiveUnit | None = None
        self._resident_start: dict[int, tuple[Any, bool]] = {}
        self._seen: list[int] = []
        # one pass at a time; device memory changes hands only under it (the lock refers back weakly, no cycle)
        self._lock = PassLock(WeakHook(self, ModelStreamer._abandon_pass))
        self._root_calls = 0  # root-module forwards in progress on the owning thread (nested calls count)
        self._pass_owner: int | None = None
        self._outside: set[int] = set()  # units entered in the pass now running outside a root forward
        self._refusal: TrainableWeightError | None = None  # this pass computes with a streamed weight requiring grad
        self._in_flags = [InFlag() for _ in self.units]  # unit i is in: its children's hooks have nothing to do
        self.hooks = ModelHooks()
        self.hooks.install(self, model, [u.staged.module for u in self.units], self._in_flags,
                           self.staged.rest.layout)
        # conversions after offloading are refused at the call; deepcopy gives an ordinary model (model_changes.py)
        self.changes = ModelChanges(model, [u.staged.layout for u in self.units] + [staged.rest.layout],
                                    WeakHook(self, ModelStreamer._in_pass),
                                    WeakHook(self, ModelStreamer._engine_hook_ids))
        prepare_dynamo()  # a no-op until torch._dynamo is in use
        restage.install()
        self._epoch = restage.epoch()  # registrations (adapters added) looked at up to here

    # the placement's figures, read by the handle's report ------------------------------
    @property
    def rest_bytes(self) -> int:
        return self.staged.rest_bytes

    @property
    def loaded(self) -> bool:
        return self.placement.loaded

    @property
    def resident_set(self) -> set[int]:
        return self.placement.resident_set

    @property
    def slots(self) -> list[torch.Tensor]:
        return self.placement.slots

    @property
    def slot_bytes(self) -> int:
        return self.placement.slot_bytes

    @property
    def peak_device_bytes(self) -> int:
        return self.placement.peak_device_bytes

    @peak_device_bytes.setter
    def peak_device_bytes(self, value: int) -> None:
        self.placement.peak_device_bytes = value

    # hooks ----------------------------------------------------------------------
    def _rest_pre(self, module: nn.Module, args: Any) -> None:
        if not self.placement.loaded and not in_backward():
            self._load_current()  # parked by the budget since (a VAE's conv_in runs before its first block)

    def remove_hooks(self) -> None:
        self.hooks.remove()
        changes = getattr(self, "changes", None)
        if changes is not None:
            changes.remove()

    def _in_pass(self) -> bool:
        """A pass (or a unit outside one) is running: the model's tensors are the engine's to swap back."""
        return self.is_busy() or bool(self._resident_start)

    def _engine_hook_ids(self) -> set[int]:
        """The ids of every forward hook the engine put on the model (a deepcopy leaves them out)."""
        ids = self.hooks.ids()
        hop = getattr(getattr(self._listener(), "secondaries", None), "hop", None)  # a model on several devices
        ids.update(h.id for h in getattr(hop, "_hooks", ()))
        return ids

    def is_busy(self) -> bool:
        """A pass (or a unit outside one, or a backward holding a unit) is running."""
        return self._root_calls > 0 or self.active is not None or self.backward.busy

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
        if in_backward():
            return  # the whole model re-runs inside backward (checkpointing): no pass, its units come in by themselves
        self._lock.acquire(frame=module_call_frame())  # another thread's pass over this model finishes first
        self._pass_owner = threading.get_ident()
        self._root_calls += 1
        if self._root_calls == 1:
            self._outside.clear()
            self._begin_pass()  # if this raises, _root_post (always called) ends the pass and releases

    def _root_post(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._root_calls == 0 or self._pass_owner != threading.get_ident() or in_backward():
            return  # an earlier pre-hook raised before ours ran: this pass never started
        try:
            self._root_calls -= 1
            if self._root_calls == 0:
                if self.active is not None:  # a unit raised: give its slot back
                    self._finish_active()
                self.backward.after_forward(self._seen)
                self.buffers.pass_ended()
                if self._refusal is not None:
                    refuse_backward(output, self._refusal)
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
            if active.hooks is not None:
                active.hooks.pop()
            self._unbind(active)  # no timing: the unit never finished
        self._resident_start.clear()
        for flag in self._in_flags:
            flag.on = False
        self._root_calls = 0
        self._pass_owner = None
        self._outside.clear()
        if not self.order_learned:
            self._seen = []  # a partial pass is not the model's order

    def _begin_pass(self) -> None:
        """A safe point before a forward: check sources and writes, rebalance, learn the order, start prefetching."""
        if self.active is not None:
            self._finish_active()
        prepare_dynamo()  # dynamo was imported since (a torch.compile): the hooks must be guarded and opaque
        if self._epoch != restage.epoch():  # tensors were registered somewhere: adapters added to this model?
            self._epoch = restage.epoch()
            restage.restage(self)
        self.staged.check_sources()
        self.metrics.harvest()
        self.writes.reclaim()
        self.writes.check_writes()
        self.backward.before_forward()
        listener = self._listener()
        if listener is not None:
            listener.before_pass()
        self.ensure_loaded()
        self._refusal = None
        if torch.is_grad_enabled():
            self._check_trainable(self.streamed())
        if self._seen and not self.order_learned:
            self.order_learned = True
            self.worker.set_order(self._seen)
        self._seen = []
        self.worker.begin_pass()  # the last pass goes into the order history; predict this one
        self.buffers.pass_started()
        self.metrics.forward_started()
        self.worker.fill()

    def _check_trainable(self, streamed: list[int]) -> None:
        """A streamed weight that requires grad is refused (the error names the parameter): at once when it was made
        trainable after offloading (a training setup), else at the start of a backward (see offload/stream/backward.py)."""
        if self._refusal is not None:
            return
        found = trainable_streamed_weight(self.units, [i for i in streamed if i not in self.writes.foreign])
        if found is not None:
            i, module, attr, made_trainable = found
            error = trainable_weight_error(self._model(), self.units[i].staged.name, module, attr)
            if made_trainable:
                raise error
            self._refusal = error

    def _backward_releasing(self, index: int, slot: int) -> None:
        """Backward lets a streamed unit go: buffers a re-run of its forward wrote reach its host master first."""
        self.buffers.recompute_ended(index, slot)

    def _after_backward(self) -> None:
        """A backward through the streamed units ended: the listener may measure what training holds."""
        self.buffers.backward_ended()
        listener = self._listener()
        after = getattr(listener, "after_backward", None)
        if after is not None:
            after()

    def _enter_outside_root(self, index: int) -> None:
        """A unit called without the root module (a text encoder entered through another method, a VAE's
        `decode`): a unit already entered in this pass starts a new one, with the same safe point as a root forward.
        Not the order of registration: diffusers' VAE decoder registers `up_blocks` before `mid_block` and runs
        `mid_block` first; the call order is learned from the passes themselves (`_seen`)."""
        if not self._outside or index in self._outside:
            self._outside.clear()
            self._begin_pass()
        self._outside.add(index)

    def _load_current(self) -> None:
        """Placed again after the budget parked the model between two of its units: the plan for its share now."""
        listener = self._listener()
        if listener is not None:
            listener.before_pass()
        self.ensure_loaded()

    def _pre(self, index: int, module: nn.Module, args: Any, whole_unit: bool = True) -> None:
        if in_backward():
            if index not in self.writes.foreign:
                self.backward.recompute_pre(index, whole_unit)
                self.buffers.recompute_started(index)  # a checkpointed forward re-runs: it writes its buffers again
            return
        outside = self._root_calls == 0 or self._pass_owner != threading.get_ident()
        if outside:
            self._lock.acquire(frame=module_call_frame(caller_of_call=True))
        try:
            if outside:
                self._enter_outside_root(index)
            if self.active is not None:
                self._finish_active()
            if index in self.writes.foreign:  # another owner's weights are in place: not ours to stream
                if outside:
                    self._lock.release()
                return
            if not self.placement.loaded:
                self._load_current()
            u = self.units[index]
            if u.resident_buf is not None:
                self._resident_start[index] = (self.backend.record(), outside)
                self._in_flags[index].on = True
                self.buffers.resident_started(index)
                return
            if torch.is_grad_enabled():
                self._check_trainable([index])
            self._seen.append(index)
            slot, copy_event, ready = self._fetch(index)
            start = self.backend.record()
            self.placement.binding(u, slot).apply()
            self.active = ActiveUnit(index, slot, copy_event, ready, start, outside)
            self._in_flags[index].on = True
            self.active.hooks = self.backward.hooks_for(index, slot)
            self.active.buffers = self.buffers.mark(index)
        except BaseException:
            if outside:
                self._lock.release()
            raise

    def _fetch(self, index: int) -> tuple[int, Any, Any]:
        """The slot holding `index`'s bytes, once its copy is done (see `prefetch.fetch_copied`)."""
        return fetch_copied(self.worker, self.backend, index, self.units[index].staged.name)

    def _child_pre(self, index: int, module: nn.Module, args: Any) -> None:
        if in_backward():
            held = self.backward.held
            if (held is None or held.index != index) and self.units[index].resident_buf is None:
                self._pre(index, module, args, whole_unit=False)
            elif index not in self.writes.foreign:
                self.buffers.recompute_started(index)
            return
        active = self.active
        if (active is not None and active.index == index) or self.units[index].resident_buf is not None:
            return
        self._pre(index, module, args)  # stays in until the next unit comes in or the forward ends

    def _post(self, index: int, module: nn.Module, args: Any, output: Any) -> Any:
        if in_backward():
            if index in self.writes.foreign:
                return None
            held = self.backward.held
            self.buffers.recompute_ended(index, held.slot if held is not None and held.index == index else None)
            return self.backward.recompute_post(index, output)
        u = self.units[index]
        if u.resident_buf is not None:
            self._in_flags[index].on = False
            started = self._resident_start.pop(index, None)
            if started is not None:
                self.metrics.add(index, None, None, started[0], self.backend.record(), 0)
                if started[1]:
                    self._lock.release()
            self.buffers.resident_ended(index)
            return None
        active = self.active
        if active is not None and active.index == index:
            replaced = unalias(output, self.placement.slot_ptrs[active.slot])
            self._finish_active()
            self.backward.arm(index, output if replaced is None else replaced)
            if self._refusal is not None:
                refuse_backward(output if replaced is None else replaced, self._refusal)
            return replaced
        return None

    def _finish_active(self) -> None:
        active, self.active = self.active, None
        try:
            if active.hooks is not None:
                active.hooks.pop()
            refused = (self.buffers.streamed_ended(active.index, active.slot, active.buffers)
                       if active.buffers is not None else None)
            free = self._unbind(active)
            nbytes = self.units[active.index].nbytes
            self.metrics.add(active.index, active.copy, active.ready, active.start, free, nbytes)
            if refused is not None:
                raise refused
        finally:
            if active.holds_lock:
                self._lock.release()

    def _unbind(self, active: ActiveUnit) -> Any:
        """The unit's parameters back on the host master, its slot back to the ring; returns the slot-free event."""
        self._in_flags[active.index].on = False
        self.units[active.index].master.host_binding.apply()
        free = self.backend.record()
        self.worker.release(active.slot, free)
        return free

    # writes between forwards ------------------------------------------------------
    def refresh(self) -> None:
        """Weights were written in a way version counters miss (through `.data`): treat everything as changed."""
        with self._lock:
            self.writes.mark_all_written(self.active)

    # device memory -------------------------------------------------------------------
    def streamed(self) -> list[int]:
        return self.placement.streamed()

    def device_bytes(self) -> int:
        """Device bytes this model holds now."""
        return self.placement.device_bytes()

    def set_plan(self, resident: set[int], n_slots: int, remote: dict[int, str] | None = None,
                 eviction: list[int] | None = None) -> None:
        """Adopt a resident set, slot count and units resident on secondary devices (at a safe point); takes
        effect now if loaded, else on load."""
        with self._lock:
            if self.placement.set_plan(resident, n_slots, remote, eviction):
                self._apply()

    def ensure_loaded(self) -> None:
        with self._lock:
            if not self.placement.loaded:
                self._apply()

    def _apply(self) -> None:
        """Make device memory match the plan; the streamed set may have changed, so the call order is learned anew."""
        if self.active is not None:
            self._finish_active()
        self.backward.close()
        self.placement.apply()
        self.order_learned = False
        self._seen = []

    def unload(self, nbytes: int | None = None) -> int:
        """Free at least `nbytes` device bytes (None: everything); the next forward re-acquires what it may."""
        with self._lock:
            if self.active is not None:
                self._finish_active()
            self.backward.close()
            self.buffers.backward_ended()
            # written since the pass began (an optimizer step on the trainable parameters kept on the device): the
            # host copy catches up before the device copy goes
            self.writes.check_writes()
            return self.placement.unload(nbytes)

    # host memory -----------------------------------------------------------------------
    def host_memory(self) -> dict[str, int]:
        """Host bytes this model holds: in RAM (blocks and non-block weights), of which pinned, and on disk."""
        return self.host.host_memory()

    def release_host_memory(self, nbytes: int, order: list[int]) -> int:
        """Free at least `nbytes` of host RAM by moving blocks to the disk tier (see `HostTiers`); waits for a
        running pass to end."""
        with self._lock:
            return self.host.release_host_memory(nbytes, order)

    # detach ----------------------------------------------------------------------------
    def detach(self) -> None:
        """Remove the hooks and give every tensor back as an ordinary host tensor."""
        if self.background is not None:
            self.background.end()  # a unit not swapped in yet stays as it is
        with self._lock:
            if any(u.master.host is None for u in self.units):
                self.staged.check_sources()  # refuse before touching anything: the file no longer has the weights
            self.writes.check_writes()  # disk units written in place take their written bytes along
            self.remove_hooks()
            self.unload()
            self.backward.detached = True  # a graph left from a forward before detach() cannot stream any more
            self.metrics.harvest(block=True)
            self.worker.configure([], [], [])
            for i, u in enumerate(self.units):
                u.master.restore_ordinary()
                # drop every reference to the unit's host buffer now, so detaching peaks at one unit, not two models
                u.slot_bindings.clear()
                u.staged.master = u.staged.source = self.sources[i] = None
            self.staged.rest.restore_ordinary()
            self.writes.data.close()
            self.units.clear()  # the list the parts share
            self.sources.clear()
            self.staged.close(self.backend)
