"""Which of transformers' cache layers are paged, and how: the cache transformers builds for a model's config, layer
by layer, with its attention keys and values moved into `KVPages`.

A paged layer is transformers' own layer class with `PagedFull` or `PagedSliding` in front (`paged_class`): every
method transformers has on it (mask sizes, beam reorder, crop, batch selection, hybrid conv / recurrent state) runs
as written, and reads or assigns `keys` / `values`, which are views of the pages. Paged:
- full attention (`DynamicLayer`, and the attention half of `LinearAttentionAndFullAttentionLayer`, and
  `DynamicIndexedLayer`'s keys and values, its indexer keys stay resident);
- sliding and chunked attention (`DynamicSlidingWindowLayer`, the attention half of
  `LinearAttentionAndSlidingWindowAttentionLayer`): only the window is kept; pages past it are freed.
Left as transformers made them, resident: linear-attention / state-space / conv layers (their state is a fixed size
per layer), `DummyLayer`, static and quantized layers, and any layer class with an `update` of its own.
"""
from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import (Cache, DynamicLayer, DynamicSlidingWindowLayer, EncoderDecoderCache)

from .kv_pages import KVPager, KVPages

_PAGED_UPDATES = (DynamicLayer.update, DynamicSlidingWindowLayer.update)
_classes: dict[type, type] = {}


class PagedFull:
    """In front of a transformers attention layer class: its keys and values live in `KVPages`."""

    _pages: KVPages
    _staged: dict[int, torch.Tensor]

    def _init_pages(self, pager: KVPager, priority: int) -> None:
        self.__dict__["_pages"] = KVPages(pager, priority, sliding=isinstance(self, DynamicSlidingWindowLayer))
        self.__dict__["_staged"] = {}

    def _visible_tail(self) -> int | None:
        return None

    def _read(self, which: int) -> torch.Tensor | None:
        staged = self._staged.get(which)
        if staged is not None:
            return staged
        pages = self._pages
        if pages.dtype is None:
            return None
        return pages.views(self._visible_tail())[which]

    def _write(self, which: int, value: Any) -> None:
        pages = self._pages
        if value is None:  # transformers' reset / __init__
            self._staged.clear()
            pages.free()
            pages.dtype = None
            return
        if value.dim() < 4:  # lazy_initialization's empty tensor: the dtype and device only
            self._staged.clear()
            pages.free()
            pages.set_dtype(value.dtype, value.device)
            return
        self._staged[which] = value
        if len(self._staged) == 2:  # both assigned (reorder, crop, batch selection): they become the pages
            keys, values = self._staged.pop(0), self._staged.pop(1)
            pages.replace(keys, values)

    keys = property(lambda self: self._read(0), lambda self, v: self._write(0, v))
    values = property(lambda self: self._read(1), lambda self, v: self._write(1, v))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self._pages.append(key_states, value_states)

    def get_seq_length(self) -> int:
        return self._pages.live if self.is_initialized else 0

    def offload(self) -> None:  # transformers' own offloading: the pager decides instead
        return None

    def prefetch(self) -> None:
        return None


class PagedSliding(PagedFull):
    """In front of `DynamicSlidingWindowLayer` (and its hybrids): the last `sliding_window - 1` tokens are kept (all
    of them while transformers records the past for a rollback), the pages before them are freed."""

    def _visible_tail(self) -> int | None:
        return None if self.record_past else max(self.sliding_window - 1, 0)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        if not self.record_past:
            return self._pages.append(key_states, value_states, keep=max(self.sliding_window - 1, 0))
        keys, values = self._pages.append(key_states, value_states)
        visible = self.sliding_window - 1 + key_states.shape[-2]
        return keys[:, :, -visible:], values[:, :, -visible:]

    def get_seq_length(self) -> int:
        return self.cumulative_length


def paged_class(cls: type) -> type | None:
    """The paged version of a transformers cache layer class, or None where the layer stays resident."""
    if cls in _classes:
        return _classes[cls]
    paged = None
    if issubclass(cls, PagedFull):
        paged = cls
    elif issubclass(cls, DynamicLayer) and cls.update in _PAGED_UPDATES:
        front = PagedSliding if issubclass(cls, DynamicSlidingWindowLayer) else PagedFull
        # `_layer_type = None`: transformers registers subclasses by it; the paged class must not replace its own
        paged = type(f"Paged{cls.__name__}", (front, cls), {"_layer_type": None, "__module__": __name__})
    _classes[cls] = paged
    return paged


def new_layer(cls: type, pager: KVPager, priority: int, **kwargs: Any) -> Any:
    """A fresh layer of transformers' class `cls` (constructor `kwargs`), paged where `paged_class` says so."""
    paged = paged_class(cls)
    if paged is None:
        return cls(**kwargs)
    layer = paged.__new__(paged)
    layer._init_pages(pager, priority)
    paged.__init__(layer, **kwargs)
    return layer


def page_layer(layer: Any, pager: KVPager, priority: int) -> Any:
    """`layer` (made by transformers, possibly holding tokens) as a paged layer of the same class; resident layers
    are returned as they are."""
    paged = paged_class(type(layer))
    if paged is None or isinstance(layer, PagedFull):
        return layer
    state = dict(layer.__dict__)
    keys, values = state.pop("keys", None), state.pop("values", None)
    new = paged.__new__(paged)
    new._init_pages(pager, priority)
    new.__dict__.update(state)
    if keys is not None:
        new.keys, new.values = keys, values
    return new


def page_cache(cache: Any, pager: KVPager, priority: int) -> int:
    """Move the attention layers of a transformers Cache (an EncoderDecoderCache's two caches too) into `pager`, in
    place; returns the number of layers paged (0: a cache kind that stays as it is: static, quantized, offloaded)."""
    if isinstance(cache, EncoderDecoderCache):
        return (page_cache(cache.self_attention_cache, pager, priority)
                + page_cache(cache.cross_attention_cache, pager, priority))
    if not isinstance(cache, Cache) or getattr(cache, "offloading", False):
        return 0
    cache.layers[:] = [page_layer(layer, pager, priority) for layer in cache.layers]
    replicate = cache.layer_class_to_replicate
    if replicate is not None and isinstance(replicate, type) and paged_class(replicate) is not None:
        cache.layer_class_to_replicate = lambda: new_layer(replicate, pager, priority)
    return sum(isinstance(layer, PagedFull) for layer in cache.layers) + (replicate is not None)
