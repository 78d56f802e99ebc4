"""TTS end to end on a real ComfyUI server (--cpu): a tiny VibeVoice in models/tts/ and a voice clip in input/;
loader -> generate -> (SaveAudio and) an audio hash, under presets, with and without a voice and KV offloading;
the report, a missing or truncated model folder, and an interrupt followed by a clean run. Skipped without
COMFYUI_PATH (or without transformers >= 5.23 in this python, which writes the tiny model)."""
from __future__ import annotations

import json
import math
import os
import struct
import wave
from typing import Any, Dict

import pytest

from conftest import combo_choices, comfy_available, load_tests_module, skip_reason

if not comfy_available():
    pytest.skip(skip_reason(), allow_module_level=True)
pytest.importorskip("transformers")

import comfy_server as cs  # noqa: E402

tv = load_tests_module("tts/tiny_vibevoice.py")

MODEL = "tiny-vibevoice"
LONG = "tiny-vibevoice-long"  # speaks for ~10 s on the CPU: something to interrupt
TEXT = "Speaker 1: Hello there, how are you?\nSpeaker 2: Fine, thanks."


def write_voice(path: str, rate: int = 22050, seconds: float = 1.0) -> None:
    """A stereo 16-bit WAV: two tones (a stand-in voice reference at another rate than the model's)."""
    n = int(rate * seconds)
    with wave.open(path, "wb") as f:
        f.setnchannels(2)
        f.setsampwidth(2)
        f.setframerate(rate)
        frames = b"".join(struct.pack("<hh", int(8000 * math.sin(2 * math.pi * 220 * i / rate)),
                                      int(6000 * math.sin(2 * math.pi * 330 * i / rate))) for i in range(n))
        f.writeframes(frames)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("comfy_tts_base"))
    paths = cs.prepare_base_dir(base)
    tv.write_tiny_vibevoice(os.path.join(paths["tts"], MODEL))
    tv.write_tiny_vibevoice(os.path.join(paths["tts"], LONG), speech_tokens=300)
    write_voice(os.path.join(paths["input"], "voice.wav"))
    srv = cs.ComfyServer(os.environ["COMFYUI_PATH"], base, startup_timeout=600)
    srv.start()
    srv.paths = paths
    try:
        yield srv
    finally:
        srv.stop()


def tts_prompt(preset: str = "budget", kv: str = "auto", seed: int = 3, voice: bool = False, model: str = MODEL,
               tokens: int = 16, save: bool = False, report: bool = False,
               dtype: str = "default") -> Dict[str, Any]:
    p: Dict[str, Any] = {
        "1": {"class_type": "OffloadTTSLoader", "inputs": {"model_name": model, "preset": preset, "dtype": dtype,
                                                            "kv_offload": kv}},
        "2": {"class_type": "OffloadTTSGenerate", "inputs": {"tts_model": ["1", 0], "text": TEXT, "seed": seed,
                                                              "cfg_scale": 1.3, "diffusion_steps": 10,
                                                              "max_new_tokens": tokens}},
        "6": {"class_type": "LOTestAudioHash", "inputs": {"audio": ["2", 0]}},
    }
    if voice:
        p["3"] = {"class_type": "LOTestWavAudio", "inputs": {"name": "voice.wav"}}
        p["2"]["inputs"]["voice_1"] = ["3", 0]
    if save:
        p["4"] = {"class_type": "SaveAudio", "inputs": {"audio": ["2", 0], "filename_prefix": "lo_tts"}}
    if report:
        p["7"] = {"class_type": "OffloadReport", "inputs": {"anything": ["2", 0]}}
    return p


def audio_hash(server: cs.ComfyServer, p: Dict[str, Any], timeout: float = 600) -> str:
    entry = server.run_prompt(p, timeout=timeout)
    texts = cs.ui_texts(entry, "6")
    assert texts and "rate=24000" in texts[0], entry.get("outputs")
    return texts[0].split()[0]


def test_tts_nodes_are_registered_and_list_the_model(server):
    info = server.get_json("/object_info")
    loader = info["OffloadTTSLoader"]
    assert loader["category"] == "Layer Offload" and loader["output"] == ["TTS_MODEL"]
    assert MODEL in combo_choices(loader["input"]["required"]["model_name"])
    assert info["OffloadTTSGenerate"]["output"] == ["AUDIO"]


