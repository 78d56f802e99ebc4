"""KV pages under the model's budget: `KVPager` (one per model, a `VramBudget` member) and `KVPages` (one attention
layer's keys and values in one device buffer that grows and shrinks by pages, offloaded whole to pinned host memory).

Each layer's keys and values live in one flat device buffer, `[batch, key_heads, capacity, key_dim]` keys then
`[batch, value_heads, capacity, value_dim]` values (MLA models have other value than key widths), so attention reads
them as tensors and a write into them (VibeVoice's negative-branch reset) lands in the cache. The live tokens are
`[start, length)`: a sliding-window layer moves `start` past the tokens that left its window and compacts (or
shrinks) the buffer when the next page would not fit, so its pages stay at the window. Pages are the unit of growth
and of accounting. The pager is a member of the same `VramBudget` as the weights: the weights take their share first
(same priority, registered first), the cache gets what is left, and at least one layer.

When a layer must grow or come back and its model's KV share is full, whole layers (attention reads all of a
layer's pages) go to pinned host memory: the one whose next use is furthest away first (for the cyclic layer
order of a decoder that is the layer that ran last; lower-priority caches, the CFG one, before the others). While
layer i computes, the pages of the layer that came next last time are copied back on the transfer stream; its
update waits GPU-side for that copy. Restores come first: room for a layer needed now or next is made by
offloading others, never the other way round. Offloads wait for their device-to-host copy before the device
memory is reused. Keys and values are never changed: outputs are identical with and without offloading.

Plain torch: the transformers side (which cache layers are paged) is offload/generate/kv_layers.py.
"""
from __future__ import annotations

import contextlib
import logging
import math
import threading
import weakref
from typing import Any, Iterator

import torch

log = logging.getLogger(__name__)


