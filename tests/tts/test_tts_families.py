"""Higgs Audio v2, Dia and CSM through the engine, without ComfyUI (offload/tts/{higgs_audio_v2,dia,csm}.py): the
offloaded generation equals transformers' own generation on the plain model (same tokens, same audio, same seed),
preset budget (every block streamed) equals high_end bit for bit, with the KV cache paged and offloaded, with fp8
weights; seeds reproduce, a voice prompt changes the output; bad folders and a too-old transformers are clear errors.

The tiny folders come from tests/tts/tiny_tts.py (random weights, built offline). Each model type is skipped, with
the reason, where the installed transformers does not ship it."""
from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import sys

import pytest
import torch

pytest.importorskip("transformers")

from offload import OffloadConfig, VramBudget, offload_module  # noqa: E402
from offload.tts import FAMILIES, family, family_for  # noqa: E402
from offload.tts.common import TTSModelError, TTSRequest, Voice  # noqa: E402
from tests.tts import tiny_tts as tt  # noqa: E402

WRITERS = {"higgs_audio_v2": tt.write_tiny_higgs, "dia": tt.write_tiny_dia, "csm": tt.write_tiny_csm}
TOKENS = {"higgs_audio_v2": 10, "dia": 12, "csm": 4}
TEXT = "Speaker 1: Hello there, how are you?\nSpeaker 2: Fine, thanks."
CODECS = ("audio_tokenizer.", "codec_model.")
_caps = itertools.count(1)


def _skip_unless_available(model_type: str) -> None:
    why = family(model_type).available()
    if why:
        pytest.skip(why)


@pytest.fixture(scope="module", params=sorted(WRITERS))
def folder(request, tmp_path_factory):
    _skip_unless_available(request.param)
    torch.set_num_threads(1)
    return WRITERS[request.param](str(tmp_path_factory.mktemp("tts") / f"tiny-{request.param}"))


def _cfg(preset: str, **kw):
    kw.setdefault("sim_capacity_bytes", (256 << 20) + 4096 * next(_caps) + 3)
    return OffloadConfig.from_preset(preset, device="sim", **kw)


def _request(folder, seed=3, text=TEXT, **kw) -> TTSRequest:
    kw.setdefault("max_new_tokens", TOKENS[family_for(folder).model_type])
    if family_for(folder).model_type == "csm" and text == TEXT:
        text = "Hello there, how are you?"  # one turn: CSM speaks a dialogue turn by turn (tested below)
    return TTSRequest(text=text, seed=seed, **kw)


def _voice(seconds=1.0, rate=44100) -> Voice:
    t = torch.arange(int(rate * seconds), dtype=torch.float32) / rate
    stereo = torch.stack([torch.sin(2 * math.pi * 220 * t), torch.sin(2 * math.pi * 330 * t)]) * 0.3
    return Voice(stereo[None], rate)


def _offloaded(folder, preset="budget", dtype="default"):
    fam = family_for(folder)
    model, processor, _ = fam.load(folder, dtype)
    handle = offload_module(model, _cfg(preset), budget=VramBudget(None), units=fam.stream_units(model),
                            name=fam.model_type)
    return fam, model, processor, handle


# ---------------------------------------------------------------------------------------------------------------
# transformers' own generation on the plain model, written from transformers' documentation of each model
# ---------------------------------------------------------------------------------------------------------------


