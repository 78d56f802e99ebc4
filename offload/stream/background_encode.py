"""Units held compressed that setup staged raw (`HostPlan.encode_later`: the encoder cannot keep up with the file's
reads, and RAM holds the raw plan meanwhile) are encoded on a thread of their own after setup, and each is swapped
in at a safe point: while no pass runs (the pass lock held), with nothing in flight (`quiesce`), and only if its
bytes did not change since it was read (its version counters) and its master is still the one encoded. Until then
the unit streams raw, bitwise the same. A unit the host copy shared with other processes holds raw stays raw while
another process maps the copy (compressing it privately would add RAM, not save it); alone, its pages in the copy
are given back.

The same thread first moves the units setup staged in this process's RAM into the host copy shared between
processes (`HostPlan.publish_later`, background_publish.py). It refers to the streamer weakly (dropping the model stops it) and stops at `detach`."""
from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Any

import torch

from ..store import codec
from ..store.spill import SpillFile, release_free_heap
from .background_publish import publish_units

log = logging.getLogger(__name__)


class BackgroundEncoder:
    """Encodes the units it is given, one at a time, and hands each to `HostTiers.take_encoded`."""

    def __init__(self, streamer: Any, units: list[int], publish: list[int] | None = None) -> None:
        self.units = list(units)
        self.publish = list(publish or [])  # put in the shared host copy first (background_publish.py)
        self.done = 0  # swapped in
        self.kept_raw = 0  # written meanwhile, moved, or shared with another process: left raw
        self.encode_ms = 0.0
        self.published = 0  # moved into the shared host copy
        self.publish_kept = 0  # kept in this process's RAM (changed meanwhile, moved, or no room in /dev/shm)
        self.publish_ms = 0.0
        self.stop = threading.Event()
        self.finished = threading.Event()
        self._thread = threading.Thread(target=_run, args=(weakref.ref(streamer), self), daemon=True,
                                        name="layer-offload-encode")
        self._thread.start()

    @property
    def pending(self) -> int:
        return len(self.units) - self.done - self.kept_raw

    def status(self) -> dict[str, Any]:
        return {"background_units": len(self.units), "background_done": self.done,
                "background_kept_raw": self.kept_raw, "background_pending": self.pending,
                "background_encode_ms": round(self.encode_ms, 3), "publish_units": len(self.publish),
                "published": self.published, "publish_kept": self.publish_kept,
                "publish_ms": round(self.publish_ms, 3)}

    def end(self) -> None:
        """Stop, and wait for the thread to end (it may be writing through the shared host copy's descriptor, which
        closes after this)."""
        self.stop.set()
        self.finished.wait()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every unit was put in the shared copy and encoded and swapped in (or left as it was); False on
        timeout."""
        return self.finished.wait(timeout)


def _locked(ref: "weakref.ref[Any]", state: BackgroundEncoder) -> Any:
    """The streamer with its pass lock held (polled, so a stop or a dropped model ends the wait), or None."""
    while not state.stop.is_set():
        streamer = ref()
        if streamer is None:
            return None
        if streamer._lock.acquire(blocking=False):
            return streamer
        del streamer
        time.sleep(0.02)
    return None


def _run(ref: "weakref.ref[Any]", state: BackgroundEncoder) -> None:
    spill = SpillFile()
    try:
        if state.publish and not publish_units(ref, state, state.publish, _locked):
            return
        for i in state.units:
            if state.stop.is_set():
                return
            streamer = ref()
            if streamer is None:
                return
            u = streamer.units[i]
            master = u.staged.master
            if master.host is None or master.encoded is not None or not u.staged.layout.entries:
                state.kept_raw += 1
                continue
            shared = master.shared
            if shared is not None and not shared.copy.alone():
                state.kept_raw += 1
                continue
            version = u.staged.layout.version()
            host, layout, backend, pin = master.host, master.layout, streamer.backend, master.pinned
            del streamer, u
            t0 = time.perf_counter()
            try:
                with torch.no_grad():
                    chunks = codec.plan(host, layout.leaves)
                    blob, pinned = backend.alloc_host(codec.encoded_size(chunks), pin)
                    encoded = codec.write(host, chunks, blob, serial=True)
                    raw = spill.put(host)
            except Exception as exc:  # noqa: BLE001 - a unit left raw, said once, never a lost model
                log.warning("a block could not be encoded in the background (%s); it stays raw", exc)
                state.kept_raw += 1
                continue
            state.encode_ms += (time.perf_counter() - t0) * 1e3
            del host
            streamer = _locked(ref, state)
            if streamer is None:
                return
            try:
                taken = streamer.host.take_encoded(i, master, version, raw, encoded, pinned)
            finally:
                streamer._lock.release()
            del streamer, master
            if taken:
                state.done += 1
            else:
                state.kept_raw += 1
        if state.units:
            log.info("%d block(s) encoded in the background (%.2f s), %d left raw", state.done, state.encode_ms / 1e3,
                     state.kept_raw)
    finally:
        spill.close()
        release_free_heap()
        state.finished.set()
