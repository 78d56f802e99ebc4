"""Higgs Audio v2, Dia and CSM end to end on a real ComfyUI server (--cpu): tiny random-weight folders in models/tts/
(tests/tts/tiny_tts.py), listed by Offload TTS Loader, loader -> generate -> an audio hash: non-empty finite AUDIO at
the model's sampling rate, preset budget (every block streamed) equal to high_end bit for bit, the same seed twice
equal, a voice prompt, the Offload Report listing the streamed blocks, a truncated weights file a clear error with
the server still working. A model type the server's transformers lacks is skipped with the reason. Skipped without
COMFYUI_PATH (or without transformers in this python, which writes the tiny models)."""
from __future__ import annotations

import json
import math
import os
import re
from typing import Any, Dict

import pytest

from conftest import combo_choices, comfy_available, load_tests_module, skip_reason

if not comfy_available():
    pytest.skip(skip_reason(), allow_module_level=True)
pytest.importorskip("transformers")

import comfy_server as cs  # noqa: E402

tt = load_tests_module("tts/tiny_tts.py")
MODELS = {"higgs_audio_v2": ("tiny-higgs", tt.write_tiny_higgs, 24000, 10),
          "dia": ("tiny-dia", tt.write_tiny_dia, 44100, 12),
          "csm": ("tiny-csm", tt.write_tiny_csm, 24000, 4)}
TEXT = "Speaker 1: Hello there, how are you?\nSpeaker 2: Fine, thanks."


def _unavailable(model_type: str) -> str | None:
    """Why this python (the server's) cannot run the model type, or None."""
    import importlib.util

    if importlib.util.find_spec(f"transformers.models.{model_type}") is None:
        import transformers

        return f"transformers {transformers.__version__} in this ComfyUI python has no {model_type}"
    return None


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("comfy_tts_models"))
    paths = cs.prepare_base_dir(base)
    for model_type, (name, write, _, _) in MODELS.items():
        if _unavailable(model_type) is None:
            write(os.path.join(paths["tts"], name))
    from test_tts_server import write_voice

    write_voice(os.path.join(paths["input"], "voice.wav"))
    srv = cs.ComfyServer(os.environ["COMFYUI_PATH"], base, startup_timeout=600)
    srv.start()
    srv.paths = paths
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(params=sorted(MODELS))
def model(request):
    why = _unavailable(request.param)
    if why:
        pytest.skip(why)
    return request.param


def prompt(model_type: str, preset: str = "budget", seed: int = 3, voice: bool = False, report: bool = False,
           name: str | None = None, kv: str = "auto") -> Dict[str, Any]:
    folder, _, _, tokens = MODELS[model_type]
    p: Dict[str, Any] = {
        "1": {"class_type": "OffloadTTSLoader", "inputs": {"model_name": name or folder, "preset": preset,
                                                            "dtype": "default", "kv_offload": kv}},
        "2": {"class_type": "OffloadTTSGenerate", "inputs": {
            "tts_model": ["1", 0], "text": TEXT if model_type != "csm" else "Hello there, how are you?",
            "seed": seed, "cfg_scale": 3.0 if model_type == "dia" else 1.3, "diffusion_steps": 10,
            "max_new_tokens": tokens}},
        "6": {"class_type": "LOTestAudioHash", "inputs": {"audio": ["2", 0]}},
    }
    if voice:
        p["3"] = {"class_type": "LOTestWavAudio", "inputs": {"name": "voice.wav"}}
        p["2"]["inputs"].update(voice_1=["3", 0], voice_text="A test voice.")
    if report:
        p["7"] = {"class_type": "OffloadReport", "inputs": {"anything": ["2", 0]}}
    return p


def audio_info(server: cs.ComfyServer, p: Dict[str, Any], model_type: str, timeout: float = 600) -> Dict[str, Any]:
    entry = server.run_prompt(p, timeout=timeout)
    text = cs.ui_texts(entry, "6")[0]
    digest, rest = text.split(" ", 1)
    shape = json.loads(re.search(r"\[[^\]]*\]", rest).group(0))
    rate = int(re.search(r"rate=(\d+)", rest).group(1))
    peak = float(re.search(r"peak=([^\s]+)", rest).group(1))
    return {"hash": digest, "shape": shape, "rate": rate, "peak": peak, "entry": entry}


def test_the_loader_lists_every_tiny_model_and_not_the_codec_folders(server):
    info = server.get_json("/object_info")
    names = combo_choices(info["OffloadTTSLoader"]["input"]["required"]["model_name"])
    for model_type, (name, _, _, _) in MODELS.items():
        if _unavailable(model_type) is None:
            assert name in names, (name, names)
    assert not any(n.endswith("audio_tokenizer") for n in names), names


def test_finite_audio_at_the_models_rate_budget_equals_high_end_and_seeds_reproduce(server, model):
    rate = MODELS[model][2]
    budget = audio_info(server, prompt(model, "budget"), model)
    assert budget["rate"] == rate and budget["shape"][:2] == [1, 1] and budget["shape"][2] > 0
    assert math.isfinite(budget["peak"]) and budget["peak"] > 0
    assert audio_info(server, prompt(model, "high_end", kv="on"), model)["hash"] == budget["hash"]
    assert audio_info(server, prompt(model, "budget"), model)["hash"] == budget["hash"], "same seed, same audio"
    assert audio_info(server, prompt(model, "budget", seed=4), model)["hash"] != budget["hash"]


def test_a_voice_prompt_changes_the_audio_and_reproduces(server, model):
    plain = audio_info(server, prompt(model), model)["hash"]
    voiced = audio_info(server, prompt(model, voice=True), model)["hash"]
    assert voiced != plain
    assert audio_info(server, prompt(model, "high_end", voice=True), model)["hash"] == voiced


def test_the_report_lists_the_streamed_blocks(server, model):
    name = MODELS[model][0]
    entry = server.run_prompt(prompt(model, report=True), timeout=600)
    data = json.loads(entry["outputs"]["7"]["report_json"][0])
    models = [m for m in data["models"] if m["kind"] == "tts" and m["name"] == "tts:" + name]
    assert models, [m["name"] for m in data["models"]]
    layers = [b for b in models[-1]["blocks"] if ".layers." in b["name"]]
    assert layers and all(b["tier"] != "vram" for b in layers)
    assert any(b["name"].startswith(("audio_tokenizer.", "codec_model.")) for b in models[-1]["blocks"]), \
        "the codec's blocks are listed too"


def test_a_truncated_weights_file_is_a_clear_error_and_the_server_stays_up(server, model):
    name, write, _, _ = MODELS[model]
    broken = "broken-" + name
    path = os.path.join(server.paths["tts"], broken)
    write(path)
    data = open(os.path.join(path, "model.safetensors"), "rb").read()
    open(os.path.join(path, "model.safetensors"), "wb").write(data[: len(data) // 3])
    try:
        with pytest.raises(RuntimeError) as err:
            server.run_prompt(prompt(model, name=broken), timeout=600)
        assert "truncated" in str(err.value) and broken in str(err.value), str(err.value)[-2000:]
    finally:
        import shutil

        shutil.rmtree(path, ignore_errors=True)
    info = audio_info(server, prompt(model), model)
    assert info["shape"][2] > 0, "the server keeps working"
