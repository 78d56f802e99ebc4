"""A paged KV cache for transformers decoders: pages on the device while they fit the model's budget, in host
memory when they do not, copied back ahead of use.

Each layer's keys and values grow in fixed-size pages of `page_tokens` tokens, held in one device buffer per layer
(so attention reads them as one tensor and writes into them, such as VibeVoice's negative-branch reset, land in
the cache). Pages are the unit of growth and of accounting. A `KVPager` serves every cache of one model (the
positive and the CFG cache of a TTS model) and is a member of the same `VramBudget` as the weights: the weights
take their share first (same priority, registered first), the cache gets what is left, and at least one layer.

When a layer must grow or come back and its model's KV share is full, whole layers (attention reads all of a
layer's pages) go to pinned host memory: the one whose next use is furthest away first (for the cyclic layer
order of a decoder that is the layer that ran last; lower-priority caches, the CFG one, before the others). While
layer i computes, the pages of the layer that came next last time are copied back on the transfer stream; its
update waits GPU-side for that copy. Restores come first: room for a layer needed now or next is made by
offloading others, never the other way round. Offloads wait for their device-to-host copy before the device
memory is reused. Keys and values are never changed: outputs are identical with and without offloading.

Needs transformers >= 5 (its `Cache` / `CacheLayerMixin` layer API); the rest of the engine does not import this
module. The cache is handed to `generate()` and the models under the name transformers reads now (`cache`; older 5.x
releases: `past_key_values`, deprecated since and removed in 5.40): `CACHE_KWARG`, `generate_kwargs(cache)`.
"""
from __future__ import annotations

import contextlib
import logging
import math
import threading
import weakref
from typing import Any, Callable, Iterator

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

log = logging.getLogger(__name__)


def _cache_kwarg() -> str:
    """The keyword generate() and the models take a Cache under in the installed transformers."""
    try:
        from transformers.generation.utils import ALL_CACHE_NAMES
    except ImportError:  # pragma: no cover - very old layouts
        return "past_key_values"
    return "cache" if "cache" in ALL_CACHE_NAMES else "past_key_values"


CACHE_KWARG = _cache_kwarg()
_CACHE_KWARGS = tuple(dict.fromkeys((CACHE_KWARG, "cache", "past_key_values")))


def generate_kwargs(cache: "Cache") -> dict[str, "Cache"]:
    """`{name: cache}` for `model.generate(**...)` / a forward, under the name the installed transformers reads."""
    return {CACHE_KWARG: cache}