def test_same_audio_across_presets_kv_modes_and_save(server):
    ref = audio_hash(server, tts_prompt("budget", "off"))
    for preset, kv in (("high_end", "on"), ("budget", "on"), ("consumer", "auto")):
        assert audio_hash(server, tts_prompt(preset, kv)) == ref, (preset, kv)
    assert audio_hash(server, tts_prompt("budget", "auto", seed=4)) != ref, "another seed gives other audio"
    info = server.get_json("/object_info")
    if "SaveAudio" in info:  # core SaveAudio takes the AUDIO as it is
        entry = server.run_prompt(tts_prompt("budget", save=True), timeout=600)
        saved = entry["outputs"]["4"]["audio"][0]
        assert saved["filename"].startswith("lo_tts") and saved["type"] == "output"


def test_a_voice_changes_the_audio_and_reproduces(server):
    plain = audio_hash(server, tts_prompt("budget", tokens=24))
    voiced = audio_hash(server, tts_prompt("budget", voice=True, tokens=24))
    assert voiced != plain
    assert audio_hash(server, tts_prompt("high_end", "on", voice=True, tokens=24)) == voiced


def test_the_report_lists_the_tts_model_with_its_layers_streamed(server):
    entry = server.run_prompt(tts_prompt("budget", report=True), timeout=600)
    data = json.loads(entry["outputs"]["7"]["report_json"][0])
    models = [m for m in data["models"] if m["kind"] == "tts" and m["name"] == "tts:" + MODEL]
    assert models, [m["name"] for m in data["models"]]
    layers = [b for b in models[-1]["blocks"] if b["name"].startswith("model.language_model.layers.")]
    assert layers and all(b["tier"] != "vram" for b in layers)


def test_missing_or_truncated_model_folders_are_clear_errors(server):
    bad = os.path.join(server.paths["tts"], "broken-vibevoice")
    tv.write_tiny_vibevoice(bad)
    data = open(os.path.join(bad, "model.safetensors"), "rb").read()
    open(os.path.join(bad, "model.safetensors"), "wb").write(data[: len(data) // 3])
    with pytest.raises(RuntimeError) as err:
        server.run_prompt(tts_prompt(model="broken-vibevoice"), timeout=600)
    assert "truncated" in str(err.value) and "broken-vibevoice" in str(err.value), str(err.value)[-2000:]
    with pytest.raises(RuntimeError) as err:
        server.run_prompt(tts_prompt(model="no-such-model"), timeout=600)
    assert "no-such-model" in str(err.value)
    assert audio_hash(server, tts_prompt("budget")) == audio_hash(server, tts_prompt("high_end")), \
        "the server keeps working"


def test_interrupt_stops_generation_and_the_next_prompt_succeeds(server):
    """Cancel while the long model speaks (it speaks exactly 300 tokens): the prompt ends interrupted, before its
    last token, and the next one runs clean. Progress events say where it stopped; no wall-clock bound (that it stops
    within a token is tests/comfyui/test_tts_nodes.py's interrupt at the third token)."""
    ref = audio_hash(server, tts_prompt("budget"))
    with cs.WsEvents(server, ("progress",)) as ws:
        pid = server.queue(tts_prompt("budget", model=LONG, tokens=400))
        ours = lambda e: e.get("prompt_id") in (None, pid) and e.get("max") == 400  # noqa: E731
        assert ws.wait_for(lambda e: ours(e) and e.get("value", 0) >= 1), "no token was generated"
        server.interrupt()
        entry = server.wait(pid, timeout=600)
    kinds = [m[0] if isinstance(m, (list, tuple)) else m for m in entry.get("status", {}).get("messages", [])]
    assert "execution_interrupted" in kinds, entry.get("status")
    reached = max(e["value"] for e in ws.events if ours(e))
    assert reached < 300, "the cancel did not stop generation: {} of 300 tokens".format(reached)
    assert audio_hash(server, tts_prompt("budget")) == ref
