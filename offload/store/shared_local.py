"""The models of one process that map the same shared host copy (two loader nodes of one file, or a cached earlier
output beside a new one): one lock on the segment between them, and a unit's pages given back only once every one
of them has let the unit go.

Each process holds a shared `flock` on the segment while it maps it; a unit's pages are given back (a hole punched
in the segment) only when no other process holds one. Two models of one file in one process used to open the
segment twice, so each held a lock of its own, each saw the other as another process, and neither could ever give a
unit back. Now a second model of the process joins through a duplicate of the first one's descriptor: the lock is
the process's, asking whether anyone else maps the copy asks other processes only, and `SharedHostCopy.give_back`
frees a unit when the last model of the process lets it go (`holds_elsewhere` says whether one still holds it).
"""
from __future__ import annotations

import os
import threading
import weakref
from pathlib import Path
from typing import Any

_lock = threading.Lock()
_copies: dict[str, "weakref.WeakSet[Any]"] = {}  # segment path -> this process's live copies of it


def _live(path: str) -> list[Any]:
    copies = _copies.get(path)
    return [c for c in copies if c.open_here()] if copies else []


def add(copy: Any) -> None:
    """A copy of the segment at `copy.path` this process maps now."""
    with _lock:
        _copies.setdefault(str(copy.path), weakref.WeakSet()).add(copy)


def lock_descriptor(path: Path) -> int | None:
    """A duplicate of the descriptor (and so of the shared lock) of a complete copy of the segment now at `path` that
    this process maps, or None (the caller opens and locks the segment itself)."""
    try:
        here = os.lstat(path)
    except OSError:
        return None
    with _lock:
        for c in _live(str(path)):
            if not c.filler_busy() and (c.stat.st_dev, c.stat.st_ino) == (here.st_dev, here.st_ino):
                return os.dup(c.fd)
    return None


def holds_elsewhere(copy: Any, i: int) -> bool:
    """Whether another model of this process still holds unit i of the same segment in RAM."""
    with _lock:
        others = [c for c in _live(str(copy.path)) if c is not copy]
    return any(i in c.placed and i not in c.let_go for c in others)  # placed, not let go (_live: still mapped)
