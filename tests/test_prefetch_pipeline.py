"""The prefetch pipeline on its own: which unit is copied into which slot, after which event, in which order."""
from __future__ import annotations

import threading

import pytest

from offload.stream.prefetch import PrefetchWorker
from offload.store.sources import DeferredCopy


class _Source:
    """A unit's source whose copies the test's issue function records (dst is the slot number here)."""

    def __init__(self, unit: int, issue) -> None:
        self.unit = unit
        self.fn = issue

    def issue(self, dst, after):
        return self.fn(self.unit, dst, after)


def configured(issue, order, n_slots, n_units=16) -> PrefetchWorker:
    """A worker over `n_slots` slots (numbered, standing in for device buffers) and recording sources."""
    w = PrefetchWorker()
    w.configure(order, list(range(n_slots)), [_Source(u, issue) for u in range(n_units)])
    return w


class Recorder:
    """Stands in for the backend: records every issued copy as (unit, slot, after)."""

    def __init__(self) -> None:
        self.issued: list[tuple[int, int, object]] = []

    def __call__(self, unit: int, slot: int, after: object) -> str:
        self.issued.append((unit, slot, after))
        return f"copy-{len(self.issued)}"


def test_fill_primes_one_copy_per_slot_in_order():
    rec = Recorder()
    w = configured(rec, [0, 1, 2, 3, 4], n_slots=3)
    w.fill()
    assert [(u, s) for u, s, _ in rec.issued] == [(0, 0), (1, 1), (2, 2)]


def test_released_slot_gets_the_next_unit_after_its_free_event():
    rec = Recorder()
    w = configured(rec, [0, 1, 2, 3, 4], n_slots=2)
    w.fill()
    slot, event = w.take(0)
    assert (slot, event) == (0, "copy-1")
    w.release(slot, "free-0")
    assert rec.issued[-1] == (2, 0, "free-0"), "unit 2 must go into unit 0's slot, after unit 0 finished with it"


def test_lookahead_wraps_into_the_next_forward():
    rec = Recorder()
    order = [3, 5, 7]
    w = configured(rec, order, n_slots=2)
    w.fill()
    for u in order:
        slot, _ = w.take(u)
        w.release(slot, f"free-{u}")
    # as the last unit finishes, the first units of the next forward are already queued
    assert [u for u, _, _ in w.inflight] == [3, 5]
    assert [u for u, _, _ in rec.issued] == [3, 5, 7, 3, 5]
    assert w.resyncs == 0


def test_out_of_order_unit_resyncs_instead_of_using_stale_bytes():
    rec = Recorder()
    w = configured(rec, [0, 1, 2, 3], n_slots=2)
    w.fill()
    slot, event = w.take(2)  # 0 and 1 were predicted; 2 came first
    assert w.resyncs == 1
    last = max(i for i, (u, _, _) in enumerate(rec.issued) if u == 2)
    assert rec.issued[last][1] == slot and event == f"copy-{last + 1}", "unit 2 must run on its own fresh copy"
    # after the resync the pipeline follows the order from unit 2 on
    w.release(slot, "free")
    assert [u for u, _, _ in w.inflight] == [3, 0]


def test_unit_not_in_the_order_is_fetched_directly():
    rec = Recorder()
    w = configured(rec, [0, 1], n_slots=2)
    w.fill()
    slot, _ = w.take(9)
    assert rec.issued[-1][:2] == (9, slot)


def test_set_order_adopts_the_observed_order():
    rec = Recorder()
    w = configured(rec, [0, 1, 2], n_slots=1)
    w.set_order([2, 0, 1])
    w.fill()
    assert rec.issued[-1][0] == 2


def test_restart_requeues_the_same_units():
    rec = Recorder()
    w = configured(rec, [0, 1, 2, 3], n_slots=2)
    w.fill()
    w.restart()  # the weights behind the queued copies changed
    w.fill()
    assert [u for u, _, _ in rec.issued] == [0, 1, 0, 1]


def test_cancelled_deferred_copy_is_resolved_before_its_slot_is_reused():
    """A disk/pageable copy still waiting for the read-ahead thread must be queued before any new copy into
    the same slot; the new copy waits on the cancelled one's event."""
    pending = DeferredCopy()
    issued = []

    def issue(unit, slot, after):
        issued.append((unit, slot, after))
        return pending if unit == 0 else f"copy-{unit}"

    w = configured(issue, [0, 1, 2], n_slots=1)
    w.fill()  # unit 0 -> deferred

    def reader():
        pending.event = "disk-copy-0"
        pending._done.set()

    t = threading.Timer(0.05, reader)
    t.start()
    slot, event = w.take(2)  # out of order: cancels unit 0's pending copy, must wait for it
    t.join()
    assert issued[-1] == (2, slot, "disk-copy-0")
    assert event == "copy-2"


def test_cancelled_failed_read_frees_the_slot():
    failed = DeferredCopy()
    failed.error = OSError("disk gone")
    failed._done.set()
    seq = iter([failed, "copy-b"])
    w = configured(lambda u, s, a: next(seq), [0, 1], n_slots=1)
    w.fill()
    slot, event = w.take(1)
    assert event == "copy-b"


def test_resolve_surfaces_read_errors():
    bad = DeferredCopy()
    bad.error = OSError("short read")
    bad._done.set()
    with pytest.raises(OSError, match="short read"):
        bad.resolve()
