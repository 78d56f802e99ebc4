"""Whole diffusers pipelines, re-created from the tiny components of diffusers' own pipeline tests.

Each `PipelineCase` names the file it imitates (huggingface/diffusers `tests/pipelines/<name>/test_*.py`,
`get_dummy_components()` / `get_dummy_inputs()`): the same component classes and configs, seeded the same way. Those
tests load tiny tokenizers and a few text-encoder configs from the hub (`hf-internal-testing/tiny-random-t5`,
`-clip`, `dummy-gemma`); here the configs are written out (`_T5`) and every tokenizer is a word-level tokenizer
built in memory (`tiny_tokenizer`), whose ids fit the text encoder's vocabulary. The plain and the offloaded run
use the very same tokenizer, so the comparison is bitwise whatever the tokens are.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

PEER = "huggingface/diffusers tests/pipelines/"
_WORDS = ("a painting of squirrel eating burger bad ugly dance monkey negative different prompt the cat dog photo "
          "an image user system assistant").split()


def tiny_tokenizer(vocab_size: int = 99, eos: bool = True, max_length: int = 77, chat: bool = False) -> Any:
    """A word-level fast tokenizer over a vocabulary written here (what the peer's tiny hub tokenizers stand for):
    <pad>=0, </s>=1, <unk>=2, <s>=3, then words; an id never reaches `vocab_size`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "</s>", "<unk>", "<s>"][:max(3, vocab_size)])}
    for w in _WORDS:
        if len(vocab) >= vocab_size:
            break
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if eos:
        tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                  bos_token="<s>" if "<s>" in vocab else None, model_max_length=max_length)
    if chat:
        out.chat_template = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                             "{% if add_generation_prompt %}assistant {% endif %}")
    return out


@dataclass
class PipelineCase:
    """One pipeline test of diffusers: its components and inputs, and which component takes a LoRA adapter."""

    name: str
    peer: str
    pipeline: str  # the diffusers pipeline class
    components: Callable[[], dict[str, Any]]
    inputs: Callable[[], dict[str, Any]]
    denoiser: str | None = "transformer"  # the component LoRA goes into (None: no peft adapters)
    lora_targets: tuple[str, ...] = ("to_q", "to_k", "to_v")
    slow: bool = False  # variants beyond the first are marked slow for this pipeline
    # components whose buffers the pipeline reads outside their forward and moves itself (`.to(latents.device)`):
    # a copy on CUDA, a no-op on the simulated device, so the host-master guard does not watch them
    unguarded: tuple[str, ...] = ()
    tags: set[str] = field(default_factory=set)

    def __str__(self) -> str:
        return self.name

    def build(self) -> Any:
        import diffusers
        return getattr(diffusers, self.pipeline)(**self.components())


def _gen() -> torch.Generator:
    return torch.Generator("cpu").manual_seed(0)


# hf-internal-testing/tiny-random-t5's shape (the encoder's), with a vocabulary the tokenizer fits
_T5 = dict(vocab_size=99, d_model=32, d_ff=37, d_kv=8, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
           decoder_start_token_id=0)


def _t5() -> Any:
    from transformers import T5Config, T5EncoderModel
    torch.manual_seed(0)
    return T5EncoderModel(T5Config(**_T5)).eval()


def _clip(projection: bool = False, hidden: int = 32, inter: int = 37, layers: int = 5, heads: int = 4) -> Any:
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection
    cfg = CLIPTextConfig(bos_token_id=0, eos_token_id=2, hidden_size=hidden, intermediate_size=inter,
                         layer_norm_eps=1e-05, num_attention_heads=heads, num_hidden_layers=layers, pad_token_id=1,
                         vocab_size=1000, hidden_act="gelu", projection_dim=32)
    torch.manual_seed(0)
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(cfg).eval()


def _kl_small(latent: int = 1) -> Any:
    from diffusers import AutoencoderKL
    torch.manual_seed(0)
    return AutoencoderKL(sample_size=32, in_channels=3, out_channels=3, block_out_channels=(4,), layers_per_block=1,
                         latent_channels=latent, norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False,
                         shift_factor=0.0609, scaling_factor=1.5035).eval()


def _flux_transformer() -> Any:
    from diffusers import FluxTransformer2DModel
    torch.manual_seed(0)
    return FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                  attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                  pooled_projection_dim=32, axes_dims_rope=[4, 4, 8])


