"""Tiny, offline Higgs Audio v2, Dia and CSM model folders for tests (transformers >= 5.24, no download, no ComfyUI).

Each `write_tiny_*(folder)` writes what transformers' `save_pretrained` writes for the real release, with random
weights and every width and depth tiny (a few hundred kB): config.json, generation_config.json, model.safetensors,
the tokenizer (built here), the processor files, and for Dia and Higgs the codec (DAC / the Higgs audio tokenizer) in
`audio_tokenizer/`, where the real codec repository goes (the processor config names the real repository id, as the
releases do; the loader never reads it). Same seed, same bytes.

The configurations follow transformers' own model tests (tests/models/dia/test_modeling_dia.py,
tests/models/csm/test_modeling_csm.py, tests/models/higgs_audio_v2/test_modeling_higgs_audio_v2.py) and the real
checkpoints' structure where a processor depends on it (CSM's Mimi keeps the real down-sampling ratios, so the
processor's audio token count holds; Higgs' audio tokenizer keeps 25 frames a second and HuBERT's 16 kHz input). The
Higgs chat template is the one of transformers' processor test (test_processing_higgs_audio_v2.py), the CSM one that
of test_processing_csm.py.

Random weights speak random codes until `max_new_tokens`: the codebook vocabularies are large enough that an
end-of-audio code comes rarely, and the codecs decode every code the models can emit.
"""
from __future__ import annotations

import os
from typing import Any

import torch

HIGGS_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>",
                 "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>", "<|audio_out_bos|>", "<|AUDIO_OUT|>",
                 "<|reserved_special_token_6|>", "<|scene_desc_start|>", "<|scene_desc_end|>"]
CSM_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|AUDIO|>", "<|audio_eos|>"]

_CORPUS = [
    "Generate audio following instruction. Audio is recorded from a quiet room.",
    "Hello there, how are you today? I am fine, thank you. The quick brown fox jumps over the lazy dog.",
    "Speaker SPEAKER0 SPEAKER1 system user assistant scene 0123456789 [0] [1] [2] [3]",
    "Welcome to the show. Today we talk about running big models on small cards.",
]

# transformers' tests/models/higgs_audio_v2/test_processing_higgs_audio_v2.py (DEFAULT_CHAT_TEMPLATE)
HIGGS_CHAT_TEMPLATE = """{{- bos_token }}
{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- if messages[0]['content'] is string %}
        {%- set system_message = messages[0]['content']|trim %}
    {%- elif messages[0]['content'] is iterable and messages[0]['content'][0]['type'] == 'text' %}
        {%- set system_message = messages[0]['content'][0]['text']|trim %}
    {%- else %}
        {{- raise_exception("System message content must be a string or contain text type!") }}
    {%- endif %}
    {%- set messages = messages[1:] %}
{%- else %}
    {{- raise_exception("A system message is required but not provided!") }}
{%- endif %}
{#- System message #}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- system_message }}
{#- Check for scene message and handle it specially #}
{%- if messages and messages[0]['role'] == 'scene' %}
    {{- "\\n\\n<|scene_desc_start|>\\n" }}
    {%- if messages[0]['content'] is string %}
        {{- messages[0]['content'] | trim }}
    {%- elif messages[0]['content'] is iterable %}
        {%- for content_item in messages[0]['content'] %}
            {%- if content_item['type'] == 'text' %}
                {%- set text_content = content_item['text'] | trim %}
                {{- text_content }}
                {%- if loop.first and not loop.last %}
                    {{- "\\n\\n" }}
                {%- endif %}
                {%- if not loop.first and not loop.last and messages[0]['content'][loop.index]['type'] != 'audio' %}
                    {{- "\\n" }}
                {%- endif %}
            {%- elif content_item['type'] == 'audio' %}
                {{- ' <|audio_out_bos|><|AUDIO_OUT|><|audio_eos|>' }}
                {%- if not loop.last %}
                    {{- "\\n" }}
                {%- endif %}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
    {{- "\\n<|scene_desc_end|>" }}
    {%- set messages = messages[1:] %}
{%- endif %}
{{- "<|eot_id|>" }}
{#- Loop through all messages #}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {%- if message['role'] == 'assistant' %}
        {%- if message['content'] is not iterable or message['content'][0]['type'] != 'audio' %}
            {{- raise_exception("Assistant messages must contain audio content only!") }}
        {%- endif %}
        {{- '<|audio_out_bos|><|AUDIO_OUT|><|audio_eos|>' }}
    {%- else %}
        {%- if message['content'] is string %}
            {{- message['content'] | trim }}
        {%- elif message['content'] is iterable %}
            {%- for content_item in message['content'] %}
                {%- if content_item['type'] == 'text' %}
                    {{- content_item['text'] | trim }}
                {%- elif content_item['type'] == 'audio' and message['role'] == 'user' %}
                    {{- raise_exception("User messages cannot contain audio content!") }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
    {%- endif %}
    {{- '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n<|audio_out_bos|>' }}
{%- endif %}
"""

