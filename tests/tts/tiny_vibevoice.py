"""A tiny, offline VibeVoice model folder for tests (transformers >= 5.23, no download, no ComfyUI).

``write_tiny_vibevoice(folder)`` writes a complete model folder (5.4 MB in float32, 1.33 M parameters) that
``VibeVoiceForConditionalGeneration.from_pretrained(folder, local_files_only=True)`` and
``AutoProcessor.from_pretrained(folder, local_files_only=True)`` load with ``HF_HUB_OFFLINE=1``:

    config.json, generation_config.json, model.safetensors            (random weights, see below)
    tokenizer.json, tokenizer_config.json                             (a byte-level BPE built here, Qwen2 style)
    processor_config.json, chat_template.jinja                        (VibeVoiceProcessor + feature extractor)

The architecture is the real one (a 4-layer Qwen2 decoder with GQA and tied embeddings like VibeVoice-1.5B, the
sigma-VAE acoustic tokenizer and the semantic encoder with the real down-sampling ratios, so one speech token is
still 3200 samples at 24 kHz, both connectors, the diffusion head); only widths and depths are tiny. Same seed,
same bytes.

Deterministic speech. A random model emits end-of-speech at once, so a few weights are set by hand (all in
``_make_speech_deterministic``). Five residual dimensions, scaled by ``_S``, hold a constant, a "not counted" flag,
an audio_bos flag, an eos flag and a counter; no layer writes them except q-heads 0-1 / kv-head 0 of layer 0, whose
query and key come from biases and one key weight, so they attend uniformly to the ``<|vision_start|>``
(audio_bos) positions and the generated speech positions and nowhere else, and write the counter
``c = m / (m + n)``: ``m`` audio_bos tokens in the prompt, ``n`` speech tokens so far. The rows of the tied
embedding/LM-head matrix of the four audio control tokens are zero outside these dimensions, so greedy decoding
gives: the speech token while ``c > 1 / (N + 0.3)``, then ``<|vision_end|>`` (audio_eos), then ``<|endoftext|>``
(eos), which ends ``generate``. The ``<|vision_pad|>`` row, as an input, looks like a speech embedding: transformers
also runs a logits-CFG pass on the raw token ids when ``guidance_scale != 1`` (see the notes), and that pass then
agrees with the positive one. Without voice references the model speaks exactly ``N = speech_tokens`` tokens
(``N * 3200`` samples) for any prompt, seed, guidance scale (1 to 5 checked) and dtype (float32, bfloat16); with
voice references it speaks longer (each voice adds an audio_bos to the prompt), deterministically but with no
closed form, so pass ``max_new_tokens``. Everything else (diffusion head, tokenizers, the other heads and layers)
stays random: the waveform depends on the seed strongly and on the text and the voices weakly (but never
bitwise-equal).

``write_original_layout(folder)`` writes the same weights in the original Microsoft release layout
(``microsoft/VibeVoice-1.5B``: config.json with ``decoder_config``/``acoustic_tokenizer_config``/...,
``model-0000k-of-0000n.safetensors`` + ``model.safetensors.index.json``, ``preprocessor_config.json``, no
``lm_head.weight`` because it is tied). ``original_to_hf_key`` is the key mapping of transformers'
``convert_vibevoice_to_hf.py`` (not shipped in the wheel), checked bitwise against the original modelling code.
"""
from __future__ import annotations

import json
import math
import os
import re
from typing import Any, Iterable, Sequence

import torch

SAMPLE_RATE = 24000
HOP_LENGTH = 3200  # prod(downsampling_ratios): samples per speech token (7.5 tokens/s)

# Qwen2.5's added tokens, in Qwen2.5's order (ids 151643.. in the real vocabulary; appended after the BPE vocab here).
QWEN25_ADDED_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
]
AUDIO_BOS_TOKEN = "<|vision_start|>"
AUDIO_EOS_TOKEN = "<|vision_end|>"
AUDIO_TOKEN = "<|vision_pad|>"  # the speech ("audio diffusion") token
EOS_TOKEN = "<|endoftext|>"

