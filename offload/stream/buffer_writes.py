"""Buffers a block writes during its own forward: the host copy catches up, so it stays the truth.

BatchNorm's running statistics in train mode, a step counter (`self.steps += 1`), a buffer reassigned
(`self.step = self.step + 1`): a streamed unit computes in a slot the next unit reuses, so without this such writes
would be thrown away when the unit's tensors go back to the host master. After a streamed unit's forward, the bytes
of the buffers it wrote (and only those) are copied device-to-host into its host master; a disk-tier unit gets a RAM
master first (its bytes are no longer the file's). A resident unit (and the weights outside the blocks) computes
on its own device copy: a write marks that copy newer, and the host master catches up when it is evicted, unloaded
or detached.

How a write is seen, per buffer:
- its version counter moved (any in-place op through it: `add_`, `copy_`, `fill_`); every buffer bound to a device
  copy has a version counter of its own (`layout.bind`), so one written buffer does not drag the others along;
- the module holds another tensor under the name (reassigned): the new value is copied into the engine's tensor,
  which goes back in its place; a value of another shape or dtype is refused, naming the buffer;
- a torch norm with running statistics (`_NormBase`: BatchNorm*, InstanceNorm* with `track_running_stats`) in
  training mode: its kernel updates `running_mean` / `running_var` without bumping their version counters, so its
  buffers count as written after every training-mode forward.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _NormBase

from ..model.layout import TensorLayout
from ..store.compressed import master_written

if TYPE_CHECKING:
    from ..backends.base import Backend
    from .host_tiers import HostTiers
    from .placement import DevicePlacement, UnitState
    from .prefetch import PrefetchWorker
    from ..store.staging import StagedModel


class BufferShapeError(ValueError):
    """A block reassigned one of its buffers with a tensor of another shape or dtype during its forward."""


@dataclass
class _Spot:
    """One buffer of a unit: the module and name it is registered under, and its leaf in the unit's layout."""

    module: nn.Module
    attr: str
    leaf: int
    norm: nn.Module | None  # a running-stats norm that writes it without a version bump


class BufferWatch:
    """The buffers of one unit (or of the weights outside the blocks), and which ones a forward wrote."""

    def __init__(self, layout: TensorLayout) -> None:
        self.layout = layout
        self.spots: list[_Spot] = []
        for entry in layout.entries:
            if not isinstance(entry.recipe, int):
                continue  # a tensor-subclass buffer: not watched
            for module, attr, kind in entry.locations:
                if kind == "buffer":
                    norm = module if isinstance(module, _NormBase) and module.track_running_stats else None
                    self.spots.append(_Spot(module, attr, entry.recipe, norm))

    def __bool__(self) -> bool:
        return bool(self.spots)

    def mark(self) -> list[tuple[torch.Tensor | None, int]]:
        """The tensor each buffer is bound to now and its version (taken right before the forward)."""
        marks = []
        for spot in self.spots:
            t = spot.module._buffers.get(spot.attr)
            marks.append((t, _version(t)))
        return marks

    def written(self, marks: list[tuple[torch.Tensor | None, int]]) -> tuple[list[int], list[tuple[int, torch.Tensor]]]:
        """Since `marks`: the spots written in place, and the spots reassigned with their new tensor."""
        in_place: list[int] = []
        reassigned: list[tuple[int, torch.Tensor]] = []
        for k, (spot, (ours, version)) in enumerate(zip(self.spots, marks)):
            if ours is None:
                continue
            now = spot.module._buffers.get(spot.attr)
            if now is not ours:
                if now is not None:
                    reassigned.append((k, now))
            elif _version(now) != version or (spot.norm is not None and spot.norm.training):
                in_place.append(k)
        return in_place, reassigned

    def check_value(self, k: int, value: torch.Tensor) -> None:
        """A reassigned value must fit the buffer's place in the layout."""
        spot, leaf = self.spots[k], self.layout.leaves[self.spots[k].leaf]
        if tuple(value.shape) != tuple(leaf.shape) or value.dtype != leaf.dtype:
            raise BufferShapeError(
                f"{type(spot.module).__name__}.{spot.attr}: the forward replaced this buffer of an offloaded block with "
                f"a {tuple(value.shape)} {value.dtype} tensor (it was {tuple(leaf.shape)} {leaf.dtype}); a streamed "
                f"buffer keeps its shape and dtype: write into it in place, keep the value as a plain attribute, or "
                f"detach() the model first")

    def leaf_bytes(self, buf: torch.Tensor, k: int) -> torch.Tensor:
        """Spot k's bytes in a flat buffer laid out as this layout (a host master or a device copy)."""
        leaf = self.layout.leaves[self.spots[k].leaf]
        return buf[leaf.offset:leaf.offset + leaf.nbytes]

    def leaf_view(self, buf: torch.Tensor, k: int) -> torch.Tensor:
        """Spot k as a tensor of its shape over a flat buffer laid out as this layout."""
        leaf = self.layout.leaves[self.spots[k].leaf]
        raw = self.leaf_bytes(buf, k).view(leaf.dtype)
        return raw.as_strided(leaf.shape, leaf.stride) if leaf.stride is not None else raw.view(leaf.shape)

    def put_back(self, marks: list[tuple[torch.Tensor | None, int]],
                 reassigned: list[tuple[int, torch.Tensor]]) -> None:
        """Copy reassigned values into the engine's tensors (device copies) and put those back in the modules."""
        with torch.no_grad():
            for k, value in reassigned:
                ours = marks[k][0]
                self.check_value(k, value)
                ours.copy_(value)
                spot = self.spots[k]
                spot.module._buffers[spot.attr] = ours


