"""The simulated device on a clock of its own: every duration the engine reads is given, none is measured.

`SimClock` keeps the simulated device's time. Compute takes the time the caller charges for it (`charge`: per call
of a module, in ms; `charge_flops`: each Linear / convolution call at a FLOP rate); a copy takes the device's
latency + bytes / bandwidth (`sim_latency_us`, `sim_bandwidth_gbps`); a read into a bounce buffer (a disk-tier
unit, pageable RAM) takes its bytes at the clock's `disk_gbps` / `bounce_gbps`; idle time between passes is
`advance`. `ClockedSimBackend` is the simulated device (`sim.SimBackend`'s memory, bytes and errors) whose events
carry those times, so placement, re-planning, stalls, overlap and the report depend on nothing the host's load
changes, while the engine's code paths stay the ones a real device runs (metrics, `CostTracker` and `PlanKeeper`
read the backend's events and `Backend.clock`, whatever the device).

The model: one compute lane (the host runs compute synchronously on the simulated device, so host and compute
stream are one) and, per device, one transfer lane on which copies run in the order they are issued, each after
the later of its issue, its `after` event and the copy before it. A read into a bounce buffer occupies the transfer
lane before its copy (the read-ahead thread and the copy engine as one pipeline). The bytes themselves are copied
at once on the issuing thread; work handed to the read-ahead thread is waited for (`hand_off`), so the order of
copies on the lane is the program's order, not the threads' interleaving. Several threads running models on one
clock share its compute lane: their times are then as interleaved as the threads are.

Use it with `OffloadConfig(device="sim", sim_clock=SimClock(...), sim_bandwidth_gbps=...)` (tests do).
"""
from __future__ import annotations

import math
import threading
from typing import Any, Callable, Iterable, TypeVar

import torch
import torch.nn as nn

from .sim import SimBackend, SimEvent, copy_bytes

T = TypeVar("T")
READ_KINDS = ("disk", "bounce")


def _rate(name: str, gbps: float | None) -> float | None:
    if gbps is None:
        return None
    if isinstance(gbps, bool) or not isinstance(gbps, (int, float)) or not gbps > 0 or math.isinf(gbps):
        raise ValueError(f"SimClock: {name} must be a finite rate above 0 (or None: free), got {gbps!r}")
    return float(gbps)


