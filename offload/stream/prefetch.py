"""The prefetch pipeline: keeps the next streamed units copying into free slots of the ring.

Lookahead is counted in streamed units: whenever a slot is freed (its unit finished), the next streamed unit
in the predicted order is queued into it, wrapping into the next forward. The prediction comes from history
(`OrderPredictor`): the pass that followed the last pass the last time it was seen (two alternating call orders
are predicted as they alternate), re-predicted inside a pass from the most recent pass with the same prefix or,
failing that, from which unit followed which. A unit that comes out of the predicted order is taken from wherever
it is in flight, or loaded on demand into a free slot (the newest copy no longer predicted gives its slot up when
none is free), while the copies still predicted stay in flight. While autograd runs backward through the
streamed units (offload/stream/backward.py) the worker follows the reversed forward order instead.
The worker refers to the sources and the slots, never back to the streamer that owns it.
"""
from __future__ import annotations

import logging
from collections import Counter, deque
from typing import Any, Sequence

import torch

from ..store.sources import UnitSource, resolve

log = logging.getLogger(__name__)

HISTORY = 16  # passes remembered for prediction


class OrderPredictor:
    """Predicts the streamed units' call order from history: whole passes, then unit-to-unit successors."""

    def __init__(self) -> None:
        self.history: deque[tuple[int, ...]] = deque(maxlen=HISTORY)
        self.successors: dict[int, Counter] = {}

    def clear(self) -> None:
        self.history.clear()
        self.successors.clear()

    def record_pass(self, seq: list[int]) -> None:
        """A pass ended having called `seq` (streamed units, in order)."""
        if not seq:
            return
        seq = tuple(seq)
        repeat = bool(self.history) and self.history[-1] == seq
        self.history.append(seq)
        if repeat and all(self.successors.get(a) for a in seq[:-1]):
            return  # the same pass again (the common case): its successors are known, counting them again is waste
        for a, b in zip(seq, seq[1:]):
            self.successors.setdefault(a, Counter())[b] += 1

    def next_pass(self) -> list[int]:
        """The pass expected next: what followed the last pass the last time it was seen, else the last pass."""
        h = self.history
        if not h:
            return []
        last = h[-1]
        for k in range(len(h) - 2, -1, -1):
            if h[k] == last:
                return list(h[k + 1])
        return list(last)

    def rest_of_pass(self, prefix: list[int], length: int) -> list[int]:
        """The units expected after `prefix` in this pass: the most recent pass starting with it, else a chain of
        the most frequent successors (each unit once)."""
        n = len(prefix)
        for seq in reversed(self.history):
            if len(seq) > n and list(seq[:n]) == prefix:
                return list(seq[n:])
        out: list[int] = []
        seen = set(prefix)
        cur = prefix[-1] if prefix else None
        while cur is not None and len(out) < length:
            nxt = next((b for b, _ in self.successors.get(cur, Counter()).most_common() if b not in seen), None)
            if nxt is None:
                break
            out.append(nxt)
            seen.add(nxt)
            cur = nxt
        return out


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
        self.predictor = OrderPredictor()
        self.seq: list[int] = []  # forward: the units predicted for this pass, then the next one's as queued
        self.pass_len = 0  # how much of `seq` is this pass (the rest was queued ahead for the next pass)
        self.taken: list[int] = []  # units taken this pass, in order
        self.demand_loads = 0  # units loaded on demand: called while not in flight
        self.prefetch_hits = 0  # units found in flight when called

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
        self.predictor.clear()  # the streamed set may have changed: history of other units misleads
        self.seq, self.pass_len, self.taken = list(order), len(order), []

    def _issue(self, unit: int, slot: int, after: Any) -> Any:
        return self.sources[unit].issue(self.slots[slot], after)

    def _copy_into_free_slot(self, unit: int) -> tuple[int, Any]:
        """Queue `unit`'s copy into the first free slot; a copy that cannot be queued leaves the slot free."""
        slot, after = self.free.popleft()
        try:
            return slot, self._issue(unit, slot, after)
        except BaseException:
            self.free.appendleft((slot, after))
            raise

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
        if order and not self.predictor.history:
            self.predictor.record_pass(list(order))
        if order and order != self.order:
            self.order = list(order)
            self.next_pos = 0
            self._cancel_inflight()
            self.seq, self.pass_len = list(order), len(order)

    def begin_pass(self) -> None:
        """A forward starts: the last pass goes into history; copies queued ahead that the prediction for this
        pass does not start with give their slots back."""
        if self.reversed:
            return
        if self.taken:
            self.predictor.record_pass(self.taken)
        self.taken = []
        predicted = self.predictor.next_pass() or list(self.order)
        self.seq, self.pass_len = predicted, len(predicted)
        self._keep_predicted(predicted)

    def set_skip(self, units: set[int]) -> None:
        """Units that run on another owner's weights for now: no copy is queued for them until they are back."""
        skip = frozenset(units)
        if skip != self.skip:
            self.skip = skip
            self.restart()

    def _keep_predicted(self, upcoming: list[int]) -> None:
        """Keep the copies in flight that the next ring's worth of `upcoming` still wants; the others give their
        slots back. Queueing resumes at the start of `upcoming` (units already in flight are skipped)."""
        wanted = set(upcoming[:max(1, len(self.slots))])
        for k in range(len(self.inflight) - 1, -1, -1):
            if self.inflight[k][0] not in wanted:
                self._cancel_at(k)
        self.next_pos = 0

    def _cancel_newest(self) -> None:
        self._cancel_at(len(self.inflight) - 1)

    def _cancel_at(self, k: int) -> None:
        _, slot, event = self.inflight[k]
        del self.inflight[k]
        try:
            after = resolve(event)
        except Exception:  # a failed read queued no copy; the slot is free
            after = None
        self.free.appendleft((slot, after))

    def _next_forward_unit(self) -> int | None:
        """The next unit to queue in forward mode, or None when nothing more is predicted."""
        inflight = self.inflight
        self.next_pos = max(self.next_pos, len(self.taken))  # `seq` starts with what this pass took (see _follow)
        for _ in range(2):
            while self.next_pos < len(self.seq):
                unit = self.seq[self.next_pos]
                self.next_pos += 1
                if unit not in self.skip and not any(entry[0] == unit for entry in inflight):
                    return unit
            if len(self.seq) > self.pass_len or not self.seq:
                return None
            # wrap: the next pass as predicted if this one goes as predicted
            guess = list(self.taken) + self.seq[len(self.taken):self.pass_len]
            self.seq = self.seq[:self.pass_len] + self._guess_after(guess)
        return None

    def _guess_after(self, this_pass: list[int]) -> list[int]:
        """The pass expected after `this_pass`: what followed it the last time it was seen, else the same again."""
        h = self.predictor.history
        key = tuple(this_pass)
        for k in range(len(h) - 2, -1, -1):
            if h[k] == key:
                return list(h[k + 1])
        return list(self.order) or list(this_pass)

    def fill(self) -> None:
        """Queue copies into every free slot, following the predicted order (less the skipped units)."""
        if not self.reversed:
            while self.free:
                unit = self._next_forward_unit()
                if unit is None:
                    return
                self.inflight.append((unit, *self._copy_into_free_slot(unit)))
            return
        if not self.order or self.skip.issuperset(self.order):
            return
        while self.free:
            while self.order[self.next_pos % len(self.order)] in self.skip:
                self.next_pos = (self.next_pos + 1) % len(self.order)
            unit = self.order[self.next_pos % len(self.order)]
            self.next_pos = (self.next_pos + 1) % len(self.order)
            self.inflight.append((unit, *self._copy_into_free_slot(unit)))

    def take(self, unit: int) -> tuple[int, Any]:
        """The slot holding `unit`'s bytes and the event its copy completes on."""
        if self.reversed:
            if not (self.inflight and self.inflight[0][0] == unit):
                self._resync(unit)
            _, slot, event = self.inflight.popleft()
            return slot, event
        retry = bool(self.taken) and self.taken[-1] == unit  # its copy failed and it is fetched again
        if not retry:
            self.taken.append(unit)
        for k, (u, slot, event) in enumerate(self.inflight):
            if u == unit:
                del self.inflight[k]
                self.prefetch_hits += 1
                self._follow(unit)
                return slot, event
        self.demand_loads += 1
        self._follow(unit)
        if not self.free:
            self._cancel_newest()  # the copy predicted furthest ahead gives its slot up
        return self._copy_into_free_slot(unit)

    def _follow(self, unit: int) -> None:
        """After taking `unit`: when the pass left the prediction, predict its rest again from history and drop the
        copies in flight that the new prediction does not start with."""
        pos = len(self.taken)
        if pos <= self.pass_len and self.seq[pos - 1] == unit:
            return  # still as predicted (`seq` starts with what the pass took so far: checked one unit at a time)
        self.resyncs += 1
        rest = self.predictor.rest_of_pass(self.taken, len(self.order))
        if not rest and unit in self.order:  # nothing in history: the learned order from this unit on
            rest = [u for u in self.order[self.order.index(unit) + 1:] if u not in self.taken]
        self.seq, self.pass_len = list(self.taken) + rest, len(self.taken) + len(rest)
        self._keep_predicted(rest)
        self.next_pos = len(self.taken) + self.next_pos

    def release(self, slot: int, after: Any) -> None:
        """A unit finished with `slot` (event `after`); reuse it for the next unit in line."""
        self.free.append((slot, after))
        self.fill()

    def give_back(self, slot: int, after: Any = None) -> None:
        """A taken slot whose unit never ran (its copy failed): free it without queueing anything."""
        self.free.appendleft((slot, after))

    def restart(self) -> None:
        """Drop queued copies (their bytes are stale) and start again from the next predicted unit."""
        if self.reversed:
            if self.inflight:
                self.next_pos = self.order.index(self.inflight[0][0]) if self.inflight[0][0] in self.order else 0
        elif self.inflight:
            first = self.inflight[0][0]
            start = min(len(self.taken), len(self.seq))
            self.next_pos = self.seq.index(first, start) if first in self.seq[start:] else start
        self._cancel_inflight()

    def _cancel_inflight(self) -> None:
        # A new copy into a cancelled slot must land after the cancelled one. A copy already on the transfer
        # stream is ahead of it anyway; one still waiting for the read-ahead thread is resolved first, so
        # the thread cannot queue the stale copy behind the new one.
        while self.inflight:
            self._cancel_newest()

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
            self.inflight.appendleft((unit, *self._copy_into_free_slot(unit)))
        log.debug("prefetch resync at unit %d (%d so far)", unit, self.resyncs)


def fetch_copied(worker: PrefetchWorker, backend: Any, index: int, name: str) -> tuple[int, Any, Any]:
    """The slot holding unit `index`'s bytes once its copy is done, with the copy's event and the compute stream's
    event before the wait; a failed copy is retried once into a fresh slot (a transient error is invisible), a second
    failure raises. No slot is ever lost to the ring."""
    for attempt in (1, 2):
        slot, copy_event = worker.take(index)
        try:
            ready = backend.record()
            copy_event = resolve(copy_event)
            backend.wait(copy_event)
            return slot, copy_event, ready
        except Exception as exc:
            worker.give_back(slot)  # the failed copy's slot is free again
            if attempt == 2:
                raise
            log.warning("copying %s to the device failed (%s); trying once more", name, exc)
        except BaseException:
            worker.give_back(slot)
            raise
    raise AssertionError("unreachable")
