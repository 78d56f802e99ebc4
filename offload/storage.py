"""Where a unit's host bytes come from when they are not in a pinned buffer: a safetensors file or pageable RAM.

The disk tier reads a unit's tensors straight from the model's safetensors file (through a private mmap, no
second copy in RAM) into a pinned bounce buffer on a read-ahead thread, then queues the bounce-to-device copy;
the unit's parameters view that mapping between forwards. Pageable RAM goes through the same
bounce path on devices with pinned memory, so its copies stay asynchronous.
"""
from __future__ import annotations

import atexit
import json
import logging
import mmap
import os
import queue
import struct
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from .staging import TensorLayout

log = logging.getLogger(__name__)

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "C64": torch.complex64, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
}


class CorruptFileError(ValueError):
    """A safetensors file that is truncated, corrupt or does not match the model: names the file."""


@dataclass(frozen=True)
class FileTensor:
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int


class SafetensorsFile:
    """A validated safetensors header plus positional reads and a read-only mmap of the data."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.tensors = self._read_header()
        self._fd = os.open(self.path, os.O_RDONLY)
        self._mmap: mmap.mmap | None = None
        self._flat: torch.Tensor | None = None

    def _fail(self, why: str) -> CorruptFileError:
        return CorruptFileError(f"{self.path}: truncated or corrupt safetensors file ({why})")

    def _read_header(self) -> dict[str, FileTensor]:
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise self._fail(f"only {size} bytes")
                (n,) = struct.unpack("<Q", head)
                if n <= 0 or 8 + n > size:
                    raise self._fail(f"header of {n} bytes does not fit a {size}-byte file")
                header = json.loads(f.read(n))
        except OSError as exc:
            raise CorruptFileError(f"{self.path}: cannot read safetensors file: {exc}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise self._fail(f"header is not JSON: {exc}") from None
        if not isinstance(header, dict):
            raise self._fail("header is not a JSON object")
        base = 8 + n
        out: dict[str, FileTensor] = {}
        for key, info in header.items():
            if key == "__metadata__":
                continue
            try:
                dtype = _DTYPES[info["dtype"]]
                shape = tuple(int(d) for d in info["shape"])
                begin, end = (int(o) for o in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise self._fail(f"bad entry for {key!r}: {info!r}") from None
            numel = 1
            for d in shape:
                numel *= d
            if end - begin != numel * dtype.itemsize or begin < 0:
                raise self._fail(f"{key!r} spans {end - begin} bytes but {shape} x {dtype} needs "
                                 f"{numel * dtype.itemsize}")
            if base + end > size:
                raise self._fail(f"{key!r} ends at byte {base + end} but the file has {size} bytes")
            out[key] = FileTensor(dtype, shape, base + begin, base + end)
        return out

    def match(self, names: list[str], tensors: list[torch.Tensor]) -> list[str]:
        """The file keys for the model's tensor names (a common key prefix is detected); checks dtype/shape."""
        if not names:
            return []
        prefix = None
        for cand in self._prefixes(names[0]):
            if all(cand + n in self.tensors for n in names):
                prefix = cand
                break
        if prefix is None:
            missing = [n for n in names if not any(p + n in self.tensors for p in self._prefixes(names[0]))]
            raise CorruptFileError(f"{self.path}: does not hold the model's weights; missing e.g. "
                                   f"{missing[:3]} (file has e.g. {list(self.tensors)[:3]})")
        keys = [prefix + n for n in names]
        for key, t in zip(keys, tensors):
            ft = self.tensors[key]
            if ft.dtype != t.dtype or tuple(ft.shape) != tuple(t.shape):
                raise CorruptFileError(f"{self.path}: {key!r} is {tuple(ft.shape)} {ft.dtype} in the file but "
                                       f"{tuple(t.shape)} {t.dtype} in the model; bytes stream as stored, so "
                                       f"the file must match the model's dtype")
        return keys

    def _prefixes(self, name: str) -> list[str]:
        found = [""]
        for key in self.tensors:
            if key.endswith("." + name):
                found.append(key[: -len(name)])
        return found

    def flat(self) -> torch.Tensor:
        """The whole file as a uint8 tensor backed by a private mmap (page cache, not process RAM)."""
        if self._flat is None:
            # Private copy-on-write mapping: a write through a parameter view (load_state_dict) lands in
            # process memory instead of crashing on a read-only page, and the file is never modified.
            self._mmap = mmap.mmap(self._fd, 0, access=mmap.ACCESS_COPY)
            self._flat = torch.frombuffer(self._mmap, dtype=torch.uint8)
        return self._flat

    def aligned(self, key: str) -> bool:
        """Whether a tensor's offset allows a zero-copy view of its dtype."""
        ft = self.tensors[key]
        return ft.start % ft.dtype.itemsize == 0

    def view(self, key: str) -> torch.Tensor:
        """A zero-copy view of one tensor (a private copy if its offset is misaligned for the dtype)."""
        ft = self.tensors[key]
        raw = self.flat()[ft.start:ft.end]
        if ft.start % ft.dtype.itemsize:
            raw = raw.clone()
        return raw.view(ft.dtype).view(ft.shape)

    def read_into(self, dst: torch.Tensor, pieces: list[tuple[str, int]]) -> int:
        """Copy (key, dst_offset) tensors from the mapping into a flat uint8 `dst`; returns bytes read.

        Reading through the mapping (not the file descriptor) means bytes written in place through a
        parameter view (copy-on-write pages) are what streams next.
        """
        flat = self.flat()
        total = 0
        for key, off in pieces:
            ft = self.tensors[key]
            n = ft.end - ft.start
            if self._mmap is not None and hasattr(self._mmap, "madvise"):
                start = ft.start // mmap.PAGESIZE * mmap.PAGESIZE
                self._mmap.madvise(mmap.MADV_WILLNEED, start, ft.end - start)
            dst[off:off + n].copy_(flat[ft.start:ft.end])
            total += n
        return total

    def close(self) -> None:
        self._flat = None
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:  # views still alive; the mapping goes with them
                pass
            self._mmap = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


