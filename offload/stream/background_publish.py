"""Units of the host copy shared between processes that setup staged in this process's own RAM
(`HostPlan.publish_later`: tmpfs takes pages at a fraction of the speed anonymous memory does, so filling the copy
during setup would hold the load up) are put in the copy on the background thread after setup, one at a time: each
unit's bytes written into the copy by `pwrite` (no pass lock held), then swapped in at a safe point (the pass lock
held, nothing in flight) only if its bytes did not change meanwhile (its version counters) and its master is still
the one written; its private buffer then goes, so RAM holds at most one unit twice. A unit that changed is taken
back out of the copy (a joining process stages it on its own). The copy's header is written after the last unit:
until then no other process maps it (they wait for it, as for a copy being filled during setup).

Run by `background_encode.BackgroundEncoder`'s thread before it encodes (a unit to be held compressed is encoded
from the copy, as it would be had setup filled it)."""
from __future__ import annotations

import logging
import os
import time
import weakref
from typing import Any, Callable

import torch

log = logging.getLogger(__name__)


def writer(host: torch.Tensor, from_file: list[int]) -> Callable[[int, int], list[int]]:
    """`SharedHostCopy.place`'s writer for a unit staged in RAM: its whole buffer written at `offset` of the copy's
    descriptor by `pwrite` (pages taken without being zeroed first); returns the leaves read from the file."""
    def write(fd: int, offset: int) -> list[int]:
        data = memoryview(host.numpy()).cast("B")
        done = 0
        while done < len(data):
            done += os.pwrite(fd, data[done:], offset + done)
        del data
        return list(from_file)
    return write


def publish_units(ref: "weakref.ref[Any]", state: Any, units: list[int],
                  locked: Callable[["weakref.ref[Any]", Any], Any]) -> bool:
    """Put `units` in the streamer's shared host copy and finish it; False when stopped (the model dropped or
    detached: the copy is never finished, and goes with the model)."""
    streamer = ref()
    if streamer is None:
        return False
    copy, backend, to_pin = streamer.staged.shared, streamer.backend, streamer.staged.publish_pinned
    del streamer
    moved: list[int] = []
    try:
        for n, i in enumerate(units):
            if not _publish_one(ref, state, locked, copy, i, moved):
                state.publish_kept += len(units) - n
                break
    except _Stopped:
        return False
    streamer = locked(ref, state)
    if streamer is None:
        return False
    try:
        copy.finish(backend, to_pin)  # the header: other processes may map it now; the planned pins registered
        streamer.host.pin_published(moved)
    finally:
        streamer._lock.release()
    log.info("%d block(s) moved into the host copy shared between processes after setup (%.2f s), %d kept in this "
             "process's RAM", state.published, state.publish_ms / 1e3, state.publish_kept)
    return True


class _Stopped(Exception):
    """The model was dropped or detached while its units were being put in the copy."""


def _publish_one(ref: "weakref.ref[Any]", state: Any, locked: Callable[["weakref.ref[Any]", Any], Any], copy: Any,
                 i: int, moved: list[int]) -> bool:
    """Unit i written into the copy and swapped in (or left private: counted); False where the copy takes no more
    (/dev/shm full, a failed write: the rest stay private too)."""
    if state.stop.is_set():
        raise _Stopped()
    streamer = ref()
    if streamer is None:
        raise _Stopped()
    master = streamer.units[i].staged.master
    del streamer
    if master.host is None or master.encoded is not None or master.shared is not None:
        state.publish_kept += 1  # moved to the disk tier, or its form changed meanwhile: stays as it is
        return True
    layout = master.layout
    version = layout.version()
    from_file = [k for k, leaf in enumerate(layout.leaves) if leaf.meta]
    t0 = time.perf_counter()
    try:
        host = copy.place(i, layout, lambda dst: [], writer(master.host[:layout.nbytes], from_file))
    except Exception as exc:  # noqa: BLE001 - the unit stays in this process's RAM, never a lost model
        log.warning("a block could not be put in the host copy shared between processes (%s: %s); it and the "
                    "blocks after it stay in this process's RAM", type(exc).__name__, exc)
        host = None
    state.publish_ms += (time.perf_counter() - t0) * 1e3
    if host is None:  # /dev/shm full (said once) or a failed write
        copy.unplace(i)
        return False
    streamer = locked(ref, state)
    if streamer is None:
        copy.unplace(i)
        raise _Stopped()
    try:
        taken = streamer.host.take_shared(i, master, version, host)
    finally:
        streamer._lock.release()
    del streamer
    if taken:
        moved.append(i)
        state.published += 1
    else:
        copy.unplace(i)  # written meanwhile: the copy must not hold other bytes than the ones it says
        state.publish_kept += 1
    return True
