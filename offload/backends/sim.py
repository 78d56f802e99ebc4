"""A simulated device on the CPU: own memory accounting and capacity, a transfer thread, bandwidth limits.

It lets every scheduling, budget and overlap test run on a machine without a GPU: device tensors are CPU
tensors, but allocations count against `capacity_bytes`, copies run in order on a worker thread (the copy
engine), and a copy of n bytes takes at least latency + n / bandwidth.
"""
from __future__ import annotations

import _thread
import atexit
import bisect
import ctypes
import logging
import os
import queue
import threading
import time
import weakref
from typing import Any, Callable

import torch

from .base import Backend
from .pin_gate import pin_host

log = logging.getLogger(__name__)

DEFAULT_SIM_CAPACITY = 8 << 30
SIM_GB_ENV = "LAYER_OFFLOAD_SIM_GB"  # the simulated device's capacity (GiB) when the config gives none: tests run
# several ComfyUI processes (ComfyUI-Distributed workers) as cards of different sizes


def default_sim_capacity() -> int:
    """DEFAULT_SIM_CAPACITY, or LAYER_OFFLOAD_SIM_GB GiB; a bad value is a ValueError naming the variable."""
    raw = os.environ.get(SIM_GB_ENV, "").strip()
    if not raw:
        return DEFAULT_SIM_CAPACITY
    try:
        gib = float(raw)
    except ValueError:
        gib = float("nan")
    if not gib > 0 or gib == float("inf"):
        raise ValueError(f"{SIM_GB_ENV}={raw!r} must be a number of GiB above 0")
    return int(gib * (1 << 30))


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """The copy engine's memcpy: one thread, outside torch's thread pool, so it steals little from compute."""
    n = src.numel() * src.element_size()
    if (dst.is_contiguous() and src.is_contiguous() and dst.dtype == src.dtype and dst.shape == src.shape
            and dst.device.type == "cpu" and src.device.type == "cpu"):
        if n:
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), n)  # releases the GIL while it runs
        return
    with torch.inference_mode():  # dst may have been allocated under inference mode by a caller
        dst.copy_(src)


def _timed_copy(dst: torch.Tensor, src: torch.Tensor) -> float:
    start = time.perf_counter()
    copy_bytes(dst, src)
    return time.perf_counter() - start


class SimEvent:
    """A completion flag with the time it completed (and started, for copies); cheap when born complete."""

    __slots__ = ("_latch", "_done", "time", "start", "error")

    def __init__(self, done_at: float | None = None) -> None:
        self.error: BaseException | None = None
        if done_at is not None:
            self._latch = None
            self._done = True
            self.time = self.start = done_at
        else:
            self._latch = _thread.allocate_lock()
            self._latch.acquire()  # held until the copy completes; waiters block on it
            self._done = False
            self.time = self.start = 0.0

    def set(self, start: float, end: float) -> None:
        self.start, self.time = start, end
        self._done = True
        self._latch.release()

    def wait(self) -> None:
        if not self._done:
            self._latch.acquire()
            self._latch.release()

    def is_set(self) -> bool:
        return self._done


