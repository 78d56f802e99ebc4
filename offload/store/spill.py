"""Where a compressed unit's tensors point between passes: a private map of a spill file the engine writes once.

A unit held compressed in RAM has no raw host copy, yet its modules must hold ordinary tensors between passes
(`state_dict()`, a patch computing from the weight, `detach()` read them). Its raw bytes are written once, while
staging, to an unnamed temporary file on disk, and the modules view a copy-on-write map of it: the pages stay on
disk until something reads them outside a pass (the page cache then holds them as reclaimable memory), and a
write lands in private pages, never in the file. The directory: `LAYER_OFFLOAD_SPILL_DIR`, else the system's
temporary directory unless it lives in RAM (tmpfs), then /var/tmp.
"""
from __future__ import annotations

import mmap
import os
import tempfile
import threading
import weakref
from pathlib import Path

import torch

PAGE = mmap.ALLOCATIONGRANULARITY
_RAM_FILESYSTEMS = {"tmpfs", "ramfs"}


def _filesystem_of(path: str) -> str | None:
    """The filesystem type of the mount holding `path` (Linux; None elsewhere or when unknown)."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    best, kind = "", None
    real = os.path.realpath(path)
    for line in lines:
        left, _, right = line.partition(" - ")
        fields = left.split()
        if len(fields) < 5 or not right:
            continue
        mount = fields[4]
        if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
            best, kind = mount, right.split()[0]
    return kind


def spill_dir() -> str:
    """The directory spill files go to (see the module docstring)."""
    chosen = os.environ.get("LAYER_OFFLOAD_SPILL_DIR")
    if chosen:
        return chosen
    tmp = tempfile.gettempdir()
    if _filesystem_of(tmp) in _RAM_FILESYSTEMS and os.path.isdir("/var/tmp"):
        return "/var/tmp"
    return tmp


def spill_in_ram(directory: str | None = None) -> bool:
    """Whether the spill directory lives in RAM (then a spilled unit costs RAM after all)."""
    return _filesystem_of(directory or spill_dir()) in _RAM_FILESYSTEMS


def release_free_heap() -> None:
    """Hand the heap memory freed after encoding back to the OS (glibc keeps freed blocks of a few MB in its heap:
    the encoder's transient buffers would otherwise stay in the process's resident set). A no-op elsewhere."""
    try:
        import ctypes
        import ctypes.util

        name = ctypes.util.find_library("c")
        if name and "libc" in name:
            libc = ctypes.CDLL(name)
            if hasattr(libc, "malloc_trim"):
                libc.malloc_trim(0)
    except OSError:  # no C library to ask
        pass


class SpillFile:
    """An unnamed temporary file that units' raw bytes are appended to; each is mapped back copy-on-write."""

    def __init__(self, directory: str | None = None) -> None:
        self.directory = directory or spill_dir()
        self._file = tempfile.TemporaryFile(prefix="layer-offload-spill-", dir=self.directory)
        self.size = 0
        self._lock = threading.Lock()  # staging's workers spill units side by side
        self._close = weakref.finalize(self, self._file.close)

    def put(self, raw: torch.Tensor) -> torch.Tensor:
        """Write `raw` (uint8, CPU) at the end of the file and return a copy-on-write map of those bytes."""
        n = int(raw.numel())
        with self._lock:  # each unit its own range: the writes then go side by side
            offset = -(-self.size // PAGE) * PAGE
            self.size = offset + n
        data = memoryview(raw.contiguous().numpy()).cast("B")
        fd = self._file.fileno()
        done = 0
        if hasattr(os, "pwrite"):
            while done < n:
                done += os.pwrite(fd, data[done:], offset + done)
        else:  # Windows
            self._file.seek(offset)
            self._file.write(data)
            self._file.flush()
        if n == 0:
            return torch.empty(0, dtype=torch.uint8)
        view = mmap.mmap(fd, n, access=mmap.ACCESS_COPY, offset=offset)
        return torch.frombuffer(view, dtype=torch.uint8)  # the tensor keeps the map alive

    def close(self) -> None:
        """Close the file (the maps handed out stay valid until their tensors go)."""
        self._close()
