"""generate() on tiny transformers models built as transformers' own model tests build them (tests/generate/
tiny_testers.py names the file each imitates), across every cache kind (full, sliding, hybrid sliding/global,
chunked, recurrent, state-space and linear-attention hybrids, encoder-decoder): greedy, sampled (seeded), beam,
static cache, continued from the returned cache, and uncached, with the weights streamed (or mixed: part resident)
and the KV cache paged by `paged_generation`, equal to the plain model bitwise (tokens and every step's scores),
under the host-read guard, with the KV pages leaving the device at every step under a budget with no room for them."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from offload import VramBudget  # noqa: E402
from offload.backends import get_backend  # noqa: E402
from offload.generate.kv_cache import KVPager, PagedKVCache, generate_kwargs, paged_generation  # noqa: E402
from tests.generate.paged_run import MASK, PROMPT, compare, offloaded, sim_config  # noqa: E402
from tests.generate.tiny_testers import DECODERS, ENCODER_DECODERS, seq2seq_inputs, config_from_tester  # noqa: E402

ALL = DECODERS + ENCODER_DECODERS
OTHERS = ["sampled", "beam", "static", "continued", "uncached"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matmuls on a shared 2-core box: one thread is 30x faster than a contended pool."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _variants(i: int) -> list[str]:
    """Greedy everywhere, and two of the others in turn (every variant meets every cache kind across the list)."""
    return ["greedy", OTHERS[(2 * i) % len(OTHERS)], OTHERS[(2 * i + 1) % len(OTHERS)]]


@pytest.mark.parametrize("i", range(len(ALL)), ids=[t.name for t in ALL])
def test_generate_streamed_with_paged_kv_equals_the_plain_model(i):
    tiny = ALL[i]
    model = tiny.build()
    inputs = seq2seq_inputs(tiny.name) if tiny.kind == "encoder-decoder" else None
    variants = _variants(i)
    kv = compare(model, variants, mixed=bool(i % 2), name=tiny.name, inputs=inputs, new_tokens=tiny.new_tokens)
    if tiny.kind == "state-space":  # no attention layer: nothing to page, transformers' own state stays
        assert kv["caches"] == 0 and kv["offloads"] == 0, kv
        return
    cached_runs = sum(v not in ("uncached", "static") for v in variants)  # a continued call brings its cache
    assert kv["caches"] == cached_runs, kv
    steps = sum(tiny.new_tokens * (2 if v == "continued" else 1) for v in variants if v not in ("uncached", "static"))
    assert kv["offloads"] >= steps, f"pages left the device fewer times than there were steps: {kv}"
    assert kv["device_bytes"] == 0, "generate's caches are gone with it"


def test_sliding_layers_keep_only_the_window_and_free_the_pages_past_it():
    """tests/models/mistral/test_modeling_mistral.py's tester with a window of 4: a prompt of 12 and 16 new tokens;
    the sliding layers' pages stay at the window (pages past it freed), keys equal transformers' own layer's."""
    cfg = config_from_tester(transformers.MistralConfig, sliding_window=4, num_hidden_layers=2)
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(cfg).eval()
    ids = torch.arange(3, 15).unsqueeze(0)
    kw = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0, output_scores=True,
              return_dict_in_generate=True)
    ref_cache = transformers.DynamicCache(config=cfg)
    with torch.no_grad():
        ref = model.generate(ids, **kw, **generate_kwargs(ref_cache))
    pager = KVPager(get_backend(sim_config()), VramBudget(32 << 20), "mistral", page_tokens=2)
    cache = PagedKVCache(pager, config=cfg)
    with torch.no_grad():
        out = model.generate(ids, **kw, **generate_kwargs(cache))
    assert torch.equal(out.sequences, ref.sequences) and torch.equal(torch.stack(out.scores), torch.stack(ref.scores))
    for layer, ref_layer in zip(cache.layers, ref_cache.layers):
        assert layer.is_sliding and type(layer).__name__ == "PagedDynamicSlidingWindowLayer"
        assert torch.equal(layer.keys, ref_layer.keys) and torch.equal(layer.values, ref_layer.values)
        assert layer.get_seq_length() == ref_layer.get_seq_length() == 12 + 16 - 1
        assert layer._pages.capacity <= 4 + 2 * 2, "a window of 4 in pages of 2, one spare page"
    assert pager.report()["pages_freed"] > 0, "the prompt's pages past the window were given back"


def test_beam_search_reorders_the_pages():
    """Beam search assigns each layer's reordered keys/values: they land in the pages (tests/models/llama)."""
    model = DECODERS[0].build()
    ref = _beam(model)
    pager = KVPager(get_backend(sim_config()), VramBudget(32 << 20), "llama", page_tokens=2)
    with paged_generation(model, pager):
        got = _beam(model)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert pager.stats["caches"] == 1


def _beam(model):
    with torch.no_grad():
        out = model.generate(input_ids=PROMPT, attention_mask=MASK, num_beams=3, num_return_sequences=2,
                             max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0,
                             output_scores=True, return_dict_in_generate=True)
    return [out.sequences, out.sequences_scores, torch.stack(out.scores)]


def test_use_cache_false_fills_no_cache():
    model = DECODERS[0].build()
    handle, pager, _ = offloaded(model, mixed=False, name="llama")
    try:
        with paged_generation(model, pager), torch.no_grad():
            model.generate(input_ids=PROMPT, attention_mask=MASK, max_new_tokens=4, use_cache=False, pad_token_id=0)
        assert pager.stats["caches"] == 0 and pager.stats["offloads"] == 0 and not pager.layers()
    finally:
        handle.detach()


def test_encoder_decoder_gets_two_paged_caches():
    """T5 (tests/models/t5/test_modeling_t5.py): self- and cross-attention in two paged caches of one
    EncoderDecoderCache, the cross one written once from the encoder."""
    model = ENCODER_DECODERS[0].build()
    pager = KVPager(get_backend(sim_config()), VramBudget(32 << 20), "t5", page_tokens=2)
    with paged_generation(model, pager), torch.no_grad():
        out = model.generate(**seq2seq_inputs("t5"), max_new_tokens=5, min_new_tokens=5, return_dict_in_generate=True)
    cache = out.past_key_values
    assert isinstance(cache, transformers.EncoderDecoderCache)
    for sub, length in ((cache.self_attention_cache, 5), (cache.cross_attention_cache, 5)):
        assert all(type(layer).__name__ == "PagedDynamicLayer" for layer in sub.layers)
        assert all(layer.get_seq_length() == length for layer in sub.layers)


def test_crop_rolls_the_pages_back_as_transformers_rolls_its_cache_back():
    """`Cache.crop` (assisted decoding's rollback) slices each layer's keys and values: the pages follow."""
    model = DECODERS[0].build()
    ids = torch.tensor([[1, 5, 9, 13, 7, 3, 4]])
    ref = transformers.DynamicCache(config=model.config)
    pager = KVPager(get_backend(sim_config()), VramBudget(32 << 20), "llama", page_tokens=2)
    paged = PagedKVCache(pager, config=model.config)
    with torch.no_grad():
        model(ids, **generate_kwargs(ref))
        model(ids, **generate_kwargs(paged))
        ref.crop(-3)
        paged.crop(-3)
        assert paged.get_seq_length() == ref.get_seq_length() == 4
        step = torch.tensor([[8]])
        assert torch.equal(model(step, **generate_kwargs(paged)).logits, model(step, **generate_kwargs(ref)).logits)
    assert all(torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
               for a, b in zip(paged.layers, ref.layers))
