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
    """Unnamed temporary files that units' raw bytes are appended to; each is mapped back copy-on-write. Each thread
    that spills (staging's workers) appends to a file of its own: writes into one file serialize on its inode."""

    def __init__(self, directory: str | None = None) -> None:
        self.directory = directory or spill_dir()
        self._files: dict[int, list] = {}  # thread id -> [file, size]
        self._lock = threading.Lock()
        self._close = weakref.finalize(self, _close_all, self._files)

    @property
    def size(self) -> int:
        return sum(f[1] for f in self._files.values())

    def _mine(self) -> list:
        key = threading.get_ident()
        with self._lock:
            found = self._files.get(key)
            if found is None:
                found = self._files[key] = [tempfile.TemporaryFile(prefix="layer-offload-spill-",
                                                                   dir=self.directory), 0]
            return found

    def put(self, raw: torch.Tensor) -> torch.Tensor:
        """Write `raw` (uint8, CPU) at the end of this thread's file and return a copy-on-write map of those bytes."""
        n = int(raw.numel())
        mine = self._mine()
        file = mine[0]
        offset = -(-mine[1] // PAGE) * PAGE
        mine[1] = offset + n
        data = memoryview(raw.contiguous().numpy()).cast("B")
        fd = file.fileno()
        done = 0
        if hasattr(os, "pwrite"):
            while done < n:
                done += os.pwrite(fd, data[done:], offset + done)
        else:  # Windows
            file.seek(offset)
            file.write(data)
            file.flush()
        if n == 0:
            return torch.empty(0, dtype=torch.uint8)
        view = mmap.mmap(fd, n, access=mmap.ACCESS_COPY, offset=offset)
        return torch.frombuffer(view, dtype=torch.uint8)  # the tensor keeps the map alive

    def close(self) -> None:
        """Close the files (the maps handed out stay valid until their tensors go)."""
        self._close()


def _close_all(files: dict[int, list]) -> None:
    for f in files.values():
        f[0].close()
