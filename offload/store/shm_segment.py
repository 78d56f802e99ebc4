"""The segment files of the shared host copy under /dev/shm: their names, owners, locks, pages and cleanup.

`shared_host.py` fills and maps one model's segment; this module holds what does not depend on what is inside: the
name (this user's id and a hash of the model file's identity and every unit's layout), which files are ours, the
mapping through a descriptor of its own, letting go (the last process out unlinks), the sweep of segments a killed
process left, freeing a range of pages, and telling whether a copy-on-write mapping's pages turned private.

Ours means: a regular file owned by this process's effective uid with no group or other permission bits. Anyone can
compute a segment's name (the model file is all it takes) and create a file under it in /dev/shm, so a file is
checked by `lstat` before it is opened (a file that is not ours is never opened, never unlinked) and again by
`fstat` on the descriptor opened with O_NOFOLLOW | O_NONBLOCK (the very file that gets mapped: no race between the
check and the use). The uid in the name keeps two users' copies apart; a file of another user under our name costs
this process its shared copy, nothing else (`ForeignSegment`: it stages a private one).

The folder is /dev/shm, or `LAYER_OFFLOAD_SHM_DIR` (another tmpfs; tests point it at one of their own).
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import logging
import mmap
import os
import stat
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
SEGMENT_DIR_ENV = "LAYER_OFFLOAD_SHM_DIR"
PREFIX = "layer-offload-"
PAGE = mmap.PAGESIZE
STALE_AFTER_S = 60.0  # an unlocked segment older than this is a leftover of a killed process
_OPEN_FLAGS = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


class ForeignSegment(OSError):
    """A file under a segment's name that is not this user's own segment (never opened, never removed)."""


def segment_dir() -> Path:
    """The folder segments live in: `LAYER_OFFLOAD_SHM_DIR`, else /dev/shm."""
    chosen = os.environ.get(SEGMENT_DIR_ENV)
    return Path(chosen) if chosen else SEGMENT_DIR


def segment_name(key: str, uid: int | None = None) -> str:
    """The file name of the segment with this key for this user (`uid`: this process's effective uid)."""
    return f"{PREFIX}{os.geteuid() if uid is None else uid}-{key[:40]}"


def available() -> bool:
    """Whether this machine can hold a shared host copy (Linux's /dev/shm or the chosen folder, writable)."""
    directory = segment_dir()
    return (fcntl is not None and sys.platform.startswith("linux") and directory.is_dir()
            and os.access(directory, os.W_OK))


def is_ours(st: os.stat_result) -> bool:
    """A regular file of this process's effective uid that nobody else may read or write."""
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077


def _describe(st: os.stat_result) -> str:
    kind = "a regular file" if stat.S_ISREG(st.st_mode) else "not a regular file"
    return f"{kind} of uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}"


def open_own(path: str | os.PathLike, flags: int, same_as: os.stat_result | None = None) -> int:
    """A descriptor of `path` when it is our own segment file (and, with `same_as`, that very file): `lstat` says
    so before it is opened, `fstat` of the descriptor after. FileNotFoundError when there is none; ForeignSegment
    (nothing opened) when it is not ours."""
    st = os.lstat(path)
    if not is_ours(st):
        raise ForeignSegment(f"{path} is {_describe(st)}, not this user's (uid {os.geteuid()}) own segment")
    if same_as is not None and (st.st_dev, st.st_ino) != (same_as.st_dev, same_as.st_ino):
        raise ForeignSegment(f"{path} is another file now")
    fd = os.open(path, flags | _OPEN_FLAGS)
    try:
        now = os.fstat(fd)
        if not is_ours(now) or (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            raise ForeignSegment(f"{path} changed while it was opened")
    except BaseException:
        os.close(fd)
        raise
    return fd


def unlink_own(path: str | os.PathLike, st: os.stat_result) -> bool:
    """Remove `path` when it still names our file `st` (never another's that took the name since)."""
    try:
        now = os.lstat(path)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino) or not is_ours(now):
            return False
        os.unlink(path)
        return True
    except OSError:
        return False


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


def release(fd: int, path: str, st: os.stat_result, unregisters: list[Callable[[], None]]) -> None:
    """Let go of a segment; unlink it when no other process holds it (the last one out cleans up)."""
    for unregister in unregisters:
        with contextlib.suppress(Exception):
            unregister()
    unregisters.clear()
    with contextlib.suppress(OSError):
        os.close(fd)
    try:
        probe = open_own(path, os.O_RDONLY, same_as=st)
    except OSError:
        return  # gone, or another segment under the same name now (ours was unlinked and made again)
    try:
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if unlink_own(path, st):
            log.debug("removed the shared host copy %s (no process maps it any more)", path)
    except OSError:  # BlockingIOError: another process still maps it
        pass
    finally:
        os.close(probe)


def map_segment(path: Path, st: os.stat_result, nbytes: int, access: int) -> mmap.mmap:
    """A mapping of our segment `st` through a descriptor of its own: mmap keeps a duplicate of the descriptor it is
    given, and a duplicate of the locked one would hold the lock for as long as any tensor views the mapping."""
    fd = open_own(path, os.O_RDWR if access == mmap.ACCESS_WRITE else os.O_RDONLY, same_as=st)
    try:
        return mmap.mmap(fd, nbytes, access=access)
    finally:
        os.close(fd)


def punch_hole(fd: int, offset: int, nbytes: int) -> None:
    """Free a range of a tmpfs file's pages (fallocate FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.fallocate(fd, 0x03, ctypes.c_int64(offset), ctypes.c_int64(nbytes)) != 0:
        raise OSError(ctypes.get_errno(), "fallocate(PUNCH_HOLE) failed")


def sweep_stale(directory: Path | None = None, older_than_s: float = STALE_AFTER_S) -> int:
    """Remove our own segments no process holds that are older than `older_than_s` (left by a killed process);
    another user's are never opened nor removed. Returns how many went."""
    directory = segment_dir() if directory is None else directory
    removed = 0
    now = time.time()
    for path in directory.glob(PREFIX + "*"):
        try:
            fd = open_own(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if now - st.st_mtime < older_than_s:
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            removed += unlink_own(path, st)
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
