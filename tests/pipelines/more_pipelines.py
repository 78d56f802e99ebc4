"""More of diffusers' pipeline tests re-created (see pipeline_builders.py): SDXL, Flux and Chroma img2img, Flux2
Klein, QwenImage, Z-Image, HunyuanVideo, Kandinsky 3, Stable Audio, SkyReels-V2, CogView4, Wan 2.2 TI2V-5B.

Where a peer loads a text encoder of a hub vocabulary (Qwen's 151936 tokens, GLM's 151552) the vocabulary is cut
to the tokenizer built here (noted per case): the embedding is the weights outside the blocks either way, and a
10 MB table would only slow the suite.
"""
from __future__ import annotations

import random
from typing import Any

import torch

from .pipeline_builders import (PEER, PipelineCase, _basic_inputs, _clip, _flux, _flux_inputs, _chroma, _gen, _t5,
                                _T5, _video_inputs, _wan_vae, tiny_tokenizer)


def _image32() -> torch.Tensor:
    """diffusers' `floats_tensor((1, 3, 32, 32), rng=random.Random(0))`."""
    rng = random.Random(0)
    return torch.tensor([rng.random() for _ in range(3 * 32 * 32)], dtype=torch.float32).view(1, 3, 32, 32)


def _img2img_inputs() -> dict[str, Any]:
    return dict(_flux_inputs(), image=_image32(), strength=0.8, output_type="np")


def _sdxl() -> dict[str, Any]:
    from diffusers import AutoencoderKL, EulerDiscreteScheduler, UNet2DConditionModel
    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        block_out_channels=(2, 4), layers_per_block=2, sample_size=32, in_channels=4, out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4), use_linear_projection=True, addition_embed_type="text_time",
        addition_time_embed_dim=8, transformer_layers_per_block=(1, 2), projection_class_embeddings_input_dim=80,
        cross_attention_dim=64, norm_num_groups=1)
    scheduler = EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, steps_offset=1,
                                       beta_schedule="scaled_linear", timestep_spacing="leading")
    torch.manual_seed(0)
    vae = AutoencoderKL(block_out_channels=[32, 64], in_channels=3, out_channels=3,
                        down_block_types=["DownEncoderBlock2D", "DownEncoderBlock2D"],
                        up_block_types=["UpDecoderBlock2D", "UpDecoderBlock2D"], latent_channels=4, sample_size=128)
    return {"unet": unet, "scheduler": scheduler, "vae": vae.eval(), "text_encoder": _clip(),
            "tokenizer": tiny_tokenizer(1000), "text_encoder_2": _clip(True), "tokenizer_2": tiny_tokenizer(1000),
            "image_encoder": None, "feature_extractor": None}


def _qwen3(model: str) -> Any:
    import transformers
    cfg = transformers.Qwen3Config(intermediate_size=16, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=2, vocab_size=99, max_position_embeddings=512)  # peer: 151936
    torch.manual_seed(0)
    return getattr(transformers, model)(cfg).eval()


def _klein() -> dict[str, Any]:
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel
    torch.manual_seed(0)
    transformer = Flux2Transformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=16, timestep_guidance_channels=256, axes_dims_rope=[4, 4, 4, 4], guidance_embeds=False)
    text_encoder = _qwen3("Qwen3ForCausalLM")
    torch.manual_seed(0)
    vae = AutoencoderKLFlux2(sample_size=32, in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",),
                             up_block_types=("UpDecoderBlock2D",), block_out_channels=(4,), layers_per_block=1,
                             latent_channels=1, norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False)
    return {"scheduler": FlowMatchEulerDiscreteScheduler(), "text_encoder": text_encoder,
            "tokenizer": tiny_tokenizer(99, eos=False, max_length=512, chat=True), "transformer": transformer,
            "vae": vae.eval()}


def _klein_inputs() -> dict[str, Any]:
    return {"prompt": "a dog is dancing", "generator": _gen(), "num_inference_steps": 2, "guidance_scale": 4.0,
            "height": 8, "width": 8, "max_sequence_length": 64, "output_type": "pt", "text_encoder_out_layers": (1,)}


