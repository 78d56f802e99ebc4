"""Where a unit's bytes come from when they move to the device: one `UnitSource` protocol, three sources, and the
read-ahead thread two of them use.

- `HostSource`: the unit's flat host buffer (pinned, or pageable where the device has no pinned memory), copied
  straight to the slot on the transfer stream.
- `BouncedSource`: a pageable host buffer on a device with pinned memory, copied into a pinned bounce buffer on
  the read-ahead thread first, so the copy to the device stays asynchronous.
- `DiskSource`: the unit's tensors read from the model's file (`storage.SafetensorsFile`, or a packed folder with
  its interface) into a bounce buffer.
"""
from __future__ import annotations

import queue
import threading
import weakref
from typing import Any, Callable, Protocol

import torch

from ..model.layout import Leaf
from .storage import SafetensorsFile


# ----------------------------------------------------------------------------------------------------------------
# the read-ahead thread
# ----------------------------------------------------------------------------------------------------------------


class DeferredCopy:
    """A copy whose device event exists only once the read-ahead thread has filled its bounce buffer."""

    __slots__ = ("_done", "event", "error", "then")

    def __init__(self, then: Callable[[Any], Any] | None = None) -> None:
        self._done = threading.Event()
        self.event: Any = None
        self.error: BaseException | None = None
        self.then = then  # queued on the transfer stream after the last range's copy (a decode); its event is the job's

    def resolve(self) -> Any:
        self._done.wait()
        if self.error is not None:
            raise self.error
        return self.event


def resolve(copy: Any) -> Any:
    """The device event behind a copy, waiting for the read-ahead thread when it is deferred."""
    return copy.resolve() if isinstance(copy, DeferredCopy) else copy


class ReadCounters:
    """What the read-ahead thread did: bounce fills and bytes read from files."""

    __slots__ = ("reads", "bytes_read")

    def __init__(self) -> None:
        self.reads = 0
        self.bytes_read = 0


def _read_ahead(jobs: queue.Queue, free: queue.Queue, backend: Any, counters: ReadCounters) -> None:
    # The thread holds only the queues, never the reader: dropping a model stops it (see BounceReader).
    # A job is one unit's bytes in one or more ranges (a bounce buffer smaller than the unit); its copy is
    # done when the copy of its last range is, since copies run in order on the transfer stream.
    while True:
        item = jobs.get()
        if item is None:
            jobs.task_done()
            return
        fill, start, end, dst, after, job, last = item
        try:
            if job.error is None:  # an earlier range of this unit failed: skip the rest
                buf, prev = free.get()
                try:
                    if prev is not None:
                        backend.event_synchronize(prev)  # its previous copy must have left the bounce buffer
                    counters.bytes_read += fill(buf, start, end)
                    event = backend.copy_h2d(dst[start:end], buf[:end - start], after)
                except BaseException:
                    free.put((buf, None))
                    raise
                free.put((buf, event))
                job.event = event
                if last:
                    counters.reads += 1
                    if job.then is not None:
                        job.event = job.then(event)
        except BaseException as exc:  # surfaced to the forward that waits for this unit
            job.error = exc
        finally:
            if last:
                job._done.set()
            del item, fill, dst, after, job  # the idle thread must not keep the last buffers alive
            jobs.task_done()


def _stop_read_ahead(jobs: queue.Queue, thread: threading.Thread) -> None:
    jobs.put(None)
    if thread is not threading.current_thread():
        thread.join()  # a daemon thread killed in the middle of a copy at interpreter exit aborts the process


