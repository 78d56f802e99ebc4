"""The prefetch pipeline: keeps the next streamed units copying into free slots of the ring.

Lookahead is counted in streamed units: whenever a slot is freed (its unit finished), the next streamed unit
in the predicted order is queued into it, wrapping into the next forward. While autograd runs backward through
the streamed units (offload/backward.py) the worker follows the reversed forward order instead. A unit that
arrives out of order (an interrupted forward, a different call order) resyncs the pipeline instead of computing
on stale bytes.
The worker refers to the sources and the slots, never back to the streamer that owns it.
"""
from __future__ import annotations

import logging
from collections import deque
from typing import Any, Sequence

import torch

from .storage import UnitSource, resolve

log = logging.getLogger(__name__)


class PrefetchWorker:
    """Orders copies into the slot ring; the copies themselves run on the backend's transfer stream."""

    def __init__(self) -> None:
        self.order: list[int] = []
        self.sources: Sequence[UnitSource] = ()
        self.slots: Sequence[torch.Tensor] = ()
        self.inflight: deque[tuple[int, int, Any]] = deque()  # (unit, slot, copy event), oldest first
        self.free: deque[tuple[int, Any]] = deque()  # (slot, event after which it may be overwritten)
        self.next_pos = 0
        self.resyncs = 0
        self.skip: frozenset[int] = frozenset()  # units in the order not to copy (another owner's weights are in place)
        self.reversed = False  # following the reversed forward order (backward); `_forward` keeps the forward one
        self._forward: list[int] | None = None

    def configure(self, order: list[int], slots: Sequence[torch.Tensor], sources: Sequence[UnitSource]) -> None:
        """New plan: predicted order of streamed units, the slot buffers and every unit's source (nothing in flight)."""
        self.order = list(order)
        self.slots = slots
        self.sources = sources
        self.inflight.clear()
        self.free = deque((s, None) for s in range(len(slots)))
        self.next_pos = 0
        self.reversed = False
        self._forward = None

    def _issue(self, unit: int, slot: int, after: Any) -> Any:
        return self.sources[unit].issue(self.slots[slot], after)

    def reverse_order(self, forward: list[int]) -> None:
        """Backward: copy units in the reverse of the forward order `forward` (the last forward's streamed units),
        starting now; queued forward copies are dropped."""
        if not forward or not self.slots:
            return
        if not self.reversed:
            self._forward = self.order
            self.reversed = True
        self.order = list(reversed(forward))
        self.next_pos = 0
        self._cancel_inflight()
        self.fill()

    def forward_order(self) -> None:
        """Back to the forward order after backward (queued backward copies are dropped)."""
        if not self.reversed:
            return
        self.reversed = False
        self.order = self._forward if self._forward is not None else self.order[::-1]
        self._forward = None
        self.next_pos = 0
        self._cancel_inflight()
        self.fill()

    def set_order(self, order: list[int]) -> None:
        """Adopt an observed execution order; takes effect from the next resync or fill."""
        if self.reversed:
            self.reversed = False
            self._forward = None
        if order and order != self.order:
            self.order = list(order)
            self.next_pos = 0
            self._cancel_inflight()

    def set_skip(self, units: set[int]) -> None:
        """Units that run on another owner's weights for now: no copy is queued for them until they are back."""
        skip = frozenset(units)
        if skip != self.skip:
            self.skip = skip
            self.restart()

    def fill(self) -> None:
        """Queue copies into every free slot, following the predicted order (less the skipped units)."""
        if not self.order or self.skip.issuperset(self.order):
            return
        while self.free:
            while self.order[self.next_pos % len(self.order)] in self.skip:
                self.next_pos = (self.next_pos + 1) % len(self.order)
            slot, after = self.free.popleft()
            unit = self.order[self.next_pos % len(self.order)]
            self.next_pos = (self.next_pos + 1) % len(self.order)
            try:
                copy = self._issue(unit, slot, after)
            except BaseException:
                self.free.appendleft((slot, after))
                raise
            self.inflight.append((unit, slot, copy))

    def take(self, unit: int) -> tuple[int, Any]:
        """The slot holding `unit`'s bytes and the event its copy completes on."""
        if not (self.inflight and self.inflight[0][0] == unit):
            self._resync(unit)
        _, slot, event = self.inflight.popleft()
        return slot, event

    def release(self, slot: int, after: Any) -> None:
        """A unit finished with `slot` (event `after`); reuse it for the next unit in line."""
        self.free.append((slot, after))
        self.fill()

    def give_back(self, slot: int, after: Any = None) -> None:
        """A taken slot whose unit never ran (its copy failed): free it without queueing anything."""
        self.free.appendleft((slot, after))

    def restart(self) -> None:
        """Drop queued copies (their bytes are stale) and start again from the next predicted unit."""
        if self.inflight:
            self.next_pos = self.order.index(self.inflight[0][0]) if self.inflight[0][0] in self.order else 0
        self._cancel_inflight()

    def _cancel_inflight(self) -> None:
        # A new copy into a cancelled slot must land after the cancelled one. A copy already on the transfer
        # stream is ahead of it anyway; one still waiting for the read-ahead thread is resolved first, so
        # the thread cannot queue the stale copy behind the new one.
        while self.inflight:
            _, slot, event = self.inflight.pop()
            try:
                after = resolve(event)
            except Exception:  # a failed read queued no copy; the slot is free
                after = None
            self.free.appendleft((slot, after))

    def _resync(self, unit: int) -> None:
        self.resyncs += 1
        self._cancel_inflight()
        if unit in self.order:
            n = len(self.order)
            start = self.next_pos
            for k in range(n):
                if self.order[(start + k) % n] == unit:
                    self.next_pos = (start + k) % n
                    break
            self.fill()
        if not (self.inflight and self.inflight[0][0] == unit):  # not predicted at all: fetch it directly
            self._cancel_inflight()
            slot, after = self.free.popleft()
            try:
                copy = self._issue(unit, slot, after)
            except BaseException:
                self.free.appendleft((slot, after))
                raise
            self.inflight.appendleft((unit, slot, copy))
        log.debug("prefetch resync at unit %d (%d so far)", unit, self.resyncs)