# The chat template of transformers' VibeVoice conversion script / processor tests (roles are speaker ids).
CHAT_TEMPLATE = """{%- set system_prompt = system_prompt | default(" Transform the text provided by various speakers into speech output, utilizing the distinct voice of each respective speaker.\\n") -%}
{{ system_prompt -}}
{%- set audio_bos_token = audio_bos_token | default("<|vision_start|>") %}
{%- set audio_eos_token = audio_eos_token | default("<|vision_end|>") %}
{%- set audio_diffusion_token = audio_diffusion_token | default("<|vision_pad|>") %}
{%- set ns = namespace(speakers_with_audio="") %}
{%- for message in messages %}
    {%- set role = message['role'] %}
    {%- set content = message['content'] %}
    {%- set has_audio = content | selectattr('type', 'equalto', 'audio') | list | length > 0 %}
    {%- if has_audio and role not in ns.speakers_with_audio %}
        {%- set ns.speakers_with_audio = ns.speakers_with_audio + role + "," %}
    {%- endif %}
{%- endfor %}

{%- if ns.speakers_with_audio %}
{{ " Voice input:\\n" }}
{%- for speaker in ns.speakers_with_audio.rstrip(',').split(',') %}
{%- if speaker %}
 Speaker {{ speaker }}:{{ audio_bos_token }}{{ audio_diffusion_token }}{{ audio_eos_token }}{{ "\\n" }}
{%- endif %}
{%- endfor %}
{%- endif %}
 Text input:{{ "\\n" }}

{%- for message in messages %}
    {%- set role = message['role'] %}
    {%- set text_items = message['content'] | selectattr('type', 'equalto', 'text') | list %}
    {%- for item in text_items %}
 Speaker {{ role }}: {{ item['text'] }}{{ "\\n" }}
    {%- endfor %}
{%- endfor %}
 Speech output:{{ "\\n" }}{{ audio_bos_token }}"""

_BPE_CORPUS = [
    " Transform the text provided by various speakers into speech output, utilizing the distinct voice of each"
    " respective speaker.\n",
    " Voice input:\n Speaker 0: Speaker 1: Speaker 2: Speaker 3:\n Text input:\n Speech output:\n",
    "Hello world, this is a tiny test of the speech model. How are you today? I am fine, thank you.",
    "The quick brown fox jumps over the lazy dog. 0123456789",
]

# Tiny sizes (the real VibeVoice-1.5B values in comments).
TEXT_CONFIG = dict(
    model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=4,  # 1536, 8960, 28
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,  # 12, 2, 65536
    rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    tie_word_embeddings=True, use_sliding_window=False, sliding_window=None, max_window_layers=4,
)
ACOUSTIC_CONFIG = dict(
    model_type="vibevoice_acoustic_tokenizer", channels=1, hidden_size=16, kernel_size=7,  # vae_dim 64
    num_filters=2, downsampling_ratios=[2, 2, 4, 5, 5, 8], depths=[1, 1, 1, 1, 1, 1, 1],  # 32, same, 3-3-3-3-3-3-8
    ffn_expansion=4, vae_std=0.625, rms_norm_eps=1e-5, layer_scale_init_value=1e-6,
)
SEMANTIC_CONFIG = dict(
    model_type="vibevoice_acoustic_tokenizer_encoder", channels=1, hidden_size=8, kernel_size=7,  # vae_dim 128
    num_filters=2, downsampling_ratios=[2, 2, 4, 5, 5, 8], depths=[1, 1, 1, 1, 1, 1, 1],
    ffn_expansion=4, rms_norm_eps=1e-5, layer_scale_init_value=1e-6,
)
DIFFUSION_CONFIG = dict(num_hidden_layers=2, intermediate_size=96, frequency_embedding_size=256, rms_norm_eps=1e-5)

# Residual dimensions reserved by the deterministic-speech construction.
_K, _U, _B, _Z, _E = 0, 1, 2, 3, 4  # constant, "not counted" flag, audio_bos flag (counter value), eos flag, counter
_S = 8.0  # scale of the reserved dims: they dominate every RMS, so the CFG and the positive pass agree
_BOS_K, _BOS_B = 0.5, 0.4  # audio_bos row: as an input it is counted (value > 0); as an output it never wins
_EOS_Z = 200.0  # eos row: wins right after audio_eos was the input
_THRESHOLD_OFFSET = 0.3  # speech while m / (m + n) > 1 / (N + 0.3): no ties for m <= 9


