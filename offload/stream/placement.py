"""Device placement of one model: its non-block weights, its resident units and its slot ring.

`DevicePlacement` owns the device side of every unit (`UnitState`): which units hold a device copy of their own,
the ring of slots streamed units are copied into, and the bytes all of that takes. It changes device memory
only when told to (`apply`, `unload`), always with nothing in flight; the pass and its lock live in
`ModelStreamer`, which calls it at safe points.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..backends.base import Backend
from ..model.layout import Binding
from ..store.compressed import master_written
from ..store.sources import HostSource, resolve
from ..store.staging import StagedModel, StagedUnit, StagingBuffer
from .prefetch import PrefetchWorker

log = logging.getLogger(__name__)


@dataclass
class UnitState:
    """One unit's device side: its resident copy or slot bindings, and what changed since it was placed."""

    staged: StagedUnit
    resident_buf: torch.Tensor | None = None
    slot_bindings: dict[int, Binding] = field(default_factory=dict)
    mark: int = 0  # version of the tensors bound between forwards, when last seen
    device_newer: bool = False  # a resident copy was written in place: the host master must catch up
    home: str | None = None  # the secondary device its resident copy lives on (None: the compute device)

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


def quiesce(staged: StagedModel, backend: Backend) -> None:
    """Wait for every queued read and copy: nothing in flight may touch memory about to change hands."""
    if staged.reader is not None:
        staged.reader.drain()
    backend.synchronize()


