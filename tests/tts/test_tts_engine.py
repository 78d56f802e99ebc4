"""VibeVoice through the engine, without ComfyUI (offload/tts/vibevoice.py): the same waveform resident and
streamed under every preset, with fp8 weights, with the KV cache paged and offloaded, under a shared budget; the
seed reproduces; a voice changes the output; bad model folders are clear errors."""
from __future__ import annotations

import itertools
import json
import math
import os

import pytest
import torch

pytest.importorskip("transformers")

from offload import OffloadConfig, VramBudget, offload_module  # noqa: E402
from offload.model.fp8 import Fp8Linear  # noqa: E402
from offload.tts import vibevoice as vv  # noqa: E402
from tests.tts import tiny_vibevoice as tv  # noqa: E402

TEXT = "Speaker 1: Hello there, how are you?\nSpeaker 2: Fine, thanks."
_caps = itertools.count(1)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    torch.set_num_threads(1)
    return tv.write_tiny_vibevoice(str(tmp_path_factory.mktemp("tts") / "tiny-vibevoice"))


def _cfg(preset: str, **kw):
    kw.setdefault("sim_capacity_bytes", (256 << 20) + 4096 * next(_caps) + 3)
    return OffloadConfig.from_preset(preset, device="sim", **kw)


def speak(model, processor, seed=3, voices=None, pager=None, tokens=16):
    return vv.generate(model, processor, TEXT, voices=voices, seed=seed, max_new_tokens=tokens, pager=pager)


@pytest.fixture(scope="module")
def reference(folder):
    model, processor, _ = vv.load(folder)
    return speak(model, processor)


@pytest.mark.parametrize("preset", ["budget", "consumer", "mid_range", "high_end"])
def test_streamed_model_speaks_exactly_like_the_resident_one(folder, reference, preset):
    model, processor, _ = vv.load(folder)
    handle = offload_module(model, _cfg(preset), budget=VramBudget(None), units=vv.stream_units(model), name="vv")
    assert torch.equal(speak(model, processor), reference)
    rep = handle.report()
    layers = [b for b in rep.blocks if b.name.startswith("model.language_model.layers.")]
    assert len(layers) == model.config.text_config.num_hidden_layers
    if preset == "budget":
        assert all(b.tier != "vram" for b in rep.blocks), "budget streams every block"
        assert all(b.calls > 0 for b in layers)
    handle.detach()
    assert torch.equal(speak(model, processor), reference)


def test_stream_units_cover_the_backbone_head_and_tokenizers(folder):
    model, _, _ = vv.load(folder)
    units = vv.stream_units(model)
    assert units[:model.config.text_config.num_hidden_layers] == [
        f"model.language_model.layers.{i}" for i in range(model.config.text_config.num_hidden_layers)]
    assert any(u.startswith("model.diffusion_head.") for u in units)
    assert any(u.startswith("model.audio_tower.decoder.") for u in units)
    assert any(u.startswith("model.semantic_tokenizer_encoder.") for u in units)
    for a in units:  # no unit inside another
        assert not any(b != a and b.startswith(a + ".") for b in units)


def test_fp8_weights_stream_as_stored_and_are_identical_across_presets(folder):
    outs = []
    for preset in ("high_end", "budget"):
        model, processor, _ = vv.load(folder, dtype="fp8_e4m3fn")
        fp8 = [m for m in model.model.language_model.layers.modules() if isinstance(m, Fp8Linear)]
        assert fp8 and all(m.weight.dtype == torch.float8_e4m3fn and m.weight_scale.dim() == 2 for m in fp8)
        handle = offload_module(model, _cfg(preset), budget=VramBudget(None), units=vv.stream_units(model))
        outs.append(speak(model, processor))
        layer = next(b for b in handle.report().blocks if b.name == "model.language_model.layers.0")
        bf16_bytes = sum(p.numel() * 2 for p in model.model.language_model.layers[0].parameters())
        assert layer.bytes < 0.75 * bf16_bytes, "fp8 layers move about half the bytes of bf16"
        handle.detach()
    assert torch.equal(outs[0], outs[1])
    assert outs[0].abs().max() > 0


def test_a_checkpoint_saved_in_fp8_with_scales_loads_as_stored(folder, tmp_path):
    """Float8 weights saved with `weight_scale` tensors are kept as stored (no re-quantization)."""
    from safetensors.torch import load_file, save_file

    model, processor, _ = vv.load(folder, dtype="fp8_e4m3fn")
    want = speak(model, processor)
    saved = tmp_path / "fp8-saved"
    import shutil

    shutil.copytree(folder, saved)
    state = load_file(str(saved / "model.safetensors"))
    for name, m in model.named_modules():
        if isinstance(m, Fp8Linear):
            state[f"{name}.weight"] = m.weight.detach().clone()
            state[f"{name}.weight_scale"] = m.weight_scale.detach().clone()
    save_file({k: v.contiguous() for k, v in state.items()}, str(saved / "model.safetensors"))
    again, processor2, info = vv.load(saved, dtype="bf16")  # the rest in bf16, as the fp8 model had it
    assert info.fp8_keys > 0
    assert any(isinstance(m, Fp8Linear) for m in again.modules())
    assert torch.equal(speak(again, processor2), want)


