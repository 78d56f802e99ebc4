"""BERT-family encoders whose layers run their feed-forward through transformers' `apply_chunking_to_forward`,
streamed bitwise under every preset (issue 41).

`apply_chunking_to_forward(self.feed_forward_chunk, chunk_size, dim, x)` counts the parameters of
`inspect.signature(feed_forward_chunk)` first (whatever the chunk size); a method wrapper that hid the signature
raised "forward_chunk_fn expects 2 arguments, but only 1 input tensors are given" in every such layer, so AudioLDM2
(its CLAP text encoder, tests/pipelines/audio_pipelines.py) failed under the budget preset.

Configs and inputs imitate transformers' own model testers: tests/models/bert/test_modeling_bert.py
(`BertModelTester`), tests/models/roberta/test_modeling_roberta.py (`RobertaModelTester`; XLM-RoBERTa's own test file
holds only hub integration tests and its model is RoBERTa's, so the same tester's config builds it), and
tests/models/clap/test_modeling_clap.py (`ClapTextModelTester`): batch, sequence length, vocabulary, widths and depths
as there, inputs as `ids_tensor` / `random_attention_mask` draw them. `chunk_size_feed_forward` = 1, as
test_modeling_common's `test_feed_forward_chunking` sets it, so the chunked path runs (seven chunks per layer).
"""
from __future__ import annotations

import pytest
import torch

from offload import PRESETS, OffloadConfig
from offload.stream.method_entry import MethodEntry
from tests.host_master_guard import host_master_guard

transformers = pytest.importorskip("transformers")

# BertModelTester / RobertaModelTester defaults (batch 13, sequence 7)
_BERT = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
             hidden_act="gelu", hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, max_position_embeddings=512,
             type_vocab_size=16, initializer_range=0.02)
# ClapTextModelTester defaults (batch 12, sequence 7)
_CLAP_TEXT = dict(vocab_size=99, hidden_size=32, projection_dim=32, num_hidden_layers=5, num_attention_heads=4,
                  intermediate_size=37, dropout=0.1, attention_dropout=0.1, max_position_embeddings=512,
                  initializer_range=0.02, projection_hidden_act="relu")

FAMILIES = {
    "bert": ("BertConfig", "BertModel", _BERT, 13, True),
    "roberta": ("RobertaConfig", "RobertaModel", _BERT, 13, True),
    "xlm_roberta": ("XLMRobertaConfig", "XLMRobertaModel", _BERT, 13, True),
    "clap_text": ("ClapTextConfig", "ClapTextModelWithProjection", _CLAP_TEXT, 12, False),
}
SEQ = 7


def _inputs(family: str) -> dict[str, torch.Tensor]:
    """ids_tensor / random_attention_mask as the testers draw them (a mask whose last column is 1)."""
    _, _, cfg, batch, token_types = FAMILIES[family]
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, cfg["vocab_size"], (batch, SEQ), generator=g)
    mask = torch.randint(0, 2, (batch, SEQ), generator=g)
    mask[:, -1] = 1
    out = {"input_ids": ids, "attention_mask": mask}
    if token_types:
        out["token_type_ids"] = torch.randint(0, cfg["type_vocab_size"], (batch, SEQ), generator=g)
    return out


def _build(family: str) -> torch.nn.Module:
    config_cls, model_cls, cfg, _, _ = FAMILIES[family]
    config = getattr(transformers, config_cls)(**cfg, chunk_size_feed_forward=1)
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(config).eval()


def _outputs(out) -> list[torch.Tensor]:
    return [v for v in out.values() if torch.is_tensor(v)]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_chunked_feed_forward_streams_bitwise_under_every_preset(family, offload):
    model = _build(family)
    x = _inputs(family)
    layers = [m for m in model.modules() if hasattr(m, "feed_forward_chunk")]
    assert layers and all(m.chunk_size_feed_forward == 1 for m in layers)  # the chunked path runs
    with torch.no_grad():
        want = _outputs(model(**x))
    for preset in PRESETS:
        handle = offload(model, OffloadConfig.from_preset(preset, device="sim"))
        # the chunk function computes with the layer's weights (its children's): wrapped, and looks unwrapped
        assert all(type(m.feed_forward_chunk) is MethodEntry for m in layers)
        blocks = handle.report().blocks
        assert blocks and (preset != "budget" or all(b.tier != "vram" for b in blocks))  # budget: every layer streams
        for _ in range(2):
            with torch.no_grad(), host_master_guard(handle):
                got = _outputs(model(**x))
            assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want)), (family, preset)
        handle.detach()