class SimBackend(Backend):
    """CPU stand-in for a GPU: separate memory accounting, an ordered transfer thread, optional bandwidth."""

    name = "sim"
    supports_pinned_host = False
    supports_peer_to_peer = True  # every simulated device is the CPU: an activation moves without a host hop

    def __init__(self, capacity_bytes: int | None = None, bandwidth_gbps: float | None = None,
                 latency_us: float = 0.0, index: int = 0) -> None:
        self.device = torch.device("cpu")
        self.index = index
        self.capacity_bytes = int(capacity_bytes if capacity_bytes is not None else default_sim_capacity())
        self.bandwidth_gbps = bandwidth_gbps
        self.latency_us = float(latency_us)
        self.used_bytes = 0
        self.peak_bytes = 0
        self._lock = threading.Lock()
        self._starts: list[int] = []  # sorted data_ptr of live allocations
        self._sizes: dict[int, int] = {}
        self._tokens: dict[int, object] = {}  # one per live allocation, so a late finalizer cannot free a newer one
        self._queue: queue.Queue = queue.Queue()
        self._queued = 0  # copies handed to the copy engine thread and not finished yet
        self._throttled = bool(bandwidth_gbps) or bool(latency_us)
        self._memcpy_gbps: float | None = None  # the host's memcpy speed, measured when first asked (h2d_gbps)
        self._worker: threading.Thread | None = None  # the copy engine thread, started by the first queued copy

    def _enqueue(self, item: tuple) -> None:
        """Hand a copy (or a decode) to the copy engine thread, starting it the first time."""
        with self._lock:
            self._queued += 1
            if self._worker is None:
                self._worker = threading.Thread(target=self._run, name="sim-copy-engine", daemon=True)
                self._worker.start()
                atexit.register(self._stop)  # a daemon thread killed mid-copy at exit would abort the process
        self._queue.put(item)

    def _stop(self) -> None:
        if self._worker is not None and self._worker.is_alive():
            self._queue.put(None)
            self._worker.join()

    # memory -----------------------------------------------------------------
    def alloc(self, nbytes: int) -> torch.Tensor:
        nbytes = int(nbytes)
        with self._lock:
            if self.used_bytes + nbytes > self.capacity_bytes:
                raise torch.OutOfMemoryError(
                    f"simulated device out of memory: tried to allocate {nbytes} bytes with "
                    f"{self.capacity_bytes - self.used_bytes} of {self.capacity_bytes} bytes free")
            if self.used_bytes == 0:  # the device was empty: a new epoch for the peak
                self.peak_bytes = 0
            buf = torch.empty(max(nbytes, 1), dtype=torch.uint8)[:nbytes]
            ptr = buf.untyped_storage().data_ptr()
            self.used_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.used_bytes)
            bisect.insort(self._starts, ptr)
            self._sizes[ptr] = nbytes
            token = object()
            self._tokens[ptr] = token
        # a buffer dropped without release() (a model garbage collected without detach) still frees its bytes
        weakref.finalize(buf, self._free, ptr, token)
        return buf

    def release(self, buf: torch.Tensor) -> None:
        ptr = buf.untyped_storage().data_ptr()
        self._free(ptr, self._tokens.get(ptr))

    def _free(self, ptr: int, token: object) -> None:
        with self._lock:
            if token is None or self._tokens.get(ptr) is not token:
                return  # released already (and maybe the address reused by a newer buffer)
            del self._tokens[ptr]
            size = self._sizes.pop(ptr)
            self._starts.remove(ptr)
            self.used_bytes -= size

    def owns(self, tensor: torch.Tensor) -> bool:
        if tensor.device.type != "cpu" or tensor.numel() == 0:
            return False
        ptr = tensor.data_ptr()
        with self._lock:
            i = bisect.bisect_right(self._starts, ptr) - 1
            return i >= 0 and ptr < self._starts[i] + max(1, self._sizes[self._starts[i]])

    def reset_peak(self) -> None:
        with self._lock:
            self.peak_bytes = self.used_bytes

    def alloc_host(self, nbytes: int, pin: bool) -> tuple[torch.Tensor, bool]:
        if pin:
            try:  # asked of the pinned-memory gate first (pin_gate.py); None: refused
                buf = pin_host(nbytes, lambda: torch.empty(nbytes, dtype=torch.uint8, pin_memory=True))
                if buf is not None:
                    return buf, True
            except RuntimeError:
                pass
        return torch.empty(nbytes, dtype=torch.uint8), False

    def mem_get_info(self) -> tuple[int, int]:
        with self._lock:
            return self.capacity_bytes - self.used_bytes, self.capacity_bytes

    # copies and events --------------------------------------------------------
    def copy_h2d(self, dst: torch.Tensor, src: torch.Tensor, after: Any = None) -> SimEvent:
        # An unthrottled copy engine with nothing queued runs the copy at once on the caller's thread: same order,
        # same bytes, no thread handoff (which costs more than a small copy). Throttled devices always queue.
        if not self._throttled and self._queued == 0 and (after is None or after.is_set()):
            start = time.perf_counter()
            try:
                copy_bytes(dst, src)
            except BaseException as exc:  # reported where the copy is waited for, as a queued copy's would be
                event = SimEvent(start)
                event.error = exc
                return event
            event = SimEvent(time.perf_counter())
            event.start = start
            return event
        event = SimEvent()
        self._enqueue((dst, src, after, event))
        return event

    def then(self, event: SimEvent, fn: Callable[[], None]) -> SimEvent:
        """`fn` (a decode) on the copy engine after the copy behind `event`; the event spans both."""
        if not self._throttled and self._queued == 0 and event.is_set():
            done = SimEvent(event.start)
            done.error = event.error
            if done.error is None:
                try:
                    fn()
                except BaseException as exc:  # reported where the decode is waited for
                    done.error = exc
            done.time = time.perf_counter()
            return done
        done = SimEvent()
        self._enqueue((None, fn, event, done))
        return done

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            dst, src, after, event = item
            try:
                if after is not None:
                    after.wait()
                start = time.perf_counter()
                if dst is None:  # a decode queued behind its copy (`then`): on the device, not over the bus
                    if after is not None and after.error is not None:
                        raise after.error
                    src()
                    event.set(after.start if after is not None else start, time.perf_counter())
                    continue
                copy_bytes(dst, src)
                if self.bandwidth_gbps or self.latency_us:
                    target = self.latency_us * 1e-6
                    if self.bandwidth_gbps:
                        target += src.numel() * src.element_size() / (self.bandwidth_gbps * 1e9)
                    remaining = start + target - time.perf_counter()
                    if remaining > 0:
                        time.sleep(remaining)
                event.set(start, time.perf_counter())
            except BaseException as exc:  # never leave a waiter hanging; the waiter re-raises
                event.error = exc
                now = time.perf_counter()
                event.set(now, now)
            finally:
                del item, dst, src, after  # the idle thread must not keep the last buffers alive
                with self._lock:
                    self._queued -= 1
                self._queue.task_done()

    def wait(self, event: SimEvent) -> float:
        start = time.perf_counter()
        event.wait()
        if event.error is not None:
            raise RuntimeError(f"simulated host-to-device copy failed: {event.error}") from event.error
        return time.perf_counter() - start

    def record(self) -> SimEvent:
        return SimEvent(time.perf_counter())

    def is_done(self, event: SimEvent) -> bool:
        return event.is_set()

    def elapsed_ms(self, start: SimEvent, end: SimEvent) -> float:
        return (end.time - start.time) * 1e3

    def copy_span_ms(self, event: SimEvent) -> float:
        return (event.time - event.start) * 1e3

    def synchronize(self) -> None:
        self._queue.join()

    def event_synchronize(self, event: SimEvent) -> None:
        event.wait()

    def h2d_gbps(self, pinned: bool = True) -> float | None:
        """The bandwidth limit, or the host's memcpy speed where it is lower (or no limit is set); measured once."""
        if self._memcpy_gbps is None:
            n = 64 << 20
            src, dst = torch.empty(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
            copy_bytes(dst, src)  # first touch of fresh pages
            best = min(_timed_copy(dst, src) for _ in range(3))
            self._memcpy_gbps = n / max(best, 1e-9) / 1e9
        return min(self._memcpy_gbps, self.bandwidth_gbps) if self.bandwidth_gbps else self._memcpy_gbps

    def describe(self) -> str:
        bw = f", {self.bandwidth_gbps} GB/s" if self.bandwidth_gbps else ""
        name = "sim" if self.index == 0 else f"sim:{self.index}"
        return f"{name} ({self.capacity_bytes / (1 << 30):.2f} GiB{bw})"