@pytest.mark.parametrize("offload_kv", [False, True])
def test_kv_cache_paged_and_offloaded_gives_the_same_audio(folder, reference, offload_kv):
    model, processor, _ = vv.load(folder)
    handle = offload_module(model, _cfg("budget"), budget=VramBudget(None), units=vv.stream_units(model), name="vv")
    pager = handle.kv_pager(page_tokens=4, offload=offload_kv)
    if offload_kv:  # squeeze the KV share to about one layer: the other layers' pages live in host memory
        handle.budget.set_total(handle.budget_for(0) + 40 * 1024, origin="test")
    assert torch.equal(speak(model, processor, pager=pager), reference)
    kv = handle.report().kv
    assert kv["caches"] == 2, "the positive and the CFG-negative cache are both paged"
    if offload_kv:
        assert kv["offloads"] > 0 and kv["restores"] > 0 and kv["prefetched"] > 0, kv
    handle.detach()


def test_two_models_under_one_budget_speak_exactly(folder, reference):
    budget = VramBudget(None)
    a, pa, _ = vv.load(folder)
    b, pb, _ = vv.load(folder)
    ha = offload_module(a, _cfg("mid_range"), budget=budget, units=vv.stream_units(a), name="a", priority=1)
    hb = offload_module(b, _cfg("budget"), budget=budget, units=vv.stream_units(b), name="b")
    assert torch.equal(speak(a, pa, pager=ha.kv_pager()), reference)
    assert torch.equal(speak(b, pb, pager=hb.kv_pager()), reference)
    assert budget.used_bytes <= budget.total_bytes
    ha.detach()
    hb.detach()


def test_seed_reproduces_and_a_voice_changes_the_output(folder, reference):
    model, processor, _ = vv.load(folder)
    assert torch.equal(speak(model, processor, seed=3), reference)
    assert not torch.equal(speak(model, processor, seed=4), reference)
    t = torch.arange(48000, dtype=torch.float32) / 48000
    stereo = torch.stack([torch.sin(2 * math.pi * 220 * t), torch.sin(2 * math.pi * 330 * t)])[None] * 0.3
    voice = vv.voice_from_audio(stereo, 48000)
    assert voice.ndim == 1 and len(voice) == 24000
    with_voice = speak(model, processor, voices={"1": voice}, tokens=24)
    assert not torch.equal(with_voice[..., :reference.shape[-1]], reference)


def test_resampling_keeps_a_tone_and_its_length():
    t = torch.arange(44100, dtype=torch.float64) / 44100
    tone = torch.sin(2 * math.pi * 1000 * t).to(torch.float32)
    out = vv.resample(tone, 44100, 24000)
    assert out.shape[-1] == 24000
    spectrum = torch.fft.rfft(out[2000:-2000]).abs()
    peak_hz = spectrum.argmax().item() * 24000 / (out.shape[-1] - 4000)
    assert abs(peak_hz - 1000) < 5
    assert torch.equal(vv.resample(tone, 24000, 24000), tone)


@pytest.mark.parametrize("text, words", [("", "empty"), ("Speaker 7: hi", "speakers 1 to 4"),
                                         ("Speaker 1:   ", "no speech")])
def test_bad_scripts_are_clear_errors(text, words):
    with pytest.raises(ValueError, match=words):
        vv.parse_script(text)


def test_scripts_map_speakers_and_continuation_lines():
    assert vv.parse_script("Speaker 1: Hi\nthere\nSpeaker 2: Yo") == [("1", "Hi there"), ("2", "Yo")]
    assert vv.parse_script("Just text") == [("1", "Just text")]


def _corrupt(folder, tmp_path, kind):
    import shutil

    bad = tmp_path / kind
    shutil.copytree(folder, bad)
    if kind == "missing_config":
        os.remove(bad / "config.json")
    elif kind == "half_written_config":
        (bad / "config.json").write_text((bad / "config.json").read_text()[:40])
    elif kind == "truncated_weights":
        data = (bad / "model.safetensors").read_bytes()
        (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    elif kind == "no_weights":
        os.remove(bad / "model.safetensors")
    elif kind == "no_tokenizer":
        os.remove(bad / "tokenizer.json")
    elif kind == "other_model":
        cfg = json.loads((bad / "config.json").read_text())
        cfg["model_type"] = "llama"
        (bad / "config.json").write_text(json.dumps(cfg))
    return bad


@pytest.mark.parametrize("kind, words", [("missing_config", "no config.json"), ("half_written_config", "JSON"),
                                         ("truncated_weights", "truncated"), ("no_weights", "incomplete"),
                                         ("no_tokenizer", "tokenizer"), ("other_model", "model_type")])
def test_bad_model_folders_are_clear_errors(folder, tmp_path, kind, words):
    bad = _corrupt(folder, tmp_path, kind)
    with pytest.raises(vv.TTSModelError, match=words) as err:
        vv.load(bad)
    assert kind in str(err.value), "the error names the folder"


def test_the_original_microsoft_layout_is_refused_with_how_to_convert(tmp_path):
    folder = tv.write_original_layout(str(tmp_path / "original"))
    with pytest.raises(vv.TTSModelError, match="convert_vibevoice_to_hf"):
        vv.load(folder)
    with pytest.raises(vv.TTSModelError):
        vv.load(tmp_path / "does-not-exist")