def _flux() -> dict[str, Any]:
    from diffusers import FlowMatchEulerDiscreteScheduler
    return {"scheduler": FlowMatchEulerDiscreteScheduler(), "text_encoder": _clip(), "text_encoder_2": _t5(),
            "tokenizer": tiny_tokenizer(1000), "tokenizer_2": tiny_tokenizer(99), "transformer": _flux_transformer(),
            "vae": _kl_small(), "image_encoder": None, "feature_extractor": None}


def _flux_inputs() -> dict[str, Any]:
    return {"prompt": "A painting of a squirrel eating a burger", "generator": _gen(), "num_inference_steps": 2,
            "guidance_scale": 5.0, "height": 8, "width": 8, "max_sequence_length": 48, "output_type": "pt"}


def _kontext_inputs() -> dict[str, Any]:
    import PIL.Image
    return dict(_flux_inputs(), image=PIL.Image.new("RGB", (32, 32), 0), max_area=8 * 8, _auto_resize=False,
                output_type="np")


def _chroma() -> dict[str, Any]:
    from diffusers import ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler
    torch.manual_seed(0)
    transformer = ChromaTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, axes_dims_rope=[4, 4, 8], approximator_hidden_dim=32, approximator_layers=1,
        approximator_num_channels=16)
    return {"scheduler": FlowMatchEulerDiscreteScheduler(), "text_encoder": _t5(), "tokenizer": tiny_tokenizer(99),
            "transformer": transformer, "vae": _kl_small(), "image_encoder": None, "feature_extractor": None}


def _chroma_inputs() -> dict[str, Any]:
    return dict(_flux_inputs(), negative_prompt="bad, ugly", output_type="np")


def _sd3() -> dict[str, Any]:
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    torch.manual_seed(0)
    transformer = SD3Transformer2DModel(sample_size=32, patch_size=1, in_channels=4, num_layers=1,
                                        attention_head_dim=8, num_attention_heads=4, caption_projection_dim=32,
                                        joint_attention_dim=32, pooled_projection_dim=64, out_channels=4)
    return {"scheduler": FlowMatchEulerDiscreteScheduler(), "text_encoder": _clip(True),
            "text_encoder_2": _clip(True), "text_encoder_3": _t5(), "tokenizer": tiny_tokenizer(1000),
            "tokenizer_2": tiny_tokenizer(1000), "tokenizer_3": tiny_tokenizer(99), "transformer": transformer,
            "vae": _kl_small(4), "image_encoder": None, "feature_extractor": None}


def _basic_inputs(**extra: Any) -> Callable[[], dict[str, Any]]:
    def inputs() -> dict[str, Any]:
        return dict({"prompt": "A painting of a squirrel eating a burger", "generator": _gen(),
                     "num_inference_steps": 2, "guidance_scale": 5.0, "output_type": "np"}, **extra)
    return inputs


def _pixart() -> dict[str, Any]:
    from diffusers import AutoencoderKL, DDIMScheduler, PixArtTransformer2DModel
    torch.manual_seed(0)
    transformer = PixArtTransformer2DModel(
        sample_size=8, num_layers=2, patch_size=2, attention_head_dim=8, num_attention_heads=3, caption_channels=32,
        in_channels=4, cross_attention_dim=24, out_channels=8, attention_bias=True, activation_fn="gelu-approximate",
        num_embeds_ada_norm=1000, norm_type="ada_norm_single", norm_elementwise_affine=False, norm_eps=1e-6).eval()
    torch.manual_seed(0)
    vae = AutoencoderKL().eval()
    return {"transformer": transformer, "vae": vae, "scheduler": DDIMScheduler(), "text_encoder": _t5(),
            "tokenizer": tiny_tokenizer(99)}


