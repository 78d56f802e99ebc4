"""CUDA (and ROCm through torch's HIP build): a copy stream, timing events, pinned host memory."""
from __future__ import annotations

import ctypes
import logging
from typing import Any, Callable

import torch

from .base import Backend
from .pin_gate import pin_host

log = logging.getLogger(__name__)

_HOST_REGISTER_PORTABLE = 0x01  # cudaHostRegisterPortable: pinned for every context
_HOST_REGISTER_READ_ONLY = 0x08  # cudaHostRegisterReadOnly: the device only reads it (a read-only shared mapping)


def _clear_last_error(cudart: Any) -> None:
    """A runtime call that failed leaves its error as the thread's last error, which torch's next kernel-launch
    check would raise as if that kernel had failed: read it back (resetting it) where the runtime can be reached."""
    get = getattr(cudart, "cudaGetLastError", None)
    try:
        if get is None:  # torch's bindings lack it: the very runtime torch loaded, by its path
            with open("/proc/self/maps") as maps:
                path = next((line.split()[-1] for line in maps if "libcudart" in line), None)
            get = ctypes.CDLL(path).cudaGetLastError if path else None
        if get is not None:
            get()
    except (OSError, AttributeError):
        pass


class CudaCopyEvent:
    """The two events bracketing one copy on the transfer stream."""

    __slots__ = ("start", "end")

    def __init__(self) -> None:
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)


