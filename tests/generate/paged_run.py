"""generate() runs for the paged-KV tests: the same call on the plain model and on the offloaded one, compared
bitwise (tokens and every step's scores), under the host-read guard, with the KV pages offloaded under a budget that
leaves them no room."""
from __future__ import annotations

import itertools
from typing import Any

import torch

from offload import OffloadConfig, VramBudget, offload_module
from offload.generate.kv_cache import generate_kwargs, paged_generation
from tests.host_master_guard import host_master_guard

_caps = itertools.count(1)
PROMPT = torch.tensor([[1, 5, 9, 13, 7], [0, 0, 4, 8, 3]])  # the second row left-padded
MASK = (PROMPT != 0).long()
MASK[0, 0] = 1


def sim_config(**kw: Any) -> OffloadConfig:
    kw.setdefault("sim_capacity_bytes", (64 << 20) + 4096 * next(_caps) + 1)
    return OffloadConfig(device="sim", **kw)


VARIANTS = {
    "greedy": dict(do_sample=False),
    "sampled": dict(do_sample=True, top_k=20, temperature=0.9),
    "beam": dict(do_sample=False, num_beams=2, num_return_sequences=2),
    "static": dict(do_sample=False, cache_implementation="static"),
    "uncached": dict(do_sample=False, use_cache=False),
    "continued": dict(do_sample=False),
}


def run(model: Any, variant: str, inputs: dict | None = None, new_tokens: int = 8) -> list[torch.Tensor]:
    """Tokens and scores of one generate() call (`continued`: a second call from the cache the first returned)."""
    inputs = inputs or dict(input_ids=PROMPT, attention_mask=MASK)
    kw = dict(VARIANTS[variant], max_new_tokens=new_tokens, min_new_tokens=new_tokens, output_scores=True,
              return_dict_in_generate=True, pad_token_id=0)
    torch.manual_seed(1234)
    with torch.no_grad():
        out = model.generate(**inputs, **kw)
    got = [out.sequences, torch.stack(out.scores)]
    if getattr(out, "sequences_scores", None) is not None:
        got.append(out.sequences_scores)
    if variant == "continued":
        ids = torch.cat([out.sequences, torch.full((out.sequences.shape[0], 1), 11)], dim=1)
        mask = torch.cat([inputs.get("attention_mask", torch.ones_like(inputs["input_ids"])),
                          torch.ones(ids.shape[0], ids.shape[1] - inputs["input_ids"].shape[1], dtype=torch.long)],
                         dim=1) if "input_ids" in inputs else None
        more = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask", "decoder_input_ids")}
        if model.config.is_encoder_decoder:
            more["decoder_input_ids"] = ids
        else:
            more.update(input_ids=ids, attention_mask=mask)
        with torch.no_grad():
            out2 = model.generate(**more, **kw, **generate_kwargs(out.past_key_values))
        got += [out2.sequences, torch.stack(out2.scores)]
    return got


def offloaded(model: Any, mixed: bool, name: str) -> tuple[Any, Any, VramBudget]:
    """The model offloaded (streamed, or mixed: part resident) under a budget that is the weights' own need, so the
    KV pages have no room and leave the device; its KV pager (pages of 2 tokens)."""
    probe = offload_module(model, sim_config(vram_fraction=0.0, prefetch=1), budget=VramBudget(None), name=name)
    units = len(probe.report().blocks)
    weights = probe.budget_for(max(1, units // 3) if mixed else 0)
    probe.detach()
    budget = VramBudget(weights, origin="test")
    cfg = (sim_config(vram_budget_bytes=weights, prefetch=1, vram_fraction=1.0) if mixed
           else sim_config(vram_fraction=0.0, prefetch=1))
    handle = offload_module(model, cfg, budget=budget, name=name)
    resident = len(handle.streamer.resident_set)
    assert (0 < resident < units) if mixed else resident == 0, handle.plan_summary()
    return handle, handle.kv_pager(page_tokens=2), budget


def compare(model: Any, variants: list[str], mixed: bool, name: str, inputs: dict | None = None,
            new_tokens: int = 8) -> dict:
    """Each variant on the plain model, then offloaded with paged KV; asserts bitwise equality; returns the KV
    report of the offloaded runs."""
    refs = {v: run(model, v, inputs, new_tokens) for v in variants}
    handle, pager, budget = offloaded(model, mixed, name)
    try:
        with host_master_guard(handle), paged_generation(model, pager):
            for v in variants:
                got = run(model, v, inputs, new_tokens)
                assert len(got) == len(refs[v])
                for i, (a, b) in enumerate(zip(got, refs[v])):
                    assert a.shape == b.shape and torch.equal(a, b), f"{name} {v}: output {i} differs"
        return handle.report().kv
    finally:
        handle.detach()