def _qwenimage() -> dict[str, Any]:
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    torch.manual_seed(0)
    transformer = QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                                              attention_head_dim=16, num_attention_heads=3, joint_attention_dim=16,
                                              guidance_embeds=False, axes_dims_rope=(8, 4, 4))
    torch.manual_seed(0)
    vae = AutoencoderKLQwenImage(base_dim=24, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1,
                                 temperal_downsample=[False, True], latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
    torch.manual_seed(0)
    scheduler = FlowMatchEulerDiscreteScheduler()
    torch.manual_seed(0)
    config = Qwen2_5_VLConfig(
        text_config={"hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
                     "num_key_value_heads": 2, "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default",
                                                                "type": "default"}, "rope_theta": 1000000.0,
                     "vocab_size": 152064},
        vision_config={"depth": 2, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 16},
        hidden_size=16, vocab_size=152064, vision_end_token_id=151653, vision_start_token_id=151652,
        vision_token_id=151654)
    text_encoder = Qwen2_5_VLForConditionalGeneration(config).eval()
    return {"transformer": transformer, "vae": vae.eval(), "scheduler": scheduler, "text_encoder": text_encoder,
            "tokenizer": tiny_tokenizer(99, eos=False, max_length=1024)}


def _qwenimage_inputs() -> dict[str, Any]:
    return {"prompt": "dance monkey", "negative_prompt": "bad quality", "generator": _gen(), "num_inference_steps": 2,
            "guidance_scale": 3.0, "true_cfg_scale": 1.0, "height": 32, "width": 32, "max_sequence_length": 16,
            "output_type": "pt"}


def _zimage() -> dict[str, Any]:
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel
    torch.manual_seed(0)
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=32, n_layers=2, n_refiner_layers=1,
        n_heads=2, n_kv_heads=2, norm_eps=1e-5, qk_norm=True, cap_feat_dim=16, rope_theta=256.0, t_scale=1000.0,
        axes_dims=[8, 4, 4], axes_lens=[256, 32, 32])
    with torch.no_grad():
        transformer.x_pad_token.copy_(torch.ones_like(transformer.x_pad_token))
        transformer.cap_pad_token.copy_(torch.ones_like(transformer.cap_pad_token))
    torch.manual_seed(0)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 2,
                        up_block_types=["UpDecoderBlock2D"] * 2, block_out_channels=[32, 64], layers_per_block=1,
                        latent_channels=16, norm_num_groups=32, sample_size=32, scaling_factor=0.3611,
                        shift_factor=0.1159)
    torch.manual_seed(0)
    scheduler = FlowMatchEulerDiscreteScheduler()
    return {"transformer": transformer, "vae": vae.eval(), "scheduler": scheduler,
            "text_encoder": _qwen3("Qwen3Model"), "tokenizer": tiny_tokenizer(99, eos=False, max_length=512, chat=True)}


def _zimage_inputs() -> dict[str, Any]:
    out = dict(_qwenimage_inputs(), cfg_normalization=False, cfg_truncation=1.0)
    del out["true_cfg_scale"]
    return out


def _hunyuan() -> dict[str, Any]:
    from diffusers import AutoencoderKLHunyuanVideo, FlowMatchEulerDiscreteScheduler, HunyuanVideoTransformer3DModel
    from transformers import LlamaConfig, LlamaModel
    torch.manual_seed(0)
    transformer = HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=10, num_layers=1,
        num_single_layers=1, num_refiner_layers=1, patch_size=1, patch_size_t=1, guidance_embeds=True,
        text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(2, 4, 4))
    torch.manual_seed(0)
    vae = AutoencoderKLHunyuanVideo(
        in_channels=3, out_channels=3, latent_channels=4, down_block_types=("HunyuanVideoDownBlock3D",) * 4,
        up_block_types=("HunyuanVideoUpBlock3D",) * 4, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
        act_fn="silu", norm_num_groups=4, scaling_factor=0.476986, spatial_compression_ratio=8,
        temporal_compression_ratio=4, mid_block_add_attention=True)
    torch.manual_seed(0)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=7.0)
    llama = LlamaConfig(bos_token_id=0, eos_token_id=2, hidden_size=16, intermediate_size=37, num_attention_heads=4,
                        num_hidden_layers=2, pad_token_id=1, vocab_size=1000, hidden_act="gelu")
    torch.manual_seed(0)
    text_encoder = LlamaModel(llama).eval()
    return {"transformer": transformer, "vae": vae.eval(), "scheduler": scheduler, "text_encoder": text_encoder,
            "text_encoder_2": _clip(hidden=8, layers=2), "tokenizer": tiny_tokenizer(1000, eos=False, max_length=256),
            "tokenizer_2": tiny_tokenizer(1000)}


def _hunyuan_inputs() -> dict[str, Any]:
    return {"prompt": "dance monkey", "prompt_template": {"template": "{}", "crop_start": 0}, "generator": _gen(),
            "num_inference_steps": 2, "guidance_scale": 4.5, "height": 16, "width": 16, "num_frames": 9,
            "max_sequence_length": 16, "output_type": "pt"}


