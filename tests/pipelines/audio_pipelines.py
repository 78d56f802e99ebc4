"""diffusers' AudioLDM2 pipeline test re-created (see pipeline_builders.py): a CLAP text encoder whose RoBERTa layers
run their feed-forward through transformers' `apply_chunking_to_forward` (which inspects the chunk function's
signature: a method wrapper that hid it failed this pipeline under the budget preset, issue 41), a T5 encoder, GPT-2
generating hidden states through `generate_language_model` (its own forward loop, outside `generate()`), the
projection model, AudioLDM2's UNet with two cross-attention widths, a 1-channel VAE and a HiFi-GAN vocoder.

The peer loads `hf-internal-testing/tiny-random-roberta` and `-T5Model` tokenizers and a CLAP feature extractor from
the hub: here the tokenizers are the word-level one of pipeline_builders as the classes the pipeline checks for
(`RobertaTokenizer` pads to its max length, `T5Tokenizer` to the longest prompt), the feature extractor is built
with the peer's `hop_length` (used only to score several waveforms per prompt), and T5's 32100-token vocabulary is
cut to the tokenizer's 99 (the embedding is outside the blocks either way). The language model is the class the
pipeline declares, `GPT2LMHeadModel`, with the peer's config (the peer's `GPT2Model` fails the pipeline itself under
transformers 5).
"""
from __future__ import annotations

from typing import Any

import torch

from .pipeline_builders import PEER, PipelineCase, _gen, tiny_tokenizer


def _tokenizer(cls_name: str, vocab_size: int) -> Any:
    import transformers

    base = tiny_tokenizer(vocab_size)
    extra = {"bos_token": "<s>"} if cls_name == "RobertaTokenizer" else {}
    return getattr(transformers, cls_name)(tokenizer_object=base.backend_tokenizer, pad_token="<pad>",
                                           eos_token="</s>", unk_token="<unk>", model_max_length=77, **extra)


def _audioldm2() -> dict[str, Any]:
    """AudioLDM2PipelineFastTests.get_dummy_components, seeded the same way."""
    from diffusers import AudioLDM2ProjectionModel, AudioLDM2UNet2DConditionModel, AutoencoderKL, DDIMScheduler
    from transformers import (ClapAudioConfig, ClapConfig, ClapFeatureExtractor, ClapModel, ClapTextConfig, GPT2Config,
                              GPT2LMHeadModel, SpeechT5HifiGan, SpeechT5HifiGanConfig, T5Config, T5EncoderModel)

    torch.manual_seed(0)
    unet = AudioLDM2UNet2DConditionModel(
        block_out_channels=(32, 64), layers_per_block=2, sample_size=32, in_channels=4, out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=([None, 16, 32], [None, 16, 32]))
    scheduler = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False,
                              set_alpha_to_one=False)
    torch.manual_seed(0)
    vae = AutoencoderKL(block_out_channels=[32, 64], in_channels=1, out_channels=1,
                        down_block_types=["DownEncoderBlock2D", "DownEncoderBlock2D"],
                        up_block_types=["UpDecoderBlock2D", "UpDecoderBlock2D"], latent_channels=4)
    torch.manual_seed(0)
    text_branch = ClapTextConfig(bos_token_id=0, eos_token_id=2, hidden_size=16, intermediate_size=37,
                                 layer_norm_eps=1e-05, num_attention_heads=2, num_hidden_layers=2, pad_token_id=1,
                                 vocab_size=1000, projection_dim=16)
    audio_branch = ClapAudioConfig(spec_size=64, window_size=4, num_mel_bins=64, intermediate_size=37,
                                   layer_norm_eps=1e-05, depths=[2, 2], num_attention_heads=[2, 2], num_hidden_layers=2,
                                   hidden_size=192, projection_dim=16, patch_size=2, patch_stride=2,
                                   patch_embed_input_channels=4)
    # the peer's ClapConfig.from_text_audio_configs (gone in transformers 5): the same three arguments
    text_encoder = ClapModel(ClapConfig(text_config=text_branch, audio_config=audio_branch, projection_dim=16))
    torch.manual_seed(0)
    text_encoder_2 = T5EncoderModel(T5Config(vocab_size=99, d_model=32, d_ff=37, d_kv=8, num_heads=2, num_layers=2))
    torch.manual_seed(0)
    # the peer's GPT2Model has no GenerationMixin under transformers 5 and the pipeline calls its
    # `_update_model_kwargs_for_generation` (diffusers issue 12630): the class the pipeline declares, same config
    language_model = GPT2LMHeadModel(GPT2Config(n_embd=16, n_head=2, n_layer=2, vocab_size=1000, n_ctx=99,
                                                n_positions=99))
    language_model.config.max_new_tokens = 8
    torch.manual_seed(0)
    projection_model = AudioLDM2ProjectionModel(text_encoder_dim=16, text_encoder_1_dim=32, langauge_model_dim=16)
    vocoder = SpeechT5HifiGan(SpeechT5HifiGanConfig(
        model_in_dim=8, sampling_rate=16000, upsample_initial_channel=16, upsample_rates=[2, 2],
        upsample_kernel_sizes=[4, 4], resblock_kernel_sizes=[3, 7], resblock_dilation_sizes=[[1, 3, 5], [1, 3, 5]],
        normalize_before=False))
    return {"unet": unet, "scheduler": scheduler, "vae": vae.eval(), "text_encoder": text_encoder.eval(),
            "text_encoder_2": text_encoder_2.eval(), "tokenizer": _tokenizer("RobertaTokenizer", 99),
            "tokenizer_2": _tokenizer("T5Tokenizer", 99), "feature_extractor": ClapFeatureExtractor(hop_length=7900),
            "language_model": language_model.eval(), "projection_model": projection_model.eval(),
            "vocoder": vocoder.eval()}


def _audioldm2_inputs() -> dict[str, Any]:
    return {"prompt": "A hammer hitting a wooden surface", "generator": _gen(), "num_inference_steps": 2,
            "guidance_scale": 6.0}


AUDIO_CASES = [
    PipelineCase("audioldm2", PEER + "audioldm2/test_audioldm2.py", "AudioLDM2Pipeline", _audioldm2,
                 _audioldm2_inputs, denoiser=None),
]
