"""The Backend protocol: the only surface through which the engine touches a device."""
from __future__ import annotations

import abc
from typing import Any, Callable

import torch

from .clock import WALL_CLOCK, Clock


class Backend(abc.ABC):
    """A device the engine streams to: allocation, async host-to-device copies, events, memory info."""

    name: str = "base"
    device: torch.device
    supports_pinned_host: bool = False  # host buffers can be pinned (else pageable units copy straight)
    supports_peer_to_peer: bool = False  # tensors move straight to another device of this kind (else through host)
    clock: Clock = WALL_CLOCK  # what host work before a copy is timed on (clock.py; the simulated device's own
    # clock in sim_clock.py)

    @abc.abstractmethod
    def alloc(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 device buffer; raises torch.OutOfMemoryError when the device is full."""

    @abc.abstractmethod
    def release(self, buf: torch.Tensor) -> None:
        """Give a buffer from `alloc` back (the caller drops its views)."""

    @abc.abstractmethod
    def alloc_host(self, nbytes: int, pin: bool) -> tuple[torch.Tensor, bool]:
        """A flat uint8 host buffer, pinned when asked and possible; returns (buffer, pinned)."""

    def register_host(self, buf: torch.Tensor) -> "Callable[[], None] | None":
        """Pin host memory the engine did not allocate (a mapping other processes share), read-only, for this
        device; returns the call that unregisters it, or None where it cannot be pinned (copies then come from
        pageable memory). Asked of the pin gate first (offload/backends/pin_gate.py)."""
        return None

    @abc.abstractmethod
    def copy_h2d(self, dst: torch.Tensor, src: torch.Tensor, after: Any = None) -> Any:
        """Queue dst.copy_(src) on the transfer stream after event `after`; returns its completion event."""

    def copy_d2h(self, dst: torch.Tensor, src: torch.Tensor, after: Any = None) -> Any:
        """Queue a device-to-host copy (KV pages going to host memory) on the transfer stream after `after`.

        Weights never take this path: their host copy is the truth. The same stream and ordering as copy_h2d.
        """
        return self.copy_h2d(dst, src, after)

    def then(self, event: Any, fn: Callable[[], None]) -> Any:
        """Run `fn` (device ops: a decode into the slot) on the transfer stream after the copy behind `event`;
        returns an event that completes after `fn` and spans the copy and `fn` (`copy_span_ms`). This default
        runs it on the host once the copy is done."""
        self.event_synchronize(event)
        fn()
        return event

    @abc.abstractmethod
    def wait(self, event: Any) -> float:
        """Make the compute stream wait for `event`; returns seconds the host was blocked (0 when GPU-side)."""

    @abc.abstractmethod
    def record(self) -> Any:
        """An event recorded on the compute stream now (used as 'slot free' and for timing)."""

    @abc.abstractmethod
    def is_done(self, event: Any) -> bool:
        """Whether an event has completed, without blocking."""

    @abc.abstractmethod
    def elapsed_ms(self, start: Any, end: Any) -> float:
        """Milliseconds between two completed events (may be negative if `end` came first)."""

    @abc.abstractmethod
    def copy_span_ms(self, event: Any) -> float:
        """Milliseconds the copy behind a `copy_h2d` event took on the transfer stream."""

    @abc.abstractmethod
    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) device bytes."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Wait for every queued copy and compute."""

    @abc.abstractmethod
    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether a tensor lives in this device's memory."""

    def empty_cache(self) -> None:
        """Return cached, unused device memory to the driver (a no-op where there is no cache)."""

    def release_host_cache(self) -> None:
        """Return cached, unused pinned host memory to the OS (a no-op where there is no cache): RAM given back must
        leave the process, not wait in an allocator's cache."""

    def peak_allocated(self) -> int | None:
        """Peak bytes allocated on the device by anything in this process (activations included), if known."""
        return None

    def reset_peak_allocated(self) -> None:
        """Start measuring `peak_allocated` afresh (before the run whose activation peak is wanted)."""

    def reset_peak(self) -> None:
        """Start the engine's own peak accounting afresh."""

    def h2d_gbps(self, pinned: bool = True) -> float | None:
        """Host-to-device copy speed in GB/s (1e9 bytes) from pinned or pageable host memory, measured once where it
        must be (what `offload.predict` costs a streamed block's copy at); None where unknown."""
        return None

    def event_synchronize(self, event: Any) -> None:
        """Block the host until `event` completes."""
        while not self.is_done(event):
            self.synchronize()

    def move_to(self, tensor: torch.Tensor, other: "Backend") -> torch.Tensor:
        """An activation moved from this device to `other` (peer to peer where both allow it, else through host
        memory); the caller's compute stream orders it."""
        if tensor.device == other.device:
            return tensor
        if self.supports_peer_to_peer and other.supports_peer_to_peer:
            return tensor.to(other.device, non_blocking=True)
        return tensor.to("cpu").to(other.device, non_blocking=True)

    def describe(self) -> str:
        return self.name