# transformers' tests/models/csm/test_processing_csm.py (prepare_processor_dict)
CSM_CHAT_TEMPLATE = (
    "\n{%- for message in messages %}\n    {#-- Validate role is a stringified integer --#}\n    {%- if not message['role']"
    " is string or not message['role'].isdigit() %}\n        {{- raise_exception(\"The role must be an integer or a "
    "stringified integer (e.g. '0') designating the speaker id\") }}\n    {%- endif %}\n\n    {#-- Validate content "
    "is a list --#}\n    {%- set content = message['content'] %}\n    {%- if content is not iterable or content is "
    "string %}\n        {{- raise_exception(\"The content must be a list\") }}\n    {%- endif %}\n\n    {#-- Collect "
    "content types --#}\n    {%- set content_types = content | map(attribute='type') | list %}\n    {%- set is_last = "
    "loop.last %}\n\n    {#-- Last message validation --#}\n    {%- if is_last %}\n        {%- if 'text' not in "
    "content_types %}\n            {{- raise_exception(\"The last message must include one item of type 'text'\") }}"
    "\n        {%- elif (content_types | select('equalto', 'text') | list | length > 1) or (content_types | "
    "select('equalto', 'audio') | list | length > 1) %}\n            {{- raise_exception(\"At most two items are "
    "allowed in the last message: one 'text' and one 'audio'\") }}\n        {%- endif %}\n\n    {#-- All other "
    "messages validation --#}\n    {%- else %}\n        {%- if content_types | select('equalto', 'text') | list | "
    "length != 1\n              or content_types | select('equalto', 'audio') | list | length != 1 %}\n            "
    "{{- raise_exception(\"Each message (except the last) must contain exactly one 'text' and one 'audio' item\") }}"
    "\n        {%- elif content_types | reject('in', ['text', 'audio']) | list | length > 0 %}\n            {{- "
    "raise_exception(\"Only 'text' and 'audio' types are allowed in content\") }}\n        {%- endif %}\n    "
    "{%- endif %}\n{%- endfor %}\n\n{%- for message in messages %}\n    {{- bos_token }}\n    {{- '[' + "
    "message['role'] + ']' }}\n    {{- message['content'][0]['text'] }}\n    {{- eos_token }}\n    {%- if "
    "message['content']|length > 1 %}\n        {{- '<|AUDIO|><|audio_eos|>' }}\n    {%- endif %}\n{%- endfor %}\n"
)