class BounceReader:
    """Read-ahead thread: fills pinned bounce buffers (from disk or pageable RAM) and queues their copies."""

    def __init__(self, backend: Any, bounce_bytes: int, count: int) -> None:
        self.clock = backend.clock  # what the sources' reads are timed on (backends/clock.py)
        self.bounce_bytes = bounce_bytes
        self.count = max(1, count)
        self.counters = ReadCounters()
        self._free: queue.Queue = queue.Queue()
        self.pinned = True
        for _ in range(max(1, count)):
            buf, pinned = backend.alloc_host(bounce_bytes, True)
            self.pinned &= pinned
            self._free.put((buf, None))
        self._scratch = torch.empty(0, dtype=torch.uint8)  # the read-ahead thread's: casts read into it
        self._jobs: queue.Queue = queue.Queue()
        thread = threading.Thread(target=_read_ahead, args=(self._jobs, self._free, backend, self.counters),
                                  name="offload-read-ahead", daemon=True)
        thread.start()
        self._stop = weakref.finalize(self, _stop_read_ahead, self._jobs, thread)  # also runs at exit

    def submit(self, fill: Callable[[torch.Tensor, int, int], int], nbytes: int, dst: torch.Tensor,
               after: Any, then: Callable[[Any], Any] | None = None) -> DeferredCopy:
        """Queue `nbytes` into `dst` after event `after`, in ranges of at most one bounce buffer each:
        `fill(buf, start, end)` puts the bytes [start, end) into `buf` and returns the bytes it read from files;
        `then(copy event)` (a decode) is queued after the last copy and gives the job's event."""
        if not self._stop.alive:
            raise RuntimeError("the read-ahead thread was stopped (the model was detached)")
        job = DeferredCopy(then)
        step = self.bounce_bytes
        starts = list(range(0, nbytes, step)) or [0]
        for k, start in enumerate(starts):
            self._jobs.put((fill, start, min(nbytes, start + step), dst, after, job, k == len(starts) - 1))
        self.clock.hand_off(job._done.wait)  # the wall clock lets it run ahead; a simulated one waits for it
        return job

    def scratch(self, nbytes: int) -> torch.Tensor:
        """`nbytes` of scratch for the read-ahead thread (grown when asked for more; only that thread uses it)."""
        if self._scratch.numel() < nbytes:
            self._scratch = torch.empty(nbytes, dtype=torch.uint8)
        return self._scratch[:nbytes]

    @property
    def scratch_bytes(self) -> int:
        return int(self._scratch.numel())

    def drain(self) -> None:
        """Wait until every submitted read has been done and its copy queued."""
        self._jobs.join()

    def close(self) -> None:
        """Finish queued reads and stop the thread (nothing may read a file after it is closed)."""
        self._stop()


CAST_CHUNK = 1 << 20  # file bytes a cast reads at a time (the read-ahead thread's scratch holds this much)


def cast_scratch_bytes(file_bytes: int) -> int:
    """Host bytes of the read-ahead thread's cast scratch for a largest cast tensor of `file_bytes` in the file."""
    return min(CAST_CHUNK, file_bytes)


