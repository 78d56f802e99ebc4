"""The TTS nodes in-process (CPU, simulated device) with Higgs Audio v2, Dia and CSM (tiny random folders from
tests/tts/tiny_tts.py): the loader lists them (not their codec subfolders, not other model types), generation equals
the model run without offloading under budget and high_end, at the model's sampling rate; the report lists the
streamed blocks; cancel stops within a token; a transformers without the model type is a clear error. Skipped
without a ComfyUI checkout; a model type this transformers lacks is skipped with the reason."""
from __future__ import annotations

import json
import os

import pytest

from conftest import combo_choices, comfy_available, load_tests_module, node_classes, skip_reason  # noqa: F401

if not comfy_available():
    pytest.skip(skip_reason(), allow_module_level=True)
pytest.importorskip("transformers")

import torch  # noqa: E402

tt = load_tests_module("tts/tiny_tts.py")
MODELS = {"higgs_audio_v2": ("tiny-higgs", tt.write_tiny_higgs, 10),
          "dia": ("tiny-dia", tt.write_tiny_dia, 12),
          "csm": ("tiny-csm", tt.write_tiny_csm, 4)}
TEXT = "Speaker 1: Hello there, how are you?\nSpeaker 2: Fine, thanks."


@pytest.fixture(scope="module")
def env(pack, tmp_path_factory):
    import comfy.model_management as mm
    import folder_paths
    from importlib import import_module

    torch.set_num_threads(1)
    tts_pkg = import_module(pack.__name__ + ".offload.tts")
    base = str(tmp_path_factory.mktemp("tts_model_nodes"))
    available = {}
    for model_type, (name, write, _) in MODELS.items():
        why = tts_pkg.family(model_type).available()
        available[model_type] = why
        if why is None:
            write(os.path.join(base, name))
    other = os.path.join(base, "not-a-tts-model")
    os.makedirs(other)
    with open(os.path.join(other, "config.json"), "w") as f:
        json.dump({"model_type": "llama"}, f)
    folder_paths.add_model_folder_path("tts", base)
    return {"pack": pack, "mm": mm, "M": node_classes(pack), "base": base, "tts": tts_pkg, "available": available,
            "common": import_module(pack.__name__ + ".offload.tts.common"),
            "status": import_module(pack.__name__ + ".nodes.status")}


@pytest.fixture(params=sorted(MODELS))
def model_type(env, request):
    if env["available"][request.param]:
        pytest.skip(env["available"][request.param])
    return request.param


def load(env, model_type, preset="budget", **kw):
    with torch.inference_mode():
        return env["M"]["OffloadTTSLoader"]().load(MODELS[model_type][0], preset, **kw)[0]


def speak(env, model_type, tts, seed=3, **kw):
    text = TEXT if model_type != "csm" else "Hello there, how are you?"
    with torch.inference_mode():
        audio = env["M"]["OffloadTTSGenerate"]().generate(tts, text, seed, 1.3, 10, MODELS[model_type][2], **kw)[0]
    assert set(audio) == {"waveform", "sample_rate"} and audio["waveform"].dim() == 3
    return audio


def plain(env, model_type, seed=3):
    """The same request on the model loaded without the engine."""
    common = env["common"]
    path = os.path.join(env["base"], MODELS[model_type][0])
    fam = env["tts"].family_for(path)
    model, processor, _ = fam.load(path)
    text = TEXT if model_type != "csm" else "Hello there, how are you?"
    with torch.inference_mode():
        return fam.speak(model, processor, common.TTSRequest(text, seed=seed, max_new_tokens=MODELS[model_type][2],
                                                             cfg_scale=1.3, diffusion_steps=10))


def test_the_loader_lists_the_models_but_not_codecs_or_other_types(env):
    names = combo_choices(env["M"]["OffloadTTSLoader"].INPUT_TYPES()["required"]["model_name"])
    for model_type, (name, _, _) in MODELS.items():
        if env["available"][model_type] is None:
            assert name in names
    assert "not-a-tts-model" not in names
    assert not any("audio_tokenizer" in n for n in names), names


@pytest.mark.parametrize("preset", ["budget", "high_end"])
def test_generation_equals_the_model_run_without_offloading(env, model_type, preset):
    want = plain(env, model_type)
    tts = load(env, model_type, preset, kv_offload="on")
    audio = speak(env, model_type, tts)
    assert audio["sample_rate"] == want.sample_rate
    assert torch.equal(audio["waveform"][0], want.audio)
    assert torch.isfinite(audio["waveform"]).all() and audio["waveform"].shape[-1] > 0
    rep = tts.managed.handle.report()
    layers = [b for b in rep.blocks if ".layers." in b.name and not b.name.startswith(("audio_tokenizer.",
                                                                                        "codec_model."))]
    assert layers and all(b.calls > 0 for b in layers)
    if preset == "budget":
        assert all(b.tier != "vram" for b in rep.blocks)
    assert rep.kv is not None and rep.kv["caches"] >= 1


def test_the_report_lists_the_streamed_blocks(env, model_type):
    tts = load(env, model_type, "budget")
    speak(env, model_type, tts)
    data = env["status"].build_report()
    name = "tts:" + MODELS[model_type][0]
    entry = [m for m in data["models"] if m["kind"] == "tts" and m["name"] == name]
    assert entry, [m["name"] for m in data["models"]]
    assert any(".layers." in b["name"] and b["tier"] in ("pinned", "pageable") for b in entry[-1]["blocks"])


def test_sampling_settings_change_the_audio_and_zero_keeps_the_default(env, model_type):
    tts = load(env, model_type, "budget")
    base = speak(env, model_type, tts)["waveform"]
    assert torch.equal(speak(env, model_type, tts, temperature=0.0, top_k=0, top_p=0.0)["waveform"], base)
    hot = speak(env, model_type, tts, temperature=3.0, top_k=5)["waveform"]
    n = min(hot.shape[-1], base.shape[-1])
    assert not torch.equal(hot[..., :n], base[..., :n])
    assert torch.equal(speak(env, model_type, tts)["waveform"], base), "settings do not stick to the model"


def test_cancel_mid_generation_then_a_clean_run(env):
    if env["available"]["dia"]:
        pytest.skip(env["available"]["dia"])
    mm = env["mm"]
    tts = load(env, "dia", "budget")
    want = speak(env, "dia", tts)["waveform"]
    real = mm.throw_exception_if_processing_interrupted
    calls = {"n": 0}

    def interrupt_at_third_token():
        calls["n"] += 1
        if calls["n"] == 3:
            mm.interrupt_current_processing(True)
        return real()

    interrupt_cls = getattr(mm, "InterruptProcessingException", None)
    if interrupt_cls is None:
        from comfy.interruption import InterruptProcessingException as interrupt_cls
    mm.throw_exception_if_processing_interrupted = interrupt_at_third_token
    try:
        with pytest.raises(interrupt_cls):
            speak(env, "dia", tts)
        assert calls["n"] == 3
    finally:
        mm.throw_exception_if_processing_interrupted = real
        mm.interrupt_current_processing(False)
    assert torch.equal(speak(env, "dia", tts)["waveform"], want)


def test_a_transformers_without_the_model_type_is_a_clear_error(env, model_type, monkeypatch):
    fam = env["tts"].family(model_type)
    monkeypatch.setattr(type(fam), "min_transformers", (99, 0))
    with pytest.raises(ValueError, match=r"needs transformers >= 99\.0"):
        load(env, model_type)
