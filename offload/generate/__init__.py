"""Generation with transformers under the same budget: `kv_cache.paged_generation` wraps a `generate()` call so the
cache transformers builds for the model has its attention KV in pages (`kv_layers.py`: which layers; `kv_pages.py`:
the pager, a budget member, offloading whole layers to pinned host memory and copying them back ahead of use); the
TTS families use it for long generations. Needs transformers (imported where used).

Layer: beside stream/, below the entry points (`OffloadHandle.kv_pager`); imports nothing from offload/.
Used from outside: `kv_cache.KVPager`, `kv_cache.PagedKVCache`, `kv_cache.paged_generation`,
`kv_cache.generation_cache`, `kv_cache.generate_kwargs`.
"""