def build_tokenizer(special: list[str], bos: str | None, eos: str, pad: str, vocab_size: int = 300) -> Any:
    """A small byte-level BPE tokenizer (Llama-3 style pre-tokenization) with `special` tokens appended."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AddedToken, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False, special_tokens=[])
    bpe.train_from_iterator(_CORPUS * 4, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=bos, eos_token=eos, pad_token=pad,
                                  model_max_length=4096)
    tok.add_special_tokens({"additional_special_tokens": [AddedToken(t, special=True, normalized=False)
                                                          for t in special if t not in (bos, eos, pad)]})
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in (bos, eos, pad) if t])
    return tok


def _vocab(tokenizer: Any) -> int:
    return int(-(-len(tokenizer) // 16) * 16)


@torch.no_grad()
def random_codebooks(codec: Any) -> Any:
    """Random codebook vectors: transformers initializes Mimi's and the Higgs tokenizer's to zeros (a trained codec
    has them from training), which would decode every code to the same sound."""
    for module in codec.modules():
        for name in ("embed", "embed_sum", "embed_avg"):
            buf = module._buffers.get(name)
            if buf is not None and buf.dim() == 2:
                buf.normal_(0.0, 1.0)
        usage = module._buffers.get("cluster_usage")
        if usage is not None:
            usage.fill_(1.0)
    return codec


def _save_generation_config(model: Any, folder: str, **values: Any) -> None:
    model.generation_config.update(**values)
    model.generation_config.save_pretrained(folder)


# ---------------------------------------------------------------------------------------------------------------
# Dia
# ---------------------------------------------------------------------------------------------------------------

DIA_CODEBOOK = 64  # codes per DAC codebook (1024 in the release); ids 64/65/66 are eos / pad / bos
DIA_DELAY = [0, 1, 2]  # one delay per channel ([0, 8, ..., 15] for 9 channels in the release)


def tiny_dac(sampling_rate: int = 44100, n_codebooks: int = len(DIA_DELAY), codebook_size: int = DIA_CODEBOOK) -> Any:
    from transformers import DacConfig, DacModel

    return DacModel(DacConfig(encoder_hidden_size=4, downsampling_ratios=[2, 4, 8, 8], decoder_hidden_size=16,
                              n_codebooks=n_codebooks, codebook_size=codebook_size, codebook_dim=4,
                              sampling_rate=sampling_rate, hidden_size=16)).eval()


def write_tiny_dia(folder: str, seed: int = 0) -> str:
    """A tiny Dia folder with its DAC in audio_tokenizer/ (what nari-labs/Dia-1.6B + descript/dac_44khz hold)."""
    from transformers import DiaConfig, DiaFeatureExtractor, DiaForConditionalGeneration, DiaProcessor, DiaTokenizer

    os.makedirs(folder, exist_ok=True)
    torch.manual_seed(seed)
    eos, pad, bos = DIA_CODEBOOK, DIA_CODEBOOK + 1, DIA_CODEBOOK + 2
    config = DiaConfig(
        encoder_config=dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, num_key_value_heads=2,
                            head_dim=16, intermediate_size=64, vocab_size=256, max_position_embeddings=1024),
        decoder_config=dict(num_hidden_layers=3, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=16, cross_num_attention_heads=2, cross_head_dim=16,
                            cross_num_key_value_heads=2, cross_hidden_size=32, vocab_size=DIA_CODEBOOK + 3,
                            num_channels=len(DIA_DELAY), eos_token_id=eos, pad_token_id=pad, bos_token_id=bos,
                            max_position_embeddings=1024),
        delay_pattern=list(DIA_DELAY))
    model = DiaForConditionalGeneration(config).eval()
    model.save_pretrained(folder)
    _save_generation_config(model, folder, do_sample=True, guidance_scale=3.0, temperature=1.8, top_p=0.95,
                            top_k=45, bos_token_id=bos, eos_token_id=eos, pad_token_id=pad)
    codec = tiny_dac()
    codec.save_pretrained(os.path.join(folder, "audio_tokenizer"))
    codec.name_or_path = "descript/dac_44khz"  # what the release's processor config names
    processor = DiaProcessor(DiaFeatureExtractor(sampling_rate=44100, hop_length=512), DiaTokenizer(), codec)
    processor.save_pretrained(folder)
    return folder


# ---------------------------------------------------------------------------------------------------------------
# CSM
# ---------------------------------------------------------------------------------------------------------------

CSM_CODEBOOKS = 4  # 32 in the release
CSM_CODEBOOK = 64  # codes per codebook (2048 in the release); 0 is end-of-audio (all codebooks), 63 padding


def tiny_mimi_config(codebooks: int = CSM_CODEBOOKS, codebook_size: int = CSM_CODEBOOK) -> dict:
    """Mimi with the release's structure (24 kHz, ratios 8-6-5-4, 12.5 frames a second), tiny widths."""
    return dict(model_type="mimi", hidden_size=16, num_filters=4, num_residual_layers=1, upsampling_ratios=[8, 6, 5, 4],
                codebook_size=codebook_size, vector_quantization_hidden_dimension=16, upsample_groups=16,
                num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, intermediate_size=32,
                sliding_window=16, codebook_dim=16, num_quantizers=codebooks, use_cache=False)


def write_tiny_csm(folder: str, seed: int = 0, codec_in_checkpoint: bool = True) -> str:
    """A tiny CSM folder (what sesame/csm-1b holds: the Mimi codec's weights are in the model's checkpoint).

    `codec_in_checkpoint=False` leaves them out and saves the codec in audio_tokenizer/ instead.
    """
    from transformers import CsmConfig, CsmForConditionalGeneration, CsmProcessor, EncodecFeatureExtractor

    os.makedirs(folder, exist_ok=True)
    tokenizer = build_tokenizer(CSM_SPECIAL, bos="<|begin_of_text|>", eos="<|end_of_text|>", pad="<|end_of_text|>")
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in CSM_SPECIAL}
    torch.manual_seed(seed)
    config = CsmConfig(
        num_codebooks=CSM_CODEBOOKS, vocab_size=CSM_CODEBOOK, text_vocab_size=_vocab(tokenizer), hidden_size=32,
        intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=2048, bos_token_id=ids["<|begin_of_text|>"], pad_token_id=ids["<|AUDIO|>"],
        eos_token_id=None, audio_token_id=ids["<|AUDIO|>"], audio_eos_token_id=ids["<|audio_eos|>"],
        codebook_pad_token_id=CSM_CODEBOOK - 1, codebook_eos_token_id=0,
        depth_decoder_config=dict(num_codebooks=CSM_CODEBOOKS, backbone_hidden_size=32, vocab_size=CSM_CODEBOOK,
                                  hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                  num_key_value_heads=1, max_position_embeddings=CSM_CODEBOOKS + 1),
        codec_config=tiny_mimi_config())
    model = CsmForConditionalGeneration(config).eval()
    random_codebooks(model.codec_model)
    model.generation_config.update(do_sample=True, temperature=0.9, top_k=50)
    model.depth_decoder.generation_config.update(do_sample=True, temperature=0.9, top_k=50)
    model.save_pretrained(folder)
    if not codec_in_checkpoint:
        from safetensors.torch import load_file, save_file

        path = os.path.join(folder, "model.safetensors")
        state = load_file(path)
        save_file({k: v for k, v in state.items() if not k.startswith("codec_model.")}, path,
                  metadata={"format": "pt"})
        model.codec_model.save_pretrained(os.path.join(folder, "audio_tokenizer"))
    processor = CsmProcessor(EncodecFeatureExtractor(feature_size=1, sampling_rate=24000), tokenizer,
                             chat_template=CSM_CHAT_TEMPLATE)
    processor.save_pretrained(folder)
    return folder