_live_readers: "weakref.WeakSet[BounceReader]" = weakref.WeakSet()


@atexit.register
def _stop_readers() -> None:
    # A daemon thread killed in the middle of a copy at interpreter exit aborts the process.
    for reader in list(_live_readers):
        reader.close()


class DeferredCopy:
    """A copy whose device event exists only once the read-ahead thread has filled its bounce buffer."""

    __slots__ = ("_done", "event", "error")

    def __init__(self) -> None:
        self._done = threading.Event()
        self.event: Any = None
        self.error: BaseException | None = None

    def resolve(self) -> Any:
        self._done.wait()
        if self.error is not None:
            raise self.error
        return self.event


class BounceReader:
    """Read-ahead thread: fills pinned bounce buffers (from disk or pageable RAM) and queues their copies."""

    def __init__(self, backend: Any, bounce_bytes: int, count: int) -> None:
        self.backend = backend
        self.bounce_bytes = bounce_bytes
        self._free: queue.Queue = queue.Queue()
        self.pinned = True
        for _ in range(max(1, count)):
            buf, pinned = backend.alloc_host(bounce_bytes, True)
            self.pinned &= pinned
            self._free.put((buf, None))
        self._jobs: queue.Queue = queue.Queue()
        self.bytes_read = 0
        self.reads = 0
        self._thread = threading.Thread(target=self._run, name="offload-read-ahead", daemon=True)
        self._thread.start()
        _live_readers.add(self)

    def submit(self, fill: Callable[[torch.Tensor], int], nbytes: int, dst: torch.Tensor, after: Any) -> DeferredCopy:
        job = DeferredCopy()
        self._jobs.put((fill, nbytes, dst, after, job))
        return job

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                self._jobs.task_done()
                return
            fill, nbytes, dst, after, job = item
            try:
                buf, last = self._free.get()
                if last is not None:
                    self.backend.event_synchronize(last)  # its previous copy must have left the bounce
                self.bytes_read += fill(buf)
                self.reads += 1
                event = self.backend.copy_h2d(dst[:nbytes], buf[:nbytes], after)
                self._free.put((buf, event))
                job.event = event
            except BaseException as exc:  # surfaced to the forward that waits for this unit
                job.error = exc
            finally:
                job._done.set()
                del item, fill, dst, after, job  # the idle thread must not keep the last buffers alive
                self._jobs.task_done()

    def drain(self) -> None:
        """Wait until every submitted read has been done and its copy queued."""
        self._jobs.join()

    def close(self) -> None:
        """Finish queued reads and stop the thread (nothing may read a mapping after it is closed)."""
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()


class DiskSource:
    """A disk-tier unit: its tensors read from the safetensors file on each streamed use."""

    tier = "disk"

    def __init__(self, file: SafetensorsFile, layout: TensorLayout, keys: list[str], reader: BounceReader) -> None:
        self.file = file
        self.layout = layout
        self.reader = reader
        self.pieces = [(k, leaf.offset) for k, leaf in zip(keys, layout.leaves)]
        self.keys = keys
        self.reads = 0

    def _fill(self, buf: torch.Tensor) -> int:
        self.reads += 1
        return self.file.read_into(buf, self.pieces)

    def issue(self, backend: Any, dst: torch.Tensor, after: Any) -> DeferredCopy:
        return self.reader.submit(self._fill, self.layout.nbytes, dst, after)


class PageableSource:
    """A pageable-RAM unit on a device with pinned memory: bounced through a pinned buffer to stay async."""

    tier = "pageable"

    def __init__(self, host: torch.Tensor, reader: BounceReader) -> None:
        self.host = host
        self.reader = reader

    def _fill(self, buf: torch.Tensor) -> int:
        buf[:self.host.numel()].copy_(self.host)
        return 0

    def issue(self, backend: Any, dst: torch.Tensor, after: Any) -> DeferredCopy:
        return self.reader.submit(self._fill, self.host.numel(), dst, after)


def resolve(copy: Any) -> Any:
    """The device event behind a copy, waiting for the read-ahead thread when it is deferred."""
    return copy.resolve() if isinstance(copy, DeferredCopy) else copy