class KVPager:
    """One model's KV pages on the device and in host memory; a member of the model's VramBudget (the caches it
    makes: offload/generate/kv_cache.py's subclass)."""

    def __init__(self, backend: Any, budget: Any, name: str, priority: int = 0, page_tokens: int = 64,
                 offload: bool = True) -> None:
        if isinstance(page_tokens, bool) or not isinstance(page_tokens, int) or page_tokens < 1:
            raise ValueError(f"page_tokens must be a whole number >= 1, got {page_tokens!r}")
        self.backend = backend
        self.budget = budget
        self.name = f"{name}:kv"
        self.priority = int(priority)
        self.page_tokens = page_tokens
        self.offload_enabled = offload
        self._layers: list[weakref.ReferenceType] = []
        self._lock = threading.RLock()
        self._busy = 0
        self._pending = 0  # bytes of the allocation being made (counted in want/floor while the budget is asked)
        self._clock = 0
        self._last: weakref.ReferenceType | None = None  # the layer updated last (caches die with generate)
        self.over_budget_said = False
        self.stats = {"caches": 0, "offloads": 0, "restores": 0, "bytes_offloaded": 0, "bytes_restored": 0,
                      "prefetched": 0, "pages_freed": 0}
        budget.register(self)

    # layers ---------------------------------------------------------------------------
    def _add(self, layer: "KVPages") -> None:
        with self._lock:
            self._layers = [r for r in self._layers if r() is not None]
            self._layers.append(weakref.ref(layer))

    def layers(self) -> list["KVPages"]:
        """The live layers that have seen keys (so their page size is known)."""
        return [layer for layer in (r() for r in self._layers) if layer is not None and layer.shaped]

    # budget member ----------------------------------------------------------------------
    def floor_bytes(self) -> int:
        """The layer computing while it grows (its old and new buffer exist for a moment)."""
        return max([2 * x.buffer_bytes + x.page_bytes for x in self.layers()] + [self._pending], default=0)

    def want_bytes(self) -> int:
        """Every layer on the device, each with a page to grow by, room for one growing layer's old buffer, and the
        allocation being asked for now (a prompt's prefill takes several pages at once)."""
        layers = self.layers()
        return (sum(x.buffer_bytes + x.page_bytes for x in layers) + max((x.buffer_bytes for x in layers), default=0)
                + self._pending)

    def device_bytes(self) -> int:
        return sum(x.buffer_bytes for x in self.layers() if x.on_device)

    def host_bytes(self) -> int:
        return sum(x.host_bytes for x in self.layers())

    def is_busy(self) -> bool:
        return self._busy > 0

    def device_total(self) -> int | None:
        return self.backend.mem_get_info()[1]

    def shrink_to(self, nbytes: int) -> int:
        """Offload layers until at most `nbytes` stay on the device (the budget asks while this cache is idle)."""
        if not self.offload_enabled:
            return 0
        got = self._lock.acquire(blocking=False)
        if not got:
            return 0
        try:
            before = self.device_bytes()
            for layer in self._eviction_order(keep=()):
                if self.device_bytes() <= nbytes:
                    break
                self._offload(layer)
            return before - self.device_bytes()
        finally:
            self._lock.release()

    # the update path ----------------------------------------------------------------------
    @contextlib.contextmanager
    def using(self, layer: "KVPages") -> Iterator[None]:
        with self._lock:
            self._busy += 1
            self._clock += 1
            layer.last_use = self._clock
            try:
                yield
            finally:
                self._busy -= 1

    def make_resident(self, layer: "KVPages") -> None:
        """Bring an offloaded layer back (waiting, GPU-side, for a prefetch already under way)."""
        if layer.on_device:
            if layer.ready is not None:
                self.backend.wait(layer.ready)
                layer.ready = None
            return
        if not layer.buffer_bytes:
            return
        self._restore(layer, keep=(layer,))
        self.backend.wait(layer.ready)
        layer.ready = None

    def allocate(self, layer: "KVPages", nbytes: int, keep: tuple) -> torch.Tensor:
        """A device buffer of `nbytes` for `layer`, making room within the model's KV share first."""
        self._pending = nbytes
        try:
            allowance = self.budget.allowance(self)
        finally:
            self._pending = 0
        if self.offload_enabled:
            for other in self._eviction_order(keep=keep):
                if self.device_bytes() + nbytes <= allowance:
                    break
                self._offload(other)
        if self.device_bytes() + nbytes > allowance and not self.over_budget_said:
            self.over_budget_said = True
            log.warning("%s: the KV cache needs %.1f MB on the device but its share of the VRAM budget is %.1f MB%s",
                        self.name, (self.device_bytes() + nbytes) / 2 ** 20, allowance / 2 ** 20,
                        "" if self.offload_enabled else " (KV offloading is off)")
        while True:
            try:
                return self.backend.alloc(nbytes)
            except torch.OutOfMemoryError:
                victims = self._eviction_order(keep=keep) if self.offload_enabled else []
                if not victims:
                    raise
                self._offload(victims[0])

    def after_update(self, layer: "KVPages") -> None:
        """Learn which layer comes next, and start bringing back the one expected after this one."""
        last = self._last() if self._last is not None else None
        if last is not None and last is not layer:
            last.next_ref = weakref.ref(layer)
        self._last = weakref.ref(layer)
        if self.offload_enabled:  # over the KV share (a budget with no room): the layers done with go now
            allowance = None
            for other in self._eviction_order(keep=(layer,)):
                allowance = self.budget.allowance(self) if allowance is None else allowance
                if self.device_bytes() <= allowance:
                    break
                self._offload(other)
        nxt = layer.next_ref() if layer.next_ref is not None else None
        if nxt is not None and nxt.buffer_bytes and not nxt.on_device and self.offload_enabled:
            if self._room_for(nxt.buffer_bytes, keep=(layer, nxt)):  # a prefetch never goes over the KV share
                self._restore(nxt, keep=(layer, nxt))
                self.stats["prefetched"] += 1

    def _room_for(self, nbytes: int, keep: tuple) -> bool:
        """Whether `nbytes` more fit the KV share once every layer but `keep` could go."""
        self._pending = nbytes
        try:
            allowance = self.budget.allowance(self)
        finally:
            self._pending = 0
        kept = sum(x.buffer_bytes for x in self.layers() if x.on_device and any(x is k for k in keep))
        return kept + nbytes <= allowance

    # moving pages --------------------------------------------------------------------------
    def _eviction_order(self, keep: tuple) -> list["KVPages"]:
        """Device-resident layers that may go: lower-priority caches first, then the furthest next use (the most
        recently used in a decoder's cyclic order: the layer that ran last may go too, its attention has run)."""
        protected = {id(x) for x in keep}
        candidates = [x for x in self.layers() if x.on_device and id(x) not in protected]
        candidates.sort(key=lambda x: (x.priority, -x.last_use))
        return candidates

    def _offload(self, layer: "KVPages") -> None:
        if layer.ready is not None:  # a restore still under way: let it land first
            self.backend.event_synchronize(layer.ready)
            layer.ready = None
        n = layer.buffer_bytes
        if layer.host is None or layer.host.numel() < n:
            layer.host, _ = self.backend.alloc_host(n, True)
        event = self.backend.copy_d2h(layer.host[:n], layer.device[:n], self.backend.record())
        self.backend.event_synchronize(event)  # the device memory is reused only once the copy is out
        self.backend.release(layer.device)
        layer.device = None
        self.stats["offloads"] += 1
        self.stats["bytes_offloaded"] += n

    def _restore(self, layer: "KVPages", keep: tuple) -> None:
        n = layer.buffer_bytes
        layer.device = self.allocate(layer, n, keep)
        layer.ready = self.backend.copy_h2d(layer.device[:n], layer.host[:n], None)
        self.stats["restores"] += 1
        self.stats["bytes_restored"] += n

    def report(self) -> dict[str, Any]:
        """Pages on the device / in host memory, and what moved (for the model's report)."""
        layers = self.layers()
        resident = sum(x.pages for x in layers if x.on_device)
        return {"page_tokens": self.page_tokens, "pages_resident": resident,
                "pages_offloaded": sum(x.pages for x in layers) - resident,
                "device_bytes": self.device_bytes(), "host_bytes": self.host_bytes(), **self.stats}


