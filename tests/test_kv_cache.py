"""The paged KV cache (offload/generate/kv_cache.py) on tiny transformers decoders: identical tokens and scores with and
without paging and offloading, pages moving to host memory and back ahead of use, the budget holding, and no
transformers deprecation warning on the way (pyproject.toml turns transformers' FutureWarnings into errors)."""
from __future__ import annotations

import itertools
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from offload import OffloadConfig, VramBudget, offload_module  # noqa: E402
from offload.generate.kv_cache import KVPager, PagedKVCache, generate_kwargs, paged_generation  # noqa: E402

_caps = itertools.count(1)


def tiny_decoder(kind: str, layers: int = 4):
    torch.manual_seed(0)
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    if kind == "qwen2":
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=True)
        model = transformers.Qwen2ForCausalLM(cfg)
    else:
        cfg = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(cfg)
    for p in model.parameters():  # fresh, aligned storage (see the alignment note in the TTS tests)
        p.data = p.data.clone()
    return model.eval()


def generate(model, cache=None, tokens: int = 40):
    ids = torch.tensor([[1, 5, 9, 13, 2, 7]])
    kwargs = dict(max_new_tokens=tokens, do_sample=False, output_scores=True, return_dict_in_generate=True,
                  pad_token_id=0, min_new_tokens=tokens)
    if cache is not None:
        kwargs.update(generate_kwargs(cache))
    with torch.no_grad():
        out = model.generate(ids, **kwargs)
    return out.sequences, torch.stack(out.scores)


def _cfg(**kw):
    kw.setdefault("sim_capacity_bytes", (64 << 20) + 4096 * next(_caps) + 1)
    return OffloadConfig.from_preset("budget", device="sim", **kw)


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_paged_cache_alone_gives_identical_tokens_and_scores(kind):
    model = tiny_decoder(kind)
    ref_seq, ref_scores = generate(model)
    backend_cfg = _cfg()
    from offload.backends import get_backend

    pager = KVPager(get_backend(backend_cfg), VramBudget(32 << 20), "plain", page_tokens=8)
    cache = PagedKVCache(pager, model.config.num_hidden_layers)
    seq, scores = generate(model, cache)
    assert torch.equal(seq, ref_seq) and torch.equal(scores, ref_scores)
    rep = pager.report()
    assert rep["pages_resident"] == model.config.num_hidden_layers * 6  # 46 tokens in pages of 8
    assert rep["offloads"] == 0, "a roomy budget offloads nothing"


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_offloaded_pages_come_back_ahead_of_use_and_outputs_stay_identical(kind):
    """A KV share of about two layers: the rest of the pages live in host memory; every step brings layers back
    (mostly prefetched while the layer before computes); tokens and scores are bitwise those of a DynamicCache."""
    model = tiny_decoder(kind)
    ref_seq, ref_scores = generate(model)
    layers = model.config.num_hidden_layers
    per_layer = 2 * 2 * 16 * 48 * 4  # k and v, 2 kv heads, head_dim 16, 48 tokens (6 pages of 8), fp32
    handle = offload_module(model, _cfg(), budget=VramBudget(None))
    weights = handle.budget_for(0)
    budget = VramBudget(weights + 2 * per_layer + 4096, origin="test")
    handle.detach()
    handle = offload_module(model, _cfg(), budget=budget, name=kind)
    pager = handle.kv_pager(page_tokens=8)
    cache = pager.new_cache(layers)
    seq, scores = generate(model, cache)
    assert torch.equal(seq, ref_seq) and torch.equal(scores, ref_scores)
    rep = handle.report().kv
    assert rep["offloads"] > 0 and rep["restores"] > 0, rep
    assert rep["prefetched"] > rep["restores"] // 2, "most layers come back ahead of use"
    assert rep["pages_offloaded"] > 0 and rep["host_bytes"] > 0
    assert budget.used_bytes <= budget.total_bytes + per_layer // 6, "the budget holds (within a page)"
    handle.detach()
    seq2, scores2 = generate(model)
    assert torch.equal(seq2, ref_seq) and torch.equal(scores2, ref_scores)


def test_paged_generation_gives_generate_its_caches():
    """`paged_generation` hands generate() paged caches without the caller building one."""
    model = tiny_decoder("qwen2")
    ref_seq, ref_scores = generate(model)
    handle = offload_module(model, _cfg(), budget=VramBudget(None))
    pager = handle.kv_pager(page_tokens=16)
    with paged_generation(model, pager):
        seq, scores = generate(model)
    assert torch.equal(seq, ref_seq) and torch.equal(scores, ref_scores)
    kv = handle.report().kv
    assert kv["caches"] == 1, "generate used a paged cache"
    assert kv["pages_resident"] == 0 and kv["device_bytes"] == 0, "generate's own caches are gone with it"
    assert "_prepare_cache_for_generation" not in model.__dict__, "the model is left as it was"
    handle.detach()


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
@pytest.mark.parametrize("how", ["explicit", "paged_generation"])
def test_paged_generation_raises_no_future_warning(kind, how):
    """transformers' current cache API: no FutureWarning (a deprecated `past_key_values`, a cache given twice) while
    paged generation runs, whatever the test run's warning filters; tokens equal the resident model's."""
    model = tiny_decoder(kind)
    ref_seq, ref_scores = generate(model)
    handle = offload_module(model, _cfg(), budget=VramBudget(None))
    pager = handle.kv_pager(page_tokens=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if how == "explicit":
            seq, scores = generate(model, pager.new_cache(model.config.num_hidden_layers))
        else:
            with paged_generation(model, pager):
                seq, scores = generate(model)
    future = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    assert future == [], future
    assert torch.equal(seq, ref_seq) and torch.equal(scores, ref_scores)
    assert handle.report().kv["caches"] == 1, "the paged cache was used"
    handle.detach()


def test_kv_pages_count_against_the_shared_budget_and_are_freed_with_the_cache():
    model = tiny_decoder("llama")
    budget = VramBudget(None)
    handle = offload_module(model, _cfg(), budget=budget)
    pager = handle.kv_pager(page_tokens=8)
    cache = pager.new_cache(model.config.num_hidden_layers)
    generate(model, cache)
    with_cache = budget.used_bytes
    assert pager.device_bytes() > 0 and with_cache == handle.device_bytes() + pager.device_bytes()
    del cache
    assert pager.device_bytes() == 0 and budget.used_bytes == handle.device_bytes()
    handle.detach()
    assert budget.members == []


def test_pager_rejects_a_bad_page_size():
    from offload.backends import get_backend

    with pytest.raises(ValueError, match="page_tokens"):
        KVPager(get_backend(OffloadConfig(device="sim")), VramBudget(1 << 20), "x", page_tokens=0)