class CudaBackend(Backend):
    """Streams on a dedicated copy stream; the compute stream waits GPU-side, never the host."""

    name = "cuda"
    supports_pinned_host = True

    def __init__(self, device: str = "cuda") -> None:
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} asked for, but this torch has no usable CUDA/ROCm device; "
                             f"valid here: 'sim' (the simulated device), or install a CUDA build of torch")
        dev = torch.device(device)
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        count = torch.cuda.device_count()
        if index >= count:
            raise ValueError(f"device {device!r} does not exist; valid: " +
                             ", ".join(f"cuda:{i}" for i in range(count)))
        self.device = torch.device("cuda", index)
        self.copy_stream = torch.cuda.Stream(self.device)
        # peer to peer when this card can reach every other card directly (else activations go through host)
        self.supports_peer_to_peer = all(torch.cuda.can_device_access_peer(index, other)
                                         for other in range(count) if other != index)
        self.used_bytes = 0
        self.peak_bytes = 0
        self._h2d: dict[bool, float] = {}  # measured host-to-device GB/s, pinned and pageable (h2d_gbps)

    def alloc(self, nbytes: int) -> torch.Tensor:
        buf = torch.empty(int(nbytes), dtype=torch.uint8, device=self.device)
        self.used_bytes += int(nbytes)
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)
        return buf

    def release(self, buf: torch.Tensor) -> None:
        self.used_bytes -= buf.numel()

    def reset_peak(self) -> None:
        self.peak_bytes = self.used_bytes

    def alloc_host(self, nbytes: int, pin: bool) -> tuple[torch.Tensor, bool]:
        if pin:
            try:  # asked of the pinned-memory gate first (pin_gate.py: ComfyUI's pin budget); None: refused
                buf = pin_host(nbytes, lambda: torch.empty(nbytes, dtype=torch.uint8, pin_memory=True))
                if buf is not None:
                    return buf, True
            except RuntimeError as exc:  # pin limit, locked-memory ulimit, WSL
                log.debug("pinning %d bytes refused: %s", nbytes, exc)
        return torch.empty(nbytes, dtype=torch.uint8), False

    def register_host(self, buf: torch.Tensor) -> Callable[[], None] | None:
        """cudaHostRegister, read-only (the pages stay shared with the other processes mapping them) and portable."""
        cudart = torch.cuda.cudart()
        ptr, nbytes = buf.data_ptr(), buf.numel() * buf.element_size()

        def register() -> torch.Tensor:
            err = cudart.cudaHostRegister(ptr, nbytes, _HOST_REGISTER_PORTABLE | _HOST_REGISTER_READ_ONLY)
            if int(err) != 0:
                _clear_last_error(cudart)
                raise RuntimeError(f"cudaHostRegister failed ({int(err)})")
            return buf

        try:
            if pin_host(nbytes, register) is None:
                return None  # the pin gate refused
        except RuntimeError as exc:
            log.info("pinning the shared host copy was refused (%s); it is copied from pageable memory", exc)
            return None
        return lambda: cudart.cudaHostUnregister(ptr)

    def copy_h2d(self, dst: torch.Tensor, src: torch.Tensor, after: Any = None) -> CudaCopyEvent:
        event = CudaCopyEvent()
        with torch.cuda.stream(self.copy_stream):
            if after is not None:
                self.copy_stream.wait_event(after.end if isinstance(after, CudaCopyEvent) else after)
            event.start.record(self.copy_stream)
            dst.copy_(src, non_blocking=True)
            event.end.record(self.copy_stream)
        return event

    def then(self, event: Any, fn: Callable[[], None]) -> CudaCopyEvent:
        done = CudaCopyEvent()
        with torch.cuda.stream(self.copy_stream):
            if isinstance(event, CudaCopyEvent):
                done.start = event.start  # the span covers the copy and the decode
            else:
                self.copy_stream.wait_event(event)
                done.start.record(self.copy_stream)
            fn()  # queued on the copy stream, after the copy (same stream, in order)
            done.end.record(self.copy_stream)
        return done

    def wait(self, event: Any) -> float:
        end = event.end if isinstance(event, CudaCopyEvent) else event
        torch.cuda.current_stream(self.device).wait_event(end)
        return 0.0

    def record(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def is_done(self, event: Any) -> bool:
        end = event.end if isinstance(event, CudaCopyEvent) else event
        return end.query()

    def elapsed_ms(self, start: Any, end: Any) -> float:
        s = start.end if isinstance(start, CudaCopyEvent) else start
        e = end.end if isinstance(end, CudaCopyEvent) else end
        return s.elapsed_time(e)

    def copy_span_ms(self, event: CudaCopyEvent) -> float:
        return event.start.elapsed_time(event.end)

    def event_synchronize(self, event: Any) -> None:
        (event.end if isinstance(event, CudaCopyEvent) else event).synchronize()

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def release_host_cache(self) -> None:
        """Pinned buffers freed go to torch's caching host allocator, not to the OS, until its cache is emptied
        (torch.accelerator.empty_host_cache; torch._C._host_emptyCache before it had a name; neither: nothing)."""
        empty = (getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
                 or getattr(torch._C, "_host_emptyCache", None))
        if empty is not None:
            empty()

    def peak_allocated(self) -> int | None:
        return int(torch.cuda.max_memory_allocated(self.device))

    def reset_peak_allocated(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def mem_get_info(self) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(self.device)
        return int(free), int(total)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def owns(self, tensor: torch.Tensor) -> bool:
        return tensor.device == self.device

    def h2d_gbps(self, pinned: bool = True) -> float | None:
        """Pinned (or pageable) host-to-device GB/s on the copy stream: the best of three 256 MiB copies, measured
        once per kind (about a tenth of a second)."""
        if pinned not in self._h2d:
            n = 256 << 20
            host, got_pinned = self.alloc_host(n, pinned)
            dev = self.alloc(n)
            try:
                best = float("inf")
                for _ in range(4):
                    event = self.copy_h2d(dev, host)
                    event.end.synchronize()
                    best = min(best, self.copy_span_ms(event))
            finally:
                self.release(dev)
                del host, dev
            self._h2d[got_pinned] = n / (best * 1e6)
            if got_pinned != pinned:  # pinning refused: what a pinned copy would reach is not known here
                return self._h2d[got_pinned]
        return self._h2d[pinned]

    def describe(self) -> str:
        return f"{self.device} ({torch.cuda.get_device_name(self.device)})"
