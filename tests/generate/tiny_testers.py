"""Tiny transformers models built as transformers' own model tests build them: `CausalLMModelTester.get_config`
(tests/causal_lm_tester.py: the tester's defaults, passed where the config's __init__ takes them), with the few
settings each model's tester changes, and the layer mix and window small enough for a short generation to cross it.
Each entry names the test file it imitates. Random weights, no hub."""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
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


def tester_config(config_class: type, **changes: Any) -> Any:
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
    extra: dict = field(default_factory=dict)


def _causal(cls_name: str, cfg_name: str, **changes: Any) -> Callable[[], Any]:
    def build() -> Any:
        cfg = tester_config(getattr(transformers, cfg_name), **changes)
        torch.manual_seed(0)
        return getattr(transformers, cls_name)(cfg).eval()
    return build


def _file(m: str) -> str:
    return f"tests/models/{m}/test_modeling_{m}.py"


SLIDE = 6  # a window the prompt (5) plus a few new tokens crosses
DECODERS = [
    Tiny("llama", _file("llama"), _causal("LlamaForCausalLM", "LlamaConfig"), "full"),
    Tiny("qwen2", _file("qwen2"), _causal("Qwen2ForCausalLM", "Qwen2Config"), "full"),
    Tiny("qwen3", _file("qwen3"), _causal("Qwen3ForCausalLM", "Qwen3Config"), "full"),
    Tiny("phi3", _file("phi3"), _causal("Phi3ForCausalLM", "Phi3Config"), "full"),
    Tiny("olmo2", _file("olmo2"), _causal("Olmo2ForCausalLM", "Olmo2Config"), "full"),
    Tiny("granite", _file("granite"), _causal("GraniteForCausalLM", "GraniteConfig"), "full"),
    Tiny("mixtral", _file("mixtral"), _causal("MixtralForCausalLM", "MixtralConfig", sliding_window=None), "full"),
    Tiny("mistral", _file("mistral"), _causal("MistralForCausalLM", "MistralConfig", sliding_window=SLIDE),
         "sliding"),
    Tiny("starcoder2", _file("starcoder2"), _causal("Starcoder2ForCausalLM", "Starcoder2Config",
                                                    sliding_window=SLIDE), "sliding"),
    Tiny("gemma2", _file("gemma2"), _causal("Gemma2ForCausalLM", "Gemma2Config", sliding_window=SLIDE,
                                            hidden_activation="gelu_pytorch_tanh"), "hybrid"),
    Tiny("gemma3", _file("gemma3"), _causal("Gemma3ForCausalLM", "Gemma3TextConfig", sliding_window=SLIDE,
                                            num_hidden_layers=3,
                                            layer_types=["sliding_attention", "full_attention",
                                                         "sliding_attention"]), "hybrid"),
    Tiny("cohere2", _file("cohere2"), _causal("Cohere2ForCausalLM", "Cohere2Config", sliding_window=SLIDE,
                                              num_hidden_layers=3,
                                              layer_types=["sliding_attention", "sliding_attention",
                                                           "full_attention"]), "hybrid"),
    Tiny("gpt_oss", _file("gpt_oss"), _causal("GptOssForCausalLM", "GptOssConfig", sliding_window=SLIDE,
                                              num_local_experts=4, num_experts_per_tok=2), "hybrid"),
    Tiny("llama4", _file("llama4"), _causal("Llama4ForCausalLM", "Llama4TextConfig", attention_chunk_size=SLIDE,
                                            num_hidden_layers=2, no_rope_layers=[1, 0],
                                            layer_types=["chunked_attention", "full_attention"],
                                            intermediate_size_mlp=37, num_local_experts=2), "chunked"),
    Tiny("recurrent_gemma", _file("recurrent_gemma"),
         _causal("RecurrentGemmaForCausalLM", "RecurrentGemmaConfig", num_hidden_layers=3, attention_window_size=SLIDE,
                 block_types=["recurrent", "attention", "recurrent"]), "recurrent", beam=False),
    Tiny("mamba", _file("mamba"), _causal("MambaForCausalLM", "MambaConfig", state_size=16, conv_kernel=4,
                                          expand=2), "state-space"),
    Tiny("mamba2", _file("mamba2"), _causal("Mamba2ForCausalLM", "Mamba2Config", num_heads=8, head_dim=8,
                                            n_groups=1, state_size=16, conv_kernel=4, expand=2, chunk_size=16),
         "state-space"),
    Tiny("jamba", _file("jamba"), _causal("JambaForCausalLM", "JambaConfig", num_hidden_layers=2, attn_layer_period=2,
                                          attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                                          num_experts=2, use_mamba_kernels=False, mamba_dt_rank=4), "hybrid-ssm"),
    Tiny("bamba", _file("bamba"), _causal("BambaForCausalLM", "BambaConfig", num_hidden_layers=2,
                                          attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=8), "hybrid-ssm"),
    Tiny("falcon_h1", _file("falcon_h1"), _causal("FalconH1ForCausalLM", "FalconH1Config", mamba_n_heads=8,
                                                  mamba_d_head=8, mamba_d_ssm=64), "hybrid-ssm"),
    Tiny("lfm2", _file("lfm2"), _causal("Lfm2ForCausalLM", "Lfm2Config", num_hidden_layers=2,
                                        layer_types=["conv", "full_attention"]), "conv"),
    Tiny("qwen3_next", _file("qwen3_next"), _causal("Qwen3NextForCausalLM", "Qwen3NextConfig", num_hidden_layers=2,
                                                    layer_types=["linear_attention", "full_attention"],
                                                    num_experts=2, linear_num_key_heads=2, linear_num_value_heads=2,
                                                    linear_key_head_dim=8, linear_value_head_dim=8), "linear"),
]
