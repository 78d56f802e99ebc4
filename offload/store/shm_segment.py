"""The segment files of the shared host copy under /dev/shm: their names, locks, pages and cleanup.

`shared_host.py` fills and maps one model's segment; this module holds what does not depend on what is inside: the
name (a hash of the model file's identity and every unit's layout), the mapping through a descriptor of its own,
letting go (the last process out unlinks), the sweep of segments a killed process left, freeing a range of pages,
and telling whether a copy-on-write mapping's pages turned private.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import logging
import mmap
import os
import struct
import sys
import time
from pathlib import Path
from typing import Any, Callable

from ..model.layout import TensorLayout

try:
    import fcntl
except ImportError:  # Windows: no flock, no /dev/shm (available() is False; nothing below is called)
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

SEGMENT_DIR = Path("/dev/shm")
PREFIX = "layer-offload-"
PAGE = mmap.PAGESIZE
STALE_AFTER_S = 60.0  # an unlocked segment older than this is a leftover of a killed process


def available() -> bool:
    """Whether this machine can hold a shared host copy (Linux's /dev/shm, writable)."""
    return (fcntl is not None and sys.platform.startswith("linux") and SEGMENT_DIR.is_dir()
            and os.access(SEGMENT_DIR, os.W_OK))


def round_up(n: int, to: int = PAGE) -> int:
    """`n` rounded up to whole pages: every unit's range starts on a page of its own."""
    return (n + to - 1) // to * to


def file_identity(path: str | os.PathLike) -> list[Any]:
    """What names the model's file for sharing: its resolved path, size and modification time (of every file in a
    packed folder)."""
    p = Path(path).resolve()
    files = sorted(q for q in p.iterdir() if q.is_file()) if p.is_dir() else [p]
    return [str(p)] + [[q.name, q.stat().st_size, q.stat().st_mtime_ns] for q in files]


def layout_key(layouts: list[TensorLayout], names: list[str]) -> list[Any]:
    """Every unit's layout as plain values: the same bytes land at the same offsets only when these are equal."""
    return [[name, layout.nbytes, [[leaf.offset, leaf.nbytes, str(leaf.dtype), list(leaf.shape),
                                    list(leaf.stride) if leaf.stride is not None else None]
                                   for leaf in layout.leaves]]
            for name, layout in zip(names, layouts)]


def segment_key(identity: list[Any], layouts: list[TensorLayout], names: list[str]) -> str:
    return hashlib.sha256(json.dumps([identity, layout_key(layouts, names)]).encode()).hexdigest()


def release(fd: int, path: str, ino: int, unregisters: list[Callable[[], None]]) -> None:
    """Let go of a segment; unlink it when no other process holds it (the last one out cleans up)."""
    for unregister in unregisters:
        with contextlib.suppress(Exception):
            unregister()
    unregisters.clear()
    with contextlib.suppress(OSError):
        os.close(fd)
    try:
        probe = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        if os.fstat(probe).st_ino != ino:
            return  # another segment under the same name now (ours was unlinked and made again)
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.unlink(path)
        log.debug("removed the shared host copy %s (no process maps it any more)", path)
    except OSError:  # BlockingIOError: another process still maps it
        pass
    finally:
        os.close(probe)


def map_segment(path: Path, nbytes: int, access: int) -> mmap.mmap:
    """A mapping of the segment through a descriptor of its own: mmap keeps a duplicate of the descriptor it is
    given, and a duplicate of the locked one would hold the lock for as long as any tensor views the mapping."""
    fd = os.open(path, os.O_RDWR if access == mmap.ACCESS_WRITE else os.O_RDONLY)
    try:
        return mmap.mmap(fd, nbytes, access=access)
    finally:
        os.close(fd)


def punch_hole(fd: int, offset: int, nbytes: int) -> None:
    """Free a range of a tmpfs file's pages (fallocate FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.fallocate(fd, 0x03, ctypes.c_int64(offset), ctypes.c_int64(nbytes)) != 0:
        raise OSError(ctypes.get_errno(), "fallocate(PUNCH_HOLE) failed")


def sweep_stale(directory: Path = SEGMENT_DIR, older_than_s: float = STALE_AFTER_S) -> int:
    """Remove segments no process holds that are older than `older_than_s` (left by a killed process); returns how
    many went."""
    removed = 0
    now = time.time()
    for path in directory.glob(PREFIX + "*"):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            if now - os.fstat(fd).st_mtime < older_than_s:
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(path)
            removed += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    if removed:
        log.info("removed %d shared host cop(ies) left in %s by processes that did not exit cleanly", removed,
                 directory)
    return removed


def private_pages(address: int, nbytes: int) -> bool:
    """Whether any present page of [address, address + nbytes) is private anonymous memory (a copy-on-write copy):
    /proc/self/pagemap's bit 61 is clear for those (readable without privileges; False where it cannot be read)."""
    if nbytes <= 0:
        return False
    first, last = address // PAGE, (address + nbytes - 1) // PAGE
    try:
        with open("/proc/self/pagemap", "rb") as f:
            f.seek(first * 8)
            data = f.read((last - first + 1) * 8)
    except OSError:
        return False
    for (entry,) in struct.iter_unpack("<Q", data):
        if entry >> 63 & 1 and not entry >> 61 & 1:
            return True
    return False
