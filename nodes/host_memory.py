"""The engine as a citizen of ComfyUI's host-memory manager, where this ComfyUI has one (feature-detected).

- **Pinned memory.** ComfyUI budgets pinned host memory (`comfy.model_management.MAX_PINNED_MEMORY`, counted in
  `TOTAL_PINNED_MEMORY`; 0.12+). The engine asks before every pin (its pin gate, `offload/backends/pin_gate.py`): ComfyUI
  makes room where it can (`ensure_pin_registerable`: it evicts pins of models outside the current prompt first), a
  pin that does not fit is refused and the engine stages that buffer pageable with a bounce buffer, and granted pins
  are added to `TOTAL_PINNED_MEMORY` and taken off again when the engine frees them. With ComfyUI's pinned memory off
  (`--disable-pinned-memory`, or a card it does not pin for: `MAX_PINNED_MEMORY <= 0`) the engine pins nothing.
- **RAM pressure.** When RAM runs short ComfyUI frees pins (`free_pins`, asked by `ensure_pin_budget` and, after every
  node, by the RAM-pressure cache; 0.33+) of DynamicVRAM models only. What it could not free is then asked of the
  engine's models: those whose patcher has `fast_disk` first, then the least recently used; a model in a pass is left
  alone. `handle.release_host_memory` moves blocks whose exact bytes the model's file holds to the disk tier
  (streaming goes on, from disk). ComfyUI 0.12's RAM-pressure cache (`--cache-ram`) has no `free_pins`: it drops
  cached node outputs in `RAMPressureCache.poll` after every node; the engine's models are asked first there, so a
  model keeps working from disk before outputs are dropped. ComfyUI 0.3.6x never asks for RAM.

A ComfyUI without these names keeps the engine's behaviour as before, with one log line per missing name.
"""
from __future__ import annotations

import inspect
import logging
import threading
from typing import Any, Callable, List

import psutil

import comfy.model_management

from ..offload.backends.pin_gate import pin_gate, set_pin_gate
from .common import log_once
from .registry import Managed, managed_models

log = logging.getLogger("layer_offload")

WRAPPED_ATTR = "_layer_offload_wraps"
GIB = 1 << 30
_lock = threading.Lock()


def acquire_pin(nbytes: int) -> bool:
    """The engine's pin gate in ComfyUI: whether `nbytes` more pinned memory fit ComfyUI's pin budget (making room
    where ComfyUI can); counted in TOTAL_PINNED_MEMORY when granted."""
    mm = comfy.model_management
    limit = getattr(mm, "MAX_PINNED_MEMORY", None)
    if limit is None:
        return True
    if limit <= 0:
        log_once("pins-off", "Layer Offload: ComfyUI's pinned memory is off (MAX_PINNED_MEMORY <= 0): offloaded "
                 "blocks stream from pageable memory through bounce buffers.", level=logging.INFO)
        return False
    ensure = getattr(mm, "ensure_pin_registerable", None)
    with _lock:
        if callable(ensure):
            if ensure(nbytes) is False:  # None (a ComfyUI whose check returns nothing): room was made
                return _refused(nbytes)
        elif getattr(mm, "TOTAL_PINNED_MEMORY", 0) + nbytes > limit:
            return _refused(nbytes)
        mm.TOTAL_PINNED_MEMORY = getattr(mm, "TOTAL_PINNED_MEMORY", 0) + int(nbytes)
    return True


def _refused(nbytes: int) -> bool:
    log_once("pin-refused", "Layer Offload: ComfyUI's pinned-memory budget is full (%.0f MB of %.0f MB): blocks that "
             "do not fit stream from pageable memory through bounce buffers.",
             getattr(comfy.model_management, "TOTAL_PINNED_MEMORY", 0) / 2 ** 20,
             getattr(comfy.model_management, "MAX_PINNED_MEMORY", 0) / 2 ** 20, level=logging.INFO)
    return False


def release_pin(nbytes: int) -> None:
    """Pinned memory the engine was granted is freed: ComfyUI's count goes down by as much."""
    mm = comfy.model_management
    with _lock:
        mm.TOTAL_PINNED_MEMORY = max(0, getattr(mm, "TOTAL_PINNED_MEMORY", 0) - int(nbytes))


def _release_order(models: List[Managed]) -> List[Managed]:
    """Who gives RAM back first: fast_disk models, then the least recently used; models in a pass never."""
    idle = [m for m in models if m.handle.attached and not m.handle.is_busy()]
    return sorted(idle, key=lambda m: (not getattr(m, "fast_disk", False), m.handle.budget.recency(m.handle)))