def transformers_generation(folder, request: TTSRequest):
    """(tokens, audio) from transformers alone: the processor, model.generate, the processor's decode."""
    import transformers

    fam = family_for(folder)
    model, processor, _ = fam.load(folder)  # from_pretrained of transformers' classes, nothing offloaded
    model_type = fam.model_type
    if model_type == "dia":
        kw = dict(delay_pattern=model.config.delay_pattern, bos_token_id=model.config.decoder_config.bos_token_id,
                  pad_token_id=model.config.decoder_config.pad_token_id,
                  eos_token_id=model.config.decoder_config.eos_token_id)
        inputs = processor(text=["[S1] Hello there, how are you? [S2] Fine, thanks."], padding=True,
                           return_tensors="pt", **kw)
        torch.manual_seed(request.seed)
        codes = model.generate(**inputs, max_new_tokens=request.max_new_tokens)
        return [codes], processor.batch_decode(codes, **kw)[0]
    if model_type == "csm":
        conversation = [{"role": "0", "content": [{"type": "text", "text": request.text}]}]
        inputs = processor.apply_chat_template(conversation, tokenize=True, return_dict=True)
        torch.manual_seed(request.seed)
        out = model.generate(**inputs, max_new_tokens=request.max_new_tokens, output_audio=True,
                             return_dict_in_generate=True)
        return [out.sequences], out.audio[0]
    assert model_type == "higgs_audio_v2"
    conversation = [
        {"role": "system", "content": [{"type": "text", "text": "Generate audio following instruction."}]},
        {"role": "scene", "content": [{"type": "text", "text": "Audio is recorded from a quiet room."}]},
        {"role": "user", "content": [{"type": "text", "text": "[SPEAKER0] Hello there, how are you?\n"
                                                                "[SPEAKER1] Fine, thanks."}]},
    ]
    inputs = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True,
                                           return_dict=True, return_tensors="pt")
    torch.manual_seed(request.seed)
    codes = model.generate(**inputs, max_new_tokens=request.max_new_tokens)
    assert isinstance(model, transformers.HiggsAudioV2ForConditionalGeneration)
    return [codes], processor.decode(codes)


def test_offloaded_generation_equals_transformers_own_generation(folder):
    request = _request(folder)
    tokens, audio = transformers_generation(folder, request)
    fam, model, processor, handle = _offloaded(folder, "budget")
    pager = handle.kv_pager(page_tokens=4)
    result = fam.speak(model, processor, request, pager=pager)
    assert len(result.tokens) == len(tokens) and all(torch.equal(a, b) for a, b in zip(result.tokens, tokens))
    assert torch.equal(result.audio.reshape(-1), audio.detach().float().reshape(-1))
    assert result.audio.numel() > 0 and torch.isfinite(result.audio).all() and result.audio.abs().max() > 0
    assert result.sample_rate == fam.sample_rate(model, processor)
    rep = handle.report()
    assert all(b.tier != "vram" for b in rep.blocks), "budget streams every block"
    layers = [b for b in rep.blocks if ".layers." in b.name and not b.name.startswith(CODECS)]
    assert layers and all(b.calls > 0 for b in layers), "every backbone layer streamed and ran"
    assert any(b.name.startswith(CODECS) and b.calls > 0 for b in rep.blocks), "codec blocks streamed and ran"
    assert rep.kv is not None and rep.kv["caches"] >= 1, "generation used the paged KV cache"
    handle.detach()


def test_budget_equals_high_end_bit_for_bit(folder):
    outs = []
    for preset in ("budget", "high_end"):
        fam, model, processor, handle = _offloaded(folder, preset)
        outs.append(fam.speak(model, processor, _request(folder), pager=handle.kv_pager()))
        handle.detach()
    assert torch.equal(outs[0].audio, outs[1].audio)
    assert all(torch.equal(a, b) for a, b in zip(outs[0].tokens, outs[1].tokens))


def test_kv_cache_offloaded_under_a_tiny_share_gives_the_same_audio(folder):
    fam, model, processor, handle = _offloaded(folder, "budget")
    want = fam.speak(model, processor, _request(folder))
    pager = handle.kv_pager(page_tokens=2, offload=True)
    handle.budget.set_total(handle.budget_for(0) + 2 * 1024, origin="test")
    got = fam.speak(model, processor, _request(folder), pager=pager)
    assert torch.equal(got.audio, want.audio)
    kv = handle.report().kv
    assert kv["offloads"] > 0 and kv["restores"] > 0, kv
    handle.detach()


def test_seed_reproduces_and_a_voice_prompt_changes_the_output(folder):
    fam, model, processor, handle = _offloaded(folder, "budget")
    a = fam.speak(model, processor, _request(folder, seed=3))
    assert torch.equal(fam.speak(model, processor, _request(folder, seed=3)).audio, a.audio)
    assert not torch.equal(fam.speak(model, processor, _request(folder, seed=4)).audio, a.audio)
    voiced = fam.speak(model, processor, _request(folder, voices={"1": _voice()}, voice_text="A voice."))
    again = fam.speak(model, processor, _request(folder, voices={"1": _voice()}, voice_text="A voice."))
    assert torch.equal(voiced.audio, again.audio)
    n = min(voiced.audio.shape[-1], a.audio.shape[-1])
    assert not torch.equal(voiced.audio[..., :n], a.audio[..., :n])
    handle.detach()


