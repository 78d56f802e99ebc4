"""transformers generate() with its KV cache paged under the model's budget: `paged_generation(model, pager)` makes
every cache generate builds for itself the one transformers would build (`DynamicCache(config=...)`, an
`EncoderDecoderCache` of two for encoder-decoder models, whatever a model's own `_prepare_cache_for_generation`
makes), with its attention layers' keys and values moved into the pager's pages (offload/generate/kv_layers.py says
which layers are paged; offload/generate/kv_pages.py how pages move). `PagedKVCache` is such a cache built directly.

A cache the caller passes (a returned paged cache to continue from, a StaticCache), a `cache_implementation` asked
for (static, offloaded, quantized), and `use_cache=False` are left to transformers.

Needs transformers >= 5 (its `Cache` / `CacheLayerMixin` layer API); the rest of the engine does not import this
module. The cache is handed to `generate()` and the models under the name transformers reads now (`cache`; older 5.x
releases: `past_key_values`, deprecated since and removed in 5.40): `CACHE_KWARG`, `generate_kwargs(cache)`.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator

from transformers.cache_utils import (DYNAMIC_LAYER_TYPE_MAPPING, Cache, DynamicCache, DynamicLayer,
                                      get_layer_types_and_kwargs)

from . import kv_pages
from .kv_layers import new_layer, page_cache
from .kv_pages import KVPages

__all__ = ["KVPager", "KVPages", "PagedKVCache", "paged_generation", "generation_cache", "generate_kwargs",
           "CACHE_KWARG", "decoder_layer_count"]

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


class KVPager(kv_pages.KVPager):
    """One model's KV pages under its budget (offload/generate/kv_pages.py), making transformers caches."""

    def new_cache(self, num_layers: int | None = None, priority: int = 1, config: Any = None) -> "PagedKVCache":
        """A transformers Cache whose attention layers live in this pager (`config`: the layers transformers' own
        `DynamicCache(config=...)` would make; `priority` 0 for a CFG cache: evicted first)."""
        return PagedKVCache(self, num_layers, priority, config=config)


class PagedKVCache(DynamicCache):
    """transformers' DynamicCache whose attention layers live in a KVPager (pass it as `**generate_kwargs(cache)`):
    with `config`, the layers `DynamicCache(config=config)` makes (sliding, chunked, hybrid and state-space layers
    included); else `num_layers` full-attention layers (or as many as the model updates)."""

    def __init__(self, pager: KVPager, num_layers: int | None = None, priority: int = 1, config: Any = None) -> None:
        self.pager = pager
        self.priority = priority
        pager.stats["caches"] += 1
        if config is not None:
            types, kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
            layers = [new_layer(DYNAMIC_LAYER_TYPE_MAPPING[t], pager, priority, **kw) for t, kw in zip(types, kwargs)]
            Cache.__init__(self, layers=layers)
        elif num_layers:
            Cache.__init__(self, layers=[new_layer(DynamicLayer, pager, priority) for _ in range(num_layers)])
        else:
            Cache.__init__(self, layer_class_to_replicate=self._new_layer)

    def _new_layer(self) -> Any:
        return new_layer(DynamicLayer, self.pager, self.priority)


def decoder_layer_count(model: Any) -> int | None:
    """The number of decoder layers from a transformers model's config (text config for multimodal models)."""
    config = getattr(model, "config", None)
    for cfg in (getattr(config, "text_config", None), getattr(config, "decoder_config", None), config):
        n = getattr(cfg, "num_hidden_layers", None) if cfg is not None else None
        if isinstance(n, int) and n > 0:
            return n
    return None


def _caller_decides(generation_config: Any, model_kwargs: dict) -> bool:
    """A cache passed in, a `cache_implementation` asked for, or `use_cache=False`: transformers' own path."""
    return (any(model_kwargs.get(k) is not None for k in _CACHE_KWARGS)
            or generation_config.cache_implementation is not None or generation_config.use_cache is False)


@contextlib.contextmanager
def generation_cache(model: Any, make: Callable[[int, tuple, dict], Any]) -> Iterator[None]:
    """While inside, the cache `model.generate` would create for itself is `make(num_layers, args, kwargs)` (the
    arguments transformers passes to `_prepare_cache_for_generation` after the config and model kwargs); a cache
    the caller passed, a `cache_implementation` asked for, and `use_cache=False` are left to transformers."""
    original = model._prepare_cache_for_generation
    num_layers = decoder_layer_count(model)

    def prepare(generation_config: Any, model_kwargs: dict, *args: Any, **kwargs: Any) -> Any:
        if _caller_decides(generation_config, model_kwargs):
            return original(generation_config, model_kwargs, *args, **kwargs)
        model_kwargs[CACHE_KWARG] = make(num_layers, args, kwargs)
        return None

    model._prepare_cache_for_generation = prepare
    try:
        yield
    finally:
        model.__dict__.pop("_prepare_cache_for_generation", None)


@contextlib.contextmanager
def paged_generation(model: Any, pager: KVPager) -> Iterator[None]:
    """While inside, every cache `model.generate` creates for itself is the one transformers would create (its own
    `_prepare_cache_for_generation` runs), with its attention keys and values in `pager`: an encoder-decoder
    model's self- and cross-attention caches both; for VibeVoice both the positive and the CFG-negative cache (the
    negative one is evicted first). State-space, conv and recurrent state stays in transformers' layers."""
    original = model._prepare_cache_for_generation

    def prepare(generation_config: Any, model_kwargs: dict, *args: Any, **kwargs: Any) -> Any:
        if _caller_decides(generation_config, model_kwargs):
            return original(generation_config, model_kwargs, *args, **kwargs)
        result = original(generation_config, model_kwargs, *args, **kwargs)
        cache = next((model_kwargs[k] for k in _CACHE_KWARGS if model_kwargs.get(k) is not None), None)
        if cache is None:
            return result  # a model that makes its cache in its own forward (mamba-style legacy caches)
        negative = "negative" in str(kwargs.get("max_length_attr_name", "")) or any(
            "negative" in str(a) for a in args if isinstance(a, str))
        if page_cache(cache, pager, priority=0 if negative else 1):
            pager.stats["caches"] += 1
        else:
            log.info("%s: generate made a %s; it stays as transformers made it (not paged)", pager.name,
                     type(cache).__name__)
        return result

    model._prepare_cache_for_generation = prepare
    try:
        yield
    finally:
        model.__dict__.pop("_prepare_cache_for_generation", None)