def _kandinsky3() -> dict[str, Any]:
    from diffusers import DDPMScheduler, Kandinsky3UNet, VQModel
    torch.manual_seed(0)
    unet = Kandinsky3UNet(in_channels=4, time_embedding_dim=4, groups=2, attention_head_dim=4, layers_per_block=3,
                          block_out_channels=(32, 64), cross_attention_dim=4, encoder_hid_dim=32)
    scheduler = DDPMScheduler(beta_start=0.00085, beta_end=0.012, steps_offset=1, beta_schedule="squaredcos_cap_v2",
                              clip_sample=True, thresholding=False)
    torch.manual_seed(0)
    movq = VQModel(block_out_channels=[32, 64], down_block_types=["DownEncoderBlock2D", "AttnDownEncoderBlock2D"],
                   in_channels=3, latent_channels=4, layers_per_block=1, norm_num_groups=8, norm_type="spatial",
                   num_vq_embeddings=12, out_channels=3, up_block_types=["AttnUpDecoderBlock2D", "UpDecoderBlock2D"],
                   vq_embed_dim=4)
    return {"unet": unet, "scheduler": scheduler, "movq": movq.eval(), "text_encoder": _t5(),
            "tokenizer": tiny_tokenizer(99, max_length=128)}


def _stable_audio() -> dict[str, Any]:
    from diffusers import (AutoencoderOobleck, EDMDPMSolverMultistepScheduler, StableAudioDiTModel,
                           StableAudioProjectionModel)
    torch.manual_seed(0)
    transformer = StableAudioDiTModel(sample_size=4, in_channels=3, num_layers=2, attention_head_dim=4,
                                      num_key_value_attention_heads=2, out_channels=3, cross_attention_dim=4,
                                      time_proj_dim=8, global_states_input_dim=8, cross_attention_input_dim=4)
    # the peer's CosineDPMSolverMultistepScheduler needs torchsde (not installed): the EDM DPM-Solver, same settings
    scheduler = EDMDPMSolverMultistepScheduler(solver_order=2, prediction_type="v_prediction", sigma_data=1.0,
                                               sigma_schedule="exponential")
    torch.manual_seed(0)
    vae = AutoencoderOobleck(encoder_hidden_size=6, downsampling_ratios=[1, 2], decoder_channels=3,
                             decoder_input_channels=3, audio_channels=2, channel_multiples=[2, 4], sampling_rate=4)
    text_encoder = _t5()  # the peer's tiny-random-T5ForConditionalGeneration encoder, as _T5
    torch.manual_seed(0)
    projection = StableAudioProjectionModel(text_encoder_dim=_T5["d_model"], conditioning_dim=4, min_value=0,
                                            max_value=32)
    return {"transformer": transformer, "scheduler": scheduler, "vae": vae.eval(), "text_encoder": text_encoder,
            "tokenizer": tiny_tokenizer(99, max_length=25), "projection_model": projection.eval()}


def _audio_inputs() -> dict[str, Any]:
    return {"prompt": "A hammer hitting a wooden surface", "generator": _gen(), "num_inference_steps": 2,
            "guidance_scale": 6.0, "output_type": "pt"}


def _skyreels() -> dict[str, Any]:
    import types

    from diffusers import SkyReelsV2Transformer3DModel, UniPCMultistepScheduler
    from diffusers.pipelines.skyreels_v2 import pipeline_skyreels_v2
    if not hasattr(pipeline_skyreels_v2, "ftfy"):  # its prompt cleaning calls ftfy unconditionally (not installed)
        pipeline_skyreels_v2.ftfy = types.SimpleNamespace(fix_text=lambda text: text)
    vae = _wan_vae()
    torch.manual_seed(0)
    scheduler = UniPCMultistepScheduler(flow_shift=8.0, use_flow_sigmas=True)
    text_encoder = _t5()
    torch.manual_seed(0)
    transformer = SkyReelsV2Transformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16,
        text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32)
    return {"transformer": transformer, "vae": vae, "scheduler": scheduler, "text_encoder": text_encoder,
            "tokenizer": tiny_tokenizer(99)}


