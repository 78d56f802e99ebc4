"""Tiny text encoders of the families, built from ComfyUI's own text-encoder classes.

ComfyUI sizes a text encoder from `model_options["<model_name>_model_config"]` (the mechanism its loader uses for
long CLIP-L), so the real classes, tokenizers and prompt templates run at width 64 with a few layers. This module only
names them (no ComfyUI import): the test imports `module`, builds `comfy.sd.CLIP` from `tokenizer` / `model` with
`model_options` and seeds the weights with `common.init_tensor`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Tuple

CLIP_L = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2, "num_hidden_layers": 3,
          "projection_dim": 64}
T5 = {"d_model": 64, "d_ff": 128, "d_kv": 32, "num_heads": 2, "num_layers": 3, "vocab_size": 32128}
LLAMA = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 2,
         "num_key_value_heads": 1, "vocab_size": 128320}

# where a full-size part (one the config cannot shrink) shows up: the test skips an encoder bigger than this
MAX_PARAMS = 20_000_000


@dataclass
class TextEncoder:
    name: str
    module: str                       # comfy module with the tokenizer and model classes
    tokenizer: str
    model: str
    model_options: Dict[str, Any]
    tokenizer_data: Dict[str, str] = field(default_factory=dict)  # values: paths relative to comfy/text_encoders
    lora_layer: Tuple[str, ...] = ()  # key fragments of the layers a test LoRA patches
    note: str = ""


TEXT_ENCODERS = {te.name: te for te in (
    TextEncoder("sd1_clip_l", "comfy.sd1_clip", "SD1Tokenizer", "SD1ClipModel", {"clip_l_model_config": CLIP_L},
                lora_layer=(".layers.1.",), note="SD1.5's CLIP-L"),
    TextEncoder("flux_clip_l_t5", "comfy.text_encoders.flux", "FluxTokenizer", "FluxClipModel",
                {"clip_l_model_config": CLIP_L, "t5xxl_model_config": T5}, lora_layer=(".layers.1.", ".block.1."),
                note="Flux / SD3's CLIP-L + T5-XXL"),
    TextEncoder("wan_umt5", "comfy.text_encoders.wan", "WanT5Tokenizer", "WanT5Model",
                {"umt5xxl_model_config": dict(T5, model_type="umt5")},
                tokenizer_data={"spiece_model": "t5_pile_tokenizer/tokenizer.model"}, lora_layer=(".block.1.",),
                note="Wan's UMT5 (a SentencePiece model from ComfyUI's tree stands in for the 256k UMT5 vocab)"),
    TextEncoder("hunyuan_video_llama", "comfy.text_encoders.hunyuan_video", "HunyuanVideoTokenizer",
                "HunyuanVideoClipModel", {"clip_l_model_config": CLIP_L, "llama_model_config": LLAMA},
                lora_layer=(".layers.1.",), note="HunyuanVideo's CLIP-L + LLaVA-Llama-3 (prompt template included)"),
    TextEncoder("qwen_image_qwen25vl", "comfy.text_encoders.qwen_image", "QwenImageTokenizer", "QwenImageTEModel",
                {"qwen25_7b_model_config": dict(LLAMA, vocab_size=152064)}, lora_layer=(".layers.1.",),
                note="Qwen-Image's Qwen2.5-VL"),
)}