def test_fp8_weights_are_identical_across_presets(folder):
    outs = []
    for preset in ("budget", "high_end"):
        fam, model, processor, handle = _offloaded(folder, preset, dtype="fp8_e4m3fn")
        from offload.model.fp8 import Fp8Linear

        assert any(isinstance(m, Fp8Linear) for m in model.modules())
        outs.append(fam.speak(model, processor, _request(folder)).audio)
        handle.detach()
    assert torch.equal(outs[0], outs[1]) and torch.isfinite(outs[0]).all()


def test_progress_is_reported_per_step_and_cancel_stops_generation(folder):
    fam, model, processor, handle = _offloaded(folder, "budget")
    steps = []
    fam.speak(model, processor, _request(folder), on_token=steps.append)
    assert steps and steps == list(range(1, len(steps) + 1))

    class Cancelled(Exception):
        pass

    def cancel_at_two(n):
        if n == 2:
            raise Cancelled

    with pytest.raises(Cancelled):
        fam.speak(model, processor, _request(folder), on_token=cancel_at_two)
    handle.detach()


def _copy(folder, tmp_path, name):
    bad = tmp_path / name
    shutil.copytree(folder, bad)
    return bad


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_bad_folders_are_clear_errors(folder, tmp_path):
    fam = family_for(folder)
    bad = _copy(folder, tmp_path, "truncated")
    _truncate(bad / "model.safetensors")
    with pytest.raises(TTSModelError, match="truncated") as err:
        fam.load(bad)
    assert "truncated" in str(err.value)
    bad = _copy(folder, tmp_path, "half_written")
    (bad / "config.json").write_text((bad / "config.json").read_text()[:30])
    with pytest.raises(TTSModelError, match="JSON"):
        family_for(bad)
    bad = _copy(folder, tmp_path, "other_type")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["model_type"] = "llama"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(TTSModelError, match="model_type 'llama'"):
        family_for(bad)
    if os.path.isdir(os.path.join(folder, "audio_tokenizer")):
        bad = _copy(folder, tmp_path, "no_codec")
        shutil.rmtree(bad / "audio_tokenizer")
        with pytest.raises(TTSModelError, match="audio_tokenizer") as err:
            fam.load(bad)
        assert "separate repository" in str(err.value)
        bad = _copy(folder, tmp_path, "truncated_codec")
        _truncate(bad / "audio_tokenizer" / "model.safetensors")
        with pytest.raises(TTSModelError, match="truncated"):
            fam.load(bad)


def test_a_transformers_without_the_model_type_is_a_clear_error(folder, monkeypatch):
    fam = family_for(folder)
    monkeypatch.setattr(type(fam), "min_transformers", (99, 1))
    with pytest.raises(TTSModelError, match=r"needs transformers >= 99\.1") as err:
        fam.load(folder)
    assert fam.model_type in str(err.value) and "other TTS models keep working" in str(err.value)
    assert family("vibevoice").available() is None or "vibevoice" in family("vibevoice").available()


# ---------------------------------------------------------------------------------------------------------------
# per-model details
# ---------------------------------------------------------------------------------------------------------------


def test_every_family_is_registered_and_tells_its_folders():
    assert set(FAMILIES) == {"vibevoice", "higgs_audio_v2", "dia", "csm"}
    for model_type in FAMILIES:
        fam = family(model_type)
        assert fam.model_type == model_type and fam.name
        for method in ("load_processor", "stream_units", "speak"):
            assert getattr(type(fam), method) is not getattr(type(fam).__mro__[-2], method, None)


def test_speaker_lines_become_each_models_own_format():
    from offload.tts.csm import csm_turns
    from offload.tts.dia import dia_text
    from offload.tts.higgs_audio_v2 import higgs_text

    assert dia_text("Speaker 1: Hi\nthere\nSpeaker 2: Yo") == "[S1] Hi there [S2] Yo"
    assert dia_text("Just text") == "[S1] Just text"
    assert dia_text("[S1] Native [S2] form") == "[S1] Native [S2] form"
    with pytest.raises(ValueError, match="Dia takes speakers 1 to 2"):
        dia_text("Speaker 3: no")
    assert higgs_text("Speaker 1: Hi\nSpeaker 2: Yo") == "[SPEAKER0] Hi\n[SPEAKER1] Yo"
    assert higgs_text("Speaker 1: Only me") == "Only me"
    assert higgs_text("Plain.") == "Plain."
    assert csm_turns("Speaker 1: Hi\nSpeaker 2: Yo") == [("1", "Hi"), ("2", "Yo")]
    assert csm_turns("One turn") == [("1", "One turn")]
    for fn in (dia_text, higgs_text, csm_turns):
        with pytest.raises(ValueError, match="empty"):
            fn("  ")


