"""The TTS nodes in-process (CPU, simulated device): the tts folder, the loader's options, generation equal to the
model run without offloading, seeds, voices, cancel, bad folders, the report, ComfyUI's memory manager, and
Offload Any on another pack's model holder. Skipped without a ComfyUI checkout (or without transformers >= 5.23)."""
from __future__ import annotations

import math
import os
import shutil

import pytest

from conftest import (combo_choices, comfy_available, display_names, load_tests_module, node_classes,  # noqa: F401
                      skip_reason)

if not comfy_available():
    pytest.skip(skip_reason(), allow_module_level=True)
pytest.importorskip("transformers")

import torch  # noqa: E402

tv = load_tests_module("tts/tiny_vibevoice.py")

MODEL = "tiny-vibevoice"
TEXT = "Speaker 1: Hello there, how are you?\nSpeaker 2: Fine, thanks."


@pytest.fixture(scope="module")
def env(pack, tmp_path_factory):
    import comfy.model_management as mm
    import folder_paths

    torch.set_num_threads(1)
    base = str(tmp_path_factory.mktemp("tts_models"))
    tv.write_tiny_vibevoice(os.path.join(base, MODEL))
    nested = os.path.join(base, "voices-pack", "tiny-vibevoice-copy")
    shutil.copytree(os.path.join(base, MODEL), nested)
    folder_paths.add_model_folder_path("tts", base)
    from importlib import import_module

    vv = import_module(pack.__name__ + ".offload.tts.vibevoice")
    model, processor, _ = vv.load(os.path.join(base, MODEL))
    ref = vv.generate(model, processor, TEXT, seed=3, max_new_tokens=16)
    return {"pack": pack, "mm": mm, "M": node_classes(pack), "base": base, "vv": vv, "ref": ref,
            "status": import_module(pack.__name__ + ".nodes.status"),
            "tts": import_module(pack.__name__ + ".nodes.tts")}


def load(env, preset="budget", **kw):
    with torch.inference_mode():
        return env["M"]["OffloadTTSLoader"]().load(MODEL, preset, **kw)[0]


def speak(env, tts, seed=3, tokens=16, **voices):
    with torch.inference_mode():
        audio = env["M"]["OffloadTTSGenerate"]().generate(tts, TEXT, seed, 1.3, 10, tokens, **voices)[0]
    assert set(audio) == {"waveform", "sample_rate"} and audio["sample_rate"] == 24000
    assert audio["waveform"].dim() == 3 and audio["waveform"].shape[:2] == (1, 1)
    return audio["waveform"]


def test_nodes_and_the_tts_folder_are_registered(env):
    import folder_paths

    assert {"OffloadTTSLoader", "OffloadTTSGenerate"} <= set(env["M"])
    assert display_names(env["pack"])["OffloadTTSLoader"] == "Offload TTS Loader"
    paths = folder_paths.get_folder_paths("tts")
    assert os.path.join(folder_paths.models_dir, "tts") in paths and env["base"] in paths, "appended, not replaced"
    spec = env["M"]["OffloadTTSLoader"].INPUT_TYPES()
    names = combo_choices(spec["required"]["model_name"])
    assert MODEL in names and "voices-pack/tiny-vibevoice-copy" in names
    assert combo_choices(spec["required"]["preset"]) == ["auto", "high_end", "mid_range", "consumer", "budget"]
    assert combo_choices(spec["optional"]["dtype"]) == ["default", "bf16", "fp16", "fp32", "fp8_e4m3fn"]
    assert combo_choices(spec["optional"]["kv_offload"]) == ["auto", "off", "on"]
    gen = env["M"]["OffloadTTSGenerate"].INPUT_TYPES()
    assert list(gen["optional"])[:4] == ["voice_1", "voice_2", "voice_3", "voice_4"], "V1 inputs first"
    assert list(gen["optional"])[4:] == ["voice_text", "temperature", "top_k", "top_p"]
    assert tuple(env["M"]["OffloadTTSGenerate"].RETURN_TYPES) == ("AUDIO",)


@pytest.mark.parametrize("preset, kv", [("budget", "auto"), ("budget", "on"), ("budget", "off"),
                                        ("high_end", "on"), ("consumer", "auto")])
def test_generation_equals_the_model_run_without_offloading(env, preset, kv):
    tts = load(env, preset, kv_offload=kv)
    out = speak(env, tts)
    assert torch.equal(out.reshape(1, -1), env["ref"])
    rep = tts.managed.handle.report()
    layers = [b for b in rep.blocks if b.name.startswith("model.language_model.layers.")]
    assert layers and all(b.calls > 0 for b in layers)
    if preset == "budget":
        assert all(b.tier != "vram" for b in layers), "budget streams the backbone layers"
    if kv != "off":
        assert rep.kv is not None and rep.kv["caches"] >= 2, "both KV caches were paged"


def test_fp8_is_identical_across_presets(env):
    outs = [speak(env, load(env, preset, dtype="fp8_e4m3fn")) for preset in ("budget", "high_end")]
    assert torch.equal(outs[0], outs[1]) and outs[0].abs().max() > 0


def test_kv_offloaded_under_a_tiny_share_gives_the_same_audio(env):
    tts = load(env, "budget", kv_offload="on")
    handle = tts.managed.handle
    budget = handle.budget
    before = budget.total_bytes
    try:
        budget.set_total(handle.budget_for(0) + 40 * 1024, origin="test")
        assert torch.equal(speak(env, tts).reshape(1, -1), env["ref"])
        kv = handle.report().kv
        assert kv["offloads"] > 0 and kv["restores"] > 0, kv
    finally:
        budget.set_total(before, origin="test")