class ModelBufferWrites:
    """A streamed model's buffer watches and the marks taken before each forward: after a streamed unit's forward the
    written bytes go into its host master; a resident unit or the rest marks its device copy newer (module docstring).
    A forward that activation checkpointing re-runs inside backward writes its buffers again, as on a plain model
    (BatchNorm statistics updated twice a step): the same write-back follows each re-run."""

    def __init__(self, staged: "StagedModel", units: list["UnitState"], placement: "DevicePlacement",
                 host: "HostTiers", worker: "PrefetchWorker", backend: "Backend") -> None:
        self.units, self.placement, self.host, self.worker, self.backend = units, placement, host, worker, backend
        self.watch = [BufferWatch(u.staged.layout) for u in units]
        self.rest_watch = BufferWatch(staged.rest.layout)
        self._rest_marks: Any = None
        self._resident_marks: dict[int, Any] = {}
        self._recompute_marks: dict[int, Any] = {}  # units re-running their forward in backward (checkpointing)

    def mark(self, index: int) -> Any:
        """Unit `index`'s buffers right before a streamed forward (None: it has none)."""
        return self.watch[index].mark() if self.watch[index] else None

    # the weights outside the blocks: a pass ------------------------------------------------
    def pass_started(self) -> None:
        self.backward_ended()  # a backward that raised may have left re-runs open
        self._rest_marks = self.rest_watch.mark() if self.rest_watch else None

    def pass_ended(self) -> None:
        """The weights outside the blocks (always resident while a pass runs) wrote their device copy: newer."""
        marks, self._rest_marks = self._rest_marks, None
        if marks is None:
            return
        in_place, reassigned = self.rest_watch.written(marks)
        if reassigned:
            self.rest_watch.put_back(marks, reassigned)
        if (in_place or reassigned) and self.placement.rest_buf is not None:
            self.placement.rest_device_newer = True

    # a resident unit ---------------------------------------------------------------------------
    def resident_started(self, index: int) -> None:
        if self.watch[index]:
            self._resident_marks[index] = self.watch[index].mark()

    def resident_ended(self, index: int) -> None:
        marks = self._resident_marks.pop(index, None)
        if marks is not None:
            self._resident_written(self.units[index], marks)

    def _resident_written(self, u: "UnitState", marks: Any) -> None:
        """A resident unit wrote buffers on its own device copy: the host master catches up when it is evicted."""
        watch = self.watch[u.index]
        in_place, reassigned = watch.written(marks)
        if reassigned:
            watch.put_back(marks, reassigned)
        if in_place or reassigned:
            u.device_newer = True

    # a forward re-run in backward (activation checkpointing) ------------------------------------
    # transformers 5 checkpoints a layer's `forward` (its hooks stay outside: only its children's run again), torch's
    # checkpoint around a module call re-runs the whole call: a re-run starts at whichever hook comes first and ends
    # at the unit's forward hook when it runs, else when backward lets the unit go (its slot back to the ring).
    def recompute_started(self, index: int) -> None:
        """A forward of unit `index` re-runs now (its buffers are bound where it computes): marks, once per re-run."""
        if self.watch[index] and index not in self._recompute_marks:
            self._recompute_marks[index] = self.watch[index].mark()
            if self.units[index].resident_buf is not None:
                # its device copy is written now (the re-run's end may come only with the next pass): the host
                # master catches up whenever the unit is evicted
                self.units[index].device_newer = True

    def recompute_ended(self, index: int, slot_index: int | None) -> None:
        """The re-run of `index` ended; `slot_index`: the slot a streamed unit is held in (None: not held, so its
        buffers are not where it computed: left for the release of its slot)."""
        resident = self.units[index].resident_buf is not None
        if index not in self._recompute_marks or not (resident or slot_index is not None):
            return
        marks = self._recompute_marks.pop(index)
        if resident:
            self._resident_written(self.units[index], marks)
            return
        refused = self.streamed_ended(index, slot_index, marks)
        if refused is not None:
            raise refused

    def backward_ended(self) -> None:
        """Backward is over: resident units that re-ran mark their device copy newer (no hook ends their re-run);
        a streamed unit's re-run ended when its slot went back (what is left is from a backward that raised)."""
        for index, marks in self._recompute_marks.items():
            if self.units[index].resident_buf is not None:
                self._resident_written(self.units[index], marks)
        self._recompute_marks.clear()

    # a streamed unit ---------------------------------------------------------------------------
    def streamed_ended(self, index: int, slot_index: int, marks: Any) -> BufferShapeError | None:
        """A streamed unit's buffers written in its forward go into its host master before its slot goes back to the
        ring: device-to-host, only those bytes (a disk-tier unit gets a RAM master first: it is no longer the file's).
        Returns the refusal of a buffer reassigned with another shape or dtype (raised once the slot is back)."""
        watch = self.watch[index]
        in_place, reassigned = watch.written(marks)
        if not in_place and not reassigned:
            return None
        for k, value in reassigned:
            try:
                watch.check_value(k, value)
            except BufferShapeError as exc:
                return exc
        u = self.units[index]
        slot = self.placement.slots[slot_index]
        self.backend.synchronize()  # the unit's writes on the compute stream are done
        with torch.no_grad():
            if u.master.host is None:
                self.host.promote_to_ram(u, slot[:u.nbytes])
            else:
                for k in in_place:
                    watch.leaf_bytes(u.master.host, k).copy_(watch.leaf_bytes(slot, k))
            for k, value in reassigned:
                watch.leaf_view(u.master.host, k).copy_(value)
            master_written(u.staged.source)
        u.mark = u.staged.layout.version()  # the host master changed on purpose: nothing queued holds this unit
        if any(queued[0] == index for queued in self.worker.inflight):
            self.worker.restart()  # a copy queued for the unit's next call in this pass holds the old bytes
        return None


def _version(t: Any) -> int:
    if t is None or t.is_inference():
        return -1  # inference tensors have no version counter
    try:
        return t._version
    except RuntimeError:
        return -1