def release_engine_ram(nbytes: int) -> int:
    """Free up to `nbytes` of host RAM from the engine's models (blocks to the disk tier); returns the bytes freed.

    Models of one file in this process share their blocks' host copy: a block leaves RAM when the last of them lets it
    go, so each is asked (a second round where the first freed something but not enough)."""
    freed = 0
    for _ in range(2):
        before = freed
        for m in _release_order(managed_models()):
            if freed >= nbytes:
                break
            try:
                got = int(m.handle.release_host_memory(int(nbytes - freed)))
            except Exception as e:  # noqa: BLE001 - a model that cannot give RAM back must not fail ComfyUI's call
                log.debug("Layer Offload: %s could not release host memory: %s", m.name, e)
                continue
            if got:
                log.info("Layer Offload: %s moved %.1f MB of blocks from RAM to the disk tier (ComfyUI is short of "
                         "RAM)", m.name, got / 2 ** 20)
            freed += got
        if freed >= nbytes or freed == before:
            break
    return freed


def _with_engine(free_pins: Callable[..., Any]) -> Callable[..., Any]:
    """ComfyUI's free_pins, then the engine's models for what it could not free."""

    def free_pins_and_engine_ram(size: Any, *args: Any, **kwargs: Any) -> Any:
        freed = free_pins(size, *args, **kwargs)
        try:
            short = int(size) - int(freed or 0)
        except (TypeError, ValueError):
            return freed
        if short > 0:
            freed = (freed or 0) + release_engine_ram(short)
        return freed

    setattr(free_pins_and_engine_ram, WRAPPED_ATTR, free_pins)
    free_pins_and_engine_ram.__doc__ = free_pins.__doc__
    return free_pins_and_engine_ram


def _engine_first(poll: Callable[..., Any]) -> Callable[..., Any]:
    """ComfyUI 0.12's RAMPressureCache.poll, after the engine's models gave back what RAM lacks of the headroom."""

    def poll_after_engine_ram(self: Any, ram_headroom: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            short = int(float(ram_headroom) * GIB) - int(psutil.virtual_memory().available)
            if short > 0:
                release_engine_ram(short)
        except Exception as e:  # noqa: BLE001 - ComfyUI's own eviction must run whatever the engine does
            log.debug("Layer Offload: giving RAM back before the RAM-pressure cache failed: %s", e)
        return poll(self, ram_headroom, *args, **kwargs)

    setattr(poll_after_engine_ram, WRAPPED_ATTR, poll)
    poll_after_engine_ram.__doc__ = poll.__doc__
    return poll_after_engine_ram


def _ram_pressure_cache() -> Any:
    """ComfyUI 0.12's RAMPressureCache when its own `poll(ram_headroom)` evicts by RAM (None elsewhere: 0.33's asks
    through free_pins)."""
    try:
        import comfy_execution.caching as caching
    except Exception:  # noqa: BLE001 - a ComfyUI without it (or one that cannot import it here)
        return None
    cls = getattr(caching, "RAMPressureCache", None)
    poll = getattr(cls, "__dict__", {}).get("poll")
    try:
        takes_headroom = callable(poll) and "ram_headroom" in inspect.signature(getattr(poll, WRAPPED_ATTR, poll)
                                                                                 ).parameters
    except (TypeError, ValueError):
        takes_headroom = False
    return cls if takes_headroom else None


def install() -> None:
    """Join ComfyUI's host-memory manager (idempotent): the pin gate and the RAM-pressure release."""
    mm = comfy.model_management
    if hasattr(mm, "MAX_PINNED_MEMORY"):
        if pin_gate() != (acquire_pin, release_pin):
            set_pin_gate(acquire_pin, release_pin)
    else:
        log_once("no-pin-budget", "Layer Offload: comfy.model_management.MAX_PINNED_MEMORY is not in this ComfyUI: "
                 "the engine pins host memory without ComfyUI's pin budget.", level=logging.INFO)
    free_pins = getattr(mm, "free_pins", None)
    if callable(free_pins):
        if not hasattr(free_pins, WRAPPED_ATTR):
            mm.free_pins = _with_engine(free_pins)
    cache = _ram_pressure_cache()
    if cache is not None and not hasattr(cache.poll, WRAPPED_ATTR):
        cache.poll = _engine_first(cache.poll)
    if not callable(free_pins) and cache is None:
        log_once("no-free-pins", "Layer Offload: this ComfyUI has neither comfy.model_management.free_pins nor a "
                 "RAM-pressure cache that evicts by RAM: it never asks offloaded models to give RAM back (the disk "
                 "tier still takes what does not fit).", level=logging.INFO)


def uninstall() -> None:
    """Leave ComfyUI's host-memory manager (tests)."""
    mm = comfy.model_management
    if pin_gate() == (acquire_pin, release_pin):
        set_pin_gate(None, None)
    inner = getattr(getattr(mm, "free_pins", None), WRAPPED_ATTR, None)
    if inner is not None:
        mm.free_pins = inner
    cache = _ram_pressure_cache()
    inner = getattr(getattr(cache, "poll", None), WRAPPED_ATTR, None)
    if inner is not None:
        cache.poll = inner