class SimClock:
    """The simulated device's time (see the module docstring): compute charged per module call, reads at given
    rates, copies at the device's bandwidth; `now_ms` only moves when the simulation says so."""

    virtual = True

    def __init__(self, disk_gbps: float | None = None, bounce_gbps: float | None = None) -> None:
        self.read_gbps = {"disk": _rate("disk_gbps", disk_gbps), "bounce": _rate("bounce_gbps", bounce_gbps)}
        self._now = 0.0  # seconds on the compute lane
        self._lock = threading.Lock()
        self._read = threading.local()  # per thread: the read a copy issued next on that thread waits for
        self._hooks: list[Any] = []

    # the compute lane ---------------------------------------------------------------------
    @property
    def now_ms(self) -> float:
        """Milliseconds on the compute lane since the clock was made."""
        return self._now * 1e3

    def now_s(self) -> float:
        """Seconds on the compute lane (what the backend's events carry)."""
        return self._now

    def advance(self, ms: float) -> None:
        """Time passes on the compute lane: a charged compute, or the host idle between passes (a sampler's
        step, a UI round trip) while copies already issued go on."""
        if not ms >= 0 or math.isinf(ms):
            raise ValueError(f"SimClock.advance: ms must be a finite number >= 0, got {ms!r}")
        with self._lock:
            self._now += ms / 1e3

    def wait_until(self, t: float) -> float:
        """The compute lane waits for time `t` (seconds): returns the seconds it waited."""
        with self._lock:
            waited = max(0.0, t - self._now)
            self._now += waited
            return waited

    # compute charged per module call ---------------------------------------------------------
    def charge(self, modules: nn.Module | Iterable[nn.Module],
               ms: float | Callable[[nn.Module, Any, Any], float]) -> None:
        """Each call of each of `modules` (a module, an iterable, or a ModuleList's modules) takes `ms` on the
        compute lane (or `ms(module, args, output)`): charged when its forward returns, before any other forward hook
        (the engine's ends the unit's timing)."""
        if isinstance(modules, (nn.ModuleList, nn.ModuleDict)):  # containers never called: their modules are
            modules = list(modules.values() if isinstance(modules, nn.ModuleDict) else modules)
        elif isinstance(modules, nn.Module):
            modules = [modules]
        if not callable(ms) and (isinstance(ms, bool) or not isinstance(ms, (int, float)) or not ms >= 0
                                 or math.isinf(ms)):
            raise ValueError(f"SimClock.charge: ms must be a finite number >= 0 (or a function), got {ms!r}")
        cost = ms if callable(ms) else (lambda _m, _a, _o, v=float(ms): v)

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self.advance(cost(module, args, output))

        for module in modules:
            self._hooks.append(module.register_forward_hook(hook, prepend=True))

    def charge_flops(self, model: nn.Module, gflops: float) -> None:
        """Each call of a Linear or convolution inside `model` takes its multiply-adds (2 x the weight's fan-in x
        the output's elements) at `gflops` GFLOP/s on the compute lane; other ops are free."""
        rate = _rate("gflops", gflops)

        def cost(module: nn.Module, args: Any, output: Any) -> float:
            weight = getattr(module, "weight", None)
            if not isinstance(output, torch.Tensor) or weight is None or weight.dim() < 2:
                return 0.0
            fan_in = math.prod(weight.shape[1:])
            return 2.0 * fan_in * output.numel() / (rate * 1e9) * 1e3

        self.charge([m for m in model.modules() if isinstance(m, (nn.Linear, nn.modules.conv._ConvNd))], cost)

    def remove_charges(self) -> None:
        """The modules' compute is free again (their hooks removed)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    # host work before a copy (Backend.clock) -----------------------------------------------------
    def timed(self, kind: str, nbytes: int, work: Callable[[], T]) -> tuple[T, float]:
        """Run the read; it takes `nbytes` at the clock's rate for `kind` (free where none is set), and the next
        copy issued on this thread waits for it on the transfer lane."""
        if kind not in READ_KINDS:
            raise ValueError(f"SimClock.timed: kind must be one of {READ_KINDS}, got {kind!r}")
        result = work()
        gbps = self.read_gbps[kind]
        seconds = nbytes / (gbps * 1e9) if gbps else 0.0
        self._read.seconds = seconds
        return result, seconds * 1e3

    def take_read(self) -> float:
        """Seconds of the read the next copy on this thread waits for (0 when none); forgotten once taken."""
        seconds = getattr(self._read, "seconds", 0.0)
        self._read.seconds = 0.0
        return seconds

    def hand_off(self, wait: Callable[[], object]) -> None:
        """Work handed to the read-ahead thread is waited for, so copies reach the transfer lane in program order."""
        wait()

    def __repr__(self) -> str:
        return f"SimClock(now_ms={self.now_ms:.3f}, disk_gbps={self.read_gbps['disk']}, " \
               f"bounce_gbps={self.read_gbps['bounce']})"


class ClockedSimBackend(SimBackend):
    """The simulated device whose events carry `clock`'s times (see the module docstring)."""

    def __init__(self, clock: SimClock, capacity_bytes: int | None = None, bandwidth_gbps: float | None = None,
                 latency_us: float = 0.0, index: int = 0) -> None:
        super().__init__(capacity_bytes, bandwidth_gbps, latency_us, index)
        self.clock = clock
        self._lane_free = 0.0  # seconds: when the transfer lane finishes the last copy issued
        self._lane = threading.Lock()

    def copy_seconds(self, nbytes: int) -> float:
        """A copy's time on the transfer lane: latency + bytes / bandwidth (bandwidth unset: latency only)."""
        seconds = self.latency_us * 1e-6
        if self.bandwidth_gbps:
            seconds += nbytes / (self.bandwidth_gbps * 1e9)
        return seconds

    def copy_h2d(self, dst: torch.Tensor, src: torch.Tensor, after: Any = None) -> SimEvent:
        error = None
        try:
            if after is not None:
                after.wait()  # complete already: events are recorded done and copies are made at once
            copy_bytes(dst, src)
        except BaseException as exc:  # reported where the copy is waited for, as on the wall-clock device
            error = exc
        read = self.clock.take_read()
        with self._lane:
            lane = max(self.clock.now_s(), self._lane_free) + read
            start = max(lane, after.time if after is not None else 0.0)
            end = start + self.copy_seconds(src.numel() * src.element_size())
            self._lane_free = end
        event = SimEvent(end)
        event.start, event.error = start, error
        return event

    def then(self, event: SimEvent, fn: Callable[[], None]) -> SimEvent:
        """`fn` (a decode) right after the copy; it takes no time of its own on the transfer lane."""
        done = SimEvent(event.time)
        done.start, done.error = event.start, event.error
        if done.error is None:
            try:
                fn()
            except BaseException as exc:  # reported where the decode is waited for
                done.error = exc
        return done

    def wait(self, event: SimEvent) -> float:
        event.wait()
        if event.error is not None:
            raise RuntimeError(f"simulated host-to-device copy failed: {event.error}") from event.error
        return self.clock.wait_until(event.time)

    def record(self) -> SimEvent:
        return SimEvent(self.clock.now_s())

    def is_done(self, event: SimEvent) -> bool:
        return event.is_set() and event.time <= self.clock.now_s()

    def synchronize(self) -> None:
        """The host waits for every copy issued."""
        self.clock.wait_until(self._lane_free)

    def event_synchronize(self, event: SimEvent) -> None:
        """The bytes are there once the event is set (its time is read where it matters: `wait`, the metrics)."""
        event.wait()

    def h2d_gbps(self, pinned: bool = True) -> float | None:
        """The device's bandwidth as set (None: unlimited); nothing is measured."""
        return self.bandwidth_gbps

    def describe(self) -> str:
        return super().describe()[:-1] + ", on its own clock)"