def _aura() -> dict[str, Any]:
    from diffusers import AuraFlowTransformer2DModel, AutoencoderKL, FlowMatchEulerDiscreteScheduler
    from transformers import UMT5Config, UMT5EncoderModel
    torch.manual_seed(0)
    transformer = AuraFlowTransformer2DModel(
        sample_size=32, patch_size=2, in_channels=4, num_mmdit_layers=1, num_single_dit_layers=1,
        attention_head_dim=8, num_attention_heads=4, caption_projection_dim=32, joint_attention_dim=32,
        out_channels=4, pos_embed_max_size=256)
    torch.manual_seed(0)
    text_encoder = UMT5EncoderModel(UMT5Config(**_T5)).eval()  # hf-internal-testing/tiny-random-umt5's shape
    torch.manual_seed(0)
    vae = AutoencoderKL(block_out_channels=[32, 64], in_channels=3, out_channels=3,
                        down_block_types=["DownEncoderBlock2D", "DownEncoderBlock2D"],
                        up_block_types=["UpDecoderBlock2D", "UpDecoderBlock2D"], latent_channels=4, sample_size=32)
    return {"scheduler": FlowMatchEulerDiscreteScheduler(), "text_encoder": text_encoder,
            "tokenizer": tiny_tokenizer(99), "transformer": transformer, "vae": vae.eval()}


def _wan_transformer() -> Any:
    from diffusers import WanTransformer3DModel
    torch.manual_seed(0)
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16,
                                 out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2,
                                 cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32)


def _wan_vae() -> Any:
    from diffusers import AutoencoderKLWan
    torch.manual_seed(0)
    return AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                            temperal_downsample=[False, True, True]).eval()


def _wan() -> dict[str, Any]:
    from diffusers import FlowMatchEulerDiscreteScheduler
    vae = _wan_vae()
    torch.manual_seed(0)
    return {"transformer": _wan_transformer(), "vae": vae, "scheduler": FlowMatchEulerDiscreteScheduler(shift=7.0),
            "text_encoder": _t5(), "tokenizer": tiny_tokenizer(99), "transformer_2": None}


def _wan22() -> dict[str, Any]:
    from diffusers import UniPCMultistepScheduler
    vae = _wan_vae()
    return {"transformer": _wan_transformer(), "vae": vae,
            "scheduler": UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                                 flow_shift=3.0),
            "text_encoder": _t5(), "tokenizer": tiny_tokenizer(99), "transformer_2": _wan_transformer(),
            "boundary_ratio": 0.875}


def _video_inputs(height: int = 16, frames: int = 9, guidance: float = 6.0, negative: str = "negative",
                  seq: int = 16) -> Callable[[], dict[str, Any]]:
    def inputs() -> dict[str, Any]:
        return {"prompt": "dance monkey", "negative_prompt": negative, "generator": _gen(), "num_inference_steps": 2,
                "guidance_scale": guidance, "height": height, "width": height, "num_frames": frames,
                "max_sequence_length": seq, "output_type": "pt"}
    return inputs


def _cogvideox() -> dict[str, Any]:
    from diffusers import AutoencoderKLCogVideoX, CogVideoXTransformer3DModel, DDIMScheduler
    torch.manual_seed(0)
    transformer = CogVideoXTransformer3DModel(
        num_attention_heads=4, attention_head_dim=8, in_channels=4, out_channels=4, time_embed_dim=2,
        text_embed_dim=32, num_layers=1, sample_width=2, sample_height=2, sample_frames=9, patch_size=2,
        temporal_compression_ratio=4, max_text_seq_length=16)
    torch.manual_seed(0)
    vae = AutoencoderKLCogVideoX(in_channels=3, out_channels=3, down_block_types=("CogVideoXDownBlock3D",) * 4,
                                 up_block_types=("CogVideoXUpBlock3D",) * 4, block_out_channels=(8, 8, 8, 8),
                                 latent_channels=4, layers_per_block=1, norm_num_groups=2,
                                 temporal_compression_ratio=4)
    torch.manual_seed(0)
    return {"transformer": transformer, "vae": vae.eval(), "scheduler": DDIMScheduler(), "text_encoder": _t5(),
            "tokenizer": tiny_tokenizer(99)}


def _mochi() -> dict[str, Any]:
    from diffusers import AutoencoderKLMochi, FlowMatchEulerDiscreteScheduler, MochiTransformer3DModel
    torch.manual_seed(0)
    transformer = MochiTransformer3DModel(
        patch_size=2, num_attention_heads=2, attention_head_dim=8, num_layers=2, pooled_projection_dim=16,
        in_channels=12, out_channels=None, qk_norm="rms_norm", text_embed_dim=32, time_embed_dim=4,
        activation_fn="swiglu", max_sequence_length=16)
    transformer.pos_frequencies.data = transformer.pos_frequencies.new_full(transformer.pos_frequencies.shape, 0)
    torch.manual_seed(0)
    vae = AutoencoderKLMochi(latent_channels=12, out_channels=3, encoder_block_out_channels=(32, 32, 32, 32),
                             decoder_block_out_channels=(32, 32, 32, 32), layers_per_block=(1, 1, 1, 1, 1))
    torch.manual_seed(0)
    return {"transformer": transformer, "vae": vae.eval(), "scheduler": FlowMatchEulerDiscreteScheduler(),
            "text_encoder": _t5(), "tokenizer": tiny_tokenizer(99)}


