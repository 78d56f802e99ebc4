"""Generation with transformers under the same budget: `kv_cache.KVPager` / `PagedKVCache` page a decoder's KV cache
to pinned host memory and copy it back ahead of use; `paged_generation` wraps a `generate()` call; the TTS
families use it for long generations. Needs transformers (imported where used).

Layer: beside stream/, below the entry points (`OffloadHandle.kv_pager`); imports nothing from offload/.
Used from outside: `kv_cache.KVPager`, `kv_cache.PagedKVCache`, `kv_cache.paged_generation`,
`kv_cache.generation_cache`.
"""
