"""Tiny transformers models built as transformers' own model tests build them: `CausalLMModelTester.get_config`
(tests/causal_lm_tester.py: the tester's defaults, passed where the config's __init__ takes them), with the few
settings each model's tester changes, and the layer mix and window small enough for a short generation to cross it.
Each entry names the test file it imitates. Random weights, no hub.

One change to every tester: enough layers that at least three keep attention KV (four for the plain decoders, the
tester's own layer pattern repeated for the hybrids), so under a budget with no room for the pages they must leave the
device at every step (two layers fit the pager's floor: the layer computing and its growth)."""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
import transformers

# tests/causal_lm_tester.py: CausalLMModelTester.__init__ defaults
CAUSAL_LM_TESTER = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=2, intermediate_size=37, hidden_act="gelu", hidden_dropout_prob=0.1,
                        attention_probs_dropout_prob=0.1, max_position_embeddings=512, type_vocab_size=16,
                        initializer_range=0.02, pad_token_id=0, bos_token_id=1, eos_token_id=2, is_decoder=False,
                        expert_interval=1, moe_intermediate_size=12, shared_expert_intermediate_size=36,
                        shared_expert_gate=True, num_experts_per_tok=2, num_experts=8, mamba_n_groups=1,
                        mamba_n_heads=16, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16)