def _ltx() -> dict[str, Any]:
    from diffusers import AutoencoderKLLTXVideo, FlowMatchEulerDiscreteScheduler, LTXVideoTransformer3DModel
    torch.manual_seed(0)
    transformer = LTXVideoTransformer3DModel(in_channels=8, out_channels=8, patch_size=1, patch_size_t=1,
                                             num_attention_heads=4, attention_head_dim=8, cross_attention_dim=32,
                                             num_layers=1, caption_channels=32)
    torch.manual_seed(0)
    vae = AutoencoderKLLTXVideo(
        in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 8, 8, 8), layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1, 1), spatio_temporal_scaling=(True, True, False, False),
        decoder_spatio_temporal_scaling=(True, True, False, False), decoder_inject_noise=(False,) * 5,
        upsample_residual=(False,) * 4, upsample_factor=(1, 1, 1, 1), timestep_conditioning=False, patch_size=1,
        patch_size_t=1, encoder_causal=True, decoder_causal=False)
    vae.use_framewise_encoding = False
    vae.use_framewise_decoding = False
    torch.manual_seed(0)
    return {"transformer": transformer, "vae": vae.eval(), "scheduler": FlowMatchEulerDiscreteScheduler(),
            "text_encoder": _t5(), "tokenizer": tiny_tokenizer(99)}


def _sd15() -> dict[str, Any]:
    from diffusers import AutoencoderKL, DDIMScheduler, UNet2DConditionModel
    torch.manual_seed(0)
    unet = UNet2DConditionModel(block_out_channels=(4, 8), layers_per_block=1, sample_size=32, in_channels=4,
                                out_channels=4, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                                up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=8,
                                norm_num_groups=2)
    scheduler = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False,
                              set_alpha_to_one=False)
    torch.manual_seed(0)
    vae = AutoencoderKL(block_out_channels=[4, 8], in_channels=3, out_channels=3,
                        down_block_types=["DownEncoderBlock2D", "DownEncoderBlock2D"],
                        up_block_types=["UpDecoderBlock2D", "UpDecoderBlock2D"], latent_channels=4, norm_num_groups=2)
    return {"unet": unet, "scheduler": scheduler, "vae": vae.eval(),
            "text_encoder": _clip(hidden=8, inter=16, layers=2, heads=2), "tokenizer": tiny_tokenizer(1000),
            "safety_checker": None, "feature_extractor": None, "image_encoder": None}


def _sana() -> dict[str, Any]:
    from diffusers import AutoencoderDC, FlowMatchEulerDiscreteScheduler, SanaTransformer2DModel
    from transformers import Gemma2Config, Gemma2Model
    torch.manual_seed(0)
    transformer = SanaTransformer2DModel(
        patch_size=1, in_channels=4, out_channels=4, num_layers=1, num_attention_heads=2, attention_head_dim=4,
        num_cross_attention_heads=2, cross_attention_head_dim=4, cross_attention_dim=8, caption_channels=8,
        sample_size=32)
    torch.manual_seed(0)
    vae = AutoencoderDC(
        in_channels=3, latent_channels=4, attention_head_dim=2, encoder_block_types=("ResBlock", "EfficientViTBlock"),
        decoder_block_types=("ResBlock", "EfficientViTBlock"), encoder_block_out_channels=(8, 8),
        decoder_block_out_channels=(8, 8), encoder_qkv_multiscales=((), (5,)), decoder_qkv_multiscales=((), (5,)),
        encoder_layers_per_block=(1, 1), decoder_layers_per_block=[1, 1], downsample_block_type="conv",
        upsample_block_type="interpolate", decoder_norm_types="rms_norm", decoder_act_fns="silu",
        scaling_factor=0.41407)
    torch.manual_seed(0)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=7.0)
    torch.manual_seed(0)
    text_encoder = Gemma2Model(Gemma2Config(
        head_dim=16, hidden_size=8, initializer_range=0.02, intermediate_size=64, max_position_embeddings=8192,
        model_type="gemma2", num_attention_heads=2, num_hidden_layers=1, num_key_value_heads=2, vocab_size=8,
        attn_implementation="eager")).eval()
    return {"transformer": transformer, "vae": vae.eval(), "scheduler": scheduler, "text_encoder": text_encoder,
            "tokenizer": tiny_tokenizer(8, eos=False, max_length=300)}