@pytest.mark.parametrize("model_type", ["csm"])
def test_csm_speaks_a_dialogue_turn_by_turn(model_type, tmp_path):
    _skip_unless_available(model_type)
    folder = tt.write_tiny_csm(str(tmp_path / "csm"))
    fam, model, processor, handle = _offloaded(folder, "budget")
    one = fam.speak(model, processor, TTSRequest("Hello there.", seed=3, max_new_tokens=3))
    two = fam.speak(model, processor, TTSRequest("Speaker 1: Hello there.\nSpeaker 2: Fine.", seed=3,
                                                 max_new_tokens=3))
    assert len(two.tokens) == 2, "one generate per turn"
    assert torch.equal(two.audio[..., :one.audio.shape[-1]], one.audio), "the first turn is the one-turn speech"
    assert two.audio.shape[-1] > one.audio.shape[-1]
    handle.detach()


@pytest.mark.parametrize("model_type", ["csm"])
def test_csm_takes_its_codec_from_audio_tokenizer_when_the_checkpoint_lacks_it(model_type, tmp_path):
    _skip_unless_available(model_type)
    whole = tt.write_tiny_csm(str(tmp_path / "whole"))
    split = tt.write_tiny_csm(str(tmp_path / "split"), codec_in_checkpoint=False)
    request = TTSRequest("Hello there.", seed=3, max_new_tokens=3)
    outs = []
    for folder in (whole, split):
        fam = family_for(folder)
        model, processor, _ = fam.load(folder)
        outs.append(fam.speak(model, processor, request).audio)
    assert torch.equal(outs[0], outs[1])
    shutil.rmtree(os.path.join(split, "audio_tokenizer"))
    with pytest.raises(TTSModelError, match="codec"):
        family_for(split).load(split)


def test_higgs_audio_tokenizer_without_torchaudio_uses_a_scoped_stand_in():
    _skip_unless_available("higgs_audio_v2")
    from offload.tts import higgs_audio_v2 as higgs
    from offload.tts.audio import resample

    had = "torchaudio" in sys.modules
    cls = higgs.audio_tokenizer_class()
    assert cls.__name__ == "HiggsAudioV2TokenizerModel"
    assert ("torchaudio" in sys.modules) == had or higgs._torchaudio_importable(), "sys.modules left alone"
    stand_in = higgs.torchaudio_stand_in()
    x = torch.randn(1, 1, 2400)
    assert torch.equal(stand_in.functional.resample(x, 24000, 16000), resample(x, 24000, 16000))
    with pytest.raises(TTSModelError, match="pip install torchaudio"):
        stand_in.load("voice.wav")
    with pytest.raises(TTSModelError, match="torchaudio"):
        stand_in.functional.resample(x, 24000, 16000, resampling_method="sinc_interp_kaiser")


def test_speech_streamed_with_kv_pages_leaving_the_device_passes_the_host_read_guard(folder):
    """Every block streamed, the KV pages offloaded under a share with no room for them, the codec entered through
    its own methods (CSM's Mimi quantizer `.decode()`, Higgs' and Dia's codecs): transformers' own tokens and audio,
    and no op reads a host master (tests/host_master_guard.py)."""
    from tests.host_master_guard import host_master_guard

    request = _request(folder)
    tokens, audio = transformers_generation(folder, request)
    fam, model, processor, handle = _offloaded(folder, "budget")
    pager = handle.kv_pager(page_tokens=2, offload=True)
    handle.budget.set_total(handle.budget_for(0) + 1024, origin="test")
    with host_master_guard(handle) as guard:
        result = fam.speak(model, processor, request, pager=pager)
    assert guard.checked > 0
    assert len(result.tokens) == len(tokens) and all(torch.equal(a, b) for a, b in zip(result.tokens, tokens))
    assert torch.equal(result.audio.reshape(-1), audio.detach().float().reshape(-1))
    kv = handle.report().kv
    assert kv["caches"] >= 1 and kv["offloads"] >= request.max_new_tokens, kv
    handle.detach()
