"""The pass lock: re-entrant, one holder at a time, and only a holder whose module calls all ended is taken over."""
from __future__ import annotations

import threading
import time

import pytest
import torch.nn as nn

from offload.stream.pass_lock import PassLock, module_call_frame

HANG_S = 120  # a guard against a hang only: generous for a loaded machine, never a verdict on speed


class _Probe(nn.Module):
    """A module whose forward takes a hold the way the engine's hooks do (naming its module call)."""

    def __init__(self, lock: PassLock, then=None) -> None:
        super().__init__()
        self.lock = lock
        self.then = then

    def forward(self) -> None:
        self.lock.acquire(frame=module_call_frame())
        if self.then is not None:
            self.then()


def _in_thread(fn, timeout: float = HANG_S) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    t.join(timeout)
    return t


def test_a_hold_whose_module_call_ended_is_taken_over_by_the_same_thread():
    stale = []
    lock = PassLock(stale.append, check_s=0.05)
    _Probe(lock)()  # takes a hold and returns without releasing it: what an interrupt leaves
    assert stale == []
    assert lock.acquire(blocking=False)
    assert stale == [threading.get_ident()]
    lock.release()
    assert _in_thread(lambda: lock.acquire() and lock.release()).is_alive() is False


def test_a_hold_whose_thread_ended_is_taken_over_by_another():
    stale = []
    lock = PassLock(stale.append, check_s=0.05)
    t = _in_thread(lambda: _Probe(lock)())
    assert not t.is_alive()
    assert lock.acquire(blocking=False), "the holder's thread is gone"
    assert stale == [t.ident]
    lock.release()


def test_a_running_module_call_is_never_taken_over():
    stale = []
    lock = PassLock(stale.append, check_s=0.02)
    inside, leave = threading.Event(), threading.Event()
    holder = threading.Thread(target=lambda: _Probe(lock, then=lambda: (inside.set(), leave.wait(HANG_S)))(),
                              daemon=True)
    holder.start()
    assert inside.wait(HANG_S)
    assert not lock.acquire(blocking=False)
    got = []
    waiter = threading.Thread(target=lambda: got.append(lock.acquire()), daemon=True)
    waiter.start()
    time.sleep(0.3)  # many stale checks go by
    assert got == [] and stale == [], "the waiter must wait while the holder's forward runs"
    leave.set()
    holder.join(HANG_S)
    # the holder's forward ended without releasing: now it is stale, and the waiter gets the lock
    waiter.join(HANG_S)
    assert got == [True] and stale == [holder.ident]


def test_a_with_block_is_never_taken_over():
    lock = PassLock(lambda _: pytest.fail("a `with` hold was taken over"), check_s=0.02)
    inside, leave = threading.Event(), threading.Event()

    def hold():
        with lock:
            inside.set()
            leave.wait(HANG_S)

    t = threading.Thread(target=hold, daemon=True)
    t.start()
    assert inside.wait(HANG_S)
    time.sleep(0.1)
    assert not lock.acquire(blocking=False)
    leave.set()
    t.join(HANG_S)
    assert lock.acquire(blocking=False)
    lock.release()


def test_nested_holds_on_one_thread_and_release_rules():
    lock = PassLock(lambda _: pytest.fail("nested holds are not stale"))
    seen = []

    def inner():
        with lock:  # re-entrant inside a running forward's hold
            seen.append(_in_thread(lambda: seen.append(lock.acquire(blocking=False))).is_alive())
        lock.release()  # the forward's own hold

    _Probe(lock, then=inner)()
    assert seen == [False, False], "another thread is kept out while the hold runs"
    with pytest.raises(RuntimeError, match="does not hold"):
        lock.release()