def _sana_inputs() -> dict[str, Any]:
    return {"prompt": "", "negative_prompt": "", "generator": _gen(), "num_inference_steps": 2,
            "guidance_scale": 6.0, "height": 32, "width": 32, "max_sequence_length": 16, "output_type": "pt",
            "complex_human_instruction": None}


def _lumina2() -> dict[str, Any]:
    from diffusers import FlowMatchEulerDiscreteScheduler, Lumina2Transformer2DModel
    from transformers import Gemma2Config, Gemma2Model
    torch.manual_seed(0)
    transformer = Lumina2Transformer2DModel(
        sample_size=4, patch_size=2, in_channels=4, hidden_size=8, num_layers=2, num_attention_heads=1,
        num_kv_heads=1, multiple_of=16, ffn_dim_multiplier=None, norm_eps=1e-5, scaling_factor=1.0,
        axes_dim_rope=[4, 2, 2], cap_feat_dim=8)
    vae = _kl_small(4)
    torch.manual_seed(0)
    text_encoder = Gemma2Model(Gemma2Config(head_dim=4, hidden_size=8, intermediate_size=8, num_attention_heads=2,
                                            num_hidden_layers=2, num_key_value_heads=2, sliding_window=2,
                                            vocab_size=99)).eval()
    return {"transformer": transformer, "vae": vae, "scheduler": FlowMatchEulerDiscreteScheduler(),
            "text_encoder": text_encoder, "tokenizer": tiny_tokenizer(99, eos=False, max_length=300)}


CASES: list[PipelineCase] = [
    PipelineCase("flux", PEER + "flux/test_pipeline_flux.py", "FluxPipeline", _flux, _flux_inputs),
    PipelineCase("flux_kontext", PEER + "flux/test_pipeline_flux_kontext.py", "FluxKontextPipeline", _flux,
                 _kontext_inputs),
    PipelineCase("chroma", PEER + "chroma/test_pipeline_chroma.py", "ChromaPipeline", _chroma, _chroma_inputs),
    PipelineCase("sd3", PEER + "stable_diffusion_3/test_pipeline_stable_diffusion_3.py", "StableDiffusion3Pipeline",
                 _sd3, _basic_inputs()),
    PipelineCase("pixart_sigma", PEER + "pixart_sigma/test_pixart.py", "PixArtSigmaPipeline", _pixart,
                 _basic_inputs(use_resolution_binning=False), denoiser=None),  # no PeftAdapterMixin
    PipelineCase("aura_flow", PEER + "aura_flow/test_pipeline_aura_flow.py", "AuraFlowPipeline", _aura,
                 _basic_inputs(height=None, width=None)),
    PipelineCase("wan", PEER + "wan/test_wan.py", "WanPipeline", _wan, _video_inputs()),
    PipelineCase("wan22_two_experts", PEER + "wan/test_wan_22.py", "WanPipeline", _wan22, _video_inputs()),
    PipelineCase("cogvideox", PEER + "cogvideo/test_cogvideox.py", "CogVideoXPipeline", _cogvideox,
                 _video_inputs(frames=8, negative="")),
    PipelineCase("mochi", PEER + "mochi/test_mochi.py", "MochiPipeline", _mochi,
                 _video_inputs(frames=7, guidance=4.5, negative="")),
    PipelineCase("ltx", PEER + "ltx/test_ltx.py", "LTXPipeline", _ltx,
                 _video_inputs(height=32, guidance=3.0, negative=""), unguarded=("vae",)),  # vae.latents_std
    PipelineCase("sd15", PEER + "stable_diffusion/test_stable_diffusion.py", "StableDiffusionPipeline", _sd15,
                 _basic_inputs(guidance_scale=6.0), denoiser="unet"),
    PipelineCase("sana", PEER + "sana/test_sana.py", "SanaPipeline", _sana, _sana_inputs),
    PipelineCase("lumina2", PEER + "lumina2/test_pipeline_lumina2.py", "Lumina2Pipeline", _lumina2,
                 _basic_inputs(height=32, width=32)),
]