class KVPages:
    """One attention layer's keys and values in one buffer of whole pages, on the device or (offloaded) in pinned
    host memory; the live tokens are `[start, length)`."""

    def __init__(self, pager: KVPager, priority: int = 1, sliding: bool = False) -> None:
        self._pager = pager
        self.priority = priority
        self.sliding = sliding  # one spare page: the window moves a page before the buffer is compacted
        self.device: torch.Tensor | None = None  # flat uint8 buffer on the device
        self.host: torch.Tensor | None = None  # flat uint8 pinned host copy (kept for the next offload)
        self.ready: Any = None  # event of a restore under way
        self.start = 0
        self.length = 0
        self.capacity = 0
        self.last_use = 0
        self.next_ref: weakref.ReferenceType | None = None
        self.dtype: torch.dtype | None = None
        self.compute_device: torch.device | None = None
        self.shape: tuple[int, int, int, int, int] | None = None  # batch, key heads, key dim, value heads, value dim
        pager._add(self)

    @property
    def shaped(self) -> bool:
        return self.shape is not None

    @property
    def on_device(self) -> bool:
        return self.device is not None

    @property
    def live(self) -> int:
        return self.length - self.start

    @property
    def token_bytes(self) -> int:
        if self.shape is None:
            return 0
        b, hk, dk, hv, dv = self.shape
        return b * (hk * dk + hv * dv) * self.dtype.itemsize

    @property
    def page_bytes(self) -> int:
        return self.token_bytes * self._pager.page_tokens

    @property
    def buffer_bytes(self) -> int:
        return self.token_bytes * self.capacity

    @property
    def host_bytes(self) -> int:
        return 0 if self.host is None else self.host.numel()

    @property
    def pages(self) -> int:
        return self.capacity // self._pager.page_tokens

    def _split(self, buf: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        b, hk, dk, hv, dv = self.shape
        nk = b * hk * capacity * dk * self.dtype.itemsize
        nv = b * hv * capacity * dv * self.dtype.itemsize
        keys = buf[:nk].view(self.dtype).view(b, hk, capacity, dk)
        values = buf[nk:nk + nv].view(self.dtype).view(b, hv, capacity, dv)
        return keys, values

    # reads ------------------------------------------------------------------------------
    def views(self, tail: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The live keys and values on the device (brought back first if offloaded); `tail`: only the last ones."""
        if not self.live:
            empty = torch.empty(0, dtype=self.dtype, device=self.compute_device)
            return empty, empty
        with self._pager.using(self):
            self._pager.make_resident(self)
            k, v = self._split(self.device, self.capacity)
        lo = self.start if tail is None else max(self.start, self.length - tail)
        return k[:, :, lo:self.length], v[:, :, lo:self.length]

    def set_dtype(self, dtype: torch.dtype, device: torch.device) -> None:
        """An empty layer of `dtype` on `device` (transformers' lazy initialization)."""
        self.dtype, self.compute_device = dtype, device

    # writes -----------------------------------------------------------------------------
    def append(self, keys: torch.Tensor, values: torch.Tensor, keep: int | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Add tokens after the live ones (a sliding layer first lets all but the last `keep` go); returns the
        live keys and values, new ones included."""
        pager = self._pager
        with pager.using(self):
            if self.shape is None:
                self.dtype, self.compute_device = keys.dtype, keys.device
                b, hk, _, dk = keys.shape
                self.shape = (b, hk, dk, values.shape[1], values.shape[-1])
            if keep is not None and self.live > keep:
                self.start = self.length - keep
            if self.buffer_bytes:
                pager.make_resident(self)
            new = keys.shape[-2]
            self._fit(self.live + new)
            k, v = self._split(self.device, self.capacity)
            end = self.length + new
            k[:, :, self.length:end].copy_(keys)
            v[:, :, self.length:end].copy_(values)
            self.length = end
            pager.after_update(self)
            return k[:, :, self.start:end], v[:, :, self.start:end]

    def replace(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """The live tokens become `keys` / `values` (beam reorder, crop, batch changes): in place where the shape
        holds, else in a new buffer."""
        with self._pager.using(self):
            if self.device is not None and _shares(keys, values, self.device):
                keys, values = keys.clone(), values.clone()
            b, hk, n, dk = keys.shape
            shape = (b, hk, dk, values.shape[1], values.shape[-1])
            if self.shape == shape and keys.dtype == self.dtype and self.capacity:
                self._pager.make_resident(self)
                self.start, self.length = 0, 0
                self._fit(n)
            else:
                self.free()
                self.dtype, self.compute_device, self.shape = keys.dtype, keys.device, shape
                self._fit(n)
            k, v = self._split(self.device, self.capacity)
            k[:, :, :n].copy_(keys)
            v[:, :, :n].copy_(values)
            self.start, self.length = 0, n

    def free(self) -> None:
        """Give the pages back (transformers' reset)."""
        if self.device is not None:
            self._pager.backend.release(self.device)
        self.device = self.host = self.ready = None
        self.start = self.length = self.capacity = 0
        self.shape = None

    def _fit(self, need: int) -> None:
        """Room for `need` live tokens from `start`: compact the live ones to the front, or move them into a buffer
        of the pages they need (growing, or shrinking once a sliding layer's window is smaller than its buffer)."""
        page = self._pager.page_tokens
        target = page * math.ceil(need / page) + (page if self.sliding else 0)
        oversized = self.capacity > target + page
        if self.start + need <= self.capacity and not oversized:
            return
        if need <= self.capacity and not oversized:  # compact in place
            k, v = self._split(self.device, self.capacity)
            live = self.live
            if self.start and live:
                k[:, :, :live].copy_(k[:, :, self.start:self.length].clone())
                v[:, :, :live].copy_(v[:, :, self.start:self.length].clone())
            self.start, self.length = 0, live
            return
        old_device, old_capacity, live = self.device, self.capacity, self.live
        freed = max(0, old_capacity - target) // page
        device = self._pager.allocate(self, self.token_bytes * target, keep=(self,))  # the old buffer still counts
        if old_device is not None and live:
            ok, ov = self._split(old_device, old_capacity)
            nk, nv = self._split(device, target)
            nk[:, :, :live].copy_(ok[:, :, self.start:self.length])
            nv[:, :, :live].copy_(ov[:, :, self.start:self.length])
        self.device, self.capacity, self.start, self.length = device, target, 0, live
        if old_device is not None:
            self._pager.backend.release(old_device)
        self.host = None  # sized for the old capacity
        self._pager.stats["pages_freed"] += freed


def _shares(keys: torch.Tensor, values: torch.Tensor, buf: torch.Tensor) -> bool:
    """Whether `keys` or `values` read the buffer `buf` (they must be copied out before it is rewritten)."""
    ptr = buf.untyped_storage().data_ptr()
    return any(t.numel() and t.untyped_storage().data_ptr() == ptr for t in (keys, values))