def read_cast(file: Any, key: str, leaf: Leaf, cast: torch.dtype, buf: torch.Tensor, start: int, end: int,
              scratch: Callable[[int], torch.Tensor]) -> int:
    """The part of a cast leaf that lies in the unit's bytes [start, end), read from the file's `key` (stored as
    `cast`) and cast into `buf` (which holds those bytes); returns the bytes read from the file. At most
    CAST_CHUNK file bytes are read at a time, into `scratch(n)`."""
    out_size, in_size = leaf.dtype.itemsize, cast.itemsize
    lo, hi = max(start, leaf.offset), min(end, leaf.offset + leaf.nbytes)
    if lo >= hi:
        return 0
    first, last = (lo - leaf.offset) // out_size, (hi - leaf.offset) // out_size
    step = max(1, CAST_CHUNK // in_size)
    done = 0
    for e0 in range(first, last, step):
        e1 = min(last, e0 + step)
        raw = scratch((e1 - e0) * in_size)
        done += file.read_range(raw, [(key, 0)], e0 * in_size, e1 * in_size)
        at = leaf.offset + e0 * out_size - start
        buf[at:at + (e1 - e0) * out_size].view(leaf.dtype).copy_(raw.view(cast))
    return done


# ----------------------------------------------------------------------------------------------------------------
# unit sources
# ----------------------------------------------------------------------------------------------------------------


class UnitSource(Protocol):
    """Where one unit's bytes come from; `issue` queues their copy into a device buffer after event `after`."""

    tier: str  # pinned | pageable | disk
    nbytes: int
    reads: int  # times the bytes were read into a bounce buffer (disk, bounced pageable RAM)
    read_ms: float  # time spent reading them into bounce buffers, in all (before each copy could start)

    def issue(self, dst: torch.Tensor, after: Any) -> Any: ...


class HostSource:
    """A host buffer copied straight to the device (pinned; or pageable where the device has no pinned memory)."""

    reads = 0
    read_ms = 0.0

    def __init__(self, host: torch.Tensor, pinned: bool, backend: Any) -> None:
        self.host = host
        self.nbytes = host.numel()
        self.tier = "pinned" if pinned else "pageable"
        self.backend = backend

    def issue(self, dst: torch.Tensor, after: Any) -> Any:
        return self.backend.copy_h2d(dst[:self.nbytes], self.host, after)


class BouncedSource:
    """Pageable RAM on a device with pinned memory: bounced through a pinned buffer so the copy stays async."""

    tier = "pageable"

    def __init__(self, host: torch.Tensor, reader: BounceReader) -> None:
        self.host = host
        self.nbytes = host.numel()
        self.reader = reader
        self.reads = 0
        self.read_ms = 0.0  # time the read-ahead thread spent filling bounce buffers with this unit's bytes

    def _fill(self, buf: torch.Tensor, start: int, end: int) -> int:
        _, ms = self.reader.clock.timed("bounce", end - start, lambda: buf[:end - start].copy_(self.host[start:end]))
        self.read_ms += ms
        return 0

    def issue(self, dst: torch.Tensor, after: Any) -> DeferredCopy:
        self.reads += 1
        return self.reader.submit(self._fill, self.nbytes, dst, after)


class DiskSource:
    """A disk-tier unit: its tensors read from the safetensors file on each streamed use; a leaf that is a cast of
    the file's tensor (`casts`: the file's dtype) is read in pieces into the read-ahead thread's scratch and cast
    into the bounce buffer there, where its bytes arrive (`read_cast`); a leaf the file lacks (key None) is copied
    from the unit's residue in RAM (`residue`: (offset in the unit, its bytes)), not counted as read."""

    tier = "disk"

    def __init__(self, file: SafetensorsFile, keys: list[Any], leaves: list[Leaf], nbytes: int,
                 reader: BounceReader, casts: tuple | None = None,
                 residue: list[tuple[int, torch.Tensor]] | None = None) -> None:
        self.file = file
        self.reader = reader
        self.nbytes = nbytes
        casts = casts or (None,) * len(keys)
        self.pieces = [(k, leaf.offset) for k, leaf, c in zip(keys, leaves, casts) if c is None and k is not None]
        self.cast_pieces = [(k, leaf, c) for k, leaf, c in zip(keys, leaves, casts) if c is not None]
        self.residue = list(residue or [])
        self.reads = 0
        self.read_ms = 0.0  # time the read-ahead thread spent reading this unit's bytes from the file

    def _fill(self, buf: torch.Tensor, start: int, end: int) -> int:
        def read() -> int:
            if start == 0 and end == self.nbytes:
                n = self.file.read_into(buf, self.pieces)
            else:
                n = self.file.read_range(buf, self.pieces, start, end)
            for key, leaf, cast in self.cast_pieces:
                n += read_cast(self.file, key, leaf, cast, buf, start, end, self.reader.scratch)
            for off, raw in self.residue:  # the leaves the file lacks: their RAM copy
                lo, hi = max(start, off), min(end, off + raw.numel())
                if lo < hi:
                    buf[lo - start:hi - start].copy_(raw[lo - off:hi - off])
            return n

        n, ms = self.reader.clock.timed("disk", self._file_bytes(start, end), read)
        self.read_ms += ms
        return n

    def _file_bytes(self, start: int, end: int) -> int:
        """The file bytes a read of the unit's bytes [start, end) takes: a cast leaf's part at its file dtype's
        size (a bf16 file read for fp8 weights: twice the bytes)."""
        extra = 0
        for _, leaf, cast in self.cast_pieces:
            lo, hi = max(start, leaf.offset), min(end, leaf.offset + leaf.nbytes)
            if lo < hi:
                extra += (hi - lo) // leaf.dtype.itemsize * cast.itemsize - (hi - lo)
        for off, raw in self.residue:  # copied from RAM, not read
            lo, hi = max(start, off), min(end, off + raw.numel())
            extra -= max(0, hi - lo)
        return max(0, end - start + extra)

    def issue(self, dst: torch.Tensor, after: Any) -> DeferredCopy:
        self.reads += 1
        return self.reader.submit(self._fill, self.nbytes, dst, after)


class SharedSource:
    """A shared unit copied to the device from the registered (pinned) shared mapping while this process has not
    written it; from its own copy-on-write view once it has (pageable, until `HostTiers.privatize` gives the unit
    a RAM master of its own at the next pass start)."""

    reads = 0
    read_ms = 0.0
    tier = "pinned"

    def __init__(self, unit: Any, backend: Any) -> None:  # a shared_host.SharedUnit
        self.unit = unit
        self.host = unit.host
        self.nbytes = unit.host.numel()
        self.backend = backend

    def issue(self, dst: torch.Tensor, after: Any) -> Any:
        src = self.host if self.unit.written() else self.unit.pinned_view
        return self.backend.copy_h2d(dst[:self.nbytes], src, after)
