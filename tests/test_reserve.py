"""The activation reserve before the first run: from a model's config where known, else a default."""
from __future__ import annotations

from types import SimpleNamespace

import torch.nn as nn

from offload.plan.planner import GIB, MIB, config_activation_bytes, default_reserve, estimate_reserve


class WithConfig(nn.Module):
    def __init__(self, **config):
        super().__init__()
        self.config = SimpleNamespace(**config)
        self.lin = nn.Linear(2, 2)


def test_transformers_style_config():
    m = WithConfig(hidden_size=4096, max_position_embeddings=2048)
    assert config_activation_bytes(m) == 12 * 2048 * 4096 * 2


def test_diffusers_style_config_uses_heads_times_head_dim_and_image_tokens():
    m = WithConfig(num_attention_heads=24, attention_head_dim=128)
    assert config_activation_bytes(m) == 12 * 4096 * 3072 * 2


def test_dict_config_and_no_config():
    m = nn.Linear(2, 2)
    m.config = {"d_model": 1024}
    assert config_activation_bytes(m) == 12 * 4096 * 1024 * 2
    assert config_activation_bytes(nn.Linear(2, 2)) is None
    assert config_activation_bytes(WithConfig(vocab_size=10)) is None


def test_estimate_is_bounded_by_the_device_and_falls_back_to_the_default():
    total = 16 * GIB
    plain = nn.Linear(2, 2)
    assert estimate_reserve(plain, total, "cuda") == default_reserve(total, "cuda")
    huge = WithConfig(hidden_size=1 << 20)
    assert estimate_reserve(huge, total, "cuda") == total // 2
    tiny = WithConfig(hidden_size=64)
    assert estimate_reserve(tiny, total, "cuda") == default_reserve(total, "cuda") // 2
    assert default_reserve(total, "cuda") >= 512 * MIB
