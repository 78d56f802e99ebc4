"""Moshi's own generate() (tests/models/moshi/test_modeling_moshi.py MoshiTester.get_config): the user's and Moshi's
audio go through Mimi's encoder and quantizer (`.encode()`), the codes come back through `.decode()`, the text
decoder's KV cache is paged by `paged_generation` (the depth decoder's per-step caches stay transformers' own); every
block streamed: tokens, codes and waveform equal the plain model's bitwise under the host-read guard. (Dia, CSM and
Higgs Audio v2 run the same way through the TTS families: tests/tts/test_tts_families.py.)"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "MoshiForConditionalGeneration"):
    pytest.skip("the installed transformers has no Moshi", allow_module_level=True)

from offload.generate.kv_cache import paged_generation  # noqa: E402
from tests.generate.paged_run import offloaded  # noqa: E402
from tests.generate.tiny_testers import aligned  # noqa: E402
from tests.host_master_guard import host_master_guard  # noqa: E402


def _moshi():
    mimi = dict(model_type="mimi", audio_channels=1, hidden_size=32, num_filters=8, num_residual_layers=1,
                upsampling_ratios=[8, 4], codebook_size=64, vector_quantization_hidden_dimension=64,
                upsample_groups=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                sliding_window=3, codebook_dim=64, use_cache=False, sampling_rate=800)
    depth = dict(hidden_size=16, num_hidden_layers=2, max_position_embeddings=5, num_attention_heads=8, ffn_dim=16,
                 sliding_window=4)
    cfg = transformers.MoshiConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=8, d_ff=4,
                                   num_codebooks=4, rms_norm_eps=0.001, tie_word_embeddings=False, pad_token_id=25,
                                   bos_token_id=25, ffn_dim=32, audio_encoder_config=mimi,
                                   depth_decoder_config=depth)
    torch.manual_seed(0)
    return aligned(transformers.MoshiForConditionalGeneration(cfg))


def _generate(model, inputs):
    torch.manual_seed(7)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=4, do_sample=False, return_audio_waveforms=True,
                             return_audio_codes=True)
    return [out.sequences, out.audio_codes, out.audio_sequences]


def test_moshi_generate_streamed_with_paged_kv_equals_the_plain_model():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = _moshi()
        g = torch.Generator().manual_seed(5)
        inputs = dict(input_ids=torch.randint(0, 99, (1, 4), generator=g),
                      user_input_values=torch.randn(1, 1, 256, generator=g),  # 4 frames of 64 samples
                      moshi_input_values=torch.randn(1, 1, 256, generator=g))
        ref = _generate(model, inputs)
        handle, pager, _ = offloaded(model, mixed=False, name="moshi")
        try:
            assert "audio_encoder.quantizer" in [b.name for b in handle.report().blocks]
            with host_master_guard(handle), paged_generation(model, pager):
                got = _generate(model, inputs)
            assert all(torch.equal(a, b) for a, b in zip(got, ref))
            quantizer = [b for b in handle.report().blocks if b.name == "audio_encoder.quantizer"][0]
            assert quantizer.calls >= 2, "entered through encode() and decode()"
            assert handle.report().kv["caches"] == 1
        finally:
            handle.detach()
    finally:
        torch.set_num_threads(before)