def config_from_tester(config_class: type, **changes: Any) -> Any:
    """`CausalLMModelTester.get_config`: the tester's attributes the config's __init__ names (pad_token_id always),
    then the model tester's own changes."""
    attrs = dict(CAUSAL_LM_TESTER, head_dim=CAUSAL_LM_TESTER["hidden_size"] // CAUSAL_LM_TESTER["num_attention_heads"])
    attrs.update(changes)
    names = set(inspect.signature(config_class.__init__).parameters) | {"pad_token_id"}
    fields = getattr(config_class, "__dataclass_fields__", {})
    kwargs = {k: v for k, v in attrs.items() if k in names or k in fields or k in changes}
    return config_class(**kwargs)


@dataclass
class Tiny:
    name: str
    imitates: str  # the transformers test file
    build: Callable[[], Any]
    kind: str  # full / sliding / hybrid / chunked / state-space / linear / recurrent / encoder-decoder
    beam: bool = True
    static: bool = True
    new_tokens: int = 8


def aligned(model: Any) -> Any:
    """Fresh storage for every parameter (grouped-mm MoE kernels want 16-byte aligned strides; a tied or sliced
    initialisation can leave a view at an odd offset)."""
    for p in model.parameters():
        p.data = p.data.clone()
    return model.eval()


def _causal(cls_name: str, cfg_name: str, **changes: Any) -> Callable[[], Any]:
    changes.setdefault("num_hidden_layers", 4)

    def build() -> Any:
        cfg = config_from_tester(getattr(transformers, cfg_name), **changes)
        torch.manual_seed(0)
        return aligned(getattr(transformers, cls_name)(cfg))
    return build


def _file(m: str) -> str:
    return f"tests/models/{m}/test_modeling_{m}.py"


MOE_WIDTH = 32  # torch's CPU grouped-mm MoE kernel wants 16-byte strides: the tester's 37 floats fail the plain model
SLIDE = 6  # a window the prompt (5) plus a few new tokens crosses
DECODERS = [
    Tiny("llama", _file("llama"), _causal("LlamaForCausalLM", "LlamaConfig"), "full"),
    Tiny("qwen2", _file("qwen2"), _causal("Qwen2ForCausalLM", "Qwen2Config"), "full"),
    Tiny("qwen3", _file("qwen3"), _causal("Qwen3ForCausalLM", "Qwen3Config"), "full"),
    Tiny("phi3", _file("phi3"), _causal("Phi3ForCausalLM", "Phi3Config"), "full"),
    Tiny("olmo2", _file("olmo2"), _causal("Olmo2ForCausalLM", "Olmo2Config"), "full"),
    Tiny("granite", _file("granite"), _causal("GraniteForCausalLM", "GraniteConfig"), "full"),
    Tiny("mixtral", _file("mixtral"), _causal("MixtralForCausalLM", "MixtralConfig", sliding_window=None,
                                                              intermediate_size=MOE_WIDTH), "full"),
    Tiny("mistral", _file("mistral"), _causal("MistralForCausalLM", "MistralConfig", sliding_window=SLIDE),
         "sliding"),
    Tiny("starcoder2", _file("starcoder2"), _causal("Starcoder2ForCausalLM", "Starcoder2Config",
                                                    sliding_window=SLIDE), "sliding"),
    Tiny("gemma2", _file("gemma2"), _causal("Gemma2ForCausalLM", "Gemma2Config", sliding_window=SLIDE,
                                            hidden_activation="gelu_pytorch_tanh"), "hybrid"),
    Tiny("gemma3", _file("gemma3"), _causal("Gemma3ForCausalLM", "Gemma3TextConfig", sliding_window=SLIDE,
                                            layer_types=["sliding_attention", "full_attention"] * 2),
         "hybrid"),
    Tiny("cohere2", _file("cohere2"), _causal("Cohere2ForCausalLM", "Cohere2Config", sliding_window=SLIDE,
                                              layer_types=["sliding_attention"] * 3 + ["full_attention"]),
         "hybrid"),
    Tiny("gpt_oss", _file("gpt_oss"), _causal("GptOssForCausalLM", "GptOssConfig", sliding_window=SLIDE,
                                              num_local_experts=4, num_experts_per_tok=2,
                                              intermediate_size=MOE_WIDTH), "hybrid"),
    Tiny("llama4", _file("llama4"), _causal("Llama4ForCausalLM", "Llama4TextConfig", attention_chunk_size=SLIDE,
                                            no_rope_layers=[1, 0] * 2,
                                            layer_types=["chunked_attention", "full_attention"] * 2,
                                            intermediate_size_mlp=37, num_local_experts=2), "chunked"),
    Tiny("recurrent_gemma", _file("recurrent_gemma"),
         _causal("RecurrentGemmaForCausalLM", "RecurrentGemmaConfig", num_hidden_layers=9, attention_window_size=SLIDE),
         "recurrent"),
    Tiny("mamba", _file("mamba"), _causal("MambaForCausalLM", "MambaConfig", state_size=16, conv_kernel=4,
                                          expand=2), "state-space"),
    Tiny("mamba2", _file("mamba2"), _causal("Mamba2ForCausalLM", "Mamba2Config", num_heads=8, head_dim=8,
                                            n_groups=1, state_size=16, conv_kernel=4, expand=2, chunk_size=16),
         "state-space"),
    Tiny("jamba", _file("jamba"), _causal("JambaForCausalLM", "JambaConfig", num_hidden_layers=6, attn_layer_period=2,
                                          attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                                          num_experts=2, mamba_dt_rank=4, intermediate_size=MOE_WIDTH), "hybrid-ssm"),
    Tiny("bamba", _file("bamba"), _causal("BambaForCausalLM", "BambaConfig", num_hidden_layers=6,
                                          attn_layer_indices=[1, 3, 5], mamba_n_heads=8, mamba_d_head=8), "hybrid-ssm"),
    Tiny("falcon_h1", _file("falcon_h1"), _causal("FalconH1ForCausalLM", "FalconH1Config", mamba_n_heads=8,
                                                  mamba_d_head=8, mamba_d_ssm=64), "hybrid-ssm"),
    Tiny("lfm2", _file("lfm2"), _causal("Lfm2ForCausalLM", "Lfm2Config", num_hidden_layers=6,
                                        layer_types=["conv", "full_attention"] * 3), "conv"),
    # MLA: keys 16 wide (8 nope + 8 rope), values 12: the pages hold keys and values of different widths
    Tiny("deepseek_v3", _file("deepseek_v3"), _causal("DeepseekV3ForCausalLM", "DeepseekV3Config", kv_lora_rank=16,
                                                      q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                                                      v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2,
                                                      first_k_dense_replace=1, moe_intermediate_size=MOE_WIDTH,
                                                      intermediate_size=MOE_WIDTH, n_group=1, topk_group=1), "full"),
    # KV sharing: the last two layers reuse the keys and values of earlier ones (DummyLayer in the cache)
    Tiny("gemma3n", _file("gemma3n"), _causal("Gemma3nForCausalLM", "Gemma3nTextConfig", sliding_window=SLIDE,
                                              num_kv_shared_layers=2, laurel_rank=4, altup_num_inputs=2,
                                              num_hidden_layers=6,
                                              layer_types=["sliding_attention", "full_attention"] * 3,
                                              hidden_size_per_layer_input=8, vocab_size_per_layer_input=99,
                                              activation_sparsity_pattern=[0.0] * 6, intermediate_size=[32] * 6),
         "hybrid"),
    Tiny("qwen3_next", _file("qwen3_next"), _causal("Qwen3NextForCausalLM", "Qwen3NextConfig", num_hidden_layers=6,
                                                    layer_types=["linear_attention", "full_attention"] * 3,
                                                    num_experts=2, linear_num_key_heads=2, linear_num_value_heads=2,
                                                    linear_key_head_dim=8, linear_value_head_dim=8), "linear"),
]


def _t5() -> Any:
    """tests/models/t5/test_modeling_t5.py T5ModelTester.get_config."""
    cfg = transformers.T5Config(vocab_size=99, d_model=32, d_ff=37, d_kv=32 // 4, num_layers=2, num_decoder_layers=2,
                                num_heads=4, relative_attention_num_buckets=8, dropout_rate=0.1,
                                initializer_factor=0.002, eos_token_id=1, bos_token_id=0, pad_token_id=0,
                                decoder_start_token_id=0)
    torch.manual_seed(0)
    return aligned(transformers.T5ForConditionalGeneration(cfg))


def _bart() -> Any:
    """tests/models/bart/test_modeling_bart.py BartModelTester.get_config."""
    cfg = transformers.BartConfig(vocab_size=99, d_model=16, encoder_layers=2, decoder_layers=2,
                                  encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=4,
                                  decoder_ffn_dim=4, dropout=0.1, attention_dropout=0.1, max_position_embeddings=20,
                                  eos_token_id=2, bos_token_id=0, pad_token_id=1, forced_eos_token_id=None)
    torch.manual_seed(0)
    return aligned(transformers.BartForConditionalGeneration(cfg))


def _whisper() -> Any:
    """tests/models/whisper/test_modeling_whisper.py WhisperModelTester.get_config."""
    cfg = transformers.WhisperConfig(vocab_size=200, d_model=16, encoder_layers=2, decoder_layers=2,
                                     encoder_attention_heads=4, decoder_attention_heads=4, num_mel_bins=80,
                                     encoder_ffn_dim=16, decoder_ffn_dim=16, max_source_positions=30,
                                     max_target_positions=40, bos_token_id=98, eos_token_id=98, pad_token_id=0,
                                     decoder_start_token_id=85, suppress_tokens=None, begin_suppress_tokens=None)
    torch.manual_seed(0)
    return aligned(transformers.WhisperForConditionalGeneration(cfg))


def seq2seq_inputs(name: str) -> dict:
    """A batch of two for the encoder (left... right-padded text, or Whisper's 60 frames of 80 mel bins)."""
    if name == "whisper":
        g = torch.Generator().manual_seed(3)
        return {"input_features": torch.randn(2, 80, 60, generator=g)}
    pad = 1 if name == "bart" else 0
    ids = torch.tensor([[5, 9, 13, 7, 2], [4, 8, 3, pad, pad]])
    return {"input_ids": ids, "attention_mask": (ids != pad).long()}


ENCODER_DECODERS = [
    Tiny("t5", _file("t5"), _t5, "encoder-decoder"),
    Tiny("bart", _file("bart"), _bart, "encoder-decoder", new_tokens=6),  # 20 positions: two calls of 6 fit
    Tiny("whisper", _file("whisper"), _whisper, "encoder-decoder"),
]
