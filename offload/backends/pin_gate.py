"""One process-wide gate on the engine's pinned host memory: asked before every pin, told when pinned memory goes.

A host application that budgets pinned memory itself (ComfyUI: `comfy.model_management.MAX_PINNED_MEMORY`, its
`ensure_pin_registerable`) installs a gate with `set_pin_gate(acquire, release)`: `acquire(nbytes) -> bool` is asked
before the engine pins `nbytes` (False: the engine stages that buffer in pageable memory and copies it through a
bounce buffer, as when the driver refuses a pin), and `release(nbytes)` is told when pinned memory the gate granted
is freed (the last tensor over its storage is gone). Without a gate every pin is tried, as before.
`pinned_bytes()` is what the engine holds pinned now, with or without a gate. The backends call `pin_host`; nothing
here touches a device.
"""
from __future__ import annotations

import logging
import threading
import weakref
from typing import Callable

import torch

log = logging.getLogger(__name__)

Acquire = Callable[[int], bool]
Release = Callable[[int], None]

_lock = threading.Lock()
_gate: tuple[Acquire | None, Release | None] = (None, None)
_pinned = 0
_gate_failed = False


def set_pin_gate(acquire: Acquire | None, release: Release | None = None) -> None:
    """Install (or with None, remove) the gate every pin of the engine asks first; pins made before keep being
    released to the gate that granted them."""
    if acquire is not None and not callable(acquire):
        raise TypeError(f"acquire must be a callable(nbytes) -> bool or None, got {type(acquire).__name__}")
    if release is not None and not callable(release):
        raise TypeError(f"release must be a callable(nbytes) or None, got {type(release).__name__}")
    global _gate
    with _lock:
        _gate = (acquire, release)


def pin_gate() -> tuple[Acquire | None, Release | None]:
    """The gate installed now: (acquire, release), (None, None) without one."""
    return _gate


def pinned_bytes() -> int:
    """Host bytes the engine holds pinned now (every model, bounce buffers and KV pages included)."""
    return _pinned


def pin_host(nbytes: int, allocate: Callable[[], torch.Tensor]) -> torch.Tensor | None:
    """`allocate()` (which pins `nbytes`) when the gate allows it, counted until its storage is freed; None when the
    gate refuses. An error from `allocate` is raised after the grant is handed back."""
    global _gate_failed
    acquire, release = _gate
    if acquire is not None:
        try:
            allowed = bool(acquire(int(nbytes)))
        except Exception as exc:  # noqa: BLE001 - a broken gate must not stop staging: pin as without one
            if not _gate_failed:
                _gate_failed = True
                log.warning("the pinned-memory gate failed (%s: %s); pinning without it", type(exc).__name__, exc)
            acquire = release = None
            allowed = True
        if not allowed:
            return None
    try:
        buf = allocate()
    except BaseException:
        if acquire is not None and release is not None:
            release(int(nbytes))
        raise
    _track(buf, int(nbytes), release if acquire is not None else None)
    return buf


def _track(buf: torch.Tensor, nbytes: int, release: Release | None) -> None:
    global _pinned
    with _lock:
        _pinned += nbytes
    # the storage, not the tensor: views of the buffer (the units' weights) keep the pinned memory alive
    weakref.finalize(buf.untyped_storage(), _freed, nbytes, release)


def _freed(nbytes: int, release: Release | None) -> None:
    global _pinned
    with _lock:
        _pinned -= nbytes
    if release is not None:
        try:
            release(nbytes)
        except Exception as exc:  # noqa: BLE001 - called from a finalizer: log, never raise
            log.debug("the pinned-memory gate's release(%d) failed: %s", nbytes, exc)