def _cogview4() -> dict[str, Any]:
    from diffusers import AutoencoderKL, CogView4Transformer2DModel, FlowMatchEulerDiscreteScheduler
    from transformers import GlmConfig, GlmForCausalLM
    torch.manual_seed(0)
    transformer = CogView4Transformer2DModel(patch_size=2, in_channels=4, num_layers=2, attention_head_dim=4,
                                             num_attention_heads=4, out_channels=4, text_embed_dim=32,
                                             time_embed_dim=8, condition_dim=4)
    torch.manual_seed(0)
    vae = AutoencoderKL(block_out_channels=[32, 64], in_channels=3, out_channels=3,
                        down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
                        latent_channels=4, sample_size=128)
    torch.manual_seed(0)
    scheduler = FlowMatchEulerDiscreteScheduler(base_shift=0.25, max_shift=0.75, base_image_seq_len=256,
                                                use_dynamic_shifting=True, time_shift_type="linear")
    torch.manual_seed(0)
    text_encoder = GlmForCausalLM(GlmConfig(hidden_size=32, intermediate_size=8, num_hidden_layers=2,
                                            num_attention_heads=4, head_dim=8, vocab_size=99,
                                            pad_token_id=0)).eval()  # peer: 151552 tokens
    return {"transformer": transformer, "vae": vae.eval(), "scheduler": scheduler, "text_encoder": text_encoder,
            "tokenizer": tiny_tokenizer(99, eos=False, max_length=1024)}


def _cogview4_inputs() -> dict[str, Any]:
    return {"prompt": "dance monkey", "negative_prompt": "bad", "generator": _gen(), "num_inference_steps": 2,
            "guidance_scale": 6.0, "height": 16, "width": 16, "max_sequence_length": 16, "output_type": "pt"}


def _wan22_5b() -> dict[str, Any]:
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
    torch.manual_seed(0)
    vae = AutoencoderKLWan(base_dim=3, z_dim=48, in_channels=12, out_channels=12, is_residual=True, patch_size=2,
                           latents_mean=[0.0] * 48, latents_std=[1.0] * 48, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           scale_factor_spatial=16, scale_factor_temporal=4, temperal_downsample=[False, True, True])
    torch.manual_seed(0)
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    text_encoder = _t5()
    torch.manual_seed(0)
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=48, out_channels=48,
        text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32)
    return {"transformer": transformer, "vae": vae.eval(), "scheduler": scheduler, "text_encoder": text_encoder,
            "tokenizer": tiny_tokenizer(99), "transformer_2": None, "boundary_ratio": None, "expand_timesteps": True}


MORE_CASES: list[PipelineCase] = [
    PipelineCase("sdxl", PEER + "stable_diffusion_xl/test_stable_diffusion_xl.py", "StableDiffusionXLPipeline",
                 _sdxl, _basic_inputs(), denoiser="unet"),
    PipelineCase("flux_img2img", PEER + "flux/test_pipeline_flux_img2img.py", "FluxImg2ImgPipeline", _flux,
                 _img2img_inputs),
    PipelineCase("chroma_img2img", PEER + "chroma/test_pipeline_chroma_img2img.py", "ChromaImg2ImgPipeline",
                 _chroma, _img2img_inputs),
    PipelineCase("flux2_klein", PEER + "flux2/test_pipeline_flux2_klein.py", "Flux2KleinPipeline", _klein,
                 _klein_inputs, unguarded=("vae",)),  # reads vae.bn.running_var outside forward, then moves it
    PipelineCase("qwenimage", PEER + "qwenimage/test_qwenimage.py", "QwenImagePipeline", _qwenimage,
                 _qwenimage_inputs),
    PipelineCase("z_image", PEER + "z_image/test_z_image.py", "ZImagePipeline", _zimage, _zimage_inputs,
                 lora_targets=("to_q", "to_k", "to_v")),
    PipelineCase("hunyuan_video", PEER + "hunyuan_video/test_hunyuan_video.py", "HunyuanVideoPipeline", _hunyuan,
                 _hunyuan_inputs),
    PipelineCase("kandinsky3", PEER + "kandinsky3/test_kandinsky3.py", "Kandinsky3Pipeline", _kandinsky3,
                 _basic_inputs(guidance_scale=6.0, width=16, height=16), denoiser=None),
    PipelineCase("stable_audio", PEER + "stable_audio/test_stable_audio.py", "StableAudioPipeline", _stable_audio,
                 _audio_inputs, denoiser=None),
    PipelineCase("skyreels_v2", PEER + "skyreels_v2/test_skyreels_v2.py", "SkyReelsV2Pipeline", _skyreels,
                 _video_inputs()),
    PipelineCase("cogview4", PEER + "cogview4/test_cogview4.py", "CogView4Pipeline", _cogview4, _cogview4_inputs),
    PipelineCase("wan22_ti2v_5b", PEER + "wan/test_wan_22.py (Wan225BPipelineTesterConfig)", "WanPipeline",
                 _wan22_5b, _video_inputs(height=32)),
]
