"""The per-model pass lock: one forward pass at a time, and a pass cut short by an interrupt does not hold it forever.

torch runs ``always_call`` forward hooks when a forward raises an ``Exception``, not a ``BaseException``: a
KeyboardInterrupt (Ctrl-C in a script, "interrupt kernel" in a notebook) leaves the pass its pre-hook opened. A plain
RLock would then stay held: the same thread's next forward nests inside a pass that never ends, and any other thread
waits forever. Each hold taken by a forward hook names the frame of the module call it belongs to; a holder none of
whose frames is still running (or whose thread is gone) is stale, and the next acquirer takes the lock over.
"""
from __future__ import annotations

import logging
import sys
import threading
from types import FrameType
from typing import Callable

import torch.nn as nn

log = logging.getLogger(__name__)

_MODULE_CALL = nn.Module._call_impl.__code__


def module_call_frame(caller_of_call: bool = False) -> FrameType | None:
    """The innermost running ``nn.Module`` call frame (or the frame that made that call), for a hold to name.

    The hold keeps the frame object itself, not its id: a finished frame's address is soon reused by the next call."""
    f: FrameType | None = sys._getframe(1)
    for _ in range(12):
        if f is None:
            return None
        if f.f_code is _MODULE_CALL:
            return f.f_back if caller_of_call and f.f_back is not None else f
        f = f.f_back
    return None


def _running(top: FrameType | None, frames: list[FrameType]) -> bool:
    while top is not None:
        if any(top is f for f in frames):
            return True
        top = top.f_back
    return False


class PassLock:
    """Re-entrant lock whose holds from forward hooks carry a frame; a holder whose frames all ended is taken over."""

    def __init__(self, on_stale: Callable[[int], None], check_s: float = 0.5) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._owner: int | None = None
        self._holds: list[FrameType | None] = []  # per hold: the module call it belongs to, None for a `with` block
        self._on_stale = on_stale  # told (with the stale holder's thread id) before its holds are dropped
        self.check_s = check_s

    def acquire(self, blocking: bool = True, frame: FrameType | None = None) -> bool:
        me = threading.get_ident()
        with self._cond:
            if self._owner == me and self._holds and self._stale(sys._getframe(1)):
                self._take_over()
            while self._owner not in (None, me):
                if blocking and self._cond.wait(self.check_s):
                    continue  # released (another waiter may still get it first)
                if self._owner in (None, me):
                    continue
                top = sys._current_frames().get(self._owner)
                if top is None or self._stale(top):
                    self._take_over()
                elif not blocking:
                    return False
            self._owner = me
            self._holds.append(frame)
            return True

    def release(self) -> None:
        with self._cond:
            if self._owner != threading.get_ident() or not self._holds:
                raise RuntimeError("pass lock released by a thread that does not hold it")
            self._holds.pop()
            if not self._holds:
                self._owner = None
                self._cond.notify()

    def __enter__(self) -> "PassLock":
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _stale(self, top: FrameType | None) -> bool:
        """Every hold came from a forward hook and none of those module calls is still on the holder's stack."""
        if any(f is None for f in self._holds):
            return False  # a `with` block: it releases on the way out, whatever is raised
        return not _running(top, self._holds)  # type: ignore[arg-type]

    def _take_over(self) -> None:
        """Drop a stale holder's holds; the callback (which must not use this lock) closes what its pass left open."""
        stale = self._owner
        try:
            self._on_stale(stale if stale is not None else threading.get_ident())
        finally:
            self._holds = []
            self._owner = None
