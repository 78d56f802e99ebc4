"""The time host-side work is measured on: the one seam through which the engine reads a duration it did not get
from a device event.

Device time (a unit's compute, a copy, a stall) is read from the backend's events (`Backend.record`,
`elapsed_ms`, `copy_span_ms`); the rest is host work before a copy: a unit's bytes read from disk or from
pageable RAM into a bounce buffer on the read-ahead thread (`store/sources.py`). That work is timed with
`Backend.clock.timed`, and handed to the read-ahead thread through `Backend.clock.hand_off`.

`WallClock` (every real device, and the simulated one by default) measures the host's own time and lets the
read-ahead thread run ahead. The simulated device's own clock (`sim_clock.SimClock`) gives every duration from
figures the caller set, so nothing the host's load changes reaches a plan, a stall or a report.
"""
from __future__ import annotations

import time
from typing import Callable, Protocol, TypeVar

T = TypeVar("T")


class Clock(Protocol):
    """What a backend's `clock` offers the engine."""

    virtual: bool

    def timed(self, kind: str, nbytes: int, work: Callable[[], T]) -> tuple[T, float]: ...

    def hand_off(self, wait: Callable[[], object]) -> None: ...


class WallClock:
    """The host's own time (`time.perf_counter`): what real devices, and the simulated one by default, measure."""

    virtual = False  # True on a clock whose durations are given, not measured

    def timed(self, kind: str, nbytes: int, work: Callable[[], T]) -> tuple[T, float]:
        """Run host work before a copy (`kind`: "disk" or "bounce", over `nbytes` bytes); returns its result and the
        milliseconds it took."""
        start = time.perf_counter()
        result = work()
        return result, (time.perf_counter() - start) * 1e3

    def hand_off(self, wait: Callable[[], object]) -> None:
        """Work was just handed to another host thread (the read-ahead thread): on the wall clock it runs ahead of
        the caller; `wait` (until it is done) is not called."""


WALL_CLOCK = WallClock()