def test_seed_reproduces_and_a_voice_changes_the_output(env):
    tts = load(env, "budget")
    assert torch.equal(speak(env, tts, seed=3), speak(env, tts, seed=3))
    assert not torch.equal(speak(env, tts, seed=4), speak(env, tts, seed=3))
    t = torch.arange(44100, dtype=torch.float32) / 44100
    voice = {"waveform": (0.3 * torch.sin(2 * math.pi * 220 * t)).reshape(1, 1, -1).repeat(1, 2, 1),
             "sample_rate": 44100}
    with_voice = speak(env, tts, tokens=24, voice_1=voice)
    again = speak(env, tts, tokens=24, voice_1=voice)
    assert torch.equal(with_voice, again)
    base = speak(env, tts, tokens=24)
    n = min(base.shape[-1], with_voice.shape[-1])
    assert not torch.equal(with_voice[..., :n], base[..., :n])


def test_cancel_mid_generation_then_a_clean_run(env):
    mm = env["mm"]
    tts = load(env, "budget", kv_offload="on")
    real = mm.throw_exception_if_processing_interrupted
    calls = {"n": 0}

    def interrupt_at_third_token():
        calls["n"] += 1
        if calls["n"] == 3:
            mm.interrupt_current_processing(True)
        return real()

    # ComfyUI's interrupt: an Exception before 0.20, a BaseException since (on comfy.interruption in the 0.12 fork)
    interrupt_cls = getattr(mm, "InterruptProcessingException", None)
    if interrupt_cls is None:
        from comfy.interruption import InterruptProcessingException as interrupt_cls
    mm.throw_exception_if_processing_interrupted = interrupt_at_third_token
    try:
        with pytest.raises(interrupt_cls) as err:
            speak(env, tts, tokens=40)
        assert "Interrupt" in type(err.value).__name__, repr(err.value)
        assert calls["n"] == 3, "generation stopped at the token the interrupt came"
    finally:
        mm.throw_exception_if_processing_interrupted = real
        mm.interrupt_current_processing(False)
    assert torch.equal(speak(env, tts).reshape(1, -1), env["ref"])


@pytest.mark.parametrize("kind, words", [("missing", "no TTS model folder"), ("truncated", "truncated"),
                                         ("half_written", "JSON"), ("original", "convert_vibevoice_to_hf")])
def test_bad_model_folders_are_clear_errors_and_leave_the_loader_working(env, kind, words):
    name = "bad-" + kind
    path = os.path.join(env["base"], name)
    shutil.rmtree(path, ignore_errors=True)
    if kind == "original":
        tv.write_original_layout(path)
    elif kind != "missing":
        shutil.copytree(os.path.join(env["base"], MODEL), path)
        if kind == "truncated":
            data = open(os.path.join(path, "model.safetensors"), "rb").read()
            open(os.path.join(path, "model.safetensors"), "wb").write(data[: len(data) // 3])
        else:
            cfg = open(os.path.join(path, "config.json")).read()
            open(os.path.join(path, "config.json"), "w").write(cfg[:30])
    with pytest.raises(ValueError, match=words):
        load_named(env, name)
    shutil.rmtree(path, ignore_errors=True)
    assert torch.equal(speak(env, load(env, "budget")).reshape(1, -1), env["ref"])


def load_named(env, name):
    with torch.inference_mode():
        return env["M"]["OffloadTTSLoader"]().load(name, "budget")[0]


def test_the_report_and_comfys_memory_manager_see_the_tts_model(env):
    mm = env["mm"]
    tts = load(env, "budget")
    speak(env, tts)
    data = env["status"].build_report()
    entry = [m for m in data["models"] if m["kind"] == "tts" and m["name"] == "tts:" + MODEL]
    assert entry, [m["name"] for m in data["models"]]
    layers = [b for b in entry[-1]["blocks"] if b["name"].startswith("model.language_model.layers.")]
    assert layers and all(b["tier"] in ("pinned", "pageable") for b in layers)
    report_text = env["M"]["OffloadReport"]().report(None)["ui"]["text"][0]
    assert "tts:" + MODEL in report_text
    assert any(lm.model is tts.patcher for lm in mm.current_loaded_models)
    assert tts.patcher.loaded_size() == tts.managed.handle.device_bytes() > 0
    mm.free_memory(1 << 60, tts.patcher.load_device)
    assert tts.patcher.loaded_size() == 0 or not any(lm.model is tts.patcher for lm in mm.current_loaded_models)
    assert torch.equal(speak(env, tts).reshape(1, -1), env["ref"]), "ComfyUI freed it; it loads again exactly"


def test_offload_any_streams_a_model_inside_another_packs_holder(env):
    """The shape of other TTS packs' caches: a plain object holding the transformers model and its processor."""

    class PackModelHolder:
        def __init__(self, model, processor):
            self.model = model
            self.processor = processor
            self.settings = {"sample_rate": 24000}

    vv = env["vv"]
    model, processor, _ = vv.load(os.path.join(env["base"], MODEL))
    holder = PackModelHolder(model, processor)
    out = env["M"]["OffloadAny"]().apply(holder, "budget")[0]
    assert out is holder and "_layer_offload" in holder.model.__dict__
    handle = holder.model.__dict__["_layer_offload"].handle
    assert any(b.tier != "vram" for b in handle.report().blocks)
    with torch.inference_mode():
        wave = vv.generate(holder.model, holder.processor, TEXT, seed=3, max_new_tokens=16)
    assert torch.equal(wave, env["ref"])