class KVPager:
    """One model's KV pages on the device and in host memory; a member of the model's VramBudget."""

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
                      "prefetched": 0}
        budget.register(self)

    def new_cache(self, num_layers: int | None = None, priority: int = 1) -> "PagedKVCache":
        """A transformers Cache whose layers live in this pager (`priority` 0 for a CFG cache: evicted first)."""
        self.stats["caches"] += 1
        return PagedKVCache(self, num_layers, priority)

    # layers ---------------------------------------------------------------------------
    def _add(self, layer: "PagedKVLayer") -> None:
        with self._lock:
            self._layers = [r for r in self._layers if r() is not None]
            self._layers.append(weakref.ref(layer))

    def layers(self) -> list["PagedKVLayer"]:
        """The live layers that have seen keys (so their page size is known)."""
        return [layer for layer in (r() for r in self._layers)
                if layer is not None and getattr(layer, "is_initialized", False)]

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
    def using(self, layer: "PagedKVLayer") -> Iterator[None]:
        with self._lock:
            self._busy += 1
            self._clock += 1
            layer.last_use = self._clock
            try:
                yield
            finally:
                self._busy -= 1

    def make_resident(self, layer: "PagedKVLayer") -> None:
        """Bring an offloaded layer back (waiting, GPU-side, for a prefetch already under way)."""
        if layer.on_device:
            if layer.ready is not None:
                self.backend.wait(layer.ready)
                layer.ready = None
            return
        self._restore(layer, keep=(layer,))
        self.backend.wait(layer.ready)
        layer.ready = None

    def allocate(self, layer: "PagedKVLayer", nbytes: int, keep: tuple) -> torch.Tensor:
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

    def after_update(self, layer: "PagedKVLayer") -> None:
        """Learn which layer comes next, and start bringing back the one expected after this one."""
        last = self._last() if self._last is not None else None
        if last is not None and last is not layer:
            last.next_ref = weakref.ref(layer)
        self._last = weakref.ref(layer)
        nxt = layer.next_ref() if layer.next_ref is not None else None
        if nxt is not None and nxt.buffer_bytes and not nxt.on_device and self.offload_enabled:
            self._restore(nxt, keep=(layer, nxt))
            self.stats["prefetched"] += 1

    # moving pages --------------------------------------------------------------------------
    def _eviction_order(self, keep: tuple) -> list["PagedKVLayer"]:
        """Device-resident layers that may go: lower-priority caches first, then the furthest next use (the most
        recently used in a decoder's cyclic order)."""
        current = self._last() if self._last is not None else None
        nxt = current.next_ref() if current is not None and current.next_ref is not None else None
        protected = {id(x) for x in keep} | {id(current), id(nxt)}
        candidates = [x for x in self.layers() if x.on_device and id(x) not in protected]
        candidates.sort(key=lambda x: (x.priority, -x.last_use))
        return candidates

    def _offload(self, layer: "PagedKVLayer") -> None:
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

    def _restore(self, layer: "PagedKVLayer", keep: tuple) -> None:
        n = layer.buffer_bytes
        layer.device = self.allocate(layer, n, keep)
        layer.ready = self.backend.copy_h2d(layer.device[:n], layer.host[:n], None)
        layer.bind()
        self.stats["restores"] += 1
        self.stats["bytes_restored"] += n

    def report(self) -> dict[str, Any]:
        """Pages on the device / in host memory, and what moved (for the model's report)."""
        layers = self.layers()
        resident = sum(x.pages for x in layers if x.on_device)
        return {"page_tokens": self.page_tokens, "pages_resident": resident,
                "pages_offloaded": sum(x.pages for x in layers) - resident,
                "device_bytes": self.device_bytes(), "host_bytes": self.host_bytes(), **self.stats}


