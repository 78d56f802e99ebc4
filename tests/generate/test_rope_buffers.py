"""Buffers a model re-registers in its forward keep the plain model's values across offload, detach and re-offload:
transformers' dynamic RoPE (tests/causal_lm_tester.py `test_model_rope_scaling_from_config("dynamic")` on the Llama
tester's config, max_position_embeddings 16 so a long input passes it) registers a new `inv_freq` for an input past
`max_position_embeddings` and, for the next short one, registers `original_inv_freq` itself as `inv_freq` (one
tensor under two names); a later long input re-registers `inv_freq` alone."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from offload import VramBudget, offload_module  # noqa: E402
from tests.generate.paged_run import sim_config  # noqa: E402
from tests.generate.tiny_testers import config_from_tester  # noqa: E402
from tests.host_master_guard import host_master_guard  # noqa: E402

SHORT = torch.tensor([[3, 4, 5, 6, 7]])
LONG = torch.arange(1, 25).unsqueeze(0)


def _run(model):
    with torch.no_grad():
        return [model(ids).logits for ids in (SHORT, LONG, SHORT, LONG, SHORT)]


def test_dynamic_rope_buffers_survive_offload_detach_and_a_mixed_reoffload():
    cfg = config_from_tester(transformers.LlamaConfig, num_hidden_layers=4, max_position_embeddings=16,
                             rope_parameters={"rope_type": "dynamic", "factor": 10.0, "rope_theta": 10000.0})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    plain = transformers.LlamaForCausalLM(cfg).eval()
    plain.load_state_dict(model.state_dict())
    ref = _run(plain)
    assert not torch.equal(ref[0], ref[1][:, :5]), "the long input changed the RoPE frequencies"
    probe = offload_module(model, sim_config(vram_fraction=0.0, prefetch=1), budget=VramBudget(None))
    mixed_budget = probe.budget_for(1)
    probe.detach()
    plans = [sim_config(vram_fraction=0.0, prefetch=1), sim_config(vram_budget_bytes=mixed_budget, prefetch=1)]
    for cfg_ in plans:
        handle = offload_module(model, cfg_, budget=VramBudget(None))
        with host_master_guard(handle):
            got = _run(model)
        assert all(torch.equal(a, b) for a, b in zip(got, _run(plain))), handle.plan_summary()
        handle.detach()
        rope, plain_rope = model.model.rotary_emb, plain.model.rotary_emb
        assert torch.equal(rope.inv_freq, plain_rope.inv_freq)
        assert torch.equal(rope.original_inv_freq, plain_rope.original_inv_freq)
        assert all(torch.equal(a, b) for a, b in zip(_run(model), _run(plain)))