# ---------------------------------------------------------------------------------------------------------------
# Higgs Audio v2
# ---------------------------------------------------------------------------------------------------------------

HIGGS_CODEBOOKS = 4  # 8 in the release
HIGGS_CODEBOOK = 64  # codes per codebook (1024 in the release); the model's vocabulary adds stream bos / eos


def tiny_higgs_audio_tokenizer() -> Any:
    """The Higgs audio tokenizer (DAC acoustic part + HuBERT semantic part) with the release's 25 frames a second
    and 16 kHz semantic input, tiny widths; 4 codebooks of 64 codes."""
    from offload.tts.higgs_audio_v2 import audio_tokenizer_class
    from transformers import HiggsAudioV2TokenizerConfig

    config = HiggsAudioV2TokenizerConfig(
        acoustic_model_config=dict(encoder_hidden_size=4, downsampling_ratios=[8, 5, 4, 2, 3], decoder_hidden_size=64,
                                   upsampling_ratios=[8, 5, 4, 2, 3], hidden_size=16),
        semantic_model_config=dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                                   conv_dim=(8,) * 7, num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2),
        target_bandwidths=[0.5, HIGGS_CODEBOOKS * 25 * 6 / 1000], codebook_size=HIGGS_CODEBOOK, codebook_dim=8)
    return random_codebooks(audio_tokenizer_class()(config).eval())


def write_tiny_higgs(folder: str, seed: int = 0) -> str:
    """A tiny Higgs Audio v2 folder with its audio tokenizer in audio_tokenizer/ (what
    bosonai/higgs-audio-v2-generation-3B-base + bosonai/higgs-audio-v2-tokenizer hold)."""
    from transformers import (DacFeatureExtractor, HiggsAudioV2Config, HiggsAudioV2ForConditionalGeneration,
                              HiggsAudioV2Processor)

    os.makedirs(folder, exist_ok=True)
    tokenizer = build_tokenizer(HIGGS_SPECIAL, bos="<|begin_of_text|>", eos="<|eot_id|>", pad="<|end_of_text|>")
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in HIGGS_SPECIAL}
    torch.manual_seed(seed)
    config = HiggsAudioV2Config(
        vocab_size=_vocab(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=2048, pad_token_id=ids["<|end_of_text|>"],
        bos_token_id=ids["<|begin_of_text|>"], eos_token_id=ids["<|eot_id|>"], num_codebooks=HIGGS_CODEBOOKS,
        codebook_size=HIGGS_CODEBOOK + 2, audio_token_id=ids["<|AUDIO_OUT|>"],
        audio_bos_token_id=ids["<|audio_out_bos|>"], audio_delay_token_id=ids["<|reserved_special_token_6|>"],
        audio_stream_bos_id=HIGGS_CODEBOOK, audio_stream_eos_id=HIGGS_CODEBOOK + 1)
    model = HiggsAudioV2ForConditionalGeneration(config).eval()
    model.save_pretrained(folder)
    _save_generation_config(model, folder, do_sample=True, temperature=1.0, top_k=50, top_p=0.95,
                            bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                            pad_token_id=config.pad_token_id)
    codec = tiny_higgs_audio_tokenizer()
    codec.save_pretrained(os.path.join(folder, "audio_tokenizer"))
    codec.name_or_path = "bosonai/higgs-audio-v2-tokenizer"  # what the release's processor config names
    processor = HiggsAudioV2Processor(DacFeatureExtractor(sampling_rate=24000, hop_length=960), tokenizer, codec,
                                      chat_template=HIGGS_CHAT_TEMPLATE, audio_stream_bos_id=HIGGS_CODEBOOK,
                                      audio_stream_eos_id=HIGGS_CODEBOOK + 1)
    processor.save_pretrained(folder)
    return folder