class PagedKVLayer(CacheLayerMixin):
    """One decoder layer's keys and values: `[2, batch, kv_heads, capacity, head_dim]` in one buffer that grows by
    pages, on the device or (offloaded) in pinned host memory."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, pager: KVPager, priority: int = 1) -> None:
        self._pager = pager
        self.priority = priority
        self.device: torch.Tensor | None = None  # flat uint8 buffer on the device
        self.host: torch.Tensor | None = None  # flat uint8 pinned host copy (kept for the next offload)
        self.ready: Any = None  # event of a restore under way
        self.length = 0
        self.capacity = 0
        self.last_use = 0
        self.next_ref: weakref.ReferenceType | None = None
        self._kv: torch.Tensor | None = None
        super().__init__()
        pager._add(self)

    # keys / values are views of the buffer (a write into them lands in the cache) ------------------------------
    @property
    def keys(self) -> torch.Tensor | None:  # type: ignore[override]
        return self._view(0)

    @keys.setter
    def keys(self, value: Any) -> None:
        if value is not None:
            raise AttributeError("PagedKVLayer.keys is a view of its pages; write into it instead")

    @property
    def values(self) -> torch.Tensor | None:  # type: ignore[override]
        return self._view(1)

    @values.setter
    def values(self, value: Any) -> None:
        if value is not None:
            raise AttributeError("PagedKVLayer.values is a view of its pages; write into it instead")

    def _view(self, which: int) -> torch.Tensor | None:
        if not getattr(self, "is_initialized", False):
            return None
        if not self.on_device:
            with self._pager.using(self):
                self._pager.make_resident(self)
        return self._kv[which, :, :, :self.length]

    @property
    def on_device(self) -> bool:
        return self.device is not None

    @property
    def token_bytes(self) -> int:
        return 2 * self.batch * self.heads * self.head_dim * self.dtype.itemsize if self.is_initialized else 0

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

    def bind(self) -> None:
        """Views of the device buffer as [2, batch, heads, capacity, head_dim]."""
        n = self.buffer_bytes
        self._kv = self.device[:n].view(self.dtype).view(2, self.batch, self.heads, self.capacity, self.head_dim)

    # the CacheLayerMixin protocol ------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.compute_device = key_states.dtype, key_states.device
        self.batch, self.heads, _, self.head_dim = key_states.shape
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        pager = self._pager
        with pager.using(self):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            new = key_states.shape[-2]
            need = self.length + new
            if self.buffer_bytes:
                pager.make_resident(self)
            if need > self.capacity:
                self._grow(need)
            self._kv[0, :, :, self.length:need].copy_(key_states)
            self._kv[1, :, :, self.length:need].copy_(value_states)
            self.length = need
            pager.after_update(self)
            return self._kv[0, :, :, :need], self._kv[1, :, :, :need]

    def _grow(self, need: int) -> None:
        pager = self._pager
        capacity = pager.page_tokens * math.ceil(need / pager.page_tokens)
        device = pager.allocate(self, self.token_bytes * capacity, keep=(self,))  # the old buffer still counts
        old_kv, old_device, old_length = self._kv, self.device, self.length
        self.device, self.capacity = device, capacity
        self.bind()
        if old_kv is not None and old_length:
            self._kv[:, :, :, :old_length].copy_(old_kv[:, :, :, :old_length])
        del old_kv
        if old_device is not None:
            pager.backend.release(old_device)
        self.host = None  # sized for the old capacity

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def offload(self) -> None:  # transformers' own offloading API: the pager decides instead
        return None

    def prefetch(self) -> None:
        return None

    def reset(self) -> None:
        self.length = 0


class PagedKVCache(Cache):
    """A transformers Cache whose layers live in a KVPager (pass it as `**generate_kwargs(cache)`)."""

    def __init__(self, pager: KVPager, num_layers: int | None = None, priority: int = 1) -> None:
        self.pager = pager
        self.priority = priority
        if num_layers:
            super().__init__(layers=[PagedKVLayer(pager, priority) for _ in range(num_layers)])
        else:
            super().__init__(layer_class_to_replicate=self._new_layer)

    def _new_layer(self) -> PagedKVLayer:
        return PagedKVLayer(self.pager, self.priority)


def decoder_layer_count(model: Any) -> int | None:
    """The number of decoder layers from a transformers model's config (text config for multimodal models)."""
    config = getattr(model, "config", None)
    for cfg in (getattr(config, "text_config", None), getattr(config, "decoder_config", None), config):
        n = getattr(cfg, "num_hidden_layers", None) if cfg is not None else None
        if isinstance(n, int) and n > 0:
            return n
    return None


@contextlib.contextmanager
def generation_cache(model: Any, make: Callable[[int, tuple, dict], Any]) -> Iterator[None]:
    """While inside, the cache `model.generate` would create for itself is `make(num_layers, args, kwargs)` (the
    arguments transformers passes to `_prepare_cache_for_generation` after the config and model kwargs); a cache
    the caller passed, or a `cache_implementation` asked for, is left to transformers."""
    original = model._prepare_cache_for_generation
    num_layers = decoder_layer_count(model)

    def prepare(generation_config: Any, model_kwargs: dict, *args: Any, **kwargs: Any) -> Any:
        if (any(model_kwargs.get(k) is not None for k in _CACHE_KWARGS)
                or generation_config.cache_implementation is not None):
            return original(generation_config, model_kwargs, *args, **kwargs)
        model_kwargs[CACHE_KWARG] = make(num_layers, args, kwargs)
        return None

    model._prepare_cache_for_generation = prepare
    try:
        yield
    finally:
        model.__dict__.pop("_prepare_cache_for_generation", None)


def paged_generation(model: Any, pager: KVPager) -> contextlib.AbstractContextManager[None]:
    """While inside, every cache `model.generate` creates for itself is a PagedKVCache in `pager` (for VibeVoice
    both the positive and the CFG-negative cache; the negative one is evicted first)."""

    def make(num_layers: int, args: tuple, kwargs: dict) -> PagedKVCache:
        negative = "negative" in str(kwargs.get("max_length_attr_name", "")) or any(
            "negative" in str(a) for a in args if isinstance(a, str))
        return pager.new_cache(num_layers, priority=0 if negative else 1)

    return generation_cache(model, make)