def build_tokenizer():
    """Build a small Qwen2-style byte-level BPE tokenizer (no download) with Qwen2.5's added tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import AddedToken
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX, Qwen2Tokenizer

    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False, special_tokens=[])
    bpe.train_from_iterator(_BPE_CORPUS * 4, trainer)
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tok = Qwen2Tokenizer(vocab=dict(model["vocab"]), merges=merges, unk_token=None, bos_token=None,
                         eos_token=EOS_TOKEN, pad_token=EOS_TOKEN, model_max_length=32768)
    tok.add_tokens([AddedToken(t, special=t.startswith("<|"), normalized=False) for t in QWEN25_ADDED_TOKENS])
    return tok


def tiny_config(tokenizer, dtype: torch.dtype = torch.float32):
    """The tiny VibeVoiceConfig whose token ids match ``tokenizer``."""
    from transformers import VibeVoiceConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (EOS_TOKEN, AUDIO_BOS_TOKEN, AUDIO_EOS_TOKEN, AUDIO_TOKEN)}
    vocab_size = int(math.ceil(len(tokenizer) / 64) * 64)
    text = dict(TEXT_CONFIG, vocab_size=vocab_size, bos_token_id=None, eos_token_id=ids[EOS_TOKEN],
                pad_token_id=ids[EOS_TOKEN])
    return VibeVoiceConfig(
        text_config=text, audio_config=dict(ACOUSTIC_CONFIG), semantic_model_config=dict(SEMANTIC_CONFIG),
        diffusion_head_config=dict(DIFFUSION_CONFIG), pad_token_id=ids[EOS_TOKEN], eos_token_id=ids[EOS_TOKEN],
        audio_bos_token_id=ids[AUDIO_BOS_TOKEN], audio_eos_token_id=ids[AUDIO_EOS_TOKEN],
        audio_token_id=ids[AUDIO_TOKEN], dtype=dtype,
    )


@torch.no_grad()
def _make_speech_deterministic(model, speech_tokens: int) -> None:
    """Set the weights described in the module docstring (in place, before the dtype cast)."""
    cfg = model.config
    hidden = cfg.text_config.hidden_size
    lm = model.model.language_model
    emb = lm.embed_tokens.weight  # tied to lm_head.weight (as in VibeVoice-1.5B)
    bos, aeos, tok, eos = cfg.audio_bos_token_id, cfg.audio_eos_token_id, cfg.audio_token_id, cfg.eos_token_id
    threshold = 1.0 / (speech_tokens + _THRESHOLD_OFFSET)
    s = _S

    # Rows on the reserved dims (K, U, B, Z, E), in units of s; the four control rows are zero everywhere else,
    # so their logits read only these dims. After a speech token the residual is x = s (1, 0, 0, 0, c) with
    # c = m / (m + n): logits (/ s^2) speech 1, audio_eos 1 + 10 (T - c), audio_bos 0.5, eos 0. At the prompt end
    # x = s (0.5, 0, 0.4, 0, 1): speech 0.5, audio_bos 0.41, audio_eos < 0. After audio_eos: eos 200 beats ~103.
    emb[:, :5] = 0.0
    emb[:, _K] = s
    emb[:, _U] = s  # every ordinary token is "not counted"
    for row in (bos, aeos, tok, eos):
        emb[row] = 0.0
    emb[bos, _K], emb[bos, _B] = s * _BOS_K, s * _BOS_B
    emb[tok, _K] = s  # as an input (only in the logits-CFG pass) it looks exactly like a speech embedding
    emb[aeos, _K], emb[aeos, _U], emb[aeos, _Z], emb[aeos, _E] = s * (1.0 + 10.0 * threshold), s, s, -10.0 * s
    emb[eos, _Z] = s * _EOS_Z
    if not cfg.text_config.tie_word_embeddings:
        model.lm_head.weight.copy_(emb)

    for layer in lm.layers:  # no layer writes the reserved dims, and every layer reads the others at full scale
        layer.self_attn.o_proj.weight[:5] = 0.0
        layer.mlp.down_proj.weight[:5] = 0.0
        layer.input_layernorm.weight.fill_(s)
        layer.post_attention_layernorm.weight.fill_(s)
        layer.input_layernorm.weight[:5] = 1.0
        layer.post_attention_layernorm.weight[:5] = 1.0
    lm.norm.weight.fill_(s)
    lm.norm.weight[:5] = 1.0
    attn = lm.layers[0].self_attn  # q-heads 0-1 / kv-head 0 of layer 0: the counter
    hd = attn.head_dim
    low = hd // 2 - 1  # lowest RoPE frequency: (almost) position-independent
    attn.q_proj.weight[: 2 * hd] = 0.0
    attn.q_proj.bias[: 2 * hd] = 0.0
    attn.q_proj.bias[low] = 1.0
    attn.k_proj.weight[:hd] = 0.0
    attn.k_proj.bias[:hd] = 0.0
    attn.k_proj.weight[low, _U] = -1000.0  # "not counted" positions get a score of about -1000
    attn.v_proj.weight[:hd] = 0.0
    attn.v_proj.bias[:hd] = 0.0
    attn.v_proj.weight[0, _B] = 1.0
    eps = cfg.text_config.rms_norm_eps
    bos_value = _BOS_B / math.sqrt((_BOS_K**2 + _BOS_B**2) / hidden + eps / s**2)  # normed audio_bos row, dim B
    attn.o_proj.weight[:, : 2 * hd] = 0.0
    attn.o_proj.weight[_E, 0] = s / bos_value  # counter = s * m / (m + n)

    # Voice-prompt embeddings (acoustic projector only): s (1, 1, 0, 0, 0), not counted. Speech embeddings
    # (acoustic projector + semantic connector): s (1, 0, 0, 0, 0), counted with value 0.
    proj, sem = model.model.multi_modal_projector.linear_2, model.model.semantic_connector.linear_2
    proj.weight[:5] = 0.0
    proj.bias[:5] = 0.0
    proj.bias[_K], proj.bias[_U] = s, s
    sem.weight[:5] = 0.0
    sem.bias[:5] = 0.0
    sem.bias[_U] = -s

    # Variance-preserving convolutions in the acoustic and semantic tokenizers (the default init scales every conv
    # by 0.01, so the waveform would be ~1e-10 and a voice reference would drown in the sigma-VAE noise).
    for tower in (model.model.audio_tower, model.model.semantic_tokenizer_encoder):
        for mod in tower.modules():
            if isinstance(mod, torch.nn.Conv1d):
                fan_in = mod.in_channels // mod.groups * mod.kernel_size[0]
                mod.weight.normal_(0.0, 1.0 / math.sqrt(fan_in))
                mod.bias.zero_()
            elif isinstance(mod, torch.nn.ConvTranspose1d):
                fan_in = mod.in_channels * mod.kernel_size[0] / mod.stride[0]
                mod.weight.normal_(0.0, 1.0 / math.sqrt(fan_in))
                mod.bias.zero_()
    model.model.audio_tower.decoder.head.conv.weight.mul_(0.1)
    # Same for the diffusion head (its default init predicts ~0, so the latent would be the noise alone).
    for mod in model.model.diffusion_head.modules():
        if isinstance(mod, torch.nn.Linear):
            mod.weight.normal_(0.0, 1.0 / math.sqrt(mod.in_features))
    model.model.latent_scaling_factor.fill_(2.0)
    model.model.latent_bias_factor.fill_(-0.05)


def build_tiny_model(seed: int = 0, dtype: torch.dtype = torch.float32, speech_tokens: int = 6):
    """Return ``(model, tokenizer)``: the tiny model in memory (eval mode, ``dtype``)."""
    from transformers import VibeVoiceForConditionalGeneration

    tokenizer = build_tokenizer()
    config = tiny_config(tokenizer, dtype)
    with torch.random.fork_rng(devices=[]):  # leaves the caller's RNG state alone
        torch.manual_seed(seed)
        model = VibeVoiceForConditionalGeneration(config)
        _make_speech_deterministic(model, speech_tokens)
    gen = model.generation_config
    gen._from_model_config = False
    gen.do_sample = False
    gen.guidance_scale = 1.3
    gen.max_new_tokens = 256
    gen.eos_token_id = config.eos_token_id
    gen.pad_token_id = config.pad_token_id
    gen.bos_token_id = None
    gen.noise_scheduler_class = "DPMSolverMultistepScheduler"
    gen.noise_scheduler_config = {"beta_schedule": "squaredcos_cap_v2", "prediction_type": "v_prediction"}
    return model.to(dtype).eval(), tokenizer


def build_processor(tokenizer):
    """VibeVoiceProcessor for the tiny tokenizer (24 kHz, pad to the 3200-sample hop, the chat template)."""
    from transformers import VibeVoiceAcousticTokenizerFeatureExtractor, VibeVoiceProcessor

    fe = VibeVoiceAcousticTokenizerFeatureExtractor(sampling_rate=SAMPLE_RATE, normalize_audio=True,
                                                     target_dB_FS=-25, eps=1e-6, pad_to_multiple_of=HOP_LENGTH)
    return VibeVoiceProcessor(feature_extractor=fe, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE)


def write_tiny_vibevoice(folder: str, seed: int = 0, dtype: torch.dtype = torch.float32,
                         speech_tokens: int = 6) -> str:
    """Write the tiny transformers-layout VibeVoice folder (model, tokenizer, processor) and return its path."""
    model, tokenizer = build_tiny_model(seed, dtype, speech_tokens)
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder)
    build_processor(tokenizer).save_pretrained(folder)
    return folder


# ---------------------------------------------------------------------------------------------------------------
# Original Microsoft layout
# ---------------------------------------------------------------------------------------------------------------

# Original -> transformers key mapping, applied in order with re.sub on the running key; "PLACEHOLDER" becomes the
# captured stage index minus one (stage 0 of the original is the transformers "stem"). Same rules as transformers'
# convert_vibevoice_to_hf.py for the 5.2x module names.
ORIGINAL_TO_HF_RULES: list[tuple[str, str]] = [
    (r"semantic_tokenizer\.encoder\.downsample_layers\.0\.0\.conv\.", "semantic_tokenizer_encoder.stem.conv.conv."),
    (r"semantic_tokenizer\.encoder\.stages\.0\.", "semantic_tokenizer_encoder.stem.stage."),
    (r"semantic_tokenizer\.encoder\.downsample_layers\.(\d+)\.0\.conv\.",
     "semantic_tokenizer_encoder.conv_layers.PLACEHOLDER.conv.conv."),
    (r"semantic_tokenizer\.encoder\.stages\.(\d+)\.", "semantic_tokenizer_encoder.conv_layers.PLACEHOLDER.stage."),
    (r"semantic_tokenizer\.encoder\.head\.conv\.", "semantic_tokenizer_encoder.head."),
    (r"acoustic_tokenizer\.encoder\.downsample_layers\.0\.0\.conv\.", "audio_tower.encoder.stem.conv.conv."),
    (r"acoustic_tokenizer\.encoder\.stages\.0\.", "audio_tower.encoder.stem.stage."),
    (r"acoustic_tokenizer\.encoder\.downsample_layers\.(\d+)\.0\.conv\.",
     "audio_tower.encoder.conv_layers.PLACEHOLDER.conv.conv."),
    (r"acoustic_tokenizer\.encoder\.stages\.(\d+)\.", "audio_tower.encoder.conv_layers.PLACEHOLDER.stage."),
    (r"acoustic_tokenizer\.encoder\.head\.conv\.", "audio_tower.encoder.head."),
    (r"acoustic_tokenizer\.decoder\.upsample_layers\.0\.0\.conv\.conv\.", "audio_tower.decoder.stem.conv.conv."),
    (r"acoustic_tokenizer\.decoder\.stages\.0\.", "audio_tower.decoder.stem.stage."),
    (r"acoustic_tokenizer\.decoder\.upsample_layers\.(\d+)\.0\.convtr\.convtr\.",
     "audio_tower.decoder.conv_layers.PLACEHOLDER.convtr.convtr."),
    (r"acoustic_tokenizer\.decoder\.stages\.(\d+)\.", "audio_tower.decoder.conv_layers.PLACEHOLDER.stage."),
    (r"acoustic_tokenizer\.decoder\.head\.conv\.", "audio_tower.decoder.head."),
    (r"prediction_head\.t_embedder\.mlp\.0\.", "diffusion_head.timestep_proj.fc1."),
    (r"prediction_head\.t_embedder\.mlp\.2\.", "diffusion_head.timestep_proj.fc2."),
    (r"prediction_head\.layers\.(\d+)\.adaLN_modulation\.1\.", r"diffusion_head.layers.\1.linear."),
    (r"prediction_head\.final_layer\.adaLN_modulation\.1\.", "diffusion_head.final_layer.linear_1."),
    (r"prediction_head\.final_layer\.linear\.", "diffusion_head.final_layer.linear_2."),
    (r"prediction_head\.", "diffusion_head."),
    (r"acoustic_connector\.fc1\.", "multi_modal_projector.linear_1."),
    (r"acoustic_connector\.norm\.", "multi_modal_projector.act."),
    (r"acoustic_connector\.fc2\.", "multi_modal_projector.linear_2."),
    (r"semantic_connector\.fc1\.", "semantic_connector.linear_1."),
    (r"semantic_connector\.norm\.", "semantic_connector.act."),
    (r"semantic_connector\.fc2\.", "semantic_connector.linear_2."),
    (r"^model\.speech_scaling_factor$", "model.latent_scaling_factor"),
    (r"^model\.speech_bias_factor$", "model.latent_bias_factor"),
    (r"mixer\.conv\.conv\.conv\.", "mixer.conv."),  # the original wraps each Conv1d once more
    (r"\.conv\.conv\.conv\.", ".conv.conv."),
]


def original_to_hf_key(key: str) -> str:
    """Map one key of the original Microsoft checkpoint to the transformers 5.2x VibeVoice key."""
    for pattern, replacement in ORIGINAL_TO_HF_RULES:
        match = re.search(pattern, key)
        if match:
            if "PLACEHOLDER" in replacement:
                replacement = replacement.replace("PLACEHOLDER", str(int(match.group(1)) - 1))
            key = re.sub(pattern, replacement, key)
    return key


# transformers -> original (the inverse of the rules above, for writing the original layout).
_HF_TO_ORIGINAL_RULES: list[tuple[str, Any]] = [
    (r"^model\.semantic_tokenizer_encoder\.stem\.conv\.conv\.", "model.semantic_tokenizer.encoder.downsample_layers.0.0.conv.conv."),
    (r"^model\.semantic_tokenizer_encoder\.stem\.stage\.(\d+)\.", r"model.semantic_tokenizer.encoder.stages.0.\1."),
    (r"^model\.semantic_tokenizer_encoder\.conv_layers\.(\d+)\.conv\.conv\.",
     lambda m: f"model.semantic_tokenizer.encoder.downsample_layers.{int(m.group(1)) + 1}.0.conv.conv."),
    (r"^model\.semantic_tokenizer_encoder\.conv_layers\.(\d+)\.stage\.(\d+)\.",
     lambda m: f"model.semantic_tokenizer.encoder.stages.{int(m.group(1)) + 1}.{m.group(2)}."),
    (r"^model\.semantic_tokenizer_encoder\.head\.", "model.semantic_tokenizer.encoder.head.conv."),
    (r"^model\.audio_tower\.encoder\.stem\.conv\.conv\.", "model.acoustic_tokenizer.encoder.downsample_layers.0.0.conv.conv."),
    (r"^model\.audio_tower\.encoder\.stem\.stage\.(\d+)\.", r"model.acoustic_tokenizer.encoder.stages.0.\1."),
    (r"^model\.audio_tower\.encoder\.conv_layers\.(\d+)\.conv\.conv\.",
     lambda m: f"model.acoustic_tokenizer.encoder.downsample_layers.{int(m.group(1)) + 1}.0.conv.conv."),
    (r"^model\.audio_tower\.encoder\.conv_layers\.(\d+)\.stage\.(\d+)\.",
     lambda m: f"model.acoustic_tokenizer.encoder.stages.{int(m.group(1)) + 1}.{m.group(2)}."),
    (r"^model\.audio_tower\.encoder\.head\.", "model.acoustic_tokenizer.encoder.head.conv."),
    (r"^model\.audio_tower\.decoder\.stem\.conv\.conv\.", "model.acoustic_tokenizer.decoder.upsample_layers.0.0.conv.conv."),
    (r"^model\.audio_tower\.decoder\.stem\.stage\.(\d+)\.", r"model.acoustic_tokenizer.decoder.stages.0.\1."),
    (r"^model\.audio_tower\.decoder\.conv_layers\.(\d+)\.convtr\.convtr\.",
     lambda m: f"model.acoustic_tokenizer.decoder.upsample_layers.{int(m.group(1)) + 1}.0.convtr.convtr."),
    (r"^model\.audio_tower\.decoder\.conv_layers\.(\d+)\.stage\.(\d+)\.",
     lambda m: f"model.acoustic_tokenizer.decoder.stages.{int(m.group(1)) + 1}.{m.group(2)}."),
    (r"^model\.audio_tower\.decoder\.head\.", "model.acoustic_tokenizer.decoder.head.conv."),
    (r"\.mixer\.conv\.", ".mixer.conv.conv.conv."),
    (r"^model\.diffusion_head\.timestep_proj\.fc1\.", "model.prediction_head.t_embedder.mlp.0."),
    (r"^model\.diffusion_head\.timestep_proj\.fc2\.", "model.prediction_head.t_embedder.mlp.2."),
    (r"^model\.diffusion_head\.layers\.(\d+)\.linear\.", r"model.prediction_head.layers.\1.adaLN_modulation.1."),
    (r"^model\.diffusion_head\.final_layer\.linear_1\.", "model.prediction_head.final_layer.adaLN_modulation.1."),
    (r"^model\.diffusion_head\.final_layer\.linear_2\.", "model.prediction_head.final_layer.linear."),
    (r"^model\.diffusion_head\.", "model.prediction_head."),
    (r"^model\.multi_modal_projector\.linear_1\.", "model.acoustic_connector.fc1."),
    (r"^model\.multi_modal_projector\.act\.", "model.acoustic_connector.norm."),
    (r"^model\.multi_modal_projector\.linear_2\.", "model.acoustic_connector.fc2."),
    (r"^model\.semantic_connector\.linear_1\.", "model.semantic_connector.fc1."),
    (r"^model\.semantic_connector\.act\.", "model.semantic_connector.norm."),
    (r"^model\.semantic_connector\.linear_2\.", "model.semantic_connector.fc2."),
    (r"^model\.latent_scaling_factor$", "model.speech_scaling_factor"),
    (r"^model\.latent_bias_factor$", "model.speech_bias_factor"),
]


def hf_to_original_key(key: str) -> str:
    """Map one transformers 5.2x VibeVoice key to the original Microsoft checkpoint key."""
    for pattern, replacement in _HF_TO_ORIGINAL_RULES:
        key = re.sub(pattern, replacement, key)
    return key


def original_config_dict(config) -> dict:
    """The original-layout config.json (``model_type: vibevoice``, microsoft/VibeVoice-1.5B schema) for ``config``."""
    text = config.text_config.to_dict()
    rope = text.get("rope_parameters") or {}
    decoder = {k: text[k] for k in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "max_position_embeddings", "rms_norm_eps", "vocab_size", "hidden_act", "initializer_range",
        "attention_dropout", "use_cache", "tie_word_embeddings", "max_window_layers", "use_sliding_window",
        "sliding_window")}
    decoder.update(model_type="qwen2", rope_theta=rope.get("rope_theta", 1000000.0), rope_scaling=None,
                   torch_dtype="bfloat16")

    def tokenizer_cfg(c, model_type: str, semantic: bool) -> dict:
        ratios = list(reversed(list(c.downsampling_ratios)))
        out = {
            "causal": True, "channels": c.channels, "conv_bias": True, "conv_norm": "none", "corpus_normalize": 0.0,
            "disable_last_norm": True, "encoder_depths": "-".join(str(d) for d in c.depths),
            "encoder_n_filters": c.num_filters, "encoder_ratios": ratios,
            "fix_std": 0 if semantic else round(c.vae_std * 0.8, 6),
            "layer_scale_init_value": c.layer_scale_init_value, "layernorm": "RMSNorm",
            "layernorm_elementwise_affine": True, "layernorm_eps": c.rms_norm_eps, "mixer_layer": "depthwise_conv",
            "model_type": model_type, "pad_mode": "constant", "std_dist_type": "none" if semantic else "gaussian",
            "vae_dim": c.hidden_size, "weight_init_value": 0.01,
        }
        if not semantic:
            out.update(decoder_depths=None, decoder_n_filters=c.num_filters, decoder_ratios=ratios)
        return out

    head = config.diffusion_head_config
    return {
        "architectures": ["VibeVoiceForConditionalGeneration"],
        "model_type": "vibevoice",
        "acoustic_vae_dim": config.audio_config.hidden_size,
        "semantic_vae_dim": config.semantic_model_config.hidden_size,
        "acoustic_tokenizer_config": tokenizer_cfg(config.audio_config, "vibevoice_acoustic_tokenizer", False),
        "semantic_tokenizer_config": tokenizer_cfg(config.semantic_model_config, "vibevoice_semantic_tokenizer", True),
        "decoder_config": decoder,
        "diffusion_head_config": {
            "ddpm_batch_mul": 4, "ddpm_beta_schedule": "cosine", "ddpm_num_inference_steps": 20,
            "ddpm_num_steps": 1000, "diffusion_type": "ddpm",
            "head_ffn_ratio": head.intermediate_size / head.hidden_size, "head_layers": head.num_hidden_layers,
            "hidden_size": head.hidden_size, "latent_size": head.latent_size, "model_type": "vibevoice_diffusion_head",
            "prediction_type": "v_prediction", "rms_norm_eps": head.rms_norm_eps, "speech_vae_dim": head.latent_size,
        },
        "torch_dtype": "bfloat16",
    }


def write_original_layout(folder: str, seed: int = 0, dtype: torch.dtype = torch.float32, speech_tokens: int = 6,
                          shards: int = 2, include_tokenizer: bool = True) -> str:
    """Write the same tiny model (same seed -> same weights) in the original Microsoft release layout."""
    from safetensors.torch import save_file

    model, tokenizer = build_tiny_model(seed, dtype, speech_tokens)
    state = model.state_dict()
    tied = bool(model.config.text_config.tie_word_embeddings)
    tensors = {hf_to_original_key(k): v.detach().clone().contiguous() for k, v in state.items()
               if not (tied and k == "lm_head.weight")}
    os.makedirs(folder, exist_ok=True)
    names = sorted(tensors)
    per_shard = int(math.ceil(len(names) / shards))
    weight_map, total = {}, 0
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: tensors[k] for k in names[i * per_shard:(i + 1) * per_shard]}
        save_file(part, os.path.join(folder, fname), metadata={"format": "pt"})
        for k, v in part.items():
            weight_map[k] = fname
            total += v.numel() * v.element_size()
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(original_config_dict(model.config), f, indent=2)
    with open(os.path.join(folder, "preprocessor_config.json"), "w") as f:
        json.dump({
            "processor_class": "VibeVoiceProcessor", "speech_tok_compress_ratio": HOP_LENGTH, "db_normalize": True,
            "audio_processor": {"feature_extractor_type": "VibeVoiceTokenizerProcessor", "sampling_rate": SAMPLE_RATE,
                                "normalize_audio": True, "target_dB_FS": -25, "eps": 1e-6},
            "language_model_pretrained_name": "Qwen/Qwen2.5-1.5B",
        }, f, indent=2)
    if include_tokenizer:  # the real release has no tokenizer files (it names Qwen/Qwen2.5-1.5B instead)
        tokenizer.save_pretrained(folder)
    return folder


def convert_original_state_dict(state: dict[str, torch.Tensor], tie_word_embeddings: bool) -> dict[str, torch.Tensor]:
    """Rename an original-layout state dict to transformers keys (adds the tied ``lm_head.weight``)."""
    out = {original_to_hf_key(k): v for k, v in state.items()}
    if tie_word_embeddings and "lm_head.weight" not in out:
        out["lm_head.weight"] = out["model.language_model.embed_tokens.weight"]
    return out


# ---------------------------------------------------------------------------------------------------------------
# Generation helper
# ---------------------------------------------------------------------------------------------------------------

def build_conversation(text_lines: Sequence[str | tuple[str, str]],
                       voices: dict[str, Any] | Sequence[Any] | None = None) -> list[dict]:
    """Conversation for ``processor.apply_chat_template``: a voice (mono 24 kHz array) goes on a speaker's first turn.

    ``text_lines`` items are ``"text"`` (speaker "0") or ``(speaker, text)``; ``voices`` maps a speaker to a 1-D
    float array, or is a list given in order of first appearance of the speakers.
    """
    turns = [(str(t[0]), str(t[1])) if isinstance(t, (tuple, list)) else ("0", str(t)) for t in text_lines]
    speakers: list[str] = []
    for role, _ in turns:
        if role not in speakers:
            speakers.append(role)
    if voices is not None and not isinstance(voices, dict):
        voices = {speakers[i]: v for i, v in enumerate(voices) if v is not None}
    voices = voices or {}
    conv, seen = [], set()
    for role, text in turns:
        content: list[dict] = [{"type": "text", "text": text}]
        if role in voices and role not in seen:
            content.append({"type": "audio", "audio": voices[role]})
        seen.add(role)
        conv.append({"role": role, "content": content})
    return conv


def generate_audio(model, processor, text_lines: Sequence[str | tuple[str, str]],
                   voices: dict[str, Any] | Sequence[Any] | None = None, seed: int = 0, cfg_scale: float = 1.3,
                   steps: int = 10, max_new_tokens: int = 16, noise_scheduler=None, **generate_kwargs) -> torch.Tensor:
    """Generate speech for one conversation; return the float32 waveform ``[1, T]`` (channels, samples at 24 kHz).

    ``generate`` returns one ``[1, T]`` tensor per batch item (``None`` when no speech token was emitted, returned
    here as ``[1, 0]``); ComfyUI's AUDIO wants ``{"waveform": wav[None], "sample_rate": 24000}``.
    """
    conv = build_conversation(text_lines, voices)
    inputs = processor.apply_chat_template(conv, tokenize=True, return_dict=True, return_tensors="pt")
    device = next(model.parameters()).device
    inputs = inputs.to(device)
    if "input_values" in inputs:
        inputs["input_values"] = inputs["input_values"].to(model.dtype)
    torch.manual_seed(seed)  # diffusion noise and the voice encoder's sigma-VAE noise use the global RNG
    kwargs = dict(max_new_tokens=max_new_tokens, num_diffusion_steps=steps, guidance_scale=cfg_scale)
    if noise_scheduler is not None:
        kwargs["noise_scheduler"] = noise_scheduler
    kwargs.update(generate_kwargs)
    with torch.inference_mode():
        audio = model.generate(**inputs, **kwargs)
    if not isinstance(audio, list):  # return_dict_in_generate=True
        audio = audio.audio
    wav = audio[0]
    if wav is None:
        return torch.zeros(1, 0)
    return wav.float().cpu()


def iter_param_bytes(module: torch.nn.Module) -> Iterable[tuple[str, int]]:
    """(name, bytes) of the direct children of ``module`` (parameters and buffers, recursively)."""
    for name, child in module.named_children():
        n = sum(p.numel() * p.element_size() for p in child.parameters())
        n += sum(b.numel() * b.element_size() for b in child.buffers())
        yield name, n