class DevicePlacement:
    """The resident set and the slot ring of one model on its device, and the device bytes they hold."""

    def __init__(self, staged: StagedModel, units: list[UnitState], sources: list[Any], backend: Backend,
                 worker: PrefetchWorker, promote_to_ram: Callable[[UnitState, torch.Tensor], None]) -> None:
        self.staged = staged
        self.units = units  # shared with the streamer (the same list object)
        self.sources = sources  # shared with the worker: a promoted unit's source swaps here
        self.backend = backend
        self.worker = worker
        self._promote_to_ram = promote_to_ram  # a disk-tier unit written on the device gets a RAM master
        self.rest_source = HostSource(staged.rest.host, False, backend)
        self.rest_buf: torch.Tensor | None = None
        self.rest_mark = staged.rest.layout.version()
        self.rest_device_newer = False
        self.slots: list[torch.Tensor] = []
        self.slot_ptrs: list[int] = []
        self.slot_bytes = 0
        self.resident_set: set[int] = set()
        self.n_slots = 0  # slots the current plan asks for
        self.eviction: list[int] = []  # resident units in the order the plan gives them up when memory is wanted
        self.loaded = False
        self.peak_device_bytes = 0
        # several devices: units resident on a secondary device (unit -> device name), and those devices' backends
        self.remote: dict[int, str] = {}
        self.secondaries: dict[str, Backend] = {}
        self.peak_on: dict[str, int] = {}
        self._remote_refused: set[int] = set()  # remote placements that ran out of memory (logged once)

    @property
    def rest_bytes(self) -> int:
        return self.staged.rest_bytes

    def streamed(self) -> list[int]:
        """Units without a device copy of their own, in index order."""
        return [u.index for u in self.units if u.index not in self.resident_set and u.index not in self.remote]

    def device_bytes(self) -> int:
        """Device bytes this model holds now on its compute device."""
        return ((self.rest_bytes if self.rest_buf is not None else 0)
                + sum(u.nbytes for u in self.units if u.resident_buf is not None and u.home is None)
                + len(self.slots) * self.slot_bytes)

    def bytes_on(self, device: str) -> int:
        """Device bytes this model holds now on one of its secondary devices."""
        return sum(u.nbytes for u in self.units if u.resident_buf is not None and u.home == device)

    def set_plan(self, resident: set[int], n_slots: int, remote: dict[int, str] | None = None,
                 eviction: list[int] | None = None) -> bool:
        """Adopt a resident set, slot count and remote placements (and the order the plan gives resident units up
        in, for `unload`); returns whether device memory must change."""
        remote = dict(remote or {})
        if eviction is not None:
            self.eviction = list(eviction)
        n_streamed = len(self.units) - len(resident)  # remote units count: the ring must fit them if they fall back
        n_slots = min(n_slots, n_streamed) if n_streamed else 0
        if n_streamed and n_slots < 1:
            n_slots = 1
        changed = resident != self.resident_set or n_slots != self.n_slots or remote != self.remote
        self.resident_set = set(resident)
        self.n_slots = n_slots
        self.remote = remote
        return changed and self.loaded

    def apply(self) -> None:
        """Make device memory match the plan: rest, resident units, slot ring (nothing may be computing)."""
        with torch.inference_mode(False), torch.no_grad():
            self._apply_plan()

    def _apply_plan(self) -> None:
        quiesce(self.staged, self.backend)  # nothing in flight may touch memory we are about to free
        # release first, so what we allocate next fits
        for u in self.units:
            if u.resident_buf is not None and self._wanted_home(u.index) != (u.home or ""):
                self.evict(u)
        self._place_remote()
        streamed = self.streamed()
        slot_bytes = max((self.units[i].nbytes for i in streamed), default=0)
        n_slots = self.n_slots if streamed else 0
        if len(self.slots) != n_slots or self.slot_bytes != slot_bytes:
            self.free_slots()
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
                self.slot_ptrs = [s.untyped_storage().data_ptr() for s in self.slots]  # read in every post hook
        except torch.OutOfMemoryError:
            self.free_slots()
            raise
        self.worker.configure(streamed, self.slots, self.sources)
        self.loaded = True
        self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes())

    def _wanted_home(self, index: int) -> str | None:
        """'' for the compute device, a device name for a secondary one, None for streamed."""
        if index in self.resident_set:
            return ""
        return self.remote.get(index)

    def _place_remote(self) -> None:
        """Copy the units planned for secondary devices there (a device out of memory leaves them streamed)."""
        for i, name in sorted(self.remote.items()):
            u = self.units[i]
            if u.resident_buf is not None:
                continue
            backend = self.secondaries[name]
            try:
                buf = backend.alloc(u.nbytes)
            except torch.OutOfMemoryError as exc:
                del self.remote[i]
                if i not in self._remote_refused:
                    self._remote_refused.add(i)
                    log.warning("%s: %s is out of memory (%s); the block streams to the compute device instead",
                                u.staged.name, name, str(exc).splitlines()[0])
                continue
            try:
                self._fill_remote(u, buf, backend)
            except BaseException:
                backend.release(buf)
                raise
            u.master.layout.build(buf).apply()
            u.resident_buf, u.home = buf, name
            u.mark = u.staged.layout.version()
            self.peak_on[name] = max(self.peak_on.get(name, 0), self.bytes_on(name))

    def _fill_remote(self, u: UnitState, buf: torch.Tensor, backend: Backend) -> None:
        """The unit's bytes into a buffer on a secondary device: from its RAM master, or read from its file."""
        host = u.master.host
        if host is None:  # disk tier: read the unit through a temporary host buffer
            source = self.sources[u.index]
            host = torch.empty(u.nbytes, dtype=torch.uint8)
            source.file.read_into(host, source.pieces)
        backend.wait(backend.copy_h2d(buf[:host.numel()], host))
        backend.synchronize()

    def _to_device(self, source: Any, master: StagingBuffer) -> torch.Tensor:
        buf = self.backend.alloc(master.layout.nbytes)
        try:
            self.backend.wait(resolve(source.issue(buf, None)))
        except BaseException:
            self.backend.release(buf)
            raise
        master.layout.build(buf).apply()
        return buf

    def evict(self, u: UnitState) -> None:
        """Drop a resident unit's device copy (catching the host master up first if it was written)."""
        if u.device_newer:
            self._copy_back(u)
            u.device_newer = False
        u.master.host_binding.apply()
        (self.backend if u.home is None else self.secondaries[u.home]).release(u.resident_buf)
        u.resident_buf, u.home = None, None
        u.mark = u.staged.layout.version()

    def _copy_back(self, u: UnitState) -> None:
        # The only device-to-host copy in the engine, and only for bytes the user wrote on the device.
        if u.master.host is None:
            self._promote_to_ram(u, u.resident_buf)
            return
        self.backend.synchronize()
        u.master.host.copy_(u.resident_buf)
        master_written(u.staged.source)

    def free_slots(self) -> None:
        """Give the slot ring back to the device (the worker forgets it)."""
        for u in self.units:
            u.slot_bindings.clear()
        for s in self.slots:
            self.backend.release(s)
        self.slots = []
        self.slot_ptrs = []
        self.slot_bytes = 0
        self.worker.configure([], [], self.sources)

    def unload(self, nbytes: int | None = None) -> int:
        """Free at least `nbytes` device bytes (None: everything); nothing may be computing."""
        before = self.device_bytes()
        quiesce(self.staged, self.backend)
        if nbytes is None:  # everything: the secondary devices' copies too
            for u in self.units:
                if u.home is not None:
                    self.evict(u)
        target = 0 if nbytes is None else max(0, before - int(nbytes))
        # demote resident units (in the plan's eviction order, then last first), then the ring, then the rest
        rank = {i: k for k, i in enumerate(self.eviction)}
        for u in sorted((u for u in self.units if u.resident_buf is not None and u.home is None),
                        key=lambda u: (rank.get(u.index, -1), -u.index)):
            if self.device_bytes() <= target:
                break
            self.evict(u)
        if self.device_bytes() > target:
            self.free_slots()
        if self.device_bytes() > target and self.rest_buf is not None:
            if self.rest_device_newer:
                self.backend.synchronize()
                self.staged.rest.host.copy_(self.rest_buf)
                self.rest_device_newer = False
            self.staged.rest.host_binding.apply()
            self.backend.release(self.rest_buf)
            self.rest_buf = None
        self.loaded = False
        self.resident_set = {u.index for u in self.units if u.resident_buf is not None and u.home is None}
        self.remote = {u.index: u.home for u in self.units if u.home is not None}
        return before - self.device_bytes()

    def unload_remote(self, device: str, nbytes: int, keep: set[int] | None = None) -> int:
        """Hold at most `nbytes` on a secondary device: its units the plan no longer keeps there (`keep`), then the
        others (last first), go back to streaming; nothing may be computing. The caller re-plans before the next
        forward (the ring may have to widen for them)."""
        before = self.bytes_on(device)
        quiesce(self.staged, self.backend)
        keep = keep or set()
        for u in sorted((u for u in self.units if u.home == device), key=lambda u: (u.index in keep, -u.index)):
            if self.bytes_on(device) <= nbytes:
                break
            self.evict(u)
            self.remote.pop(u.index, None)
        if self.bytes_on(device) != before:
            self.loaded = False  # the streamed set changed: the ring and the worker are set up again
        return before - self.bytes_on(device)

    def binding(self, u: UnitState, slot: int) -> Binding:
        """The unit's tensors as views of `slot` (built once per unit and slot)."""
        binding = u.slot_bindings.get(slot)
        if binding is None:
            with torch.inference_mode(False):  # views made under inference_mode could not serve autograd later
                binding = u.staged.layout.build(self.slots[slot])
            u.slot_bindings[slot] = binding
        return binding
